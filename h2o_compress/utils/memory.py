"""Device memory (a leaf module): the bytes free now (`available_memory`), and the peak while a loaded model
generates: what ``generate --memory-limit`` sets against the planner's total (weights + KV cache + workspace).

The window opens before the weights load (its baseline excludes what the process held before) and its peak
restarts once they are loaded (`PeakMemory.loaded`), so a transient of loading (bitsandbytes quantizing a
checkpoint read in full precision) is not counted; the resident weights are.

- CUDA: ``torch.cuda.max_memory_allocated`` summed over the GPUs (a model split by ``device_map`` uses several),
  less what was allocated before loading. The planner counts the same tensors; the CUDA context and the
  allocator's reserve are in neither.
- CPU (Linux): the process's peak resident set (``VmHWM`` in ``/proc/self/status``, restarted by writing ``5`` to
  ``/proc/self/clear_refs``) less its resident set before loading. It also holds allocator slack and memory freed
  while loading but not returned to the system, so it reads above the planner's total for small models.
  Elsewhere: ``getrusage`` ``ru_maxrss`` growth, including the load. The jobs (``generate --memory-limit``,
  ``batch --batch-size auto``) open the window with ``whole_process``: on a CPU a memory limit bounds the whole
  process, so the planner counts its resident set once the model is loaded (runtime, weights, tokenizer) and the
  measured peak is the process's own.
"""

from __future__ import annotations

import os
import resource
import sys

import torch


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _rss_peak() -> int:
    peak = _status_kib("VmHWM")
    if peak is not None:
        return peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024)


def _restart_rss_peak() -> bool:
    """Restart the kernel's peak-RSS counter (Linux >= 4.0); False where it cannot be restarted."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def resident_bytes() -> int | None:
    """The process's resident set now (``VmRSS``, bytes), or ``None`` where ``/proc`` cannot tell."""
    return _status_kib("VmRSS")


def peak_resident_bytes() -> int:
    """The process's peak resident set (bytes) since it started or since `restart_peak_resident`."""
    return _rss_peak()


def restart_peak_resident() -> bool:
    """Restart the process's peak resident set at its resident set now (Linux >= 4.0: a peak inherited from the
    parent or left by loading the model is forgotten); ``False`` where it cannot be restarted."""
    return _restart_rss_peak()


class PeakMemory:
    """Opens a peak-memory window at construction (before loading); `loaded` restarts the peak once the
    weights are in place; `measure` gives ``(bytes, kind)``.

    ``kind``: ``cuda_max_memory_allocated`` (all GPUs), ``cpu_peak_rss_growth`` (peak since `loaded`, above
    the resident set before loading), ``cpu_peak_rss_growth_with_load`` (the peak could not be restarted), or with
    ``whole_process`` on a CPU ``cpu_peak_rss`` / ``cpu_peak_rss_with_load``: the process's whole resident set, its
    own baseline included (the Python runtime, torch and transformers as imported, allocator slack), which is what a
    ``--memory-limit`` on a CPU bounds.

    Args:
        whole_process: on a CPU, count from zero instead of the resident set before loading (`held` is then the
            whole resident set, and `measure` the process's peak); no effect on CUDA.
    """

    def __init__(self, whole_process: bool = False):
        self.cuda = torch.cuda.is_available()
        self.restarted = False
        self.whole_process = whole_process and not self.cuda
        if self.cuda:
            self.devices = list(range(torch.cuda.device_count()))
            self.start = sum(torch.cuda.memory_allocated(index) for index in self.devices)
        else:
            self.start = 0 if self.whole_process else _status_kib("VmRSS") or _rss_peak()
        self.loaded()

    def loaded(self) -> None:
        """Restart the peak: from now on it counts what is resident (the weights) and what generation adds."""
        if self.cuda:
            for index in self.devices:
                torch.cuda.synchronize(index)
                torch.cuda.reset_peak_memory_stats(index)
        else:
            self.restarted = _restart_rss_peak()

    def held(self, model=None) -> int | None:
        """Bytes the process holds now above the baseline taken before loading: on a CPU its resident set growth
        (the weights, and what loading them brought: transformers' modules, the tokenizer, allocator slack; with
        ``whole_process``, the whole resident set), with
        ``model``'s CPU weights paged in first, so that weights mapped from their file (read lazily, by the first
        forward pass) are counted as the measured peak will count them. ``None`` on CUDA, where the measure counts
        the tensors the planner counts.
        """
        if self.cuda:
            return None
        if model is not None:
            page_in(model)
        now = _status_kib("VmRSS")
        return None if now is None else max(now - self.start, 0)

    def measure(self) -> tuple[int, str]:
        """Peak bytes above the baseline taken before loading, and how they were measured."""
        if self.cuda:
            for index in self.devices:
                torch.cuda.synchronize(index)
            peak = sum(torch.cuda.max_memory_allocated(index) for index in self.devices)
            return max(peak - self.start, 0), "cuda_max_memory_allocated"
        kind = "cpu_peak_rss" if self.whole_process else "cpu_peak_rss_growth"
        return max(_rss_peak() - self.start, 0), kind if self.restarted else f"{kind}_with_load"


@torch.no_grad()
def page_in(model) -> None:
    """Read one element per memory page of each CPU parameter and buffer of ``model`` (a tensor mapped from its
    checkpoint is not resident until read; the first forward pass reads every page anyway)."""
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.device.type != "cpu" or not tensor.numel() or not tensor.is_contiguous():
            continue
        flat = tensor.detach().reshape(-1)
        step = max(1, 4096 // flat.element_size())
        flat[::step].to(torch.float32 if flat.is_floating_point() else torch.int64).sum()


def available_memory(device: torch.device) -> int | None:
    """Bytes free on ``device`` now (CUDA: ``torch.cuda.mem_get_info``; CPU: available physical memory), or
    ``None`` when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return None
