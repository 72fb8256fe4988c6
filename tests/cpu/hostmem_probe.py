"""Child process for tests/test_hostmem.py (a fresh process: glibc's thresholds are per process).

    python tests/hostmem_probe.py once      prints "<first call> <second call>" of retain_freed_memory()
    python tests/hostmem_probe.py faults 0|1
        minor page faults of five malloc/touch/free cycles of 64 MB, without (0) or with (1)
        hostmem.retain_freed_memory() called first
"""

import ctypes
import resource
import sys

from eyas.cpu import hostmem


def once() -> None:
    ok = hostmem.retain_freed_memory()
    print(ok, hostmem.retain_freed_memory())


def faults(retain: bool) -> None:
    if retain:
        assert hostmem.retain_freed_memory()
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    n = 64 << 20

    def touch() -> None:
        p = libc.malloc(n)
        ctypes.memset(p, 1, n)
        libc.free(ctypes.c_void_p(p))

    touch()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        touch()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)


if __name__ == "__main__":
    if sys.argv[1] == "once":
        once()
    else:
        faults(sys.argv[2] == "1")
