"""Run untrusted Python (a policy's completions) in confined, short-lived processes.

`Sandbox.run(jobs, deadline)` runs each `Job` (source code, a function name, test
inputs) in its own process, `workers` at a time, and returns one `Outcome` per job: the
repr of each call's return value, or a named failure `reason`. With a deadline each
program's wall clock is its fair share of the time left (`Shares`), so a program that
hangs costs its own time only. The expected outputs never enter the sandboxed process;
callers compare them (rewards/code.py).

Two isolation levels (`Sandbox(isolation=...)`):

**strong** (the default; refused in one line where it cannot be had):
- Linux: each program runs under bubblewrap in new mount, pid, ipc, uts, network (and,
  without root, user) namespaces. Its filesystem is a fresh root holding only the
  Python runtime, read-only (the interpreter, its standard library with site-packages
  hidden, the shared libraries they load), a minimal `/dev`, and private size-limited
  tmpfs mounts at the working directory, `/tmp` and `/dev/shm` (as root, limited in
  files too), the only places it can write: the project tree, your home, other
  sandboxes and the host's `/proc` do not exist inside, the hostname is `sandbox`, and
  everything the program wrote vanishes with it. As root, bubblewrap sets this up and the program then
  drops to a slot uid of its own; without root, an unprivileged user namespace does it.
  The process dies with its parent, and RLIMIT_NPROC leaves it no room for another
  process or thread (`Limits.nproc` extra), so the job as a whole is bounded by its
  address-space limit and the tmpfs sizes.
- macOS: `sandbox-exec` with a profile that denies by default: it allows reading the
  Python runtime and the system libraries, reading and writing the job's own temporary
  directory, and nothing else: no network, no new processes. (macOS does not enforce
  RLIMIT_AS: memory is not bounded by the kernel there.)

**weak** (opt in with the code recipe's `isolation = "weak"`): a separate process, a
fresh temporary directory, rlimits, and as root on Linux a slot uid and empty network
and IPC namespaces; the audit hook is then the only guard for your files (and, without
root, the network), and it is Python in the program's own interpreter.

Both levels keep: `python -I -S` (no site-packages, no PYTHONPATH, no cwd import); an
environment of only HOME, TMPDIR, PATH and LANG; the wall-clock limit (process group
killed, and as root every process of the slot uid); RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE
(output), RLIMIT_NOFILE, RLIMIT_CORE=0, RLIMIT_NPROC; and the audit hook (PEP 578) as a
tripwire that names what a program tried (`forbidden_file`, `network`, `process`,
`forbidden_module`). No guarantee of the strong level depends on the hook.

The report comes back on a pipe, read with a size cap and parsed defensively: anything
malformed is that job's `bad_report`, and no job can reach another's pipe or process.
"""

from __future__ import annotations

import ast
import fcntl
import functools
import glob
import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from mlx_grpo.tether import tether, untether

CHILD = Path(__file__).with_name("_sandbox_child.py")
SLOT_UID_BASE = 60000  # uids (and gids) 60000.. are used for sandbox slots when root
SLOT_UID_COUNT = 4096  # how far past the base a Sandbox looks for free uids
# flock'ed while a Sandbox holds that uid, in a folder only root can write: in a shared
# /tmp a program running as a slot uid (weak isolation) could plant them and hold slots.
SLOT_LOCKS = "/run/mlx-grpo" if os.path.isdir("/run") else "/var/lib/mlx-grpo"
SLOT_LOCK = SLOT_LOCKS + "/slot-{uid}.lock"
# Exit status of a child the audit hook ended, per reason (_sandbox_child.VIOLATION_RC).
VIOLATION_RC = {81: "forbidden_file", 82: "network", 83: "process", 84: "forbidden_module"}
ISOLATION = ("strong", "weak")
# Machines whose system-call numbers the child's seccomp filter knows (keep in step with
# _sandbox_child._SYSCALLS); elsewhere RLIMIT_NPROC alone bounds processes.
SECCOMP_MACHINES = ("x86_64", "aarch64")
WORKDIR = "/work"  # the program's working directory inside bubblewrap
SCRATCH = ("/dev/shm", "/tmp", WORKDIR)  # the private tmpfs mounts a program may write
HOSTNAME = "sandbox"  # the name a program sees inside bubblewrap (its own UTS namespace)
CHILD_INSIDE = "/sandbox/child.py"


