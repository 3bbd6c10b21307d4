"""Child process groups that die with this process, however it ends.

A helper process (browsers, servers) started with `start_new_session=True` leads a
process group of its own, which every process it starts joins. `tether(pgid)` hands that
group to a watchdog: a small process that reads a pipe from this one and, when the pipe
closes, kills every group it was given. The pipe closes when this process exits for any
reason (a normal end, an exception, Ctrl-C, SIGTERM, kill -9), since the kernel closes a
dead process's files. Groups released with `untether` (already shut down cleanly) are
left alone.

The watchdog is started on first use, in a session of its own, so that Ctrl-C in a
terminal reaches this process and not it. Works on Linux and macOS.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

_WATCHDOG = r"""
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
groups = set()
for line in sys.stdin:
    op, pgid = line[0], int(line[1:])
    (groups.add if op == "+" else groups.discard)(pgid)
for pgid in groups:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
"""

_lock = threading.Lock()
_watchdog: subprocess.Popen | None = None


def _send(line: str) -> None:
    global _watchdog
    with _lock:
        if _watchdog is None or _watchdog.poll() is not None:
            _watchdog = subprocess.Popen(
                [sys.executable, "-c", _WATCHDOG],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
                text=True,
            )
        _watchdog.stdin.write(line)
        _watchdog.stdin.flush()


def tether(pgid: int) -> None:
    """Kill process group `pgid` (SIGKILL) when this process ends, unless untethered."""
    _send(f"+{pgid}\n")


def untether(pgid: int) -> None:
    """Forget `pgid` (its processes were shut down another way)."""
    _send(f"-{pgid}\n")


def kill_group(pgid: int) -> None:
    """SIGKILL every process of group `pgid` now (gone already: nothing to do)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
