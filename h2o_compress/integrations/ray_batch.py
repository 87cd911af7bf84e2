"""A batch job on a Ray cluster with Ray Data (``h2o-compress batch --ray [ADDRESS]``; Ray Data's ``map_batches``
with a class: https://docs.ray.io/en/latest/data/transforming-data.html).

- `ray_session` connects (``ray.init``, shipping this package to the workers, as ``profile --ray`` does:
  `h2o_compress.integrations.ray_sweep`), with Ray's own messages (log records, progress, the workers' output)
  kept off stderr unless ``verbose``; `run_on_ray` then answers the prompts on that connection.
- The prompts become a dataset of JSON rows; ``map_batches`` runs `BatchActor` on them: one actor per GPU of the
  cluster, or per ``threads`` CPUs where it has none, each loading the model once and answering its share through
  [`h2o_compress.generate_batch`][h2o_compress.generate_batch] (continuous batching, ``batch_size`` rows), with the
  same settings as a local run (so the same answers).
- Each answer comes back to this process (the driver) as soon as it is generated (one block per answer), with the
  figures of the actor call it came from; the driver writes it at once, so OUTPUT has the same semantics as a local
  run (each prompt once, appended and flushed, resumable), and `RayBatchRun.stats` has the same figures as a local
  run's: the actors' decode seconds, row-steps and KV bytes added up (decode tokens/s is one actor's rate).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from h2o_compress.config import CompressionConfig
from h2o_compress.integrations.ray_sweep import check_address, connect, import_ray
from h2o_compress.models import load_model
from h2o_compress.runtime.batch import BatchStats, generate_batch
from h2o_compress.runtime.batch_requests import BatchResult
from h2o_compress.utils import errors
from h2o_compress.utils.errors import ConfigError, H2OCompressError, short
from h2o_compress.utils.memory import PeakMemory

#: Prompts handed to one actor call, in units of the batch size: enough for its rows to refill while the call runs.
CALL_BATCHES = 4

#: The figures of `BatchStats` that add up over the actor calls (the others: the largest of any call).
SUMMED = ("prefill_s", "decode_s", "row_steps", "idle_row_steps")


class RayJobError(H2OCompressError):
    """The Ray job failed for a reason of Ray's own (an actor died, a node was lost): the answers received are
    kept, and the same command resumes."""


class BatchActor:
    """A Ray Data actor: loads the model once (``load_model(model, **load)``), then answers each batch of rows
    (column ``request``: a request as JSON) with
    [`generate_batch`][h2o_compress.runtime.batch.generate_batch], yielding one row per answer as it finishes:
    ``result`` (the answer's line as JSON) and ``stats`` (the call's `BatchStats` so far, its id and the actor's
    peak memory, as JSON)."""

    def __init__(self, model: str, load: dict, config: CompressionConfig, generation: dict, threads: int | None,
                 trust_remote_code: bool):
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.peak = PeakMemory()
        self.model, self.tokenizer = load_model(model, trust_remote_code=trust_remote_code, **load)
        self.peak.loaded()
        self.config, self.generation = config, generation

    def __call__(self, batch: dict) -> Iterator[dict]:
        requests = [json.loads(text) for text in batch["request"]]
        call = uuid.uuid4().hex
        run = generate_batch(self.model, self.tokenizer, requests, self.config, **self.generation)
        for result in run:
            peak, kind = self.peak.measure()
            stats = {**dataclasses.asdict(run.stats), "call": call, "peak_bytes": peak, "peak_kind": kind}
            yield {"result": [json.dumps(result.to_dict())], "stats": [json.dumps(stats)]}


def import_ray_data():
    """The ``ray`` module with Ray Data imported. Raises ConfigError naming the extra when either is missing."""
    ray = import_ray()
    try:
        import ray.data  # noqa: F401 (Ray Data needs pyarrow: the ray extra installs it)
    except ImportError as exc:
        raise ConfigError(f"--ray needs Ray Data ({short(str(exc), 80, repr_=False)}); allowed: install the ray "
                          "extra (pip install 'h2o-compress[ray]')") from None
    return ray


@contextmanager
def ray_session(address: str, verbose: bool = False):
    """Connect to Ray at ``address`` for the block (unless this process is connected already: that connection is
    used and left open), with Ray Data's settings for `run_on_ray`: each answer its own block (so it comes back
    as soon as it is generated) and, unless ``verbose``, no progress bars or log records of Ray's on stderr (they
    are still in Ray's log files). Yields the ``ray`` module; leaving restores Ray Data's settings and
    disconnects what it connected.

    Raises:
        ConfigError: Ray (with Ray Data) not installed, an empty address, or a cluster that cannot be reached.
    """
    ray = import_ray_data()
    connected_here = connect(ray, check_address(address), verbose)
    context = ray.data.DataContext.get_current()
    saved = {name: getattr(context, name) for name in ("target_max_block_size", "enable_progress_bars")}
    consoles = [h for h in logging.getLogger("ray.data").handlers if not isinstance(h, logging.FileHandler)]
    levels = [h.level for h in consoles]
    context.target_max_block_size = 1  # a block per answer: the driver writes each as soon as it is generated
    if not verbose:
        context.enable_progress_bars = False
        for handler in consoles:
            handler.setLevel(logging.ERROR)
    try:
        yield ray
    finally:
        for name, value in saved.items():
            setattr(context, name, value)
        for handler, level in zip(consoles, levels):
            handler.setLevel(level)
        if connected_here:
            ray.shutdown()


def run_on_ray(requests: list[dict], model: str, config: CompressionConfig, generation: dict,
               load: dict | None = None, threads: int | None = None, trust_remote_code: bool = False,
               device: str = "auto") -> RayBatchRun:
    """Answer ``requests`` (dicts with an ``id``) on the Ray cluster this process is connected to (`ray_session`).
    ``generation``: the keyword arguments of ``generate_batch`` (``max_new_tokens``, ``batch_size``, ``chat``,
    ``temperature``, ``seed``, ``compile``); ``model``: an alias, a hub id, or a directory at the same path on
    every node.

    Returns:
        A `RayBatchRun`: iterate it for each answer as it comes back (in no set order); ``.stats`` fills as they do.
    """
    import ray

    resources = ray.cluster_resources()
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
    per_actor = {"num_gpus": 1} if gpus and not device.startswith("cpu") else {"num_cpus": threads or 1}
    actors = gpus if "num_gpus" in per_actor else max(1, cpus // (threads or 1))
    batch_size = generation.get("batch_size", 8)
    actors = max(1, min(actors, -(-len(requests) // batch_size)))
    rows = ray.data.from_items([{"request": json.dumps(r)} for r in requests])
    answers = rows.map_batches(
        BatchActor, batch_size=CALL_BATCHES * batch_size, compute=ray.data.ActorPoolStrategy(size=actors),
        fn_constructor_kwargs={"model": model, "load": load or {}, "config": config, "generation": generation,
                               "threads": threads, "trust_remote_code": trust_remote_code},
        **per_actor)
    return RayBatchRun(answers, actors)


class RayBatchRun:
    """The answers of `run_on_ray` as they come back, and their figures.

    Attributes:
        actors: the actors answering.
        stats: a `BatchStats` of the answers received: their counts and tokens, and the figures of the actor
            calls they came from (seconds and row-steps added up; the batch and KV bytes per sequence the largest).
        peak_bytes: the largest peak memory of an actor (above what it held before loading), ``peak_kind``: how
            it was measured (as `h2o_compress.utils.memory.PeakMemory`).
    """

    def __init__(self, dataset, actors: int):
        self.dataset, self.actors = dataset, actors
        self.stats = BatchStats()
        self.peak_bytes, self.peak_kind = 0, "not_measured"
        self._calls: dict[str, dict] = {}

    def __iter__(self) -> Iterator[BatchResult]:
        import ray

        try:
            for row in self.dataset.iter_rows():
                yield self._take(row)
        except ray.exceptions.RayError as exc:
            raise ray_failure(exc) from None

    def _take(self, row: dict) -> BatchResult:
        line, figures = json.loads(row["result"]), json.loads(row["stats"])
        self._calls[figures.pop("call")] = figures
        calls, stats = list(self._calls.values()), self.stats
        for name in SUMMED:
            setattr(stats, name, sum(call[name] for call in calls))
        stats.batch_size = max(call["batch_size"] for call in calls)
        stats.kv_bytes_per_sequence = max(call["kv_bytes_per_sequence"] for call in calls)
        stats.capacity = max((call["capacity"] for call in calls if call["capacity"] is not None), default=None)
        self.peak_bytes, self.peak_kind = max(call["peak_bytes"] for call in calls), figures["peak_kind"]
        result = BatchResult(id=line["id"], index=-1, text=line["text"], prompt_tokens=line["prompt_tokens"],
                             new_tokens=line["new_tokens"], finish_reason=line["finish_reason"],
                             error=line.get("error"))
        stats.prompts, stats.errors = stats.prompts + 1, stats.errors + (result.finish_reason == "error")
        stats.prompt_tokens += result.prompt_tokens
        stats.new_tokens += result.new_tokens
        return result


def ray_failure(exc: Exception) -> H2OCompressError:
    """The one-line error for a Ray job that failed: an h2o-compress error raised on a worker (a model that does
    not load there) as it was raised, else a `RayJobError` naming Ray's exception and its last line."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, H2OCompressError):
        return cause
    text = str(exc)
    ours = re.findall(r"h2o_compress\.utils\.errors\.(\w+): (.+)", text)
    if ours:
        name, message = ours[-1]
        kind = getattr(errors, name, None)
        return (kind if isinstance(kind, type) and issubclass(kind, H2OCompressError) else RayJobError)(message)
    last = next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")
    return RayJobError(f"the Ray job failed ({type(exc).__name__}: {short(last, 200, repr_=False)}); allowed: rerun "
                       "the same command, which resumes (the answers received are kept); --verbose shows Ray's "
                       "messages, and its logs are under /tmp/ray/session_latest/logs on the head node")
