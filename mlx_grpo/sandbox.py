"""Run untrusted Python (a policy's completions) in confined, short-lived processes.

`run_programs(jobs)` runs each `Job` (source code, a function name, test inputs) in its
own process, `workers` at a time, and returns one `Outcome` per job: the repr of each
call's return value, or a named failure `reason`. The expected outputs never enter the
sandboxed process; callers compare them (rewards/code.py).

What holds, by layer (each job):

| layer | Linux, as root | Linux, not root | macOS |
| --- | --- | --- | --- |
| separate process, fresh temp dir as cwd, `python -I -S` (no site-packages, no PYTHONPATH, no cwd import), environment of only HOME and TMPDIR (the temp dir), PATH=/usr/bin:/bin, LANG=C.UTF-8 | yes | yes | yes |
| wall-clock limit (process group killed) | yes | yes | yes |
| RLIMIT_CPU, RLIMIT_FSIZE (output cap), RLIMIT_NOFILE, RLIMIT_CORE=0 | yes | yes | yes |
| RLIMIT_AS (memory) | yes | yes | not enforced by macOS; a failed allocation is still reported as `memory` |
| unprivileged uid per worker slot (60000.., each locked to one Sandbox: `_claim_uids`), so RLIMIT_NPROC bounds a fork bomb, other users' files follow normal permissions, and every process of that uid is killed after the job | yes | runs as you: RLIMIT_NPROC is set to your current process count + `nproc` | same as Linux, not root |
| empty network namespace (unshare CLONE_NEWNET): no interface but a down loopback | yes (unless a container withholds CAP_SYS_ADMIN: probed once) | no | no |
| audit hook (PEP 578) in the child: refuses file access outside the temp dir and the stdlib, sockets, fork/exec/subprocess, signals, chdir, ctypes, sqlite3, and importing modules that act unseen by it (`DENIED_MODULES`); a refusal ends the process | yes | yes | yes |

The audit hook is a best-effort layer, not a security boundary: it is Python in the
program's own interpreter, and a way around it gets whatever the OS allows. The OS
layers above are what bound time, memory, processes, output and (as root on Linux) the
network and the files. Without root on Linux, and on macOS, the program runs as you and
the hook is the only guard for your files and the network. A cgroup or a container
gives more, and is the right tool for code from people rather than a 135M model.
"""

from __future__ import annotations

import ast
import fcntl
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

CHILD = Path(__file__).with_name("_sandbox_child.py")
SLOT_UID_BASE = 60000  # uids (and gids) 60000.. are used for sandbox slots when root
SLOT_UID_COUNT = 4096  # how far past the base a Sandbox looks for free uids
SLOT_LOCK = "/tmp/mlx-grpo-slot-{uid}.lock"  # flock'ed while a Sandbox holds that uid
# Exit status of a child the audit hook ended, per reason (_sandbox_child.VIOLATION_RC).
VIOLATION_RC = {81: "forbidden_file", 82: "network", 83: "process", 84: "forbidden_module"}


@dataclass(frozen=True)
class Limits:
    """Per-program limits. Defaults suit short test functions."""

    wall_s: float = 10.0  # generous: the machine may be busy; CPU time is the real bound
    cpu_s: int = 3
    memory_bytes: int = 512 * 2**20
    output_bytes: int = 256 * 2**10  # what the program may print or write (RLIMIT_FSIZE)
    result_bytes: int = 1 * 2**20  # the report read back
    repr_chars: int = 10_000  # longest repr of one returned value
    nproc: int = 16  # processes (and threads) the program's uid may hold


@dataclass(frozen=True)
class Job:
    code: str
    func: str
    inputs: list  # one list of positional arguments per call


@dataclass
class Outcome:
    """What a program did: `values` holds one entry per call, the repr of its return
    value or None when that call raised; `reason` names why the run failed as a whole
    (None when every call returned or raised normally)."""

    values: list[str | None] = field(default_factory=list)
    reason: str | None = None
    detail: str = ""
    seconds: float = 0.0


