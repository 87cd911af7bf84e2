"""The peak-memory window of ``generate --memory-limit`` (:class:`h2o_compress.utils.memory.PeakMemory`) on the CPU:
what is allocated after :meth:`~PeakMemory.loaded` counts, what was freed before it does not, and a freed block
still counts (a peak, not the current size)."""

from __future__ import annotations

import pytest
import torch

from h2o_compress.utils.memory import PeakMemory

MiB = 2**20


def resident_bytes() -> int:
    """The process's current resident set, in bytes (``/proc/self/statm``)."""
    import os

    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def release_freed_memory() -> None:
    """Ask glibc to hand freed heap pages back to the kernel (``malloc_trim``), where the C library has it."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def touched(bytes_: int) -> torch.Tensor:
    """A block of ``bytes_`` whose pages are all written (resident), as a forward pass's buffers are."""
    return torch.ones(bytes_ // 4, dtype=torch.float32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU window (on CUDA it reads max_memory_allocated)")
def test_peak_counts_what_is_allocated_after_loaded_and_not_what_was_freed_before():
    peak = PeakMemory()
    if not peak.restarted:
        pytest.skip("the kernel's peak-RSS counter cannot be restarted here (/proc/self/clear_refs)")
    before = touched(192 * MiB)  # a load-time high water mark, freed before loaded()
    holding = resident_bytes()
    del before
    release_freed_memory()
    if holding - resident_bytes() < 128 * MiB:  # after a long test session the allocator may keep the pages
        pytest.skip("the allocator kept the freed 192 MiB block resident: a new block reuses it, RSS cannot grow")
    peak.loaded()
    block = touched(64 * MiB)
    del block  # freed again: the peak keeps it
    measured, kind = peak.measure()
    assert kind == "cpu_peak_rss_growth"
    assert 60 * MiB <= measured < 160 * MiB, measured / MiB  # the 64 MiB block; not the 192 MiB one
