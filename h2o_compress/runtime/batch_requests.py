"""The requests of a batch job ([`h2o_compress.generate_batch`][h2o_compress.generate_batch]) and their results: what one prompt asks for,
checked on its own so that a bad one becomes an error result naming its id, never a traceback or a silent skip."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from h2o_compress.runtime.chat import apply_chat_template
from h2o_compress.runtime.generation import check_generation_args, encode_prompt
from h2o_compress.runtime.prefill import check_context
from h2o_compress.utils.errors import H2OCompressError, InputError, short

#: The keys a request may carry (a JSONL line, or a dict given to ``generate_batch``).
REQUEST_KEYS = ("id", "prompt", "messages", "max_new_tokens", "temperature", "seed")
#: ``finish_reason`` values: ``stop`` (an end-of-sequence token), ``length`` (``max_new_tokens`` reached),
#: ``error`` (the request was refused or its batch failed: ``error`` says why).
FINISH_REASONS = ("stop", "length", "error")


@dataclass
class BatchRequest:
    """One prompt of a batch job. Exactly one of ``prompt`` (a text, through the chat template when ``chat``) and
    ``messages`` (a chat, ``[{"role": ..., "content": ...}, ...]``, always through the chat template).
    ``max_new_tokens``, ``temperature`` and ``seed`` override the job's for this prompt (``None``: the job's)."""

    id: str
    prompt: str | None = None
    messages: list | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None

    @classmethod
    def of(cls, item, index: int) -> "BatchRequest":
        """A request from a text, a dict with `REQUEST_KEYS` or a request (``index``: its place in the input,
        the id when none is given).

        Raises:
            InputError: an item of another kind, an unknown key, or an id that is not a text or an integer.
        """
        if isinstance(item, cls):
            return item
        if isinstance(item, str):
            return cls(id=str(index), prompt=item)
        if not isinstance(item, dict):
            raise InputError(f"request {index} is a {type(item).__name__} ({short(item)}); allowed: a text, or an object "
                             f"with the keys {', '.join(REQUEST_KEYS)}")
        unknown = sorted(set(item) - set(REQUEST_KEYS))
        if unknown:
            raise InputError(f"unknown key {', '.join(map(repr, unknown))}; allowed: {', '.join(REQUEST_KEYS)}")
        ident = item.get("id", index)
        if isinstance(ident, bool) or not isinstance(ident, (str, int)):
            raise InputError(f"id {short(ident)} is invalid; allowed: a text or an integer")
        return cls(id=str(ident), **{k: item[k] for k in REQUEST_KEYS[1:] if k in item})


@dataclass
class BatchResult:
    """What one prompt of a batch job gave.

    Attributes:
        id: the request's id.
        index: its place in the input (0-based).
        text: the generated text (prompt excluded); empty for an error.
        prompt_tokens: tokens of the prompt.
        new_tokens: tokens generated.
        finish_reason: one of `FINISH_REASONS`.
        error: why the request failed (``finish_reason == "error"``), else ``None``.
        token_ids: the new token ids.
    """

    id: str
    index: int
    text: str = ""
    prompt_tokens: int = 0
    new_tokens: int = 0
    finish_reason: str = "length"
    error: str | None = None
    token_ids: list[int] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict:
        """The output line: ``id``, ``text``, ``prompt_tokens``, ``new_tokens``, ``finish_reason`` (and ``error``)."""
        out = {"id": self.id, "text": self.text, "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
               "finish_reason": self.finish_reason}
        if self.error is not None:
            out["error"] = self.error
        return out


@dataclass
class Prepared:
    """A request checked and tokenized: ``ids`` int64 ``[tokens]`` (CPU) and the settings it decodes with."""

    request: BatchRequest
    index: int
    ids: torch.Tensor
    max_new_tokens: int
    temperature: float
    seed: int | None  # the request's own, else the job's plus the index, else None (drawn at random)


def prepare(model, tokenizer, item, index: int, chat: bool, max_new_tokens: int, temperature: float,
            seed: int | None) -> Prepared | BatchResult:
    """Check and tokenize one request (``generate``'s checks: a non-empty UTF-8 prompt, valid ``max_new_tokens``,
    ``temperature`` and ``seed``, prompt + new tokens within the model's context), or its error result."""
    ident = str(item.get("id", index)) if isinstance(item, dict) else getattr(item, "id", str(index))
    try:
        request = BatchRequest.of(item, index)
        ident = request.id
        new = max_new_tokens if request.max_new_tokens is None else request.max_new_tokens
        temp = temperature if request.temperature is None else request.temperature
        row_seed = request.seed if request.seed is not None else None if seed is None else (seed + index) % 2**64
        check_generation_args(new, temp, row_seed)
        ids = _encode(tokenizer, request, chat)
        check_context(model, ids.numel(), new)
        return Prepared(request, index, ids, new, float(temp), row_seed)
    except H2OCompressError as exc:
        return BatchResult(id=str(ident), index=index, finish_reason="error", error=str(exc))


def _encode(tokenizer, request: BatchRequest, chat: bool) -> torch.Tensor:
    if (request.prompt is None) == (request.messages is None):
        raise InputError("give exactly one of 'prompt' (a text) and 'messages' (a chat)")
    if request.prompt is not None:
        return encode_prompt(tokenizer, request.prompt, chat)[0]
    messages = request.messages
    if (not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)):
        raise InputError(f"messages {short(messages)} is invalid; allowed: a non-empty list of objects with a 'role' "
                         "and a 'content' text")
    if not getattr(tokenizer, "chat_template", None):
        raise InputError("'messages' needs a chat template, and this tokenizer has none; allowed: 'prompt'")
    if not any(m["content"].strip() for m in messages):
        raise InputError("messages are all empty; allowed: at least one message with text")
    encoded = apply_chat_template(tokenizer, messages, add_generation_prompt=True, return_dict=True,
                                  return_tensors="pt")
    return encoded["input_ids"][0]