# Reasons that mean the program broke a rule or a limit, not merely a wrong answer.
SANDBOX_REASONS = (
    "timeout",
    "cpu_time",
    "memory",
    "output_limit",
    "process_limit",
    "forbidden_file",
    "network",
    "process",
    "forbidden_module",
    "exited",
    "crashed",
)


def _root_linux() -> bool:
    return sys.platform.startswith("linux") and os.geteuid() == 0


_NETNS: bool | None = None


def network_namespace_available() -> bool:
    """Whether a child can unshare(CLONE_NEWNET) here: root on Linux, and not a
    container that withholds CAP_SYS_ADMIN (probed once)."""
    global _NETNS
    if _NETNS is None:
        _NETNS = _root_linux() and (
            subprocess.run(
                [sys.executable, "-I", "-S", "-c", _NETNS_PROBE], capture_output=True, env={}
            ).returncode
            == 0
        )
    return _NETNS


_NETNS_PROBE = (
    "import ctypes, sys\nsys.exit(ctypes.CDLL(None, use_errno=True).unshare(0x40000000) != 0)"
)


def isolation_summary() -> dict[str, bool]:
    """Which layers this machine gives (see the module docstring)."""
    return {
        "rlimits": True,
        "memory_limit": sys.platform != "darwin",
        "separate_uid": _root_linux(),
        "network_namespace": network_namespace_available(),
        "audit_hook": True,
    }


def _user_process_count() -> int:
    """Processes (and threads: RLIMIT_NPROC counts tasks) of this uid now."""
    uid = os.getuid()
    proc = Path("/proc")
    if proc.is_dir():
        n = 0
        for p in proc.iterdir():
            if p.name.isdigit():
                try:
                    if p.stat().st_uid == uid:
                        n += len(list((p / "task").iterdir()))
                except OSError:
                    continue
        return n
    out = subprocess.run(["ps", "-U", str(uid), "-M"], capture_output=True, text=True).stdout
    return max(1, len(out.splitlines()))


def _claim_uids(n: int) -> tuple[list[int], list[int]]:
    """Claim `n` slot uids no other Sandbox on this machine holds: an exclusive flock on
    SLOT_LOCK per uid, held until the returned descriptors are closed (or the process
    ends). Returns (uids, lock fds)."""
    uids: list[int] = []
    fds: list[int] = []
    for uid in range(SLOT_UID_BASE, SLOT_UID_BASE + SLOT_UID_COUNT):
        if len(uids) == n:
            break
        path = SLOT_LOCK.format(uid=uid)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held by another Sandbox, here or in another process
            os.close(fd)
            continue
        uids.append(uid)
        fds.append(fd)
    if len(uids) < n:
        _release(fds)
        raise RuntimeError(
            f"sandbox: only {len(uids)} of {n} slot uids free in {SLOT_UID_BASE}.."
            f"{SLOT_UID_BASE + SLOT_UID_COUNT - 1} (locks {SLOT_LOCK.format(uid='*')})"
        )
    return uids, fds


def _release(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())  # closing the descriptor drops its flock


