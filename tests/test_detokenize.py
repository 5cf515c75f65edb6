"""Incremental text: the pieces add up to the whole decode, and never end inside a multi-byte character."""

from __future__ import annotations

import pytest

from conftest import make_tokenizer
from selfspec.detokenize import IncrementalText

TEXT = "Héllo, wörld! naïve café 東京 🙂 — done.\n  indented  twice"


def pieces(tok, ids: list[int], step: int) -> list[str]:
    text = IncrementalText(tok)
    out = [text.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    return out + [text.finish()]


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_pieces_add_up_on_a_byte_level_tokenizer(step):
    tok = make_tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    got = pieces(tok, ids, step)
    assert "".join(got) == tok.decode(ids) == TEXT
    assert not any(p.endswith("\ufffd") for p in got)  # a character split over tokens waits for its last byte


@pytest.mark.integration
@pytest.mark.parametrize("step", [1, 3])
def test_pieces_add_up_on_smollm2s_tokenizer(step):
    from selfspec.zoo import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    ids = tok.encode(TEXT + " " + TEXT.upper(), add_special_tokens=False) + [tok.eos_token_id]
    assert "".join(pieces(tok, ids, step)) == tok.decode(ids, skip_special_tokens=True)
