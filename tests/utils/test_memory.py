"""The peak-memory window of ``generate --memory-limit`` (:class:`h2o_compress.utils.memory.PeakMemory`) on the CPU:
what is allocated after :meth:`~PeakMemory.loaded` counts, what was freed before it does not, and a freed block
still counts (a peak, not the current size)."""

from __future__ import annotations

import pytest
import torch

from h2o_compress.utils.memory import PeakMemory

MiB = 2**20


def touched(bytes_: int) -> torch.Tensor:
    """A block of ``bytes_`` whose pages are all written (resident), as a forward pass's buffers are."""
    return torch.ones(bytes_ // 4, dtype=torch.float32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU window (on CUDA it reads max_memory_allocated)")
def test_peak_counts_what_is_allocated_after_loaded_and_not_what_was_freed_before():
    peak = PeakMemory()
    if not peak.restarted:
        pytest.skip("the kernel's peak-RSS counter cannot be restarted here (/proc/self/clear_refs)")
    before = touched(192 * MiB)  # a load-time high water mark, freed before loaded()
    del before
    peak.loaded()
    block = touched(64 * MiB)
    del block  # freed again: the peak keeps it
    measured, kind = peak.measure()
    assert kind == "cpu_peak_rss_growth"
    assert 60 * MiB <= measured < 160 * MiB, measured / MiB  # the 64 MiB block; not the 192 MiB one
