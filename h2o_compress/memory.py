"""Peak memory of a piece of work (a leaf module): what ``generate --memory-limit`` sets against the planner.

CUDA: ``torch.cuda.max_memory_allocated`` summed over the GPUs (a model split by ``device_map`` uses several), less
what was allocated when the window opened; the planner's total counts the same tensors (weights, KV cache and
workspace), not the CUDA context or the allocator's reserve. CPU: growth of the process's peak resident set
(``getrusage`` ``ru_maxrss``) over its resident set when the window opened; it includes allocator slack and
library buffers, so it reads higher than the planner's total for small models.
"""

from __future__ import annotations

import resource
import sys

import torch


def _rss_now() -> int:
    """Resident bytes of this process now (Linux ``/proc/self/statm``; elsewhere the peak so far)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            pages = int(handle.read().split()[1])
        import os

        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _rss_peak()


def _rss_peak() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024)


class PeakMemory:
    """Opens a peak-memory window at construction; :meth:`measure` gives ``(bytes, kind)`` since then.

    ``kind`` is ``cuda_max_memory_allocated`` (all GPUs, window-relative) or ``cpu_peak_rss_growth``.
    """

    def __init__(self):
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            self.devices = list(range(torch.cuda.device_count()))
            for index in self.devices:
                torch.cuda.reset_peak_memory_stats(index)
            self.start = sum(torch.cuda.memory_allocated(index) for index in self.devices)
        else:
            self.start = _rss_now()

    def measure(self) -> tuple[int, str]:
        """Peak bytes above the start of the window, and how they were measured."""
        if self.cuda:
            for index in self.devices:
                torch.cuda.synchronize(index)
            peak = sum(torch.cuda.max_memory_allocated(index) for index in self.devices)
            return max(peak - self.start, 0), "cuda_max_memory_allocated"
        return max(_rss_peak() - self.start, 0), "cpu_peak_rss_growth"
