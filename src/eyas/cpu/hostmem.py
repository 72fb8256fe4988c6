"""Host memory: keep freed tensor memory in the process for reuse (glibc malloc only).

glibc serves every allocation above its mmap threshold (128 KB to 32 MB, adjusted as it goes)
with a fresh mapping and returns it to the kernel when freed, so each new (M, N) buffer of a
training step (logits, loss gradients, 20-200 MB each) is faulted in page by page again.
With the thresholds raised, freed memory stays in the heap and the next step reuses it: far fewer
page faults and less kernel time (measured: docs/cpu-performance.md, "Host memory retention").
Where the user chose an allocator or glibc settings, those stand.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
MMAP_THRESHOLD = 1 << 30  # allocations below 1 GB come from the heap
TRIM_THRESHOLD = (1 << 31) - 1  # never give the heap's free top back (mallopt takes an int)
_done: bool | None = None


def retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; False where it does not apply
    (not Linux/glibc, another allocator preloaded, MALLOC_* or GLIBC_TUNABLES set by the user,
    or EYAS_MALLOC=default)."""
    global _done
    if _done is not None:
        return _done
    _done = False
    env = os.environ
    user_set = ("GLIBC_TUNABLES" in env or any(k.startswith("MALLOC_") for k in env)
                or "malloc" in env.get("LD_PRELOAD", "") or env.get("EYAS_MALLOC", "") == "default")
    if not sys.platform.startswith("linux") or user_set:
        return _done
    try:
        libc = ctypes.CDLL("libc.so.6")
        if not hasattr(libc, "gnu_get_libc_version"):
            return _done
        _done = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    except OSError:
        return _done
    log.debug("glibc malloc: freed memory kept for reuse (%s)", _done)
    return _done
