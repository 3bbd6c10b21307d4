"""How this process's allocator keeps the memory it frees (glibc on Linux).

MLX's CPU backend allocates its buffers with malloc, so glibc's rules for handing freed
memory back to the kernel decide how many fresh pages an update faults in.
"""

from __future__ import annotations

import ctypes
import sys

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4
_INT_MAX = 2**31 - 1


def keep_freed_memory() -> bool:
    """Keep glibc's allocator from handing freed memory back to the kernel: no block is
    mmap'd on its own (each of those is unmapped when freed), and the heap is trimmed
    only when more than 2 GB at its top is free. MLX frees and allocates buffers of the same sizes
    every step; memory handed back comes again as fresh pages, and a fresh page costs
    a page fault and its zeroing. Whether the allocator hands memory back depends on the
    process's history (glibc raises its mmap threshold as blocks are freed), so without
    this the same update could take 100,000 page faults or none. The process's resident
    memory then stays at its peak. Returns whether it applied: glibc on Linux only (the
    default allocators of macOS and musl keep their own rules)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc's alone)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _INT_MAX), (_M_TOP_PAD, 1 << 30))
    return all(mallopt(param, value) == 1 for param, value in settings)
