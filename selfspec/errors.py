"""The one exception type selfspec raises for a user's mistake or an environment problem.

The CLI prints it as a single line (``selfspec: error: ...``) instead of a stack trace.
"""


class SelfspecError(Exception):
    """A user-facing error: bad input, a missing model, a failed download, a full disk."""
