"""``generate``'s streamed text: pieces that join to the full decode, each from a short window of ids."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from h2o_compress.runtime.generation import TextStream

MIXED = ("Heavy hitters are the few tokens that receive most of the attention. Naïve café, crème brûlée; "
         "東京 and 🚀 — then plain text again, \"quoted\", and numbers 3.14159 and 2048.\n") * 12


def stream_ids(tokenizer, ids: list[int]) -> tuple[list[str], list[int]]:
    """Feed ``ids`` one at a time, as generate does; ``(pieces, length of every id list decoded)``."""
    pieces, decoded = [], []
    original = tokenizer.decode

    def counting(part, **kwargs):
        decoded.append(len(part))
        return original(part, **kwargs)

    tokenizer.decode = counting
    try:
        stream = TextStream(tokenizer, pieces.append)
        for n in range(1, len(ids) + 1):
            stream.update(ids[:n])
    finally:
        del tokenizer.decode
    return pieces, decoded


def check(tokenizer, text: str, window: int) -> None:
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) > 300
    pieces, decoded = stream_ids(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in piece for piece in pieces)
    assert max(decoded) <= window, f"a decode of {max(decoded)} ids: the stream re-decodes its whole output"


def test_word_level_tokenizer_streams_in_short_windows(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    check(tokenizer, " ".join(f"w{i % 120}" for i in range(400)), window=3)


@pytest.mark.integration
def test_smollm2_tokenizer_streams_multibyte_text_exactly(smollm2):
    """Byte-level BPE splits accented letters, CJK and emoji over several tokens: none is streamed half-made."""
    _, tokenizer = smollm2
    check(tokenizer, MIXED, window=8)
