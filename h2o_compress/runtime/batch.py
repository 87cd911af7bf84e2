"""``generate_batch``: many prompts through one compressed KV cache of ``batch_size`` rows (the throughput of the
H2O paper, Zhang et al. 2023, arXiv 2306.14048 §5.3: a smaller cache fits a larger batch).

How a job runs (continuous batching over the cache's fixed buffers):

- Every request is checked and tokenized first (`prepare`); a bad one
  gives an error result naming its id and the others go on.
- Each prompt is prefilled **alone**, exactly as ``generate`` prefills it (its own scoring pass for ``kvzip`` and
  ``lookahead``), into a one-row cache whose sequence is then moved into a free row of the batch cache
  ([`take_rows`][h2o_compress.cache.CompressedCache.take_rows]: positions are aligned, nothing is recomputed). So the
  prefill needs the workspace of one sequence, whatever the batch, and no padding is ever computed.
- Decode steps run every row at once. A row whose sequence ends (its end-of-sequence token or its own
  ``max_new_tokens``) is refilled with the next prompt, so no row waits for another. While other rows decode, the
  new prompt's prefill is interleaved with their steps (continuous batching): before each step it runs at most
  ``prefill_chunk_size`` prompt tokens (at least one chunk, `prompt_chunks`), so a long prompt does not stall the
  batch; the row joins the decode once its whole prompt is in. Rows are idle only while their next prompt is
  prefilled and at the end of the job, when no prompt is left (then the batch shrinks by halves). ``refill=False``
  runs static batches instead (the next ``batch_size`` prompts start when all rows have ended), to measure what
  refilling saves: `BatchStats.idle_row_steps`.
- The budget: an integer is tokens per layer and KV head for every row, as for ``generate`` alone (so each answer
  has the greedy tokens ``generate`` gives that prompt alone). A fraction applies to the job's longest sequence
  (the longest ``prompt + max_new_tokens`` of all requests): every row keeps ``ceil(budget x that)`` tokens, at
  least what it keeps alone, and every row holds the same bytes (what ``--batch-size auto`` plans).
  ``layer_budgets="global"`` splits the capacity over the layers once, from the scores of the first prompts
  admitted (one split for every row: the rows share the cache's buffers).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Callable, Iterable, Iterator

import torch

from h2o_compress.config import CompressionConfig
from h2o_compress.policies import POLICIES
from h2o_compress.runtime.batch_requests import BatchRequest, BatchResult, Prepared, prepare
from h2o_compress.runtime.compiled import compiled_decode_step, decode_step, resolve_compile, warmup_steps
from h2o_compress.runtime.context_scores import global_layer_capacities, hand_context_scores, score_context
from h2o_compress.runtime.decode_loop import decode_steps, ended, eos_ids, sync
from h2o_compress.runtime.prefill import prompt_chunks
from h2o_compress.runtime.generation import (
    _check_argument_kinds, check_config, check_generation_args, check_switch, make_cache, make_scored_cache,
)
from h2o_compress.models.weights import input_device
from h2o_compress.utils.errors import ConfigError, H2OCompressError, UnsupportedModelError, short

MAX_BATCH_SIZE = 4096
#: model types whose recurrent/conv states live in the model's own modules (one state for the whole batch the model
#: last ran), not in rows of the cache: a prompt prefilled alone cannot be moved into a row of the batch
MODULE_STATE_TYPES = frozenset({"recurrent_gemma"})


@dataclass
class BatchStats:
    """Figures of a [`generate_batch`][h2o_compress.runtime.batch.generate_batch] run so far (filled in place while it runs).

    Attributes:
        prompts: requests answered (errors included).
        errors: the requests that failed.
        prompt_tokens: tokens read (answered requests).
        new_tokens: tokens generated (answered requests).
        batch_size: rows of the batch cache (at most the number of prompts).
        prefill_s: seconds of the prefills (scoring passes and the move into the batch included).
        decode_s: seconds of the decode steps.
        row_steps: decode row-steps run (rows x steps).
        idle_row_steps: the row-steps spent on rows holding no running
            sequence (the end of the job; static batches: rows whose sequence ended before their batch's last).
        kv_bytes_per_sequence: ``cache.nbytes()`` per row (bytes).
        capacity: tokens kept per layer and KV head for every row (``None``: unbounded).
    """

    prompts: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    batch_size: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    row_steps: int = 0
    idle_row_steps: int = 0
    kv_bytes_per_sequence: int = 0
    capacity: int | None = None

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens generated by decode steps per second of decode (the first token of each row comes from the prefill)."""
        return (self.row_steps - self.idle_row_steps) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def idle_share(self) -> float:
        """Share of the decode row-steps spent on rows holding no running sequence."""
        return self.idle_row_steps / self.row_steps if self.row_steps else 0.0

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "decode_tokens_per_s": self.decode_tokens_per_s,
                "idle_share": self.idle_share}


