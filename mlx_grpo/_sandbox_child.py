"""The sandboxed process: confine itself, run one program, report what its calls returned.

Started by mlx_grpo.sandbox as `python -I -S _sandbox_child.py` with a fresh working
directory as cwd (at the strong level, inside bubblewrap: see mlx_grpo/sandbox.py). It
reads one JSON job from stdin, then, before any untrusted code:

1. (weak level, root on Linux) enters new, empty network and IPC namespaces,
2. sets the resource limits (CPU seconds, address space, file size, processes, files),
3. (root) drops to the job's unprivileged uid/gid, so RLIMIT_NPROC applies to it,
4. (Linux) installs a seccomp filter under which fork, exec, new namespaces and ptrace
   end the process (SIGSYS), a new thread is refused, and the kernel keyrings, bpf and
   sockets other than unix and IP ones are refused (see `_SYSCALLS`),
5. points fds 1 and 2 at out.txt in the working directory (user prints land there,
   capped by RLIMIT_FSIZE) and keeps a private copy of the original stdout for results,
6. removes from sys.modules every module the program may not import (ctypes, loaded
   for steps 1 and 4, and anything a preloaded module pulled in), and
7. installs an audit hook (sys.addaudithook) that refuses file access outside the
   temporary directory and the standard library, sockets, new processes, signals to
   other processes, sqlite3, and imports of modules that reach the OS behind the hook's
   back (`DENIED_MODULES`: _posixsubprocess, ctypes, sqlite3, subinterpreters...).

A refusal is fatal: the hook writes the violation to the results descriptor and ends
the process with `os._exit(VIOLATION_RC[reason])`, so a program can neither catch it
nor erase it; the parent maps the exit status back to the reason. The hook uses only
names bound when it is installed: the program can rebind this module's globals,
builtins and os.path functions, and none of that changes what the hook decides.

Then it executes the program and calls `func(*args)` for each test input. Only the
*returned values* are sent back (as repr); the expected values never enter this process,
so nothing the program does here can make a wrong answer count as right.

Only the standard library is imported, and nothing from the project: this file runs
under `-I -S` (no site-packages, no PYTHONPATH, no cwd on sys.path).
"""

import errno
import json
import os
import resource
import stat
import sys
import sysconfig
import types

# Exit status of a process the audit hook ended, per reason (mlx_grpo/sandbox.py maps
# them back; keep the two in step).
VIOLATION_RC = {"forbidden_file": 81, "network": 82, "process": 83, "forbidden_module": 84}

# Modules a program may not import (top-level names): each reaches processes, files or
# the interpreter in ways the audit hook does not see (_posixsubprocess.fork_exec runs
# a program with no audit event; sqlite3 and dbm open files in C; a subinterpreter has
# no hook; ctypes and the _test* modules call C directly).
DENIED_MODULES = frozenset({
    "_posixsubprocess", "subprocess", "_sqlite3", "sqlite3", "_ctypes", "ctypes",
    "_xxsubinterpreters", "_xxinterpchannels", "_interpreters", "_interpchannels",
    "_interpqueues", "_multiprocessing", "multiprocessing", "_posixshmem", "_dbm", "_gdbm",
    "dbm", "pty", "_testcapi", "_testinternalcapi", "_testmultiphase", "_testbuffer",
    "_testimportmultiple", "_ctypes_test", "_xxtestfuzz", "_tkinter", "readline",
})  # fmt: skip
# os functions that create files with no audit event: replaced by a refusal.
UNAUDITED_FUNCTIONS = ("mkfifo", "mknod")


# Imported before the program runs (and before dropping privileges, after which the
# interpreter's own files may be unreadable, e.g. a Python installed in a private home):
# the standard modules a short function plausibly needs.
PRELOAD = (
    "math", "re", "collections", "itertools", "functools", "string", "heapq", "bisect",
    "typing", "operator", "statistics", "fractions", "decimal", "random", "copy",
    "json", "datetime", "time", "enum", "dataclasses", "array", "textwrap", "unicodedata",
    "socket", "encodings.idna",  # so that network attempts reach the namespace and hook
)  # fmt: skip


# The weak level's namespaces (CLONE_NEWNET | CLONE_NEWIPC): no network, and no System V
# IPC object that would outlive the job in the host's namespace. mlx_grpo.sandbox probes
# the same flags (UNSHARE there).
UNSHARE = 0x40000000 | 0x08000000


