"""Helpers shared by the two benchmark workers (ours in the main environment, the peers in their own venv).

Only the standard library and torch: this file is imported under transformers 5.23 (ours) and 5.2 (peers).

Protocol: the orchestrator (``benchmarks/compare_peers.py``) starts a worker with a pipe on stdin/stdout and
sends one JSON command per line: ``{"id": n, "cmd": name, "out": path, ...}``. The worker runs it, writes its
result as JSON to ``out`` and answers one line ``{"id": n, "ok": true}`` (or ``"ok": false`` with the
traceback). Logs go to stderr.
"""

from __future__ import annotations

import ctypes
import gc
import json
import math
import os
import statistics
import sys
import threading
import time
import traceback
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # process_memory.py, shared with cpu_worker.py
from process_memory import high_water_mark, reset_high_water_mark, rss_bytes  # noqa: E402


def log(*parts) -> None:
    print(time.strftime("%H:%M:%S"), *parts, file=sys.stderr, flush=True)


def serve(handlers: dict[str, Callable[[dict], dict]]) -> None:
    """Answer JSON-line commands from stdin until EOF or ``{"cmd": "exit"}``."""
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        command = json.loads(line)
        if command.get("cmd") == "exit":
            break
        reply = {"id": command.get("id")}
        try:
            result = handlers[command["cmd"]](command)
            with open(command["out"], "w") as handle:
                json.dump(result, handle)
            reply["ok"] = True
        except Exception:  # reported to the orchestrator, which records it in the results
            reply.update(ok=False, error=traceback.format_exc()[-4000:])
            log("command failed:", reply["error"])
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


def set_threads(threads: int) -> None:
    torch.set_num_threads(threads)


def load_inputs(path: str) -> dict:
    with open(path) as handle:
        return json.load(handle)


def ids_tensor(ids: list[int]) -> torch.Tensor:
    return torch.tensor([ids], dtype=torch.long)


# ----------------------------------------------------------------------------------------------------- bytes


def tensor_bytes(obj, seen: set | None = None, depth: int = 0) -> int:
    """Bytes of every tensor reachable from ``obj`` (tensors, tensor subclasses such as quanto's QTensor via
    ``__tensor_flatten__``, tuples, lists, dicts), each storage counted once."""
    seen = set() if seen is None else seen
    if depth > 6 or obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        flatten = getattr(type(obj), "__tensor_flatten__", None)
        if flatten is not None and type(obj) is not torch.Tensor and type(obj) is not torch.nn.Parameter:
            names, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, name), seen, depth + 1) for name in names)
        if obj.numel() == 0:
            return 0
        key = (obj.untyped_storage().data_ptr(), obj.storage_offset(), tuple(obj.shape))
        if key in seen:
            return 0
        seen.add(key)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(value, seen, depth + 1) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(value, seen, depth + 1) for value in obj)
    return 0


LAYER_TENSOR_ATTRS = ("keys", "values", "_quantized_keys", "_quantized_values")


def transformers_cache_bytes(cache) -> int:
    """Bytes held by a transformers DynamicCache / QuantizedCache: full-precision keys and values (the residual
    window of a QuantizedCache) plus the quantized data, scales and zero points, every layer."""
    seen: set = set()
    return sum(tensor_bytes(getattr(layer, name, None), seen) for layer in cache.layers for name in LAYER_TENSOR_ATTRS)


def kept_tokens(cache) -> int:
    """Tokens held by layer 0 of a transformers cache: full-precision ones plus quantized ones."""
    layer = cache.layers[0]
    count = 0
    keys = getattr(layer, "keys", None)
    if isinstance(keys, torch.Tensor) and keys.dim() == 4:
        count += keys.shape[-2]
    quantized = getattr(layer, "_quantized_keys", None)
    if isinstance(quantized, tuple):  # hqq: (packed data, meta with the original shape)
        count += quantized[1]["shape"][-2]
    elif isinstance(quantized, torch.Tensor):  # quanto QTensor keeps the logical shape
        count += quantized.shape[-2]
    return count


# ---------------------------------------------------------------------------------------------------- memory

_LIBC = None


def release_memory() -> None:
    """Collect garbage and give freed heap pages back to the OS, so the next RSS baseline is honest."""
    global _LIBC
    gc.collect()
    try:
        _LIBC = _LIBC or ctypes.CDLL("libc.so.6")
        _LIBC.malloc_trim(0)
    except OSError:
        pass


