"""The serving engine: one thread owns the model and runs the continuous-batching engine of
[`generate_batch`][h2o_compress.generate_batch] for the requests the HTTP handlers submit.

- A handler checks and tokenizes its request (`prepare`, as ``batch`` checks a line), wraps it in a `Job` and
  `Engine.submit` puts it in a queue of at most ``max_queue`` waiting requests (past it: `QueueFull`, HTTP 429).
- The engine thread takes the first waiting request and starts a batch of ``batch_size`` rows for its compression
  setting (with ``memory_limit``: at most the rows the planner fits, `fit_batch`, as ``batch --batch-size auto``).
  While the batch runs, each free row takes the next waiting request **of the same setting whose prompt + max_tokens
  is within the batch's longest** (continuous admission: its prefill is interleaved with the other rows' decode
  steps, a chunk budget per step). A request of another setting (its own ``h2o`` budget, bits or policy), or a
  longer one, waits until the running batch has drained: the rows share one cache's buffers, made for one setting
  and one length.
- After every step each row's new text goes to its request's asyncio queue (``("text", piece)``, then
  ``("done", finish_reason, prompt_tokens, completion_tokens, cached_tokens)`` or ``("error", status,
  message)``), through the event loop's thread-safe call. A row whose request was cancelled (the client went away,
  a stop string was met) ends at the next step, freeing it.
- With ``prefix_cache_bytes``, a chat request that ends keeps its row's compressed cache for the conversation's
  next turn, and a chat request whose prompt extends a kept one starts from it and prefills only the rest
  (`h2o_compress.serving.prefix_cache`); the planner leaves that budget out of what a batch may use.
- A failure in one request's own work (its text, its stop strings) fails that request alone (status 500); a
  failure of a decode step fails the requests of that batch (they share the step); the engine goes on either way.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import time
from dataclasses import dataclass, field

import torch

from h2o_compress.config import CompressionConfig
from h2o_compress.planner import format_bytes, parse_memory
from h2o_compress.planner.plan import fit_batch
from h2o_compress.runtime.batch import BatchStats, _Admission, _Batch, row_config
from h2o_compress.runtime.batch_requests import BatchResult, Prepared
from h2o_compress.runtime.decode_loop import TextStream
from h2o_compress.runtime.prefill import prompt_chunks
from h2o_compress.utils.errors import ConfigError, H2OCompressError, one_line
from h2o_compress.serving.metrics import Metrics
from h2o_compress.serving.prefix_cache import PrefixCache
from h2o_compress.serving.request import ServeRequest


class QueueFull(Exception):
    """`Engine.submit` found ``max_queue`` requests waiting already."""


@dataclass(eq=False)
class Job:
    """One request as the engine runs it; its events go to ``events``, an asyncio queue of the handler's loop.

    Attributes:
        prepared: the request checked and tokenized (``prepared.index``: its unique number).
        config: its compression setting (the server's, with its own ``h2o`` overrides).
        loop: the event loop of the handler.
        stop: stop strings: the text ends before the first one met (which is not returned).
        events: ``("text", piece)``, then ``("done", finish_reason, prompt_tokens, completion_tokens,
            cached_tokens)`` or ``("error", status, message)``.
        arrived: ``time.perf_counter()`` at arrival (seconds).
        cancelled: set when the client went away or a stop string was met: its row ends at the next step.
        cached_tokens: prompt tokens taken from the prefix cache (not prefilled).
    """

    prepared: Prepared
    config: CompressionConfig
    loop: asyncio.AbstractEventLoop
    stop: tuple[str, ...] = ()
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    text: str = ""
    sent: int = 0
    stopped: bool = False
    stream: TextStream | None = None
    cached_tokens: int = 0

    @property
    def chat(self) -> bool:
        """Whether the request is a chat (its ``messages`` through the chat template): only chats use the prefix
        cache."""
        return self.prepared.request.messages is not None

    @property
    def length(self) -> int:
        """Prompt tokens plus ``max_tokens``: the longest this sequence can be."""
        return self.prepared.ids.numel() + self.prepared.max_new_tokens

    def push(self, event: tuple) -> None:
        """Hand ``event`` to the handler's loop (from any thread); dropped if that loop is closed."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def receive(self, piece: str) -> None:
        """Take a new piece of text (`TextStream`'s callback): send what no stop string can still claim (the last
        ``len(longest stop) - 1`` characters are held back), or cut the text at a stop string and end the row."""
        if self.stopped:
            return
        self.text += piece
        found = [i for i in (self.text.find(s, self.sent) for s in self.stop) if i >= 0]
        if found:
            self.text, self.stopped, self.cancelled = self.text[: min(found)], True, True
            self._emit(len(self.text))
            return
        hold = max((len(s) for s in self.stop), default=1) - 1
        self._emit(max(self.sent, len(self.text) - hold))

    def _emit(self, upto: int) -> None:
        if upto > self.sent:
            self.push(("text", self.text[self.sent : upto]))
            self.sent = upto

    def finish(self, result: BatchResult) -> None:
        """Send the rest of the text (the result's whole text, unless a stop string cut it) and ``done``."""
        if not self.stopped and result.text.startswith(self.text):
            self.receive(result.text[len(self.text) :])
        if not self.stopped:
            self._emit(len(self.text))
        reason = "stop" if self.stopped else result.finish_reason
        self.push(("done", reason, result.prompt_tokens, result.new_tokens, self.cached_tokens))


class Engine:
    """The model, its tokenizer and the batch engine, run by a thread of their own (`start`, `stop`).

    Args:
        model: a loaded causal LM (`load_model`).
        tokenizer: its tokenizer.
        metrics: where the engine's figures go.
        request: the server's settings, trusted (validated when made): ``batch_size`` rows decoded at once,
            ``max_queue`` requests waiting at most (past it `submit` raises `QueueFull`), ``memory_limit`` (each
            batch takes at most the rows the planner fits in it for its longest request; ``None``: ``batch_size``
            rows), ``compile`` as for ``generate``, ``prefix_cache_bytes`` the bytes the prefix cache of chat turns
            may hold (`PrefixCache`; 0: off), which the planner leaves out of ``memory_limit``.
        held: bytes the process holds with the model loaded (`PeakMemory.held`), counted by the planner.
    """

    def __init__(self, model, tokenizer, metrics: Metrics, request: ServeRequest, held: int | None = None):
        self.request, self.prefix = request, PrefixCache(request.prefix_cache_bytes)
        self.model, self.tokenizer, self.metrics = model, tokenizer, metrics
        self.batch_size, self.max_queue = request.batch_size, request.max_queue
        self.memory_limit = request.memory_limit
        self.compile, self.held = request.compile, held
        self.jobs: dict[int, Job] = {}  # by prepared.index: waiting or running
        self._waiting: collections.deque[Job] = collections.deque()
        self._members: set[int] = set()  # the jobs in the running batch
        self._numbers = itertools.count()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="h2o-compress-engine", daemon=True)

    def next_index(self) -> int:
        """A number no other request has (a `Prepared`'s ``index``)."""
        return next(self._numbers)

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs."""
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel every request (each running row ends at the next step) and wait for the thread to end."""
        with self._cond:
            self._stopping = True
            for job in list(self.jobs.values()):
                job.cancelled = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def cancel_all(self, message: str) -> int:
        """End every request now (the grace period of a shutdown is over): each gets ``("error", 503, message)``,
        a running row ends at the next step, and the engine thread takes nothing more and ends. Returns how many
        requests were ended."""
        with self._cond:
            self._stopping = True
            jobs = list(self.jobs.values())
            self.jobs.clear()
            self._waiting.clear()
            self.metrics.waiting.set(0)
            for job in jobs:
                job.cancelled = True
                job.push(("error", 503, one_line(message)))
            self._cond.notify_all()
        return len(jobs)

    def submit(self, job: Job) -> None:
        """Queue ``job`` for admission; its events start coming to ``job.events``.

        Raises:
            QueueFull: ``max_queue`` requests are waiting already.
        """
        job.stream = TextStream(self.tokenizer, job.receive)
        with self._cond:
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting already (--max-queue {self.max_queue})")
            self._waiting.append(job)
            self.jobs[job.prepared.index] = job
            self.metrics.waiting.set(len(self._waiting))
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Drop ``job`` (its client went away): out of the queue if it waits, else its row ends at the next step."""
        job.cancelled = True
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
                self.jobs.pop(job.prepared.index, None)
                self.metrics.waiting.set(len(self._waiting))

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                first = self._waiting[0]
            self._run_batch(first)

    def _run_batch(self, first: Job) -> None:
        """Run one batch for ``first``'s setting until no row runs and no waiting request fits it."""
        batch = None
        try:
            with self._cond:
                alike = [j for j in self._waiting if j.config == first.config]
            size, longest = self._rows(first.config, alike)
            batch = ServeBatch(self, first.config, longest, size)
            jobs = self.take(batch, size)
            for result in batch.run([j.prepared for j in jobs], refill=True,
                                    on_step=lambda produced, rows: self.metrics.decode_tokens.inc(produced)):
                self._finish(result, batch)
        except Exception as exc:  # noqa: BLE001 - the batch failed: its requests say why, the engine goes on
            status = 400 if batch is None and isinstance(exc, H2OCompressError) else 500
            failed = set(self._members) if batch is not None else {first.prepared.index}
            with self._cond:
                if batch is None and first in self._waiting:
                    self._waiting.remove(first)
            for index in failed:
                self._fail(index, status, exc)
        finally:
            self._members.clear()
            self.metrics.running.set(0)
            self.metrics.kv_bytes.set(0)

    def _rows(self, config: CompressionConfig, alike: list[Job]) -> tuple[int, int]:
        """The rows and the longest sequence (tokens) of a batch for ``config`` and the requests ``alike`` waiting
        for it: ``batch_size`` rows, or with ``memory_limit`` at most what the planner fits.

        Raises:
            ConfigError: not even one sequence of the longest request fits ``memory_limit`` (less the prefix
                cache's budget).
        """
        longest = max(j.length for j in alike)
        if self.memory_limit is None:
            return self.batch_size, longest
        prompt_len = max(j.prepared.ids.numel() for j in alike)
        gen_len = max(j.prepared.max_new_tokens for j in alike)
        row = fit_batch(self.model, row_config(config, longest), self.memory_limit, prompt_len, gen_len,
                        headroom=self.prefix.budget, held=self.held)
        if row.max_batch < 1:
            raise ConfigError(f"a sequence of {prompt_len} + {gen_len} tokens does not fit --memory-limit "
                              f"{format_bytes(parse_memory(self.memory_limit))} (one needs "
                              f"{format_bytes(row.total_bytes)}); allowed: fewer tokens, or a smaller budget or bits")
        return min(self.batch_size, row.max_batch), longest

    def take(self, batch: "ServeBatch", free: int) -> list[Job]:
        """Up to ``free`` waiting requests that fit ``batch`` (its setting, within its longest), out of the queue."""
        taken = []
        with self._cond:
            for job in list(self._waiting):
                if len(taken) == free:
                    break
                if not job.cancelled and job.config == batch.base and job.length <= batch.longest:
                    self._waiting.remove(job)
                    self._members.add(job.prepared.index)
                    taken.append(job)
            self.metrics.waiting.set(len(self._waiting))
        return taken

    def publish(self, batch: "ServeBatch") -> None:
        """Stream each running row's new text to its request; a failure there fails that request alone."""
        for row, prompt in enumerate(batch.rows):
            job = None if prompt is None else self.jobs.get(prompt.index)
            if job is None or job.cancelled:
                continue
            try:
                job.stream.update(batch.tokens[row])
            except Exception as exc:  # noqa: BLE001 - this request's own failure: the others go on
                job.cancelled = True
                self._fail(prompt.index, 500, exc)

    def _finish(self, result: BatchResult, batch: "ServeBatch") -> None:
        """A row ended: count it, and send its request the rest of its text and ``done`` (or its error)."""
        self._members.discard(result.index)
        job = self.jobs.pop(result.index, None)
        self.metrics.evicted.inc(evicted_tokens(result, batch.capacity))
        if job is None:
            return
        if result.finish_reason == "error":
            job.push(("error", 500, one_line(result.error or "the request failed")))
            return
        try:
            job.finish(result)
        except Exception as exc:  # noqa: BLE001 - this request's own failure
            job.push(("error", 500, one_line(f"{type(exc).__name__}: {exc}")))

    def _fail(self, index: int, status: int, exc: Exception) -> None:
        job = self.jobs.pop(index, None)
        if job is not None:
            message = str(exc) if isinstance(exc, H2OCompressError) else f"{type(exc).__name__}: {exc}"
            job.push(("error", status, one_line(message)))