class Sandbox:
    """A pool of `workers` slots running jobs under `limits`; `audit=False` drops the
    in-process audit hook (for tests that prove the OS layers hold on their own).

    As root on Linux each slot runs as its own uid, claimed for this Sandbox alone
    (`uids`) so that killing every process of a slot's uid after a job cannot hit
    another Sandbox's program; `close()` (or garbage collection) gives them back."""

    def __init__(self, limits: Limits = Limits(), workers: int | None = None, audit: bool = True):
        self.limits = limits
        self.workers = max(1, workers or os.cpu_count() or 1)
        self.audit = audit
        self.root = _root_linux()
        self.netns = network_namespace_available()
        self.uids: list[int] | None = None
        self._lock_fds: list[int] = []
        if self.root:
            self.uids, self._lock_fds = _claim_uids(self.workers)
        self._finalizer = weakref.finalize(self, _release, self._lock_fds)
        self._slots = list(range(self.workers))
        self._lock = threading.Lock()

    def close(self) -> None:
        """Give the slot uids back (no-op when not root, or already closed)."""
        self._finalizer()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, jobs: list[Job]) -> list[Outcome]:
        """One Outcome per job, in order; jobs run `workers` at a time."""
        if not jobs:
            return []
        with ThreadPoolExecutor(min(self.workers, len(jobs))) as pool:
            return list(pool.map(self._run_slot, jobs))

    def _run_slot(self, job: Job) -> Outcome:
        with self._lock:
            slot = self._slots.pop()
        try:
            return self.run_one(job, slot)
        finally:
            with self._lock:
                self._slots.append(slot)

    def run_one(self, job: Job, slot: int = 0) -> Outcome:
        lim = self.limits
        tic = time.perf_counter()
        tmp = tempfile.mkdtemp(prefix="mlx-grpo-sandbox-")
        if self.root and not self._finalizer.alive:
            raise RuntimeError("sandbox: run on a closed Sandbox")
        uid = self.uids[slot] if self.root else None
        proc = None
        try:
            if uid is not None:
                os.chown(tmp, uid, uid)
                os.chmod(tmp, 0o700)
            nproc = lim.nproc if uid is not None else _user_process_count() + lim.nproc
            payload = {
                "code": job.code,
                "func": job.func,
                "inputs": job.inputs,
                "netns": self.netns,
                "uid": uid,
                "gid": uid,
                "audit": self.audit,
                "limits": {
                    "cpu_s": lim.cpu_s,
                    "memory_bytes": lim.memory_bytes,
                    "output_bytes": lim.output_bytes,
                    "repr_chars": lim.repr_chars,
                    "nproc": nproc,
                },
            }
            env = {"HOME": tmp, "TMPDIR": tmp, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", str(CHILD)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                cwd=tmp,
                env=env,
                start_new_session=True,  # its own process group, killed as a whole
                close_fds=True,
            )
            data, timed_out, overflow = _exchange(
                proc, json.dumps(payload).encode(), lim.wall_s, lim.result_bytes
            )
            out = _outcome(proc.returncode, data, timed_out, overflow, len(job.inputs))
        finally:
            _kill_all(proc, uid)
            shutil.rmtree(tmp, ignore_errors=True)
        out.seconds = time.perf_counter() - tic
        return out