class SandboxUnavailable(RuntimeError):
    """Strong isolation cannot be had here; the message is one line saying why and what
    to install (or how to opt in to the weak level)."""


@dataclass(frozen=True)
class Limits:
    """Per-program limits. Defaults suit short test functions."""

    wall_s: float = 10.0  # generous: the machine may be busy; CPU time is the real bound
    cpu_s: int = 3
    memory_bytes: int = 512 * 2**20
    output_bytes: int = 256 * 2**10  # what the program may print or write (RLIMIT_FSIZE)
    result_bytes: int = 1 * 2**20  # the report read back
    repr_chars: int = 10_000  # longest repr of one returned value
    nproc: int = 0  # processes and threads the program may start besides itself
    scratch_bytes: int = 16 * 2**20  # each tmpfs (working dir, /tmp, /dev/shm), strong level
    # Files and folders in each of them (strong level as root): an inode's kernel memory
    # is outside the size limit (100,000 empty files: 136 MiB of the host's).
    scratch_inodes: int = 1024


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


# Reasons that mean the program broke a rule or a limit, or was stopped from outside
# (`killed`), not merely a wrong answer.
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
    "bad_report",
    "killed",
)


def _root_linux() -> bool:
    return sys.platform.startswith("linux") and os.geteuid() == 0


_NETNS: bool | None = None


def network_namespace_available() -> bool:
    """Whether a child can unshare(CLONE_NEWNET | CLONE_NEWIPC) here: root on Linux, and
    not a container that withholds CAP_SYS_ADMIN (probed once)."""
    global _NETNS
    if _NETNS is None:
        _NETNS = _root_linux() and (
            subprocess.run(
                [sys.executable, "-I", "-S", "-c", _NETNS_PROBE], capture_output=True, env={}
            ).returncode
            == 0
        )
    return _NETNS


UNSHARE = 0x40000000 | 0x08000000  # CLONE_NEWNET | CLONE_NEWIPC (_sandbox_child.UNSHARE)
_NETNS_PROBE = (
    f"import ctypes, sys\nsys.exit(ctypes.CDLL(None, use_errno=True).unshare({UNSHARE}) != 0)"
)


def isolation_summary() -> dict[str, bool | str | None]:
    """What this machine gives: the strong level's tool (None: unavailable, with why),
    and the layers of the weak level (see the module docstring)."""
    try:
        strong, why = strong_isolation(_root_linux()), None
    except SandboxUnavailable as e:
        strong, why = None, str(e)
    return {
        "strong": strong,
        "strong_unavailable": why,
        "rlimits": True,
        "memory_limit": sys.platform != "darwin",
        "separate_uid": _root_linux(),
        "network_namespace": network_namespace_available(),
        "audit_hook": True,
    }


@functools.cache
def warn_weak() -> None:
    """One line on stderr, once per process, saying what weak isolation leaves open."""
    print(
        "sandbox: weak isolation (opted in): programs run as "
        + (
            "a slot uid without network"
            if _root_linux() and network_namespace_available()
            else "you, with your network"
        )
        + "; only the audit hook keeps them from reading your files (docs/sandbox.md)",
        file=sys.stderr,
    )


_WEAK_HINT = "or opt in to weak isolation with --recipe.params.isolation=weak (docs/sandbox.md)"


