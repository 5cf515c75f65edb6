"""Text of a growing token sequence, piece by piece, never splitting a character."""

from __future__ import annotations


class IncrementalText:
    """Feed token ids as they are committed; get back the text they add.

    Each call decodes a short window, not the whole sequence: the tokens from ``start`` (already shown, kept
    as context because tokenizers merge pieces across token boundaries and drop a leading space at the start
    of a decode) to the end, minus the decode of the window's shown part. Text ending in U+FFFD, an
    incomplete multi-byte character, is held back until the rest arrives. The pieces add up to the decode of
    the whole sequence.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = []
        self.start = 0  # window start: context for the next piece
        self.shown = 0  # tokens whose text has been returned

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=self.skip_special_tokens)

    def _piece(self, hold_partial: bool) -> str:
        before = self._decode(self.tokens[self.start:self.shown])
        after = self._decode(self.tokens[self.start:])
        if len(after) <= len(before) or (hold_partial and after.endswith("\ufffd")):
            return ""
        self.start, self.shown = self.shown, len(self.tokens)
        return after[len(before):]

    def add(self, tokens: list[int]) -> str:
        """The text ``tokens`` complete (possibly empty)."""
        self.tokens += tokens
        return self._piece(hold_partial=True)

    def finish(self) -> str:
        """Whatever was held back waiting for the rest of a character."""
        return self._piece(hold_partial=False)