class BatchRun:
    """The iterator [`generate_batch`][h2o_compress.runtime.batch.generate_batch] returns: [`BatchResult`][h2o_compress.runtime.batch.BatchResult] objects, each as soon as its prompt finishes
    (``in_order``: in input order instead), and `stats` filled as it goes."""

    def __init__(self, results: Iterator[BatchResult], stats: BatchStats):
        self._results, self.stats = results, stats

    def __iter__(self) -> Iterator[BatchResult]:
        return self._results

    def __next__(self) -> BatchResult:
        return next(self._results)


def check_batch_size(batch_size) -> int:
    """``batch_size`` if it is an integer in [1, `MAX_BATCH_SIZE`]; raises ConfigError naming it otherwise."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= MAX_BATCH_SIZE:
        raise ConfigError(f"batch_size={short(batch_size)} is invalid; allowed: an integer from 1 to {MAX_BATCH_SIZE}")
    return batch_size


def check_batchable(model) -> None:
    """Refuse, before any pass, a model whose recurrent or conv states live in its own modules rather than in the
    cache (`MODULE_STATE_TYPES`: RecurrentGemma): continuous batching prefills each prompt alone and moves its cache
    into a row of the batch, which such states cannot follow. Reads the config only.

    Raises:
        UnsupportedModelError: naming the model type and what is supported, in one line.
    """
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", lambda: config)()
    model_type = getattr(text, "model_type", None) or getattr(config, "model_type", None)
    if model_type in MODULE_STATE_TYPES:
        raise UnsupportedModelError(
            f"batch does not support model type {model_type!r}: it keeps its recurrent and conv states in its own "
            "modules, not in the cache, so a prompt prefilled alone cannot join a row of the batch; allowed: a model "
            "whose states the cache holds (attention-only models and the other hybrids), or generate, one prompt at "
            "a time"
        )


def row_config(config: CompressionConfig, longest: int) -> CompressionConfig:
    """``config`` with a fractional budget below 1 turned into the tokens it keeps of the job's ``longest`` sequence
    (prompt + new tokens): the capacity every row of every group gets (budget 1.0 where the longest sequence is
    within ``min_capacity``: nothing is evicted). Other budgets unchanged."""
    if config.policy == "full" or not config.budget_is_fraction or config.budget >= 1:
        return config
    capacity = config.capacity(longest)
    return dataclasses.replace(config, budget=1.0 if capacity is None else capacity)


def generate_batch(
    model, tokenizer, requests: Iterable, config: CompressionConfig | None = None, max_new_tokens: int = 128,
    batch_size: int = 8, chat: bool = True, temperature: float = 0.0, seed: int | None = None,
    compile: bool | None = None, in_order: bool = False, on_step: Callable[[int, int], None] | None = None,
    longest_first: bool = True, refill: bool = True,
) -> BatchRun:
    """Generate for many prompts, ``batch_size`` sequences decoded at once through one compressed KV cache, a row
    refilled with the next prompt as soon as its sequence ends (see the module's text).

    Args:
        model: as for [`h2o_compress.generate`][h2o_compress.generate].
        tokenizer: as for [`h2o_compress.generate`][h2o_compress.generate].
        requests: texts, dicts with the keys of `REQUEST_KEYS` (``id``,
            ``prompt`` or ``messages``, and per-prompt ``max_new_tokens``, ``temperature``, ``seed``) or
            [`BatchRequest`][h2o_compress.runtime.batch.BatchRequest] objects; all are read and checked first.
        config: the compression setting for every row (see the module's text for what a budget fraction means).
        max_new_tokens: the job's default, as for ``generate``.
        chat: the job's default, as for ``generate``.
        temperature: the job's default, as for ``generate``.
        seed: the job's default, as for ``generate``; a request's own ``seed`` seeds its sampling as ``generate``
            would (the same tokens); without one, the job's ``seed`` plus the request's index.
        compile: the job's default, as for ``generate``.
        batch_size: rows of the batch cache, 1 to `MAX_BATCH_SIZE` (at most the number of prompts are used).
        in_order: yield results in input order (held back until their turn) instead of as they finish.
        on_step: called after each decode step with ``(rows that produced a token, rows in the batch)`` (for a
            progress bar).
        longest_first: admit prompts longest first (``prompt + max_new_tokens``), so the end of the job, where rows
            run idle, holds the short ones; ``False``: in input order.
        refill: refill a row as soon as its sequence ends (continuous batching); ``False``: static batches.

    Returns:
        A `BatchRun`: iterate it for [`BatchResult`][h2o_compress.runtime.batch.BatchResult] objects (one
        per request; a refused request, or one whose batch failed, has ``finish_reason == "error"`` and ``error``);
        ``.stats`` holds the [`BatchStats`][h2o_compress.runtime.batch.BatchStats].

    Raises:
        ConfigError: a bad job-wide argument (checked before anything runs, when this is called): ``requests``
            not an iterable of requests (a text, a dict), a switch (``chat``, ``in_order``, ``longest_first``,
            ``refill``) that is not a bool.
        UnsupportedModelError: a model whose states live in its own modules (`check_batchable`), when this is
            called.
    """
    _check_argument_kinds(model, tokenizer, None)
    config = check_config(config)
    check_generation_args(max_new_tokens, temperature, seed)
    check_batch_size(batch_size)
    if on_step is not None and not callable(on_step):
        raise ConfigError(f"on_step={short(on_step)} is not callable; allowed: a function or None")
    for name, value in (("chat", chat), ("in_order", in_order), ("longest_first", longest_first), ("refill", refill)):
        check_switch(name, value)
    return generate_batch_checked(model, tokenizer, _request_list(requests), config, max_new_tokens, batch_size, chat,
                                  temperature, seed, compile, in_order, on_step, longest_first, refill)


def generate_batch_checked(model, tokenizer, requests: list, config: CompressionConfig, max_new_tokens: int,
                           batch_size: int, chat: bool, temperature: float, seed: int | None, compile: bool | None,
                           in_order: bool = False, on_step: Callable[[int, int], None] | None = None,
                           longest_first: bool = True, refill: bool = True,
                           compile_checked_for: CompressionConfig | None = None) -> BatchRun:
    """[`generate_batch`][h2o_compress.runtime.batch.generate_batch] for job-wide arguments already checked (what
    [`BatchJob`][h2o_compress.jobs.BatchJob] checks when it is made), so that a request is validated once:
    ``model`` and ``tokenizer`` of the right kind, ``requests`` a list, ``config`` a CompressionConfig,
    ``max_new_tokens``, ``temperature`` and ``seed`` as `check_generation_args` allows, ``batch_size`` as
    `check_batch_size` allows, the switches bools and ``on_step`` callable or ``None``. Each request is checked
    here, as ``generate_batch`` checks it.

    Args:
        compile_checked_for: the setting ``compile`` was checked against (`check_compile`): a batch cache of that
            setting (its budget as `row_config` sets it) is not checked again; ``None``: it is checked.

    Raises:
        UnsupportedModelError: a model whose states live in its own modules (`check_batchable`), when this is
            called, before any pass.
    """
    check_batchable(model)
    stats = BatchStats()
    results = _run(model, tokenizer, requests, config, max_new_tokens, batch_size, chat, temperature, seed,
                   compile, on_step, stats, longest_first, refill, compile_checked_for)
    return BatchRun(_in_order(results) if in_order else results, stats)


def _request_list(requests) -> list:
    """``requests`` read into a list: any iterable of requests but a text, bytes or a mapping (whose keys would be
    taken for prompts).

    Raises:
        ConfigError: naming what was given and what is allowed.
    """
    allowed = "a list (or other iterable) of texts, request dicts or BatchRequest objects"
    if isinstance(requests, (str, bytes, bytearray)):
        raise ConfigError(f"requests is a single text ({type(requests).__name__}); allowed: {allowed}")
    if isinstance(requests, Mapping):
        raise ConfigError(f"requests is a {type(requests).__name__} ({short(requests)}), whose keys would be taken for "
                          f"prompts; allowed: {allowed} (a single request dict goes in a list: [{{...}}])")
    try:
        return list(requests)
    except TypeError:
        raise ConfigError(f"requests={short(requests)} is not iterable; allowed: {allowed}") from None


def _in_order(results: Iterator[BatchResult]) -> Iterator[BatchResult]:
    held, turn = {}, 0
    for result in results:
        held[result.index] = result
        while turn in held:
            yield held.pop(turn)
            turn += 1


def _run(model, tokenizer, items, config, max_new_tokens, batch_size, chat, temperature, seed, compile, on_step,
         stats: BatchStats, longest_first: bool, refill: bool,
         compile_checked_for: CompressionConfig | None = None) -> Iterator[BatchResult]:
    prepared = [prepare(model, tokenizer, item, index, chat, max_new_tokens, temperature, seed)
                for index, item in enumerate(items)]
    for result in prepared:
        if isinstance(result, BatchResult):
            stats.prompts, stats.errors = stats.prompts + 1, stats.errors + 1
            yield result
    rows = [p for p in prepared if isinstance(p, Prepared)]
    if not rows:
        return
    if longest_first:
        rows.sort(key=lambda p: -(p.ids.numel() + p.max_new_tokens))
    longest = max(p.ids.numel() + p.max_new_tokens for p in rows)
    config = row_config(config, longest)
    checked = compile_checked_for is not None and row_config(compile_checked_for, longest) == config
    stats.capacity = config.capacity(longest)
    batch = _Batch(model, tokenizer, config, longest, min(batch_size, len(rows)), compile, stats, checked)
    answered = set()
    try:
        for result in batch.run(rows, refill, on_step):
            answered.add(result.index)
            stats.prompts += 1
            stats.prompt_tokens, stats.new_tokens = stats.prompt_tokens + result.prompt_tokens, stats.new_tokens + result.new_tokens
            yield result
    except H2OCompressError as exc:  # the batch cache failed (e.g. NaN reached it): the prompts not answered say why
        for p in rows:
            if p.index not in answered:
                stats.prompts, stats.errors = stats.prompts + 1, stats.errors + 1
                yield BatchResult(id=p.request.id, index=p.index, prompt_tokens=p.ids.numel(), finish_reason="error",
                                  error=str(exc))


class _Batch:
    """The rows of a batch job: the batch cache, which prompt each row runs, its tokens so far and its sampler."""

    def __init__(self, model, tokenizer, config: CompressionConfig, longest: int, size: int, compile, stats,
                 compile_checked: bool = False):
        self.model, self.tokenizer, self.config, self.longest, self.stats = model, tokenizer, config, longest, stats
        self.device, self.size = input_device(model), size
        self.eos = eos_ids(model, tokenizer)
        self.scored = bool(POLICIES[config.policy].scorer)
        self.capacities = None  # layer_budgets="global": one split for every row, from the first prompts' scores
        self.scores: dict[int, list] = {}  # those scores, by prompt index, until the prompt is prefilled
        self.cache = make_cache(model, config, longest)
        self.compile, self.compile_checked = compile, compile_checked  # checked: for this setting, by a job
        self.rows: list[Prepared | None] = [None] * size
        self.tokens: list[list[int]] = [[] for _ in range(size)]
        self.generators: list[torch.Generator | None] = [None] * size
        self.token = torch.zeros(size, 1, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def run(self, prompts: list[Prepared], refill: bool, on_step) -> Iterator[BatchResult]:
        self.queue = collections.deque(prompts)
        self.admitting: dict[int, _Admission] = {}  # rows whose next prompt is being prefilled, a chunk at a time
        if self.scored and self.config.layer_budgets == "global":
            start = time.perf_counter()
            self._split_layers(prompts[: self.size])
            self.stats.prefill_s += time.perf_counter() - start
        yield from self._refill()
        compiled = resolve_compile(self.compile, self.cache, self.device, self.model,
                                   checked=self.compile_checked and self.cache.config == self.config)
        step = compiled_decode_step(self.model, self.device) if compiled else decode_step
        untimed = warmup_steps(self.device) if compiled else 0
        for done in decode_steps(step, self.model, self.cache, self._inputs, self._pick, self._running, untimed,
                                 self.device):
            yield from self._after_step(done, on_step)
            if refill or not self._running():
                yield from self._refill()
            if not compiled:  # a compiled step keeps its shapes (and its buffers' addresses)
                self._shrink()
        self.cache.check()

    def _after_step(self, done, on_step) -> Iterator[BatchResult]:
        """Take a decode step's tokens into the running rows; yield the results of the rows that ended."""
        self.token = done.token
        running = [row for row in range(self.size) if self.rows[row] is not None]
        if done.timed:
            self.stats.decode_s += done.seconds
            self.stats.row_steps += self.size
            self.stats.idle_row_steps += self.size - len(running)
        if on_step is not None:
            on_step(len(running), self.size)
        for row in running:
            self.tokens[row].append(done.values[row])
            if self._ended(row):
                yield self._result(row)
                self.rows[row] = None

    def _refill(self) -> Iterator[BatchResult]:
        """Start the next prompts in the free rows and prefill them. While other rows decode, the prefills advance
        by one chunk budget (``prefill_chunk_size`` tokens, at least one chunk) per decode step, interleaved with
        the running rows' steps, so a long prompt does not stall them; with no row decoding, they run to the end."""
        budget = max(1, self.config.prefill_chunk_size or 0) if self._decoding() else None
        for row in range(self.size):
            while budget is None or budget > 0:
                if row not in self.admitting:
                    if self.rows[row] is not None or not self.queue:
                        break
                    self.admitting[row] = self._start(self.queue.popleft())
                spent, result = self._advance(row, budget)
                budget = None if budget is None else budget - spent
                if result is not None:
                    yield result

    def _decoding(self) -> bool:
        """Whether a row is decoding (a sequence past its prefill)."""
        return any(r is not None for r in self.rows)

    def _start(self, prompt: Prepared) -> "_Admission":
        """Begin ``prompt``'s prefill alone, into a one-row cache of its own (its scoring pass first, if any)."""
        start = time.perf_counter()
        ids = prompt.ids[None].to(self.device)
        if self.scored and self.capacities is None:  # snapkv's pass lays the prompt in: nothing left to feed
            part = make_scored_cache(self.model, self.tokenizer, ids, self.config, self.longest, True)
        else:
            part = make_cache(self.model, self.config, self.longest, layer_capacities=self.capacities)
            if self.scored:
                hand_context_scores(self.model, self.tokenizer, ids, part, question_in_prompt=True,
                                    scores=self.scores.pop(prompt.index, None))
        self.stats.prefill_s += time.perf_counter() - start
        if part.seen_tokens() == ids.shape[1]:
            return _Admission(prompt, part, iter(()), left=0, logits=part.prompt_state.next_logits)
        return _Admission(prompt, part, prompt_chunks(self.model, ids, part), left=prompt.ids.numel())

    def _advance(self, row: int, budget: int | None) -> tuple[int, BatchResult | None]:
        """Run the next chunks of ``row``'s admission, up to ``budget`` tokens (at least one chunk; ``None``: all);
        once its prompt is in, move it into the row. Returns the tokens fed and the result of a prompt that ended at
        its first token (its row is free again)."""
        admission, start, spent = self.admitting[row], time.perf_counter(), 0
        while admission.left > 0 and (budget is None or spent < budget):
            tokens, admission.logits = next(admission.chunks)
            spent, admission.left = spent + tokens, admission.left - tokens
        self.stats.prefill_s += time.perf_counter() - start
        if admission.left > 0:
            return spent, None
        del self.admitting[row]
        return spent, self._admit(row, admission)

    def _admit(self, row: int, admission: "_Admission") -> BatchResult | None:
        """Move a prefilled prompt into ``row`` of the batch cache and pick its first token; returns its result if
        that first token ended it."""
        start, prompt = time.perf_counter(), admission.prompt
        self.cache.take_rows([row], admission.part, self.size)
        self.rows[row], self.tokens[row] = prompt, []
        self.generators[row] = _generator(prompt, self.device)
        first = self._pick(admission.logits, only=row)
        self.token[row] = first[0]
        self.tokens[row].append(int(first[0, 0]))
        sync(self.device)
        self.stats.prefill_s += time.perf_counter() - start
        self.stats.batch_size = max(self.stats.batch_size, self.size)
        if not self._ended(row):
            self.stats.kv_bytes_per_sequence = self.cache.nbytes() // self.size
            return None
        result = self._result(row)
        self.rows[row] = None
        return result

    def _split_layers(self, first: list[Prepared]) -> None:
        """``layer_budgets="global"``: each layer's capacity, from the scores of the first prompts (each alone)."""
        capacity = self.config.capacity(self.longest)
        if capacity is None:
            return
        capacity = min(capacity, self.longest)
        width = max(p.ids.numel() for p in first)
        scores = [score_context(self.model, self.tokenizer, p.ids[None].to(self.device),
                                self.config.eviction_policy(), True) for p in first]
        self.scores = {p.index: s for p, s in zip(first, scores)}
        aligned = [torch.cat([torch.nn.functional.pad(s[layer], (0, width - s[layer].shape[-1])) for s in scores])
                   for layer in range(len(scores[0]))]  # first token first: the sinks are each prompt's first tokens
        self.capacities = global_layer_capacities(aligned, capacity, self.config.min_layer_capacity(capacity),
                                                  self.longest, self.config.sinks)
        self.cache = make_cache(self.model, self.config, self.longest, layer_capacities=self.capacities)

    def _running(self) -> bool:
        """Whether a row still runs a sequence or is being prefilled (the decode loop goes on while one does)."""
        return self._decoding() or bool(self.admitting)

    def _inputs(self) -> tuple[torch.Tensor, torch.Tensor, None]:
        """The next step's inputs: each row's last token, at its position (`_position`), and no mask."""
        positions = torch.tensor([[self._position(row)] for row in range(self.size)], device=self.device)
        return self.token, positions, None

    def _position(self, row: int) -> int:
        """The position of the token ``row`` feeds: its prompt's length plus its tokens so far, less one (an idle
        row feeds its last again: a learned position table ends at the model's context)."""
        prompt = self.rows[row]
        return 0 if prompt is None else prompt.ids.numel() + len(self.tokens[row]) - 1

    def _ended(self, row: int) -> bool:
        return ended(self.tokens[row], self.eos, self.rows[row].max_new_tokens)

    def _pick(self, logits: torch.Tensor, only: int | None = None) -> torch.Tensor:
        """Next token ``[rows, 1]``: the argmax, or for a sampling row a draw of ``softmax(logits / t)`` with its
        own generator (as ``generate`` draws for that prompt alone). ``only``: ``logits`` ``[1, vocab]`` of that row."""
        token = logits.argmax(-1, keepdim=True)
        for i, row in enumerate([only] if only is not None else range(self.size)):
            prompt, generator = self.rows[row], self.generators[row]
            if prompt is not None and generator is not None:
                probs = torch.softmax(logits[i : i + 1].float() / prompt.temperature, -1)
                token[i] = torch.multinomial(probs, 1, generator=generator)[0]
        return token

    def _shrink(self) -> None:
        """With no prompt left to admit, halve the batch once at most half its rows run (fewer rows per step; a
        compiled step compiles, or records, once per size)."""
        running = [row for row in range(self.size) if self.rows[row] is not None]
        if not running or len(running) > self.size // 2 or self.size == 1 or self.queue or self.admitting:
            return
        keep = torch.tensor(running, device=self.device)
        self.cache.batch_select_indices(keep)
        self.rows = [self.rows[r] for r in running]
        self.tokens = [self.tokens[r] for r in running]
        self.generators = [self.generators[r] for r in running]
        self.token = self.token.index_select(0, keep)
        self.size = len(running)

    def _result(self, row: int) -> BatchResult:
        prompt, tokens = self.rows[row], self.tokens[row]
        return BatchResult(
            id=prompt.request.id, index=prompt.index, text=self.tokenizer.decode(tokens, skip_special_tokens=True),
            prompt_tokens=prompt.ids.numel(), new_tokens=len(tokens),
            finish_reason="stop" if tokens[-1] in self.eos else "length", token_ids=tokens,
        )


@dataclass
class _Admission:
    """A prompt being prefilled alone into its own one-row cache, a chunk at a time, before it joins the batch.

    Attributes:
        prompt: the request.
        part: its one-row cache.
        chunks: the prefill's chunks (`prompt_chunks`), run on demand.
        left: prompt tokens not yet fed.
        logits: ``[1, vocab]`` after the last chunk run.
    """

    prompt: Prepared
    part: object
    chunks: Iterator
    left: int
    logits: torch.Tensor | None = None


def _generator(prompt: Prepared, device) -> torch.Generator | None:
    """The sampler of a sampling prompt: seeded with its seed (as ``generate(seed=...)``), else at random."""
    if prompt.temperature == 0:
        return None
    generator = torch.Generator(device=device)
    if prompt.seed is not None:
        generator.manual_seed(prompt.seed)
    else:
        generator.seed()
    return generator


__all__ = ["BatchRequest", "BatchResult", "BatchRun", "BatchStats", "check_batch_size", "check_batchable", "check_switch", "generate_batch", "row_config"]