@functools.cache
def strong_isolation(root: bool) -> str:
    """The tool that gives strong isolation here ("bwrap" or "sandbox-exec"), checked by
    starting one program under it (once per process); else SandboxUnavailable, in one
    line that says what to install."""
    if sys.platform.startswith("linux"):
        tool = _bwrap()
        if tool is None:
            raise SandboxUnavailable(
                "sandbox: strong isolation needs bubblewrap, which is not installed "
                f"(Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap); {_WEAK_HINT}"
            )
    elif not (sys.platform == "darwin" and os.path.exists(SANDBOX_EXEC)):
        raise SandboxUnavailable(
            f"sandbox: no strong isolation on {sys.platform} (bubblewrap on Linux, "
            f"sandbox-exec on macOS); {_WEAK_HINT}"
        )
    else:
        tool = SANDBOX_EXEC
    with tempfile.TemporaryDirectory(prefix="mlx-grpo-sandbox-") as tmp:
        if tool == SANDBOX_EXEC:
            argv = [tool, "-p", _macos_profile(tmp), _runtime()[0]]
        else:
            argv = _bwrap_argv(tool, Limits(), root)
        argv += ["-I", "-S", "-c", "import json"]
        probe = subprocess.run(argv, capture_output=True, text=True, env={}, cwd=tmp, timeout=60)
    if probe.returncode != 0:
        said = (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
        need = (
            "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1; on "
            "Ubuntu, AppArmor's bwrap profile) or root"
            if tool != SANDBOX_EXEC
            else "a working sandbox-exec"
        )
        raise SandboxUnavailable(
            f"sandbox: {os.path.basename(tool)} could not start a program here ({said[:200]}); "
            f"it needs {need}; {_WEAK_HINT}"
        )
    return "bwrap" if tool != SANDBOX_EXEC else "sandbox-exec"


SANDBOX_EXEC = "/usr/bin/sandbox-exec"


def _seccomp_here() -> bool:
    return sys.platform.startswith("linux") and os.uname().machine in SECCOMP_MACHINES


def _bwrap() -> str | None:
    return shutil.which("bwrap") or shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin")


@functools.cache
def _runtime() -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """(interpreter, paths a sandboxed program may read, directories among them to hide):
    the base interpreter (never a venv's), its standard library, the shared libraries
    they load (ldd), and the base's site-packages where it sits inside the stdlib."""
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    prefix, exec_prefix = sys.base_prefix, sys.base_exec_prefix
    base = {"base": prefix, "platbase": exec_prefix}
    base |= {"installed_base": prefix, "installed_platbase": exec_prefix}
    paths = sysconfig.get_paths(vars=base)  # the base installation's, not a venv's
    dirs = {os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib")}
    site = {os.path.realpath(paths[k]) for k in ("purelib", "platlib")}
    hidden = [d for d in site if os.path.isdir(d) and any(d.startswith(r + "/") for r in dirs)]
    objects = [exe] + [f for d in sorted(dirs) for f in glob.glob(f"{d}/lib-dynload/*.so")]
    libs = _shared_libraries(objects)
    extra = [p for p in ("/etc/ld.so.cache",) if os.path.exists(p)]
    binds = sorted({exe, *dirs, *libs, *extra}, key=lambda p: (p.count("/"), p))
    return exe, tuple(binds), tuple(sorted(hidden))


def _shared_libraries(objects: list[str]) -> set[str]:
    """The shared libraries (and the loader) that `objects` load, by ldd (Linux)."""
    ldd = shutil.which("ldd", path="/usr/bin:/bin")
    if ldd is None or sys.platform == "darwin":
        return set()
    out = subprocess.run([ldd, *objects], capture_output=True, text=True, env={}).stdout
    libs = set()
    for line in out.splitlines():
        if not line.startswith((" ", "\t")):
            continue  # a "file:" header
        path = line.split("=>", 1)[-1].strip().split(" (", 1)[0].strip()
        if path.startswith("/") and os.path.exists(path):
            libs.add(path)
    return libs


def _ancestors(path: str) -> list[str]:
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _bwrap_argv(bwrap: str, lim: Limits, root: bool) -> list[str]:
    """The bubblewrap command up to the interpreter, to which the caller adds its
    arguments (see the module docstring for what it sets up). As root
    bubblewrap runs privileged (no user namespace) and the child drops to its slot uid;
    otherwise an unprivileged user namespace, in which no further one may be made."""
    exe, binds, hidden = _runtime()
    argv = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"]
    argv += ["--hostname", HOSTNAME]  # the host's name is none of the program's business
    # No --new-session: Popen's start_new_session already leaves no controlling
    # terminal, and staying in bubblewrap's process group lets one killpg (the job's end,
    # the tether) reach the program inside the pid namespace too.
    argv += ["--unshare-cgroup-try", "--die-with-parent"]
    if not root:
        argv += ["--unshare-user", "--disable-userns"]
    parents = sorted({a for p in [*binds, CHILD_INSIDE] for a in _ancestors(p)}, key=len)
    for d in parents:  # readable on the way to the runtime (a Python under /root, say)
        argv += ["--perms", "0755", "--dir", d]
    for p in binds:
        argv += ["--ro-bind", p, p]
    for d in hidden:
        argv += ["--perms", "0555", "--size", "4096", "--tmpfs", d]
    argv += ["--ro-bind", str(CHILD), CHILD_INSIDE, "--dev", "/dev"]
    for d in SCRATCH:
        argv += ["--perms", "1777", "--size", str(lim.scratch_bytes), "--tmpfs", d]
    # The root and /dev are tmpfs mounts of bubblewrap's with no size limit, which the
    # program owns in a user namespace: read-only, the scratch mounts are all it writes.
    for d in [*hidden, "/dev", "/"]:
        argv += ["--remount-ro", d]
    return argv + ["--chdir", WORKDIR, exe]


def _macos_profile(tmp: str) -> str:
    """A sandbox-exec profile: deny by default; read the Python runtime, the system
    libraries and the child script, read and write `tmp`; no network, no new processes
    (a framework build's `bin/python3.x` execs its `Python.app`, inside the runtime)."""
    exe, _, _ = _runtime()
    runtime = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)}
    runtime.add(os.path.dirname(exe))
    dirs = " ".join(f"(subpath {json.dumps(p)})" for p in sorted(runtime))
    libs = " ".join(
        f"(subpath {json.dumps(p)})"
        for p in (
            "/usr/lib",
            "/System",
            "/Library/Apple",
            "/private/var/db/dyld",
            "/opt/homebrew",
            "/usr/local",
        )
    )
    child, work = json.dumps(str(CHILD.resolve())), json.dumps(os.path.realpath(tmp))
    return f"""(version 1)
(deny default)
(allow process-exec {dirs})
(allow file-read-metadata)
(allow file-read* {dirs} {libs} (literal {child})
  (literal "/dev/null") (literal "/dev/urandom") (literal "/dev/random"))
(allow file-read* file-write* (subpath {work}))
(allow file-write-data (literal "/dev/null"))
(allow sysctl-read)
(allow signal (target self))
"""


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
    os.makedirs(SLOT_LOCKS, mode=0o700, exist_ok=True)
    st = os.stat(SLOT_LOCKS, follow_symlinks=False)
    if st.st_uid != 0 or st.st_mode & 0o022 or not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"sandbox: {SLOT_LOCKS} must be a folder only root can write")
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
    """A pool of `workers` slots running jobs under `limits`, at `isolation` "strong"
    (refused with SandboxUnavailable where it cannot be had) or "weak" (see the module
    docstring); `audit=False` drops the in-process audit hook (for tests that prove the
    OS layers hold on their own).

    As root on Linux each slot runs as its own uid, claimed for this Sandbox alone
    (`uids`) so that killing every process of a slot's uid after a job cannot hit
    another Sandbox's program; `close()` (or garbage collection) gives them back."""

    def __init__(
        self,
        limits: Limits = Limits(),
        workers: int | None = None,
        audit: bool = True,
        isolation: str = "strong",
    ):
        if isolation not in ISOLATION:
            raise ValueError(f"sandbox: isolation must be one of {ISOLATION}, got {isolation!r}")
        self.limits = limits
        self.workers = max(1, workers or os.cpu_count() or 1)
        self.audit = audit
        self.isolation = isolation
        self.root = _root_linux()
        self.tool = strong_isolation(self.root) if isolation == "strong" else None
        self.netns = self.tool is None and network_namespace_available()
        self.uids: list[int] | None = None
        self._lock_fds: list[int] = []
        if self.root:
            self.uids, self._lock_fds = _claim_uids(self.workers)
        self._finalizer = weakref.finalize(self, _release, self._lock_fds)
        self._slots = list(range(self.workers))
        self._free = threading.Condition()  # a slot given back wakes a job waiting for one

    def close(self) -> None:
        """Give the slot uids back (no-op when not root, or already closed)."""
        self._finalizer()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, jobs: list[Job], deadline: float | None = None) -> list[Outcome]:
        """One Outcome per job, in order; jobs run `workers` at a time.

        With `deadline` (a time.monotonic() value) the batch ends by then and each
        program's time counts only to itself: a program starts with a wall clock of
        its fair share of the slot time left (`Shares`, at most limits.wall_s), so
        programs that hang fail as `timeout` each while the others finish as they
        would alone; a job with no slot by the deadline fails as `timeout` unrun."""
        if not jobs:
            return []
        shares = Shares(len(jobs), self.workers, self.limits.wall_s, deadline)
        with ThreadPoolExecutor(min(self.workers, len(jobs))) as pool:
            return list(pool.map(lambda job: self._run_slot(job, shares), jobs))

    def _run_slot(self, job: Job, shares: Shares) -> Outcome:
        # Another run (one its caller gave up on, say) may hold slots: wait for one,
        # never past the deadline.
        with self._free:
            if not self._free.wait_for(lambda: self._slots, shares.left()):
                return Outcome(reason="timeout", detail="no sandbox slot before the deadline")
            slot = self._slots.pop()
        try:
            wall_s = shares.take()
            if wall_s is None:
                return Outcome(reason="timeout", detail="not started before the deadline")
            return self.run_one(job, slot, wall_s)
        finally:
            shares.done()
            with self._free:
                self._slots.append(slot)
                self._free.notify()

    def _command(self, tmp: str | None) -> tuple[list[str], dict, int]:
        """(argv, environment, RLIMIT_NPROC) of the child. The process limit counts the
        program itself, `limits.nproc` more, and what else its uid holds where the
        count is taken: bubblewrap's init in an unprivileged user namespace; all your
        processes when the program runs as you without one."""
        extra = self.limits.nproc
        child = ["-I", "-S", "-B"]
        if self.tool == "bwrap":
            argv = _bwrap_argv(_bwrap(), self.limits, self.root) + [*child, CHILD_INSIDE]
            env = {"HOME": WORKDIR, "TMPDIR": "/tmp", "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
            return argv, env, (1 if self.root else 2) + extra
        env = {"HOME": tmp, "TMPDIR": tmp, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        nproc = 1 + extra if self.root else _user_process_count() + 1 + extra
        if self.tool == "sandbox-exec":
            exe = _runtime()[0]
            return [SANDBOX_EXEC, "-p", _macos_profile(tmp), exe, *child, str(CHILD)], env, nproc
        return [sys.executable, *child, str(CHILD)], env, nproc

    def run_one(self, job: Job, slot: int = 0, wall_s: float | None = None) -> Outcome:
        """Run `job` in `slot` (its uid, as root), killed after `wall_s` seconds
        (default limits.wall_s)."""
        lim = self.limits
        wall_s = lim.wall_s if wall_s is None else wall_s
        tic = time.perf_counter()
        if self.root and not self._finalizer.alive:
            raise RuntimeError("sandbox: run on a closed Sandbox")
        uid = self.uids[slot] if self.root else None
        # Under bubblewrap the working directory is a tmpfs of the sandbox's own.
        tmp = None if self.tool == "bwrap" else tempfile.mkdtemp(prefix="mlx-grpo-sandbox-")
        proc = None
        try:
            if uid is not None and tmp is not None:
                os.chown(tmp, uid, uid)
                os.chmod(tmp, 0o700)
            argv, env, nproc = self._command(tmp)
            payload = {
                "code": job.code,
                "func": job.func,
                "inputs": job.inputs,
                "netns": self.netns,
                "seccomp": _seccomp_here(),
                "uid": uid,
                "gid": uid,
                # Root's child under bubblewrap still holds its capabilities in its own
                # mount namespace: it can remount its tmpfs with an inode limit before
                # dropping to the slot uid. (In a user namespace bubblewrap's nested one
                # owns no mount: no bound there.)
                "scratch": {"paths": SCRATCH, "inodes": lim.scratch_inodes}
                if self.tool == "bwrap" and self.root
                else None,
                "audit": self.audit,
                "limits": {
                    "cpu_s": lim.cpu_s,
                    "memory_bytes": lim.memory_bytes,
                    "output_bytes": lim.output_bytes,
                    "repr_chars": lim.repr_chars,
                    "nproc": nproc,
                },
            }
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                cwd=tmp or "/",
                env=env,
                start_new_session=True,  # its own process group, killed as a whole
                close_fds=True,
            )
            tether(proc.pid)  # killed with this process, however it ends
            data, timed_out, overflow = _exchange(
                proc, json.dumps(payload).encode(), wall_s, lim.result_bytes
            )
            rc = proc.returncode
            if self.tool == "bwrap" and rc is not None and rc > 128:
                rc = 128 - rc  # bubblewrap's init exits 128 + n when the child dies of signal n
            # Under seccomp the program has one thread, so its CPU seconds are at most
            # the seconds since `tic`: RLIMIT_CPU's SIGKILL (at cpu_s + 1) cannot have
            # come sooner. Elsewhere threads can outrun the clock: no telling.
            elapsed = time.perf_counter() - tic
            hard_cpu = not payload["seccomp"] or elapsed >= lim.cpu_s + 1
            out = _outcome(rc, data, timed_out, overflow, len(job.inputs), hard_cpu, lim.repr_chars)
            if out.reason == "timeout":
                out.detail = f"wall-clock limit ({wall_s:.3g} s)"
        finally:
            _kill_all(proc, uid)
            if proc is not None:
                untether(proc.pid)
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        out.seconds = time.perf_counter() - tic
        return out


class Shares:
    """Wall clocks for a batch of `n` jobs on `slots` slots that must end by `deadline`
    (None: no deadline, every program gets `wall_s`).

    A job starting now gets the slot time left before the deadline, less what the
    programs running on the other slots may still use, divided among the jobs not yet
    started (itself included), and at most `wall_s`. Every job is promised at least
    its fair share whatever ran before it: a program that hangs uses its own share
    and no one else's, and one that finishes early leaves its time to the rest."""

    def __init__(self, n: int, slots: int, wall_s: float, deadline: float | None):
        self.pending, self.slots, self.wall_s, self.deadline = n, slots, wall_s, deadline
        self._ends: dict[int, float] = {}  # pool thread -> when its program is killed
        self._lock = threading.Lock()

    def left(self) -> float | None:
        """Seconds to the deadline (None: no deadline), for waits."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def take(self) -> float | None:
        """The wall clock of the calling thread's job, starting now; None when the
        deadline has passed."""
        with self._lock:
            self.pending -= 1
            if self.deadline is None:
                return self.wall_s
            now = time.monotonic()
            left = self.deadline - now
            if left <= 0:
                return None
            running = sum(max(0.0, end - now) for end in self._ends.values())
            share = (self.slots * left - running) / (self.pending + 1)
            wall_s = min(self.wall_s, left, share)
            self._ends[threading.get_ident()] = now + wall_s
            return wall_s

    def done(self) -> None:
        """The calling thread's program has ended: its slot time is free."""
        with self._lock:
            self._ends.pop(threading.get_ident(), None)


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


def _outcome(
    rc: int,
    data: bytes,
    timed_out: bool,
    overflow: bool,
    n_calls: int,
    hard_cpu: bool,
    repr_chars: int,
) -> Outcome:
    """`hard_cpu`: whether the program can have reached RLIMIT_CPU's hard limit."""
    if overflow:
        return Outcome(reason="output_limit", detail="report larger than the cap")
    if rc in VIOLATION_RC:  # the audit hook refused an operation and ended the process
        return Outcome(values=[None] * n_calls, reason=VIOLATION_RC[rc], detail=_violation(data))
    if timed_out:  # whatever it wrote first: the child reports as it exits
        return Outcome(reason="timeout", detail="wall-clock limit")
    # The child exits 0 right after its report: a report followed by a death (a forked
    # process after it, the CPU limit) is the program's, and the death decides.
    report = _report(data, n_calls, repr_chars) if rc == 0 else None
    if report is None:
        if data and rc == 0:  # it wrote something that is no report
            return Outcome(reason="bad_report", detail="malformed report")
        if rc == -signal.SIGXCPU:
            return Outcome(reason="cpu_time", detail="RLIMIT_CPU")
        if rc == -signal.SIGXFSZ:
            return Outcome(reason="output_limit", detail="RLIMIT_FSIZE")
        if rc == -signal.SIGKILL:
            # RLIMIT_CPU's hard limit (a program that ignored SIGXCPU), or a kill from
            # outside: the kernel's OOM killer when the machine runs out of memory.
            if hard_cpu:
                return Outcome(reason="cpu_time", detail="SIGKILL: RLIMIT_CPU (or the OOM killer)")
            return Outcome(
                reason="killed",
                detail="SIGKILL from outside the sandbox before its CPU limit "
                "(the OOM killer, most likely)",
            )
        if rc == -signal.SIGSYS:
            return Outcome(reason="process", detail="a process, exec or namespace call (seccomp)")
        if rc in (96, 97, 98):
            what = {96: "bound the scratch inodes", 97: "isolate the network and IPC"}
            return Outcome(
                reason="crashed", detail=f"could not {what.get(rc, 'install the seccomp filter')}"
            )
        if rc is not None and rc < 0:
            return Outcome(reason="crashed", detail=f"signal {-rc}")
        return Outcome(reason="exited", detail=f"exit status {rc} before reporting")
    values: list[str | None] = [c["repr"] if c["ok"] else None for c in report["calls"]]
    values += [None] * (n_calls - len(values))
    return Outcome(values=values, reason=report.get("reason"), detail=report.get("error", ""))


# Reasons the child itself reports (the others come from exit statuses and signals).
CHILD_REASONS = ("syntax", "memory", "runtime_error", "no_function", "process_limit",
                 "output_limit", "exited")  # fmt: skip


def _report(data: bytes, n_calls: int, repr_chars: int) -> dict | None:
    """The child's report, or None when there is none or it is not one the child could
    have written (the program can write to the same descriptor; a forged report can
    only claim values it could have returned, no longer than the child cuts a repr to,
    and a malformed one must not crash us)."""
    try:
        report = json.loads(data) if data else None
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than any report
        return None
    if not isinstance(report, dict):
        return None
    calls, reason, error = report.get("calls"), report.get("reason"), report.get("error", "")
    if not (isinstance(calls, list) and len(calls) <= n_calls):
        return None
    if not all(_call_ok(c, repr_chars + len("...")) for c in calls):
        return None
    if not (reason is None or reason in CHILD_REASONS) or not isinstance(error, str):
        return None
    return report


def _call_ok(c, longest: int) -> bool:
    if not isinstance(c, dict):
        return False
    if c.get("ok") is False:
        return True
    return c.get("ok") is True and isinstance(c.get("repr"), str) and len(c["repr"]) <= longest


def _violation(data: bytes) -> str:
    """The hook's record of a violation (the last line it wrote), or "" if unreadable:
    the program may have written to the same descriptor before."""
    try:
        reason, detail = json.loads(data.rstrip(b"\n").rsplit(b"\n", 1)[-1])["violation"]
        return str(detail)[:500]
    except (ValueError, KeyError, TypeError, IndexError, RecursionError):
        return ""


def same_value(got: str | None, expected) -> bool:
    """Whether a returned value's repr equals `expected` (tuples read as lists).

    >>> same_value("[1, 2]", [1, 2]), same_value("(1, 2)", [1, 2]), same_value("'a'", "b")
    (True, True, False)
    """
    if got is None:
        return False
    want = _norm(expected)
    try:  # a repr the program chose: '{[]: 0}' (TypeError), '1' * 400 + '+0j'...
        value = _norm(ast.literal_eval(got))
    except Exception:
        return False
    return value == want and type(value) is type(want)


def _norm(x):
    if isinstance(x, (list, tuple)):
        return [_norm(v) for v in x]
    if isinstance(x, dict):
        return {k: _norm(v) for k, v in x.items()}
    return x