def evicted_tokens(result: BatchResult, capacity: int | None) -> int:
    """Tokens a finished sequence evicted per layer and KV head: those it fed to the cache (its prompt and every
    new token but the last) beyond ``capacity`` (``None``: unbounded, nothing evicted)."""
    fed = result.prompt_tokens + max(result.new_tokens - 1, 0)
    return 0 if capacity is None else max(fed - capacity, 0)


class ServeBatch(_Batch):
    """A batch of the continuous-batching engine (`h2o_compress.runtime.batch`) that takes its prompts from the
    engine's queue while it runs, streams each row's text after every step and ends a cancelled row.

    Args:
        engine: the `Engine` running it.
        base: the compression setting of its requests (before a budget fraction is taken of ``longest``).
        longest: prompt + max_tokens of its longest request (tokens): what the cache is made for.
        size: rows.

    Its first prompts are not all prefilled before the first decode step (``fill_before_decode=False``): the first
    answers at once, the others' prefills are interleaved with its steps, so the first request does not wait for
    the whole batch's prefill.
    """

    fill_before_decode = False
    # With no waiting request that fits it (they would have taken the free rows), the batch halves once at most half
    # its rows run, as a batch job's does (`_Batch._shrink`): a step then costs the running rows, not the idle ones.
    # A request arriving later takes a free row of what is left, or waits for the batch to drain.

    def __init__(self, engine: Engine, base: CompressionConfig, longest: int, size: int):
        config = row_config(base, longest)
        super().__init__(engine.model, engine.tokenizer, config, longest, size, engine.compile, BatchStats())
        self.engine, self.base, self.capacity = engine, base, config.capacity(longest)

    def _refill(self):
        free = sum(r is None and i not in self.admitting for i, r in enumerate(self.rows)) - len(self.queue)
        if free > 0 and not self.engine._stopping:
            self.queue.extend(j.prepared for j in self.engine.take(self, free))
        yield from super()._refill()
        metrics = self.engine.metrics
        metrics.set_running(sum(r is not None for r in self.rows) + len(self.admitting))
        metrics.kv_bytes.set(self.cache.nbytes())
        self.engine.publish(self)

    def _start(self, prompt: Prepared) -> _Admission:
        """Begin ``prompt``'s prefill: from the prefix cache's longest entry its ids extend (a chat request), only
        the tokens after it; else the whole prompt, as every batch does."""
        metrics, job = self.engine.metrics, self.engine.jobs.get(prompt.index)
        resumed = None
        if job is not None and job.chat and self.engine.prefix.budget:
            try:
                resumed = self.engine.prefix.resume(self, prompt.ids, job.config)
            except Exception:  # noqa: BLE001 - a cache that cannot be resumed: the prompt is prefilled afresh
                resumed = None
        if resumed is None:
            metrics.prefill_tokens.inc(prompt.ids.numel())
            return super()._start(prompt)
        part, held = resumed
        job.cached_tokens = held
        metrics.prefix_hits.inc(held)
        metrics.prefill_tokens.inc(prompt.ids.numel() - held)
        rest = prompt.ids[None, held:].to(self.device)
        return _Admission(prompt, part, prompt_chunks(self.model, rest, part), left=rest.shape[1])

    def _result(self, row: int) -> BatchResult:
        """The result of ``row``, which ended; a chat request that ran to its end leaves its row's cache to the
        prefix cache first (before the row is refilled or stepped again)."""
        prompt, tokens = self.rows[row], self.tokens[row]
        job = self.engine.jobs.get(prompt.index)
        prefix = self.engine.prefix
        if prefix.budget and job is not None and job.chat and not job.cancelled and not self.engine._stopping:
            ids = torch.cat([prompt.ids.cpu(), torch.tensor(tokens[:-1], dtype=prompt.ids.dtype)])
            try:
                prefix.keep(self, row, ids, job.config)
            except Exception:  # noqa: BLE001 - a row that cannot be kept: its answer is not changed by that
                pass
            self.engine.metrics.set_prefix(prefix)
        return super()._result(row)

    def _after_step(self, done, on_step):
        yield from super()._after_step(done, on_step)
        self.engine.publish(self)

    def _ended(self, row: int) -> bool:
        job = self.engine.jobs.get(self.rows[row].index)
        return job is None or job.cancelled or super()._ended(row)
