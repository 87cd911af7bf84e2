"""Bounded work on text a model directory or a user hands us, before any of it is tokenized.

- `apply_chat_template`: the tokenizer's chat template (Jinja, from the model directory: code of sorts that
  runs without ``--trust-remote-code``) rendered under a time limit, so a template with nested loops ends with one
  error line instead of hanging; what it renders is bounded in size too.
- `check_text_fits`: a text that cannot fit the model's window is refused from its length alone (a token
  covers at most the longest token's characters), before a tokenizer spends minutes and gigabytes on it.
"""

from __future__ import annotations

import contextlib
import functools
import re
import signal
import threading

from h2o_compress.utils.errors import InputError, ModelLoadError

TEMPLATE_SECONDS = 10.0  # a real chat template renders in milliseconds
TEMPLATE_GROWTH = 64  # rendered characters per character of the messages, at most (plus TEMPLATE_FIXED)
TEMPLATE_FIXED = 1 << 20
_WHITESPACE = re.compile(r"\s+")  # what str.split() splits on (str.isspace characters)


class _TemplateTimeout(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise `_TemplateTimeout` in this (main) thread after ``seconds``; no limit off the main thread (a
    signal can only interrupt the main thread), where the template runs as transformers runs it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise _TemplateTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def apply_chat_template(tokenizer, messages: list[dict], seconds: float | None = None, **kwargs):
    """``tokenizer.apply_chat_template(messages, **kwargs)`` rendered within ``seconds`` (default
    `TEMPLATE_SECONDS`) and within `TEMPLATE_GROWTH` characters per character of the messages (text
    output).

    Raises:
        ModelLoadError: the template ran longer or rendered more, naming the limit and ``--no-chat`` (chat=False).
    """
    seconds = TEMPLATE_SECONDS if seconds is None else seconds
    try:
        with _time_limit(seconds):
            rendered = tokenizer.apply_chat_template(messages, **kwargs)
    except _TemplateTimeout:
        raise ModelLoadError(
            f"the model's chat template did not finish rendering in {seconds:g} s (a template runs loops of its own); "
            "allowed: a model directory with a working chat template, or --no-chat (chat=False) to skip it"
        ) from None
    size = sum(len(str(m.get("content", ""))) for m in messages)
    if isinstance(rendered, str) and len(rendered) > TEMPLATE_FIXED + TEMPLATE_GROWTH * size:
        raise ModelLoadError(
            f"the model's chat template rendered {len(rendered)} characters for {size} characters of messages; "
            "allowed: a working chat template, or --no-chat (chat=False) to skip it"
        )
    return rendered


@functools.lru_cache(maxsize=8)
def _longest_token(tokenizer) -> int:
    """Characters of the tokenizer's longest vocabulary entry (an upper bound on the text one token covers)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1


def check_text_fits(tokenizer, text: str, window: int | None, what: str = "the text") -> None:
    """Refuse ``text`` that needs more than ``window`` tokens whatever the tokenization: at least (its characters
    besides whitespace) / (the longest token's characters) tokens. Cheap (no tokenizing); ``window`` ``None``: no
    check.

    Raises:
        InputError: naming the length, the bound and the window.
    """
    if window is None or not text:
        return
    try:
        longest = _longest_token(tokenizer)
    except (AttributeError, TypeError, NotImplementedError):  # a tokenizer without a vocabulary to read
        return
    if len(text) // longest <= window:  # fits whatever its whitespace: nothing to count
        return
    visible = len(_WHITESPACE.sub("", text))  # a pre-tokenizer may drop whitespace; anything else is covered
    least = visible // longest
    if least > window:
        raise InputError(
            f"{what} has {visible:,} characters besides whitespace: at least {least:,} tokens (no token covers more "
            f"than {longest} characters), beyond the model's window of {window:,} tokens; allowed: a shorter text"
        )
