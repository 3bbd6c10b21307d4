"""Memory held by this process's descendants (browsers, sandboxes, servers), which
MLX's own peak-memory figure does not see; and how this process's allocator keeps what
it frees (`keep_freed_memory`)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    if sys.platform.startswith("linux"):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(name))
        return kids
    out = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    for line in out.splitlines():
        pid, ppid = map(int, line.split())
        kids.setdefault(ppid, []).append(pid)
    return kids


def descendants(pid: int | None = None) -> list[int]:
    """Every process below `pid` (default: this one), at any depth."""
    kids, todo, found = _children_map(), [pid or os.getpid()], []
    while todo:
        for child in kids.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def _resident(pid: int) -> int:
    """Proportional set size on Linux (shared pages split among their users), else RSS."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    out = subprocess.run(
        ["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True
    ).stdout
    return int(out.strip() or 0) * 1024


def descendants_bytes() -> int:
    """Resident memory of this process's descendants, in bytes (0 when there are none)."""
    return sum(_resident(p) for p in descendants())


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
