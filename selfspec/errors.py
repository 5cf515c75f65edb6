"""The one exception type selfspec raises for a user's mistake or an environment problem.

The CLI prints it as a single line (``selfspec: error: ...``) instead of a stack trace.
"""


class SelfspecError(Exception):
    """A user-facing error: bad input, a missing model, a failed download, a full disk."""


class ContextError(SelfspecError):
    """A request longer than the model reads or the engine holds per request (``context.check_request``); a server
    answers it with 400 ``context_length_exceeded``."""
