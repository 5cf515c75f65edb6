"""Text of a growing token sequence, piece by piece, never splitting a character."""

from __future__ import annotations


class IncrementalText:
    """Feed token ids as they are committed; get back the text they add.

    The whole sequence is decoded each time (tokenizers merge pieces across token boundaries), and text
    ending in U+FFFD, an incomplete multi-byte character, is held back until the rest arrives.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = []
        self.shown = ""

    def _decode(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=self.skip_special_tokens)

    def add(self, tokens: list[int]) -> str:
        """The text ``tokens`` complete (possibly empty)."""
        self.tokens += tokens
        text = self._decode()
        if text.endswith("\ufffd") or len(text) <= len(self.shown):
            return ""
        piece, self.shown = text[len(self.shown):], text
        return piece

    def finish(self) -> str:
        """Whatever was held back (the final text is the full decode)."""
        text = self._decode()
        piece = text[len(self.shown):]
        self.shown = max(text, self.shown, key=len)
        return piece

    @property
    def text(self) -> str:
        """The full text of every token fed so far."""
        return self._decode()
