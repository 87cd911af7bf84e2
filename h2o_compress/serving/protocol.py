"""The OpenAI request bodies the server takes (pydantic models: an unknown field is refused, naming it) and the
response objects it writes."""

from __future__ import annotations

import time
import uuid
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr

Number = Union[StrictInt, StrictFloat]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class H2OOptions(_Strict):
    """The per-request compression overrides (the ``h2o`` object): each goes over the server's setting for this
    request, validated as the CLI validates its flags.

    Attributes:
        budget: a fraction in (0, 1] of the sequence, or an integer number of tokens.
        kv_bits: bits of stored keys and values.
        policy: the eviction policy.
    """

    budget: Optional[Union[Number, StrictStr]] = None
    kv_bits: Optional[StrictInt] = None
    policy: Optional[StrictStr] = None


class StreamOptions(_Strict):
    """``stream_options``: with ``include_usage``, a streamed answer ends with a chunk of no choices and its
    ``usage`` (prompt and completion tokens), as OpenAI's."""

    include_usage: StrictBool = False


class Sampling(_Strict):
    """The fields both endpoints share (OpenAI's names). ``temperature`` defaults to the server's (greedy unless
    ``serve --temperature``); ``top_p`` other than 1 and ``n`` other than 1 are refused (the engine samples from
    the whole distribution, one choice per request)."""

    model: StrictStr
    max_tokens: Optional[StrictInt] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    n: Optional[StrictInt] = None
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    seed: Optional[StrictInt] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[StrictStr] = None
    h2o: Optional[H2OOptions] = None


class CompletionRequest(Sampling):
    """``POST /v1/completions``: ``prompt`` is read as it is (no chat template)."""

    prompt: Union[StrictStr, list[StrictStr]]


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: StrictStr


class ChatRequest(Sampling):
    """``POST /v1/chat/completions``: ``messages`` go through the tokenizer's chat template."""

    messages: list[ChatMessage]


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """An OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Reply:
    """The response objects of one request (one id and creation time for the whole answer or every chunk)."""

    def __init__(self, model: str, chat: bool):
        self.model, self.chat = model, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _object(self, kind: str, choice: dict | None, usage: dict | None = None) -> dict:
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": [] if choice is None else [choice]}
        if usage is not None:
            body["usage"] = usage
        return body

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
        """The ``usage`` object: prompt, completion and total tokens, and in ``prompt_tokens_details`` the prompt
        tokens taken from the prefix cache (``cached_tokens``, as OpenAI's)."""
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
        """The last chunk of a stream asked with ``stream_options.include_usage``: no choices, the ``usage``."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._object(kind, None, self.usage(prompt_tokens, completion_tokens, cached_tokens))

    def whole(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int,
              cached_tokens: int = 0) -> dict:
        """The answer of a request that does not stream."""
        usage = self.usage(prompt_tokens, completion_tokens, cached_tokens)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
                      "logprobs": None}
            return self._object("chat.completion", choice, usage)
        return self._object("text_completion", {"index": 0, "text": text, "logprobs": None,
                                                "finish_reason": finish_reason}, usage)

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False) -> dict:
        """A streamed chunk: a piece of text, or the last (``finish_reason``, no text); a chat's first chunk gives
        the role."""
        if self.chat:
            delta = {} if text is None else {"content": text}
            if first:
                delta = {"role": "assistant", **delta}
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            return self._object("chat.completion.chunk", choice)
        return self._object("text_completion", {"index": 0, "text": text or "", "logprobs": None,
                                                "finish_reason": finish_reason})
