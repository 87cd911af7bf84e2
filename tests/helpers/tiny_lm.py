"""Helpers of the evaluation tests: a tiny LLaMA with a small BPE tokenizer trained on the shipped corpus, so
English text gives real, varied token ids (vocabulary 128, the tiny model's)."""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch
from conftest import tiny_llama


@lru_cache(maxsize=1)
def english_tokenizer():
    """A 128-token BPE tokenizer (``<unk>``, ``</s>`` + characters + merges) trained on 30 KB of the corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from h2o_compress.evaluation import default_corpus

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=128, special_tokens=["<unk>", "</s>"], show_progress=False,
                                  initial_alphabet=list("0123456789"))
    backend.train_from_iterator([default_corpus()[:30000]], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")


def tiny_lm(seed: int = 0):
    """``(model, tokenizer)``: the tiny GQA LLaMA of conftest and :func:`english_tokenizer`."""
    return tiny_llama(seed), english_tokenizer()


#: The smallest profile sweep on the tiny model (the reference and h2o at 0.5, 16 tokens, a 24-token perplexity
#: stream read 8 tokens a pass); each test file adds the settings it looks at.
TINY_PROFILE = {"model": "tiny", "policies": ("h2o",), "budgets": (1.0, 0.5), "seq_lens": (16,), "decode_tokens": 2,
                "ppl_tokens": 24, "chunk_size": 8}


def profile_tiny(settings, out, model=None, tokenizer=None) -> dict:
    """``run_profile(settings, out)`` on the given ``model``/``tokenizer`` (default: a fresh :func:`tiny_lm`), without
    a progress bar; the report."""
    from h2o_compress.profiling import run_profile

    if model is None:
        model, tokenizer = tiny_lm()
    return run_profile(settings, out, show_progress=False, model=model, tokenizer=tokenizer)


def save_tiny_lm(path) -> str:
    """Save :func:`tiny_lm` as a local model directory that ``load_model(path)`` reads; returns ``str(path)``."""
    model, tokenizer = tiny_lm()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture
def one_thread():
    """Run a test with one torch thread (tiny models gain nothing from more; a busy 2-core machine loses a lot)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
