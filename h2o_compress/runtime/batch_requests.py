"""The requests of a batch job ([`h2o_compress.generate_batch`][h2o_compress.generate_batch]) and their results: what one prompt asks for,
checked on its own so that a bad one becomes an error result naming its id, never a traceback or a silent skip."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from h2o_compress.runtime.chat import apply_chat_template, check_text_fits
from h2o_compress.runtime.generation import check_generation_args, encode_prompt
from h2o_compress.runtime.prefill import check_context, context_window
from h2o_compress.utils.checks import is_integer
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
        return cls(id=_id_text(item.get("id", index)), **{k: item[k] for k in REQUEST_KEYS[1:] if k in item})


def _id_text(ident) -> str:
    """An id as the text the answers carry.

    Raises:
        InputError: not a text or an integer, or an integer too long to write out (more than 4300 digits).
    """
    if not (isinstance(ident, str) or is_integer(ident)):
        raise InputError(f"id {short(ident)} is invalid; allowed: a text or an integer")
    try:
        return str(ident)
    except ValueError:  # Python writes out integers of at most 4300 digits
        raise InputError(f"id {short(ident)} is invalid; allowed: a text or an integer of at most 4300 digits") from None


def _given_id(item, index: int) -> str:
    """The id an error result of ``item`` carries: its own when it can be written out, else its place."""
    ident = item.get("id", index) if isinstance(item, dict) else getattr(item, "id", index)
    try:
        return _id_text(ident)
    except InputError:
        return str(index)


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
    ident = _given_id(item, index)
    try:
        request = BatchRequest.of(item, index)
        ident = request.id
        new = max_new_tokens if request.max_new_tokens is None else request.max_new_tokens
        temp = temperature if request.temperature is None else request.temperature
        row_seed = request.seed if request.seed is not None else None if seed is None else (seed + index) % 2**64
        check_generation_args(new, temp, row_seed)
        ids = _encode(tokenizer, request, chat, context_window(model))
        check_context(model, ids.numel(), new)
        return Prepared(request, index, ids, new, float(temp), row_seed)
    except H2OCompressError as exc:
        return BatchResult(id=str(ident), index=index, finish_reason="error", error=str(exc))


def _encode(tokenizer, request: BatchRequest, chat: bool, window: int | None) -> torch.Tensor:
    """The token ids of ``request`` (``[tokens]``), its length checked against the model's ``window`` first
    (`check_text_fits`: a 50 MB prompt is refused in milliseconds, never tokenized).

    Raises:
        InputError: both or neither of ``prompt`` and ``messages``, malformed or empty messages, text that is not
            UTF-8 (a lone surrogate), text too long for ``window``, or ``messages`` without a chat template.
    """
    if (request.prompt is None) == (request.messages is None):
        raise InputError("give exactly one of 'prompt' (a text) and 'messages' (a chat)")
    if request.prompt is not None:
        return encode_prompt(tokenizer, request.prompt, chat, window)[0]
    messages = request.messages
    if (not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)):
        raise InputError(f"messages {short(messages)} is invalid; allowed: a non-empty list of objects with a 'role' "
                         "and a 'content' text")
    for number, message in enumerate(messages):
        for key in ("role", "content"):
            _check_utf8(message[key], f"messages[{number}].{key}")
    if not getattr(tokenizer, "chat_template", None):
        raise InputError("'messages' needs a chat template, and this tokenizer has none; allowed: 'prompt'")
    if not any(m["content"].strip() for m in messages):
        raise InputError("messages are all empty; allowed: at least one message with text")
    check_text_fits(tokenizer, "".join(m["content"] for m in messages), window, "the messages")
    encoded = apply_chat_template(tokenizer, messages, add_generation_prompt=True, return_dict=True,
                                  return_tensors="pt")
    return encoded["input_ids"][0]


def _check_utf8(text: str, where: str) -> None:
    """Refuse ``text`` holding a lone surrogate (what invalid UTF-8 bytes become), which a tokenizer cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(f"{where} holds a character that is not valid UTF-8 at position {exc.start}; allowed: UTF-8 "
                         "text") from None
