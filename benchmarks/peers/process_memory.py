"""This process's resident memory from /proc (Linux), standard library only: imported by `cpu_worker.py`, which must
not import torch (it would add its own resident memory to a peer's figure), and by `common.py`."""

from __future__ import annotations

import os


def rss_bytes() -> int:
    """This process's resident set now, in bytes."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def high_water_mark() -> int | None:
    """The kernel's peak RSS of this process (VmHWM) since start or the last `reset_high_water_mark`, in bytes;
    None where /proc does not report it."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


def reset_high_water_mark() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: ``echo 5 > /proc/self/clear_refs``); False where the kernel
    refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False