class PeakRSS:
    """Extra resident memory a run needs above the idle process (activations, cache, temporaries), per phase.

    Uses the kernel's exact high-water mark (VmHWM, reset through ``/proc/self/clear_refs``), so short spikes are
    never missed; where that is not allowed it falls back to sampling the RSS every ``interval`` seconds.
    ``mark()`` closes a phase (freed memory is given back first, so each phase starts from what is still live).
    """

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.phases: list[int] = []
        self.exact = True

    def __enter__(self):
        release_memory()
        self.baseline = rss_bytes()
        self.exact = reset_high_water_mark()
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = None
        if not self.exact:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval)

    def _current_peak(self) -> int:
        if self.exact:
            return high_water_mark() or rss_bytes()
        return max(self.peak, rss_bytes())

    def mark(self) -> None:
        """Close a phase: record its peak, give freed memory back, and start the next phase's peak."""
        self.phases.append(self._current_peak() - self.baseline)
        release_memory()
        if self.exact:
            reset_high_water_mark()
        self.peak = rss_bytes()

    def __exit__(self, *exc):
        self.mark()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


# ------------------------------------------------------------------------------------------------- measures


def answer_nll(logits: torch.Tensor, answer_ids: list[int]) -> float:
    """Mean NLL (nats/token) of ``answer_ids`` given ``logits`` [1, k, vocab] whose last ``len(answer_ids)``
    positions predict the answer tokens."""
    predicting = logits[0, -len(answer_ids):].double()
    return torch.nn.functional.cross_entropy(predicting, torch.tensor(answer_ids), reduction="mean").item()


def stream_nll_chunks(step: Callable[[torch.Tensor, int], torch.Tensor], ids: list[int],
                      chunk: int) -> tuple[float, float]:
    """Mean next-token NLL of ``ids`` read ``chunk`` tokens per call of ``step(chunk_ids [1, k], start)``
    (returns logits [1, k, vocab]); returns ``(nll, seconds)``."""
    tensor = ids_tensor(ids)
    total, count, seconds = 0.0, 0, 0.0
    for start in range(0, tensor.shape[1], chunk):
        piece = tensor[:, start : start + chunk]
        began = time.perf_counter()
        logits = step(piece, start)
        seconds += time.perf_counter() - began
        targets = tensor[:, start + 1 : start + 1 + piece.shape[1]]
        logits = logits[:, : targets.shape[1]]
        if targets.numel():
            total += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).double(), targets.reshape(-1), reduction="sum").item()
            count += targets.numel()
    return total / count, seconds


def perplexity(nll: float) -> float:
    return math.exp(nll)


def make_probe(model) -> Callable[[], float]:
    """A fixed CPU workload that tracks how much of the machine this process gets right now: every decoder
    layer's MLP on one token (the bulk of a decode step's weight traffic). Returns its seconds per call.
    Identical code under both transformers versions (torch modules only)."""
    layers = model.model.layers
    hidden = torch.randn(1, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(0))

    def probe() -> float:
        began = time.perf_counter()
        with torch.inference_mode():
            for layer in layers:
                layer.mlp(hidden)
        return time.perf_counter() - began

    return probe


def decode_timing(step: Callable[[torch.Tensor, int], torch.Tensor], first_logits: torch.Tensor, steps: int,
                  probe: Callable[[], float] | None = None) -> dict:
    """Greedy decode ``steps`` tokens with ``step(token [1, 1], i) -> logits [1, 1, vocab]``.

    Reports the median step (robust to short interruptions) and, with ``probe``, the median ratio of each step
    to a probe run right after it: a load-normalized cost that other jobs on a shared machine affect alike.
    """
    token = first_logits[:, -1:].argmax(-1)
    times, ratios, probes = [], [], []
    for i in range(steps):
        began = time.perf_counter()
        logits = step(token, i)
        times.append(time.perf_counter() - began)
        token = logits[:, -1:].argmax(-1)
        if probe is not None:
            probes.append(probe())
            ratios.append(times[-1] / probes[-1])
    median = statistics.median(times)
    result = {"decode_step_s_median": median, "decode_step_s_mean": sum(times) / len(times),
              "decode_tokens_per_s": 1.0 / median, "steps": steps}
    if probe is not None:
        result.update(probe_s_median=statistics.median(probes), decode_cost_vs_probe=statistics.median(ratios))
    return result
