"""Where an answer stops: EOS ids, the token budget, and stop strings, checked as tokens arrive.

    truncate_at_stop(new, room, eos)   a step's tokens cut to the budget and just after the first EOS
    StopTokens                         the engine's stop-string check: fed each step's tokens, it decodes only
                                       the new ones (``IncrementalText``) and searches only the text they could
                                       complete, so a long answer costs no more per step than a short one
    StopText                           the server's: fed text pieces, it passes on what cannot be the start of
                                       a stop string and cuts the answer before the first stop string, as
                                       OpenAI's API does (the stop string itself is never returned)
"""

from __future__ import annotations

from .detokenize import IncrementalText


def truncate_at_stop(new: list[int], room: int, eos: set[int]) -> tuple[list[int], bool]:
    """Cut ``new`` to the ``room`` tokens left and just after the first EOS. Returns (tokens, finished)."""
    for i, tok in enumerate(new[:room]):
        if tok in eos:
            return new[: i + 1], True
    return new[:room], len(new) >= room


class StopTokens:
    """How many of the answer's tokens it takes for a stop string to appear in its text."""

    def __init__(self, tokenizer, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.longest = max((len(s) for s in stops), default=0)
        self.text = IncrementalText(tokenizer) if stops and tokenizer is not None else None
        self.chars = ""  # the answer's text so far
        self.ends: list[int] = []  # len(chars) after each token

    def add(self, tokens: list[int]) -> int | None:
        """Feed the next tokens; the smallest token count whose text holds a stop string, or None."""
        if self.text is None:
            return None
        start = max(0, len(self.chars) - self.longest + 1)  # a stop string found now ends in the new text
        for tok in tokens:
            self.chars += self.text.add([tok])
            self.ends.append(len(self.chars))
        hits = [i + len(s) for s in self.stops if (i := self.chars.find(s, start)) >= 0]
        if not hits:
            return None
        end = min(hits)
        return next(n + 1 for n, e in enumerate(self.ends) if e >= end)


class StopText:
    """The answer's text as the client may see it: up to, not including, the first stop string."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.held = ""  # text that may be the start of a stop string
        self.stopped = False

    def add(self, piece: str) -> str:
        """Feed the next piece of text; what may be sent now."""
        if self.stopped:
            return ""
        text = self.held + piece
        hits = [i for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return text[:min(hits)]
        keep = max((k for s in self.stops for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k])),
                   default=0)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def finish(self) -> str:
        """What was held back, at the end of an answer that did not stop at a stop string."""
        rest, self.held = ("" if self.stopped else self.held), ""
        return rest

    def cut(self, text: str) -> str:
        """A whole answer's text, cut before its first stop string."""
        return self.add(text) + self.finish()
