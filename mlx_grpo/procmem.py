"""Memory held by this process's descendants (browsers, sandboxes, servers), which
MLX's own peak-memory figure does not see."""

from __future__ import annotations

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