def _exchange(proc: subprocess.Popen, payload: bytes, wall_s: float, cap: int):
    """Send the job, read the report (at most `cap` bytes) until exit or the deadline."""
    deadline = time.monotonic() + wall_s
    try:
        proc.stdin.write(payload)
        proc.stdin.close()
    except BrokenPipeError:
        pass
    chunks, size, timed_out, overflow = [], 0, False, False
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            if not sel.select(left):
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            size += len(chunk)
            if size > cap:
                overflow = True
                break
            chunks.append(chunk)
    if timed_out or overflow:
        _killpg(proc)
    try:
        proc.wait(timeout=max(0.5, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
        _killpg(proc)
        proc.wait()
    proc.stdout.close()
    return b"".join(chunks), timed_out, overflow


def _killpg(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_all(proc: subprocess.Popen | None, uid: int | None) -> None:
    """Kill what the job left running: its process group, and (as root) every process
    of its slot uid, including any that left the group with setsid()."""
    if proc is not None:
        _killpg(proc)
        if proc.poll() is None:
            proc.wait()
    if uid is None:
        return
    # kill(-1) from a process running as `uid` signals every process of that uid
    # (except itself): one pass in the kernel, so a fork bomb cannot outrun it.
    for _ in range(3):
        if _KILL:
            subprocess.run(
                [_KILL, "-9", "-1"],
                user=uid,
                group=uid,
                extra_groups=[],
                env={},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                check=False,
            )
        else:
            pid = os.fork()
            if pid == 0:  # only raw system calls in the child
                try:
                    os.setgroups([])
                    os.setgid(uid)
                    os.setuid(uid)
                    os.kill(-1, signal.SIGKILL)
                finally:
                    os._exit(0)
            os.waitpid(pid, 0)
        for _ in range(20):  # SIGKILL is delivered asynchronously
            if not _uid_alive(uid):
                return
            time.sleep(0.01)


_KILL = shutil.which("kill", path="/usr/bin:/bin")


def uid_processes(uid: int) -> list[int]:
    """Pids of the live (not zombie) processes of `uid` (Linux)."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if p.stat().st_uid != uid:
                continue
            state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):  # a zombie holds no memory and runs nothing
            out.append(int(p.name))
    return out


def _uid_alive(uid: int) -> bool:
    return bool(uid_processes(uid))


def _outcome(rc: int, data: bytes, timed_out: bool, overflow: bool, n_calls: int) -> Outcome:
    if overflow:
        return Outcome(reason="output_limit", detail="report larger than the cap")
    if rc in VIOLATION_RC:  # the audit hook refused an operation and ended the process
        return Outcome(values=[None] * n_calls, reason=VIOLATION_RC[rc], detail=_violation(data))
    report = _report(data, n_calls)
    if report is None:
        if timed_out:
            return Outcome(reason="timeout", detail="wall-clock limit")
        if rc == -signal.SIGXCPU:
            return Outcome(reason="cpu_time", detail="RLIMIT_CPU")
        if rc == -signal.SIGXFSZ:
            return Outcome(reason="output_limit", detail="RLIMIT_FSIZE")
        if rc == -signal.SIGKILL:  # RLIMIT_CPU hard limit, or the OOM killer
            return Outcome(reason="cpu_time", detail="killed (SIGKILL)")
        if rc == 97:
            return Outcome(reason="crashed", detail="could not isolate the network")
        if rc is not None and rc < 0:
            return Outcome(reason="crashed", detail=f"signal {-rc}")
        return Outcome(reason="exited", detail=f"exit status {rc} before reporting")
    values: list[str | None] = [c["repr"] if c["ok"] else None for c in report["calls"]]
    values += [None] * (n_calls - len(values))
    return Outcome(values=values, reason=report.get("reason"), detail=report.get("error", ""))


# Reasons the child itself reports (the others come from exit statuses and signals).
CHILD_REASONS = ("syntax", "memory", "runtime_error", "no_function", "process_limit",
                 "output_limit", "exited")  # fmt: skip


def _report(data: bytes, n_calls: int) -> dict | None:
    """The child's report, or None when there is none or it is not one the child could
    have written (the program can write to the same descriptor; a forged report can
    only claim values it could have returned, and a malformed one must not crash us)."""
    try:
        report = json.loads(data) if data else None
    except ValueError:
        return None
    if not isinstance(report, dict):
        return None
    calls, reason, error = report.get("calls"), report.get("reason"), report.get("error", "")
    if not (isinstance(calls, list) and len(calls) <= n_calls and all(map(_call_ok, calls))):
        return None
    if not (reason is None or reason in CHILD_REASONS) or not isinstance(error, str):
        return None
    return report


def _call_ok(c) -> bool:
    if not isinstance(c, dict):
        return False
    return c.get("ok") is False or (c.get("ok") is True and isinstance(c.get("repr"), str))


def _violation(data: bytes) -> str:
    """The hook's record of a violation (the last line it wrote), or "" if unreadable:
    the program may have written to the same descriptor before."""
    try:
        reason, detail = json.loads(data.rstrip(b"\n").rsplit(b"\n", 1)[-1])["violation"]
        return str(detail)[:500]
    except (ValueError, KeyError, TypeError, IndexError):
        return ""


def same_value(got: str | None, expected) -> bool:
    """Whether a returned value's repr equals `expected` (tuples read as lists).

    >>> same_value("[1, 2]", [1, 2]), same_value("(1, 2)", [1, 2]), same_value("'a'", "b")
    (True, True, False)
    """
    if got is None:
        return False
    try:
        value = ast.literal_eval(got)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return False
    return _norm(value) == _norm(expected) and type(_norm(value)) is type(_norm(expected))


def _norm(x):
    if isinstance(x, (list, tuple)):
        return [_norm(v) for v in x]
    if isinstance(x, dict):
        return {k: _norm(v) for k, v in x.items()}
    return x
