"""Compress-then-ask with a context whose last tokens merge with the question's separator: a context file ending in a
newline (or a space), read without a chat template, held every token, and each question's prompt ("context\\n\\n
question") started with other tokens ("\\n" + "\\n\\n" read as one), so ``ask`` refused its own context ("the prompt
(7 tokens) does not start with the 4 tokens the cache holds"). The compressed context holds only the tokens every
question's prompt shares (`context_prefix_length`); the rest is read with the question."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_lm import english_tokenizer, save_tiny_lm, tiny_lm

from h2o_compress import CompressionConfig, ask, compress, generate
from h2o_compress.jobs import run_ask
from h2o_compress.runtime.ask import SEPARATOR, context_prefix_length
from h2o_compress.runtime.generation import encode_prompt

CONTEXTS = ["the cache keeps\n", "the cache keeps ", "the cache keeps\n\n", "the cache keeps"]
QUESTIONS = ["what", "\nwhat", " what"]
EVERYTHING = CompressionConfig(budget=1.0, kv_bits=16)  # nothing evicted: an answer is generate's


@pytest.mark.parametrize("context", CONTEXTS)
@torch.inference_mode()
def test_questions_after_a_context_ending_in_whitespace_are_answered_as_generate_answers(context):
    """Every question is answered (no refusal), with the tokens ``generate`` gives context + separator + question,
    and the context holds a prefix of every question's prompt."""
    model, tokenizer = tiny_lm()
    held = context_prefix_length(tokenizer, context, chat=False)
    compressed = compress(model, tokenizer, context, EVERYTHING, chat=False)
    assert compressed.tokens == held
    for question in QUESTIONS:
        prompt = encode_prompt(tokenizer, context + SEPARATOR + question, chat=False)[0]
        assert torch.equal(prompt[:held], encode_prompt(tokenizer, context, chat=False)[0, :held])
        answer = ask(model, tokenizer, compressed, question, max_new_tokens=4)
        alone = generate(model, tokenizer, context + SEPARATOR + question, EVERYTHING, max_new_tokens=4, chat=False)
        assert answer.token_ids == alone.token_ids and answer.prompt_tokens == prompt.shape[0]


def test_the_merging_newline_is_left_for_the_question():
    """The newline ending the context and the separator are one token in this tokenizer: not held."""
    tokenizer = english_tokenizer()
    ids = encode_prompt(tokenizer, CONTEXTS[0], chat=False)[0]
    merged = encode_prompt(tokenizer, CONTEXTS[0] + SEPARATOR + "what", chat=False)[0]
    assert not torch.equal(merged[: ids.shape[0]], ids)  # the bug's premise
    assert context_prefix_length(tokenizer, CONTEXTS[0], chat=False) == ids.shape[0] - 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_lm(tmp_path_factory.mktemp("tiny-lm"))


@pytest.mark.parametrize("chat", [True, False])
def test_ask_job_answers_from_a_context_file_ending_in_a_newline(chat, model_dir, tmp_path):
    """The command's path: a model directory without a chat template (``chat`` on or off reads the same) and a
    context file with its last newline; every question answered."""
    (tmp_path / "context.txt").write_text("the cache keeps\n")
    report = run_ask(QUESTIONS, context_file=str(tmp_path / "context.txt"), model=model_dir, chat=chat,
                     max_new_tokens=3, load={"device": "cpu"})
    assert [len(result.token_ids) for result in report.results] == [3, 3, 3]
    assert report.context["context_tokens"] < min(a["prompt_tokens"] for a in report.answers)