def _confine(job):
    for name in PRELOAD:
        __import__(name)
    if job.get("scratch"):
        _bound_scratch(job["scratch"]["paths"], job["scratch"]["inodes"])
    if job.get("netns"):
        import ctypes  # loaded before the audit hook, which refuses ctypes afterwards

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(UNSHARE) != 0:
            os.write(2, b"sandbox: unshare(CLONE_NEWNET | CLONE_NEWIPC) failed\n")
            os._exit(97)
        del libc, ctypes
    lim = job["limits"]
    _limit(resource.RLIMIT_CPU, lim["cpu_s"], lim["cpu_s"] + 1)
    _limit(resource.RLIMIT_FSIZE, lim["output_bytes"])
    _limit(resource.RLIMIT_NOFILE, 64)
    _limit(resource.RLIMIT_CORE, 0)
    if lim.get("memory_bytes"):
        _limit(resource.RLIMIT_AS, lim["memory_bytes"], optional=sys.platform == "darwin")
    if job.get("uid") is not None:
        os.setgroups([])
        os.setgid(job["gid"])
        os.setuid(job["uid"])
    if lim.get("nproc"):
        _limit(resource.RLIMIT_NPROC, lim["nproc"])
    if job.get("seccomp") and not _seccomp():
        os.write(2, b"sandbox: could not install the seccomp filter\n")
        os._exit(98)
    for name in [m for m in sys.modules if m.split(".")[0] in DENIED_MODULES]:
        del sys.modules[name]  # else `import ctypes` finds it there, with no audit event


# seccomp (Linux): system calls that end the process (SIGSYS) whatever the program did
# to the audit hook: new processes (fork, vfork, clone without CLONE_THREAD), exec, new
# namespaces, ptrace. clone3 answers ENOSYS (libc falls back to clone, whose flags the
# filter can read); a new thread answers EAGAIN, as RLIMIT_NPROC would. Calls that reach
# state the namespaces do not separate answer EPERM: the kernel keyrings (the trainer's
# session keyring, and a slot uid's user keyring that would outlive the job), bpf,
# perf_event_open, userfaultfd, io_uring, other processes' memory and descriptors
# (process_vm_*, pidfd_getfd), new System V
# and POSIX IPC objects (shmget, semget, msgget, mq_open: memory no rlimit counts,
# which outlives the job where the IPC namespace is the host's), and file locks and
# leases (flock, fcntl's F_SETLK, F_OFD_SETLK, F_SETLEASE): the runtime's files are the
# host's own, bind-mounted, and share its lock state, so a lock taken inside would
# block the host (and signal a concurrent sandbox) until the job ends. A socket or socket
# pair of a family other than unix, IPv4 and IPv6 (which the network namespace holds)
# answers EAFNOSUPPORT: vsock shares the host's port space, netlink and packet sockets
# reach the kernel's own.
_SYSCALLS = {  # machine: (AUDIT_ARCH, killed, denied, (socket, socketpair), clone, clone3, x32 bit, fcntl)
    "x86_64": (
        0xC000003E,
        (57, 58, 59, 322, 101, 272, 308),
        (248, 249, 250, 321, 298, 323, 425, 426, 427, 310, 311, 438, 29, 64, 68, 240, 73),
        (41, 53),
        56,
        435,
        0x40000000,
        72,
    ),
    "aarch64": (
        0xC00000B7,
        (221, 281, 117, 97, 268),
        (217, 218, 219, 280, 241, 282, 425, 426, 427, 270, 271, 438, 194, 190, 186, 180, 32),
        (198, 199),
        220,
        435,
        None,
        25,
    ),
}
_CLONE_THREAD = 0x10000
_SOCKET_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6
# fcntl commands that take a lock or a lease: F_SETLK, F_SETLKW, F_OFD_SETLK,
# F_OFD_SETLKW, F_SETLEASE.
_FCNTL_LOCKS = (6, 7, 37, 38, 1024)


