"""The one decode loop: step by step after a prefill, until a stop, streaming what each step gives.

``generate`` ([`h2o_compress.runtime.generation`][h2o_compress.runtime.generation]), the batch job
([`h2o_compress.runtime.batch`][h2o_compress.runtime.batch]) and the greedy continuation of the evaluations
(``h2o_compress.evaluation.stream.greedy_decode``) all decode through `decode_steps`: per step, the inputs
(``feed``), one decode step (eager or compiled, `h2o_compress.runtime.compiled`), the next-token choice (``pick``),
the new ids read to the host once (the one host sync of a step, which the stop rule needs anyway), and the step's
seconds. The caller decides what a step's ids mean: `decode` (one sequence: `generate` and ``greedy_decode``)
stops at `ended` and hands the growing ids to ``on_ids`` (e.g. a `TextStream`); the batch job ends, refills and
shrinks its rows between steps. The prefill before the loop is `h2o_compress.runtime.prefill.prefill` (or the
caller's forward pass), whose logits give the first token.

Everything here is plain functions over tensors, the model and the cache: no state outside the arguments, so a
compiled step (`compiled_decode_step`) sees the same inputs, shapes and buffers at every step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Generator, Iterator, NamedTuple

import torch

from h2o_compress.runtime.compiled import step_inputs

StepFn = Callable[..., torch.Tensor]
"""``step(model, token [rows, 1], cache, positions [rows, 1], attention_mask)`` -> logits ``[rows, vocab]``
(`h2o_compress.runtime.compiled.decode_step` or its compiled form)."""

PickFn = Callable[[torch.Tensor], torch.Tensor]
"""The next-token choice: logits ``[rows, vocab]`` -> token ids ``[rows, 1]``."""


def sync(device: torch.device) -> None:
    """Wait for queued CUDA work so wall-clock timings are real (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def eos_ids(model, tokenizer) -> set[int]:
    """The end-of-sequence ids: the model's ``generation_config.eos_token_id`` and the tokenizer's (either may be one
    id or a list)."""
    ids = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update(value if isinstance(value, (list, tuple)) else [value])
    return ids


def ended(ids: list[int], eos, max_new_tokens: int) -> bool:
    """The stop rule of every decode: the sequence's new ``ids`` end with an id of ``eos`` or number
    ``max_new_tokens``."""
    return ids[-1] in eos or len(ids) >= max_new_tokens


def sampler(temperature: float, seed: int | None, device: torch.device) -> PickFn:
    """The next-token choice from ``[1, vocab]`` logits to a ``[1, 1]`` token id: the argmax at ``temperature``
    0, else a draw from ``softmax(logits / temperature)`` (float32), from a generator on ``device`` seeded with
    ``seed`` (``None``: torch's global one)."""
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None

    def pick(logits: torch.Tensor) -> torch.Tensor:
        if temperature == 0:
            return logits.argmax(-1, keepdim=True)
        probs = torch.softmax(logits.float() / temperature, -1)
        return torch.multinomial(probs, 1, generator=generator)

    return pick


class TextStream:
    """Streams the text of a growing list of token ids to ``on_text``, piece by piece, decoding a short window per
    call instead of every id so far (the full decode per new token grows with the output: at a few thousand
    tokens it is a sizeable share of a compiled GPU decode step). The window starts where
    the previous piece started: the new piece is ``decode(ids[start:])`` less ``decode(ids[start:end])``, so a
    tokenizer that drops the leading space of a decode's first token, or a character split over several byte
    tokens (held back while the text ends in U+FFFD), streams as the full decode would (the incremental
    detokenization of vLLM's ``detokenize_incrementally``). The pieces join to ``tokenizer.decode(ids,
    skip_special_tokens=True)``.
    """

    def __init__(self, tokenizer, on_text: Callable[[str], None]):
        self.tokenizer, self.on_text = tokenizer, on_text
        self.start = self.end = 0  # ids[start:end] were streamed; ids[end:] not yet

    def update(self, ids: list[int]) -> None:
        """Stream what ``ids`` (the whole list so far, grown since the last call) adds to the text."""
        decode = lambda part: self.tokenizer.decode(part, skip_special_tokens=True)  # noqa: E731
        shown, text = decode(ids[self.start : self.end]), decode(ids[self.start :])
        if len(text) > len(shown) and not text.endswith("\ufffd"):
            self.on_text(text[len(shown) :])
            self.start, self.end = self.end, len(ids)


@dataclass
class Step:
    """One decode step of `decode_steps`.

    Attributes:
        token: the picked ids ``[rows, 1]`` on the device (the next step's input).
        values: the same ids on the host, one per row.
        seconds: the step's wall-clock seconds (inputs, forward pass, pick, the ids read back).
        timed: past the first ``untimed`` steps (a compiled step's warm-up): a decode speed may count it.
    """

    token: torch.Tensor
    values: list[int]
    seconds: float
    timed: bool


def decode_steps(step: StepFn, model, cache, feed: Callable[[], tuple], pick: PickFn, more: Callable[[], bool],
                 untimed: int = 0, device: torch.device | None = None) -> Iterator[Step]:
    """The decode loop: while ``more()``, one decode step of every row, yielded as a `Step`.

    Args:
        step: the decode step (`StepFn`).
        model: the causal LM.
        cache: the cache the step reads and extends.
        feed: ``feed()`` -> ``(token [rows, 1], positions [rows, 1], attention_mask or None)``: the step's inputs,
            asked for right before it runs (the caller may have changed its rows since the last step).
        pick: the next-token choice (`PickFn`).
        more: asked before each step; the loop ends when it says ``False`` (or when the caller stops iterating).
        untimed: the first steps that compile or record a CUDA graph (`Step.timed` is ``False`` for them).
        device: where to wait for queued work after a step (`sync`) before reading the clock; ``None``: the
            read-back of the ids is the only wait.
    """
    count = 0
    while more():
        start = time.perf_counter()
        token, positions, mask = feed()
        token = pick(step(model, token, cache, positions, mask))
        values = token[:, 0].tolist()
        if device is not None:
            sync(device)
        count += 1
        yield Step(token, values, time.perf_counter() - start, count > untimed)


class Decoded(NamedTuple):
    """What `decode` returns: the new ``ids`` (the prefill's first), the seconds of the timed steps
    (``decode_s``) and those of the untimed ones (``compile_s``)."""

    ids: list[int]
    decode_s: float
    compile_s: float


def decode(step: StepFn, model, cache, token: torch.Tensor, seen: int, pick: PickFn, eos, max_new_tokens: int,
           on_ids: Callable[[list[int]], None] | None = None, untimed: int = 0,
           device: torch.device | None = None) -> Decoded:
    """One sequence decoded from its first token until `ended`: one step per token after the prefill's.

    Args:
        step: the decode step (`StepFn`).
        model: the causal LM.
        cache: the cache after the prefill.
        token: the first new token ``[1, 1]`` (picked from the prefill's logits).
        seen: tokens the cache had seen when ``token`` was picked (the position ``token`` is fed at).
        pick: the next-token choice (`PickFn`).
        eos: the end-of-sequence ids (`eos_ids`).
        max_new_tokens: new tokens at most (the first included).
        on_ids: receives the new ids so far after each token, the first included (e.g. `TextStream.update`).
        untimed: as for `decode_steps`.
        device: as for `decode_steps`.
    """
    loop = decoding(step, model, cache, token, seen, pick, eos, max_new_tokens, untimed, device)
    while True:
        try:
            ids = next(loop)
        except StopIteration as stop:
            return stop.value
        if on_ids is not None:
            on_ids(ids)


def decoding(step: StepFn, model, cache, token: torch.Tensor, seen: int, pick: PickFn, eos, max_new_tokens: int,
             untimed: int = 0, device: torch.device | None = None) -> Generator[list[int], None, Decoded]:
    """`decode` as a generator (the arguments as there): yields the new ids so far after each token, the first
    included (the same list, grown: read it before the next step), and returns the `Decoded`. Nothing runs between
    two yields, so a caller that takes its time with the ids (a text stream's consumer) is not timed."""
    ids: list[int] = [token.item()]
    current = [token]
    decode_s = compile_s = 0.0
    yield ids

    def feed() -> tuple:
        return (current[0], *step_inputs(cache, current[0], seen + len(ids) - 1))

    for done in decode_steps(step, model, cache, feed, pick, lambda: not ended(ids, eos, max_new_tokens), untimed,
                             device):
        current[0] = done.token
        ids.append(done.values[0])
        if done.timed:
            decode_s += done.seconds
        else:
            compile_s += done.seconds
        yield ids
    return Decoded(ids, decode_s, compile_s)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The greedy next-token choice (`PickFn`): the argmax of logits ``[rows, vocab]`` as ids ``[rows, 1]``."""
    return logits.argmax(-1, keepdim=True)


def fixed_steps(step: StepFn, model, cache, token: torch.Tensor, seen: int, count: int, pick: PickFn = greedy,
                untimed: int = 0, device: torch.device | None = None) -> Iterator[Step]:
    """Exactly ``count`` decode steps of every row through `decode_steps`, with no stop rule: each step feeds the
    previous step's ids (the first feeds ``token``) at the next position, its inputs from
    `h2o_compress.runtime.compiled.step_inputs` (no mask for a compressed cache, the all-ones mask for any other),
    as `decode` feeds them. What a benchmark runs to time a fixed number of steps of the package's own loop, for
    our cache and a transformers cache alike.

    Args:
        step: the decode step (`StepFn`).
        model: the causal LM.
        cache: the cache after the prefill (any ``transformers`` cache, or a compressed one).
        token: the ids fed first, ``[rows, 1]`` on the model's device.
        seen: tokens the cache had seen when ``token`` was picked (the position ``token`` is fed at).
        count: steps to run (``0``: none).
        pick: the next-token choice (`PickFn`; default `greedy`).
        untimed: as for `decode_steps`.
        device: as for `decode_steps`.

    Yields:
        Each `Step`; the last one's ``token`` is what a next step would feed.
    """
    current, done = [token], [0]

    def feed() -> tuple:
        return (current[0], *step_inputs(cache, current[0], seen + done[0]))

    for finished in decode_steps(step, model, cache, feed, pick, lambda: done[0] < count, untimed, device):
        current[0] = finished.token
        done[0] += 1
        yield finished


def run_steps(step: StepFn, model, cache, token: torch.Tensor, seen: int, count: int, pick: PickFn = greedy,
              device: torch.device | None = None) -> torch.Tensor:
    """Run `fixed_steps` (the arguments as there) to the end; returns the ids ``[rows, 1]`` the last step picked
    (``token`` itself for ``count`` 0): the input of a next step."""
    for finished in fixed_steps(step, model, cache, token, seen, count, pick, device=device):
        token = finished.token
    return token