def _seccomp_program(machine):
    """The classic-BPF filter for `machine` as bytes (None: not a known machine)."""
    import struct

    if machine not in _SYSCALLS:
        return None
    arch, killed, denied, sockets, clone, clone3, x32, fcntl = _SYSCALLS[machine]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    kill, allow, errno_ret = 0x80000000, 0x7FFF0000, 0x00050000
    # (label, (code, label if true, label if false, k)); labels become jump offsets.
    insns = [(None, (ld, None, None, 4)), (None, (jeq, "load_nr", "kill", arch))]
    insns.append(("load_nr", (ld, None, None, 0)))
    if x32 is not None:  # the x32 ABI's numbers: none is allowed
        insns.append((None, (jge, "kill", None, x32)))
    insns += [(None, (jeq, "kill", None, nr)) for nr in killed]
    insns += [(None, (jeq, "eperm", None, nr)) for nr in denied]
    insns += [(None, (jeq, "socket", None, nr)) for nr in sockets]
    insns += [(None, (jeq, "clone", None, clone)), (None, (jeq, "nosys", None, clone3))]
    insns.append((None, (jeq, "fcntl", None, fcntl)))
    insns.append((None, (ret, None, None, allow)))
    insns.append(("fcntl", (ld, None, None, 24)))  # the low half of the command argument
    insns += [(None, (jeq, "eperm", None, cmd)) for cmd in _FCNTL_LOCKS]
    insns.append((None, (ret, None, None, allow)))
    insns.append(("clone", (ld, None, None, 16)))  # the low half of the flags argument
    insns.append((None, (jset, "eagain", "kill", _CLONE_THREAD)))
    insns.append(("socket", (ld, None, None, 16)))  # the low half of the family argument
    insns += [(None, (jeq, "family_ok", None, family)) for family in _SOCKET_FAMILIES]
    insns.append((None, (ret, None, None, errno_ret | errno.EAFNOSUPPORT)))
    insns.append(("family_ok", (ret, None, None, allow)))
    insns.append(("kill", (ret, None, None, kill)))
    insns.append(("nosys", (ret, None, None, errno_ret | errno.ENOSYS)))
    insns.append(("eagain", (ret, None, None, errno_ret | errno.EAGAIN)))
    insns.append(("eperm", (ret, None, None, errno_ret | errno.EPERM)))
    where = {label: i for i, (label, _) in enumerate(insns) if label}
    out = b""
    for i, (_, (code, jt, jf, k)) in enumerate(insns):
        t = where[jt] - i - 1 if jt else 0
        f = where[jf] - i - 1 if jf else 0
        out += struct.pack("HBBI", code, t, f, k)
    return out


def _seccomp():
    """Install the filter (after PR_SET_NO_NEW_PRIVS); False where it cannot be."""
    import ctypes

    program = _seccomp_program(os.uname().machine)
    if program is None:
        return False

    class Filter(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    libc = ctypes.CDLL(None, use_errno=True)
    fprog = Filter(len(program) // 8, program)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        return False
    return libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0  # PR_SET_SECCOMP, FILTER


def _bound_scratch(paths, inodes):
    """Remount the private tmpfs mounts at `paths` with at most `inodes` files each (their
    size stays): as root under bubblewrap, in this process's own mount namespace, before
    dropping to the slot uid. Exit status 96 where the kernel refuses."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    flags = 32 | 2 | 4  # MS_REMOUNT | MS_NOSUID | MS_NODEV (bubblewrap's, kept)
    for path in paths:
        if libc.mount(None, path.encode(), None, flags, f"nr_inodes={inodes}".encode()) != 0:
            os.write(2, f"sandbox: could not bound the inodes of {path}\n".encode())
            os._exit(96)


def _limit(res, soft, hard=None, optional=False):
    """Set a limit, never above the hard limit already in force (which only root may
    raise); `optional` limits (RLIMIT_AS on macOS, which does not enforce it) may fail."""
    cur_hard = resource.getrlimit(res)[1]
    hard = soft if hard is None else hard
    if cur_hard != resource.RLIM_INFINITY:
        soft, hard = min(soft, cur_hard), min(hard, cur_hard)
    try:
        resource.setrlimit(res, (soft, hard))
    except (ValueError, OSError):
        if not optional:
            raise


def _allowed_roots(tmp):
    roots = {os.path.realpath(tmp)}
    for key in ("stdlib", "platstdlib"):
        roots.add(os.path.realpath(sysconfig.get_paths()[key]))
    return tuple(roots), os.path.realpath(tmp)


def _install_hook(read_roots, write_root, results_fd):
    """Step 7 of the module docstring: the audit hook, and a refusal in place of each
    function that creates a file with no audit event.

    Everything the hook uses is bound when the helpers below are called, here, in the
    closures they return: the program can rebind module globals (this module's
    included, so these helpers too, but only after they have run), builtins and
    os/posixpath functions, but not these names, C functions, or the methods of exact
    str and bytes."""
    deny = _violation(results_fd)
    plain, check_path = _path_rules(deny, read_roots, write_root)
    sys.addaudithook(_audit_hook(deny, plain, check_path))
    _refuse_unaudited(deny)


def _violation(results_fd):
    """`deny(reason, detail)`, which reports a violation on the results descriptor and
    ends the process; its own names bound here (see `_install_hook`)."""
    _exit, _write, _dumps = os._exit, os.write, json.dumps
    _rcs = types.MappingProxyType(dict(VIOLATION_RC))

    def deny(reason, detail):
        """Report the violation and end the process: nothing can catch or undo it."""
        try:
            _write(results_fd, b"\n" + _dumps({"violation": [reason, detail]}).encode() + b"\n")
        finally:
            _exit(_rcs[reason])

    return deny


def _path_rules(deny, read_roots, write_root):
    """(`plain`, `check_path`): a path argument as an exact str, and the check that it
    resolves (symlinks followed with the bound functions only) inside `read_roots`, or
    `write_root` for a write, else `deny`; its own names bound here (see `_install_hook`)."""
    _lstat, _readlink, _getcwd, _islnk = os.lstat, os.readlink, os.getcwd, stat.S_ISLNK
    _str, _bytes, _int, _type, _repr = str, bytes, int, type, repr
    _isinstance, _reversed, _enc = isinstance, reversed, sys.getfilesystemencoding()
    devices = frozenset({"/dev/null", "/dev/urandom", "/dev/random"})
    write_roots = (write_root,)

    def plain(text):
        """An exact str from a str or bytes (subclasses included: join copies the raw
        data, never calling their methods); None for anything else."""
        if _isinstance(text, _str):
            return "".join((text,))
        if _isinstance(text, _bytes):
            return b"".join((text,)).decode(_enc, "surrogateescape")
        return None

    def realpath(path):
        """os.path.realpath with the bound functions only (posixpath's are rebindable)."""
        todo = [*_reversed((path if path.startswith("/") else _getcwd() + "/" + path).split("/"))]
        resolved, links = "", 0
        while todo:
            name = todo.pop()
            if name in ("", "."):
                continue
            if name == "..":
                resolved = resolved[: resolved.rfind("/")] if resolved else ""
                continue
            cand = resolved + "/" + name
            try:
                st = _lstat(cand)
            except OSError:
                resolved = cand  # does not exist (yet): kept as written
                continue
            if not _islnk(st.st_mode):
                resolved = cand
                continue
            links += 1
            if links > 40:
                deny("forbidden_file", f"symlink loop at {cand}")
            target = _readlink(cand)
            if target.startswith("/"):
                resolved = ""
            todo += [*_reversed(target.split("/"))]
        return resolved or "/"

    def inside(path, roots):
        for r in roots:
            if path == r or path.startswith(r + "/"):
                return True
        return False

    def check_path(event, path, write):
        if _type(path) is _int:
            return  # an already-open descriptor
        text = plain(path)
        if text is None:  # a path object: its __fspath__ could answer differently to open()
            deny("forbidden_file", f"{event}: a path must be str or bytes, not {_type(path)}")
        try:
            real = realpath(text)
        except Exception:
            deny("forbidden_file", f"{event} {_repr(text)}")
        if real in devices:
            return
        if not inside(real, write_roots if write else read_roots):
            deny("forbidden_file", f"{event} {real}")

    return plain, check_path


def _audit_hook(deny, plain, check_path):
    """The audit hook: which events are file access (checked by `check_path`), and
    which are refused outright (sockets, new processes, signals, denied modules); its
    own names bound here (see `_install_hook`)."""
    _int, _tuple, _type = int, tuple, type
    _denied = DENIED_MODULES
    _write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC
    write_events = frozenset({
        "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link",
        "os.chmod", "os.chown", "os.truncate", "os.utime", "os.chflags", "os.lchflags",
        "os.setxattr", "os.removexattr", "shutil.rmtree",
    })  # fmt: skip
    process_events = frozenset({
        "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
        "os.startfile", "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg",
        "signal.pthread_kill", "os.setuid", "os.setgid", "resource.setrlimit", "os.chdir",
        "os.chroot", "os.fchdir", "resource.prlimit",
    })  # fmt: skip
    # The gc walks reach any live object, a module deleted from sys.modules included.
    module_events = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents",
                               "sys._debugmallocstats"})  # fmt: skip
    module_prefixes = ("ctypes.", "_ctypes", "mmap.", "sqlite3.", "winreg")

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            mode, write = plain(mode) or "", False
            for c in "wax+":
                write = write or c in mode
            if _type(flags) is _int and flags & _write_flags:
                write = True
            check_path(event, path, write)
        elif event in ("os.listdir", "os.scandir", "glob.glob"):
            check_path(event, args[0] if args and args[0] is not None else ".", False)
        elif event in write_events:
            for a in args[:2]:  # paths, or modes, ids, times (int, tuple, None)
                if not (a is None or _type(a) is _int or _type(a) is _tuple):
                    check_path(event, a, True)
        elif event.startswith("socket.") and event != "socket.gethostname":
            deny("network", event)
        elif event in process_events:
            deny("process", event)
        elif event == "import":
            # Any component, and the file: an extension module's init function is named
            # after the last one, so `x._posixsubprocess` would load the real thing.
            name, file = plain(args[0]) or "", plain(args[1]) if len(args) > 1 else None
            parts = name.split(".") + ([file.split("/")[-1].split(".")[0]] if file else [])
            for part in parts:
                if part in _denied or part == "posix":  # a fresh posix has mkfifo again
                    deny("forbidden_module", f"import {name}")
        elif event.startswith(module_prefixes) or event in module_events:
            deny("forbidden_module", event)

    return hook


def _refuse_unaudited(deny):
    """Replace os's and posix's UNAUDITED_FUNCTIONS by a call to `deny` (the hook
    refuses a fresh copy of posix)."""

    def refuse(name):
        return lambda *args, **kwargs: deny("forbidden_file", f"os.{name}")

    for name in UNAUDITED_FUNCTIONS:
        for module in (os, sys.modules["posix"]):
            if hasattr(module, name):
                setattr(module, name, refuse(name))


def _short_repr(value, limit):
    try:
        text = repr(value)
    except Exception as e:
        text = f"<repr failed: {type(e).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


def _error_reason(e):
    if isinstance(e, MemoryError):
        return "memory"
    if isinstance(e, OSError) and e.errno == errno.EAGAIN:  # fork refused by RLIMIT_NPROC
        return "process_limit"
    if isinstance(e, RuntimeError) and str(e) == "can't start new thread":  # RLIMIT_NPROC
        return "process_limit"
    if isinstance(e, OSError) and e.errno == errno.EFBIG:  # write refused by RLIMIT_FSIZE
        return "output_limit"
    if isinstance(e, SystemExit):
        return "exited"
    return None


def main():
    job = json.loads(sys.stdin.read())
    sys.stdin.close()
    tmp = os.getcwd()
    read_roots, write_root = _allowed_roots(tmp)  # sysconfig reads files: before confining
    _confine(job)
    my_pid = os.getpid()
    results_fd = os.dup(1)
    out = os.open(os.path.join(tmp, "out.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.set_inheritable(results_fd, False)
    limit = job["limits"]["repr_chars"]
    if job.get("audit", True):
        _install_hook(read_roots, write_root, results_fd)
    report = {"stage": "compile", "calls": []}

    def send():
        if os.getpid() != my_pid:  # a forked child of the program: never reports
            os._exit(1)
        data = json.dumps(report).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(results_fd, view) :]
        os._exit(0)

    try:
        code = compile(job["code"], "solution.py", "exec")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        report["error"] = f"{type(e).__name__}: {e}"
        report["reason"] = "syntax" if not isinstance(e, MemoryError) else "memory"
        send()
    report["stage"] = "exec"
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(code, namespace)
    except BaseException as e:  # noqa: BLE001 - the program's own failure, reported
        report["error"] = f"{type(e).__name__}: {_short_repr(e, 200)}"
        report["reason"] = _error_reason(e) or "runtime_error"
        send()
    func = namespace.get(job["func"])
    if not callable(func):
        report["reason"] = "no_function"
        report["error"] = f"no function named {job['func']}"
        send()
    report["stage"] = "tests"
    for args in job["inputs"]:
        try:
            value = func(*args)
            report["calls"].append({"ok": True, "repr": _short_repr(value, limit)})
        except BaseException as e:  # noqa: BLE001
            reason = _error_reason(e)
            report["calls"].append({"ok": False, "error": f"{type(e).__name__}"})
            if reason:  # a limit or a rule, not a wrong answer: stop here
                report["reason"] = reason
                report["error"] = f"{type(e).__name__}: {_short_repr(e, 200)}"
                send()
    report["stage"] = "done"
    send()


if __name__ == "__main__":
    main()
