"""The sandbox against hostile programs: each is stopped, scores 0 through the code
reward, and names its failure; the OS layers are also checked without the audit hook."""

from __future__ import annotations

import errno
import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

import mlx_grpo.sandbox as sandbox_module
import rewards.code as code_reward
from mlx_grpo.recipe import Task
from mlx_grpo.sandbox import (
    CHILD,
    SLOT_UID_BASE,
    Job,
    Limits,
    Sandbox,
    SandboxUnavailable,
    isolation_summary,
    network_namespace_available,
    uid_processes,
)

SECCOMP = sandbox_module._seccomp_here()
# wall_s well past cpu_s: a CPU hog must reach its 1 CPU-second before the wall clock
# even when it gets a fraction of a core (two workers and the tests on two cores).
FAST = Limits(wall_s=8.0, cpu_s=1, memory_bytes=256 * 2**20, output_bytes=64 * 2**10)
ROOT_LINUX = sys.platform.startswith("linux") and os.geteuid() == 0


def _task(func="f", tests=(([3], 6), ([4], 8))) -> Task:
    return Task(
        id="t",
        level=1,
        messages=[],
        payload={"func": func, "tests": [{"args": a, "expected": e} for a, e in tests]},
    )


def _fenced(body: str) -> str:
    return f"```python\n{body}\n```"


@pytest.fixture
def fast_sandbox(monkeypatch):
    sb = Sandbox(FAST, workers=2)
    monkeypatch.setattr(code_reward, "_SANDBOX", sb)
    return sb


@pytest.fixture
def home_secret():
    path = Path.home() / f".mlx-grpo-sandbox-test-{uuid.uuid4().hex}"
    path.write_text("secret")
    yield path
    path.unlink()


def _listener():
    """A TCP server on 127.0.0.1 that records whether anything connected."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.settimeout(0.2)
    hits: list[int] = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
                hits.append(1)
                conn.close()
            except OSError:
                continue

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, hits, stop


@pytest.mark.skipif(
    sys.platform == "darwin",
    reason="macOS does not enforce RLIMIT_AS: no memory bound in the sandbox there, so the 10 GB program is not failed as `memory`",
)
def test_hostile_programs_score_zero_with_named_reasons(fast_sandbox, home_secret, tmp_path):
    outside = Path("/tmp") / f"mlx-grpo-sandbox-escape-{uuid.uuid4().hex}"
    srv, hits, stop = _listener()
    port = srv.getsockname()[1]
    hostile = {
        "cpu_time": "def f(x):\n    while True:\n        pass",
        "timeout": "import time\ndef f(x):\n    time.sleep(60)",
        "process": "import os\ndef f(x):\n    while True:\n        os.fork()",
        "memory": "def f(x):\n    return len(bytearray(10 * 10**9))",
        "forbidden_file": f"def f(x):\n    open({str(outside)!r}, 'w').write('x')\n    return 2 * x",
        "network": f"import socket\ndef f(x):\n    socket.create_connection(('127.0.0.1', {port}))\n"
        "    return 2 * x",
        "exited": "import os\ndef f(x):\n    os._exit(0)",
        "output_limit": "def f(x):\n    print('x' * 10**7)\n    return 2 * x",
    }
    home_reader = f"def f(x):\n    open({str(home_secret)!r}).read()\n    return 2 * x"
    # A program that catches the refusal and answers right is still failed.
    sneaky = f"def f(x):\n    try:\n        open({str(home_secret)!r}).read()\n    except Exception:\n        pass\n    return 2 * x"
    texts = [_fenced(b) for b in [*hostile.values(), home_reader, sneaky]]
    try:
        out = code_reward.reward_batch([_task()], [texts])[0]
    finally:
        stop.set()
        srv.close()
    expected = [*hostile, "forbidden_file", "forbidden_file"]
    for want, comps in zip(expected, out):
        assert comps["failure"] == want, (want, comps)
        assert all(comps[k] == 0.0 for k in ("passes", "partial", "compiles", "format")), comps
    assert not outside.exists()
    assert hits == []
    # A good program in the same batch still passes.
    good = code_reward.reward_batch([_task()], [[_fenced("def f(x):\n    return 2 * x")]])
    assert good[0][0]["passes"] == 1.0 and "failure" not in good[0][0]


def test_os_limits_hold_without_the_audit_hook(tmp_path):
    """Fork bomb, memory, CPU and output are bounded by the kernel, not the hook."""
    sb = Sandbox(FAST, workers=2, audit=False)
    jobs = [
        Job("import os\ndef f():\n    while True:\n        os.fork()", "f", [[]]),
        Job("def f():\n    return len(bytearray(10 * 10**9))", "f", [[]]),
        Job("def f():\n    while True:\n        pass", "f", [[]]),
        Job(
            "import os\ndef f():\n    for _ in range(100):\n        os.write(1, b'x' * 10**5)",
            "f",
            [[]],
        ),
    ]
    reasons = [o.reason for o in sb.run(jobs)]
    if SECCOMP:  # the first fork ends the process (SIGSYS)
        assert reasons[0] == "process"
    else:
        assert reasons[0] in ("process_limit", "crashed", "cpu_time")
    memory = "memory" if sys.platform != "darwin" else reasons[1]  # macOS ignores RLIMIT_AS
    assert reasons[1:] == [memory, "cpu_time", "output_limit"]
    if ROOT_LINUX:  # nothing of the slot uids is left running (zombies wait for init)
        assert [uid_processes(uid) for uid in sb.uids] == [[], []]


@pytest.mark.skipif(
    not (ROOT_LINUX and network_namespace_available()),
    reason="the network namespace and the uid drop need root on Linux (and CAP_SYS_ADMIN)",
)
def test_network_namespace_and_uid_hold_without_the_audit_hook(home_secret):
    srv, hits, stop = _listener()
    port = srv.getsockname()[1]
    sb = Sandbox(FAST, workers=2, audit=False)
    try:
        out = sb.run(
            [
                Job(
                    "import socket\ndef f():\n"
                    f"    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n    return 1",
                    "f",
                    [[]],
                ),
                Job(f"def f():\n    return open({str(home_secret)!r}).read()", "f", [[]]),
                Job("import os\ndef f():\n    return os.getuid()", "f", [[]]),
            ]
        )
    finally:
        stop.set()
        srv.close()
    assert out[0].values == [None] and hits == []  # no route to the host's loopback
    if oct(Path.home().stat().st_mode)[-3:] == "700":
        assert out[1].values == [None]  # the home folder is not readable by the slot uid
    assert int(out[2].values[0]) >= SLOT_UID_BASE
    assert isolation_summary()["network_namespace"] and isolation_summary()["separate_uid"]


def _escapes(marker: Path) -> dict[str, str]:
    """Pure-Python ways around the audit hook's event checks, each writing `marker`."""
    return {
        # _posixsubprocess.fork_exec runs a program without any audit event; with
        # call_setsid it also leaves the process group that the wall-clock kill targets.
        "posixsubprocess": "import _posixsubprocess, os, time\ndef f(x):\n"
        f"    argv = [b'/bin/sh', b'-c', b'echo x > {marker}']\n"
        "    r, w = os.pipe()\n"
        "    _posixsubprocess.fork_exec(argv, [argv[0]], True, (w,), None, None, -1, -1, -1,"
        " -1, -1, -1, r, w, True, False, 0, None, None, None, -1, None, False)\n"
        "    time.sleep(0.5)\n    return 2 * x",
        # sqlite3 opens its database file in C, not through open().
        "sqlite3": f"import sqlite3\ndef f(x):\n    sqlite3.connect({str(marker)!r}).execute("
        "'create table t(x)')\n    return 2 * x",
        # The same extension module loaded under another name (its init function is
        # named after the last component).
        "renamed": "import _imp, importlib.machinery, importlib.util, os, time\ndef f(x):\n"
        "    so = importlib.machinery.PathFinder.find_spec('_posixsubprocess').origin\n"
        "    m = _imp.create_dynamic(importlib.util.spec_from_file_location("
        "'x._posixsubprocess', so))\n"
        f"    argv = [b'/bin/sh', b'-c', b'echo x > {marker}']\n"
        "    r, w = os.pipe()\n"
        "    m.fork_exec(argv, [argv[0]], True, (w,), None, None, -1, -1, -1,"
        " -1, -1, -1, r, w, True, False, 0, None, None, None, -1, None, False)\n"
        "    time.sleep(0.5)\n    return 2 * x",
        # ctypes was imported by the child to enter the network namespace.
        "ctypes": "import sys\ndef f(x):\n    m = sys.modules.get('ctypes') or __import__('ctypes')\n"
        f"    m.CDLL(None).system(b'echo x > {marker}')\n    return 2 * x",
    }


# As root the program also runs as a slot uid that cannot import from a Python in a
# private home; `root=False` runs it as the caller, as on a machine without root.
AS_CALLER = [False, True] if ROOT_LINUX else [False]


@pytest.mark.parametrize("as_caller", AS_CALLER, ids=lambda v: "as_caller" if v else "default")
def test_modules_that_bypass_the_audit_hook_cannot_be_imported(fast_sandbox, as_caller):
    if as_caller:
        fast_sandbox.root = False
    kinds = ("posixsubprocess", "sqlite3", "renamed", "ctypes")
    markers = [Path("/tmp") / f"mlx-grpo-sandbox-escape-{uuid.uuid4().hex}" for _ in kinds]
    programs = [_escapes(m)[k] for m, k in zip(markers, kinds)]
    try:
        out = code_reward.reward_batch([_task()], [[_fenced(p) for p in programs]])[0]
        time.sleep(0.3)  # a shell that escaped would have written by now
        want = ["forbidden_module"] * len(kinds)
        assert [c.get("failure") for c in out] == want, out
        assert all(c["passes"] == c["partial"] == 0.0 for c in out), out
        assert [m.exists() for m in markers] == [False] * len(kinds)
    finally:
        for m in markers:
            m.unlink(missing_ok=True)


def test_a_refusal_is_fatal_and_cannot_be_erased(fast_sandbox, home_secret):
    """Catching the refused open() and wiping the child's records does not help."""
    erase = (
        "import sys\ndef f(x):\n    try:\n"
        f"        open({str(home_secret)!r}).read()\n    except Exception:\n        pass\n"
        "    m = sys.modules['__main__']\n"
        "    for name in ('VIOLATIONS',):\n"
        "        getattr(m, name, []).clear()\n"
        "    return 2 * x"
    )
    replace_exit = (
        "import os\ndef f(x):\n    os._exit = lambda *a: None\n    try:\n"
        f"        open({str(home_secret)!r}).read()\n    except BaseException:\n        pass\n"
        "    return 2 * x"
    )
    sb = fast_sandbox
    out = sb.run([Job(erase, "f", [[3], [4]]), Job(replace_exit, "f", [[3], [4]])])
    assert [(o.reason, o.values) for o in out] == [("forbidden_file", [None, None])] * 2, out
    assert str(home_secret) in out[0].detail


@pytest.mark.parametrize("as_caller", AS_CALLER, ids=lambda v: "as_caller" if v else "default")
def test_the_hook_ignores_what_the_program_rebinds(fast_sandbox, as_caller):
    """Rebinding the child's globals, builtins or os.path, os.mkfifo (unaudited), or a
    path object that names another file the second time it is asked, does not make a
    file outside."""
    if as_caller:
        fast_sandbox.root = False
    markers = [Path("/tmp") / f"mlx-grpo-sandbox-escape-{uuid.uuid4().hex}" for _ in range(6)]
    inside = "__import__('os').getcwd() + '/x'"
    rebinds = [
        "sys.modules['__main__'].DENIED_MODULES = frozenset()",
        "sys.modules['__main__'].VIOLATION_RC.update(forbidden_file=0)",
        f"os.path.realpath = lambda p, *a, **k: {inside}",
        "posixpath._joinrealpath = lambda *a: (__import__('os').getcwd(), True)",
        "builtins.any = lambda it: True",
        "os.fsdecode = lambda p: 'x'",
    ]
    head = "import builtins, os, posixpath, sys\n"
    programs = [
        f"{head}def f(x):\n    {r}\n    open({str(m)!r}, 'w').write('x')\n    return 2 * x"
        for r, m in zip(rebinds, markers)
    ]
    fifo = Path("/tmp") / f"mlx-grpo-sandbox-escape-{uuid.uuid4().hex}"
    markers.append(fifo)  # os.mkfifo raises no audit event
    programs.append(f"import os\ndef f(x):\n    os.mkfifo({str(fifo)!r})\n    return 2 * x")
    switch = Path("/tmp") / f"mlx-grpo-sandbox-escape-{uuid.uuid4().hex}"
    markers.append(switch)
    programs.append(  # outside when os.mkdir asks (first), inside when the hook does
        f"import os\nclass P:\n    n = 0\n    def __fspath__(self):\n        P.n += 1\n"
        f"        return {str(switch)!r} if P.n == 1 else {inside}\n"
        "def f(x):\n    os.mkdir(P())\n    return 2 * x"
    )
    try:
        out = fast_sandbox.run([Job(p, "f", [[3]]) for p in programs])
        assert [o.reason for o in out] == ["forbidden_file"] * len(programs), out
        assert [m.exists() for m in markers] == [False] * len(markers)
    finally:
        for m in markers:
            m.rmdir() if m.is_dir() else m.unlink(missing_ok=True)


def test_a_report_written_by_the_program_cannot_crash_or_fool_the_parent(fast_sandbox):
    """The program can write to the results descriptor (it is fd 3) and exit: whatever
    it writes, the parent returns an Outcome, never takes a forged reason or extra
    values, and the job still scores by the values alone."""
    forged = [
        b"{}",
        b"[1, 2]",
        b'{"calls": 7}',
        b'{"calls": [{"ok": true}]}',
        b'{"calls": [1]}',
        b'{"calls": [], "reason": "wrong_answer", "error": ""}',
        b'{"calls": [{"ok": true, "repr": "6"}, {"ok": true, "repr": "8"}, {"ok": true, "repr": "1"}]}',
        # a repr longer than the child cuts one to: the parent would parse it unbounded
        b'{"calls": [{"ok": true, "repr": "[' + b"[]," * FAST.repr_chars + b'6]"}]}',
    ]
    jobs = [
        Job(f"import os\ndef f(x):\n    os.write(3, {d!r})\n    os._exit(0)", "f", [[3], [4]])
        for d in forged
    ]
    out = fast_sandbox.run(jobs)
    assert [(o.reason, o.values) for o in out] == [("bad_report", [])] * len(forged), out
    # A report, then the wall clock or the CPU limit: that failure, whatever the report
    # said (else an escape tried after a right report would cost nothing, and show nowhere).
    report = b'{"calls": [{"ok": true, "repr": "6"}, {"ok": true, "repr": "8"}]}'
    then = {"timeout": "time.sleep(60)", "cpu_time": "while True:\n        pass"}
    late = "import os, time\ndef f(x):\n    os.write(3, {!r})\n    {}"
    out = fast_sandbox.run([Job(late.format(report, t), "f", [[3], [4]]) for t in then.values()])
    assert [(o.reason, o.values) for o in out] == [(r, []) for r in then], out


def test_a_value_whose_repr_is_no_literal_fails_only_its_own_completion(fast_sandbox):
    """A returned object's repr is the program's to choose; one that literal_eval cannot
    read without raising (an unhashable key, an overflow) is a wrong answer, and the
    step's other completions score as usual."""
    poison = (
        "class V:\n    def __init__(self, r):\n        self.r = r\n"
        "    def __repr__(self):\n        return self.r\n"
        "def f(x):\n    return V({!r})"
    )
    reprs = ["{[]: 0}", "1" * 400 + "+0j", "{{1}: 2}"]
    good = _fenced("def f(x):\n    return 2 * x")
    texts = [_fenced(poison.format(r)) for r in reprs] + [good]
    out = code_reward.reward_batch([_task()], [texts])[0]
    assert [c.get("failure") for c in out] == ["wrong_answer"] * len(reprs) + [None], out
    assert [c["passes"] for c in out] == [0.0] * len(reprs) + [1.0], out


def test_a_poisoned_report_fails_only_its_own_completion(fast_sandbox):
    """Nesting deeper than the JSON parser's recursion limit (a RecursionError, not a
    ValueError) is that program's `bad_report`; the rest of the step scores as usual."""
    poison = _fenced("import os\ndef f(x):\n    os.write(3, b'[' * 100000)\n    os._exit(0)")
    good = _fenced("def f(x):\n    return 2 * x")
    out = code_reward.reward_batch([_task()], [[poison, good, poison]])[0]
    assert [c.get("failure") for c in out] == ["bad_report", None, "bad_report"], out
    assert out[0]["passes"] == out[0]["compiles"] == out[0]["format"] == 0.0
    assert out[1] == {"passes": 1.0, "partial": 1.0, "compiles": 1.0, "format": 1.0}


@pytest.mark.skipif(not ROOT_LINUX, reason="slot uids are used as root on Linux only")
def test_a_program_cannot_plant_the_slot_locks():
    """At the weak level the host's files are visible and the hook can be switched off
    (here: not installed); the slot locks are where a slot uid cannot create one, so a
    program cannot hold slots that later Sandboxes would then skip."""
    plant = (
        "def f(path):\n    try:\n        open(path, 'w').close()\n        return 'planted'\n"
        "    except OSError as e:\n        return type(e).__name__"
    )
    last = sandbox_module.SLOT_LOCK.format(uid=SLOT_UID_BASE + sandbox_module.SLOT_UID_COUNT - 1)
    # Nor System V IPC objects in the host's namespace, which would outlive the job,
    # holding memory that no limit counts: the weak level has an IPC namespace of its own.
    ipc = "import os\ndef f():\n    return os.readlink('/proc/self/ns/ipc')"
    with Sandbox(FAST, workers=1, audit=False, isolation="weak") as sb:
        out, ns = sb.run([Job(plant, "f", [[last]]), Job(ipc, "f", [[]])])
    assert out.values == ["'PermissionError'"], out
    assert not Path(last).exists()
    if sb.netns:
        assert ns.values != [repr(os.readlink("/proc/self/ns/ipc"))] and ns.reason is None, ns


@pytest.mark.skipif(not ROOT_LINUX, reason="slot uids are used as root on Linux only")
def test_two_sandboxes_never_share_a_slot_uid():
    """Two trainers on one machine (two ranks): one's kill of its slot uid must not hit
    the other's program, so their uids are disjoint; close() gives them back."""
    job = Job("import os\ndef f():\n    return os.getuid()", "f", [[]])
    a, b = Sandbox(FAST, workers=2), Sandbox(FAST, workers=2)
    try:
        got_a = {int(o.values[0]) for o in a.run([job] * 4)}
        got_b = {int(o.values[0]) for o in b.run([job] * 4)}
        assert not got_a & got_b
        assert got_a <= set(a.uids) and got_b <= set(b.uids) and not set(a.uids) & set(b.uids)
        freed = a.uids
        a.close()
        with Sandbox(FAST, workers=2) as c:
            assert set(freed) <= set(c.uids) | set(range(SLOT_UID_BASE, min(freed)))
    finally:
        a.close()
        b.close()


def test_ordinary_failures_keep_earned_components(fast_sandbox):
    texts = [
        "def f(x):\n    return x + x\nThat doubles x.",  # bare code: passes, format 0
        _fenced("def f(x):\n    return x"),  # wrong answer
        _fenced("def f(x):\n    return 12 // (x - 3)"),  # raises on one test
        _fenced("def f(x) return 1"),  # syntax error
        "I cannot write code.",
        _fenced("def g(x):\n    return 2 * x"),  # wrong name
    ]
    out = code_reward.reward_batch([_task()], [texts])[0]
    assert out[0] == {"passes": 1.0, "partial": 1.0, "compiles": 1.0, "format": 0.0}
    assert out[1]["failure"] == "wrong_answer" and out[1]["compiles"] == 1.0
    assert out[1]["partial"] == 0.0 and out[1]["format"] == 1.0
    assert out[2]["failure"] == "runtime_error" and out[2]["partial"] == 0.0
    assert out[3]["failure"] == "syntax" and out[3]["compiles"] == 0.0
    assert out[4]["failure"] == "no_code"
    assert out[5]["failure"] == "no_function" and out[5]["compiles"] == 0.0


def test_a_constant_answer_earns_no_partial_credit(fast_sandbox):
    task = _task("even", [([n], n % 2 == 0) for n in (1, 2, 3, 4, 6, 7)])
    const, half = code_reward.reward_batch(
        [task],
        [
            [
                _fenced("def even(n):\n    return True"),
                _fenced("def even(n):\n    return n < 5 and n % 2 == 0"),
            ]
        ],
    )[0]
    assert const["partial"] == 0.0 and const["compiles"] == 1.0  # passes 3 of 6: chance
    # 5 of 6 against a constant's 3 of 6: (5/6 - 1/2) / (1/2) = 2/3.
    assert half["partial"] == pytest.approx(2 / 3) and half["passes"] == 0.0


def test_violation_statuses_agree_between_parent_and_child():
    from mlx_grpo import _sandbox_child as child
    from mlx_grpo.sandbox import SANDBOX_REASONS, SECCOMP_MACHINES, VIOLATION_RC

    assert {rc: reason for reason, rc in child.VIOLATION_RC.items()} == VIOLATION_RC
    assert set(VIOLATION_RC.values()) <= set(SANDBOX_REASONS)
    assert set(SECCOMP_MACHINES) == set(child._SYSCALLS)
    assert sandbox_module.UNSHARE == child.UNSHARE  # what is probed is what the child does


# ---------------------------------------------------------------- strong isolation

STRONG = sys.platform.startswith("linux") and sandbox_module._bwrap() is not None
needs_bwrap = pytest.mark.skipif(not STRONG, reason="strong isolation on Linux needs bubblewrap")


@pytest.fixture
def bare_sandbox():
    """Strong isolation alone: no audit hook, so every refusal below is the kernel's."""
    with Sandbox(FAST, workers=2, audit=False) as sb:
        yield sb


@needs_bwrap
def test_the_program_sees_only_the_python_runtime(bare_sandbox, home_secret):
    """Nothing of the project (the code recipe's reference solutions included), the home
    folder or the host's /proc exists inside; what does is the runtime."""
    families = Path(code_reward.__file__).resolve().parents[1] / "recipes" / "code" / "families.py"
    probe = (
        "import os\ndef f(path):\n    try:\n        return open(path).read()[:10]\n"
        "    except OSError as e:\n        return type(e).__name__"
    )
    walk = (  # every path not on the way to, or inside, an allowed one
        "import os\ndef f(allowed):\n    out = []\n"
        "    for root, dirs, files in os.walk('/'):\n"
        "        for p in [os.path.join(root, n) for n in dirs + files]:\n"
        "            if not any(p == a or p.startswith(a + '/') or a.startswith(p + '/')"
        " for a in allowed):\n"
        "                out.append(p)\n"
        "    return out"
    )
    exe, binds, hidden = sandbox_module._runtime()
    allowed = [*binds, "/dev", "/tmp", "/work", "/sandbox/child.py"]
    reads = [str(families), str(home_secret), "/proc/self/status", "/etc/passwd"]
    # The answer looked up relative to a descriptor for "/" (what the audit hook cannot
    # follow): there is nothing to find.
    at_root = (
        "import os\ndef f(path):\n    root = os.open('/', os.O_RDONLY)\n    try:\n"
        "        fd = os.open(path.lstrip('/'), os.O_RDONLY, dir_fd=root)\n"
        "        return os.read(fd, 10)\n"
        "    except OSError as e:\n        return type(e).__name__"
    )
    out = bare_sandbox.run(
        [
            Job(probe, "f", [[p] for p in reads]),
            Job(walk, "f", [[allowed]]),
            Job(at_root, "f", [[str(families)]]),
        ]
    )
    assert out[0].values == ["'FileNotFoundError'"] * len(reads), out[0]
    assert out[1].values == ["[]"], out[1]
    assert out[2].values == ["'FileNotFoundError'"], out[2]
    seen = (  # and nothing of a site-packages or a venv among what is allowed
        "import os\ndef f(d):\n    return [os.path.join(r, n) for r, ds, fs in os.walk(d)"
        " for n in ds + fs if 'site-packages' in n or '.venv' in n]"
    )
    dirs = sorted({os.path.dirname(exe), *[b for b in binds if os.path.isdir(b)]})
    found = bare_sandbox.run([Job(seen, "f", [[d] for d in dirs])])[0].values
    assert found == ["[]"] * len(dirs) or all(
        eval(v) == [h for h in hidden if h.startswith(d + "/")] for v, d in zip(found, dirs)
    ), found


@needs_bwrap
def test_scratch_space_is_private_bounded_and_gone_after_the_job(bare_sandbox):
    write = (
        "import os\ndef f():\n"
        "    for d in ('/tmp', '/dev/shm', '.'):\n"
        "        open(os.path.join(d, 'left-behind'), 'w').write('x')\n"
        "    return sorted(os.listdir('/tmp') + os.listdir('/dev/shm'))"
    )
    look = "import os\ndef f():\n    return sorted(os.listdir('/tmp') + os.listdir('/dev/shm'))"
    fill = (  # more than the tmpfs holds, in files each under the output limit
        "def f():\n    for i in range(10**4):\n"
        "        open('/dev/shm/f%d' % i, 'wb').write(b'x' * 60000)"
    )
    out = bare_sandbox.run([Job(write, "f", [[]])])
    assert out[0].values == ["['left-behind', 'left-behind']"], out
    later = bare_sandbox.run([Job(look, "f", [[]]), Job(fill, "f", [[]])])
    assert later[0].values == ["[]"]  # a fresh /tmp and /dev/shm for every job
    assert later[1].values == [None] and later[1].reason is None  # ENOSPC: an error, no more
    assert not [n for n in os.listdir("/dev/shm") + os.listdir("/tmp") if "left-behind" in n]


@needs_bwrap
@pytest.mark.skipif(not SECCOMP, reason="no seccomp filter for this machine")
def test_kernel_state_the_namespaces_do_not_separate_is_refused(bare_sandbox):
    """With ctypes (no audit hook here): the kernel keyrings (the trainer's session
    keyring; a slot uid's user keyring, which would carry data to later jobs) and new
    IPC objects answer EPERM, and vsock and netlink sockets, which the network namespace does not confine,
    answer EAFNOSUPPORT; unix and IP sockets are still made (the namespace holds them)."""
    numbers = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}  # asm/unistd.h
    add_key, request_key, keyctl = numbers[os.uname().machine]
    keyrings = (
        "import ctypes\ndef f(call, args):\n"
        "    libc = ctypes.CDLL(None, use_errno=True)\n"
        "    args = [ctypes.c_char_p(a.encode()) if isinstance(a, str) else ctypes.c_long(a)"
        " for a in args]\n"
        "    got = libc.syscall(call, *args)\n"
        "    return got if got >= 0 else ctypes.get_errno()"
    )
    user, session = -4, -3  # KEY_SPEC_USER_KEYRING, KEY_SPEC_SESSION_KEYRING
    # and System V and POSIX IPC objects (memory no limit counts; at the weak level in
    # the host's IPC namespace unless it has one of its own)
    shmget, semget, msgget, mq_open = {
        "x86_64": (29, 64, 68, 240),
        "aarch64": (194, 190, 186, 180),
    }[os.uname().machine]
    create = 0o1000 | 0o666  # IPC_CREAT, read and write for all; key IPC_PRIVATE
    calls = [
        [keyctl, [0, session, 1]],  # KEYCTL_GET_KEYRING_ID, creating it
        [keyctl, [0, user, 1]],
        [add_key, ["user", "left-behind", "x", 1, user]],
        [request_key, ["user", "left-behind", 0, 0]],
        [shmget, [0, 2**20, create]],
        [semget, [0, 1, create]],
        [msgget, [0, create]],
        [mq_open, ["left-behind", 0o100 | 2, 0o666, 0]],  # O_CREAT | O_RDWR
        [438, [-1, 0, 0]],  # pidfd_getfd (EBADF where it is allowed)
    ]
    sockets = (
        "import socket\ndef f(family, kind):\n    try:\n"
        "        socket.socket(family, kind).close()\n        return 'made'\n"
        "    except OSError as e:\n        return e.errno"
    )
    families = [
        [socket.AF_UNIX, socket.SOCK_STREAM],
        [socket.AF_INET, socket.SOCK_DGRAM],
        [socket.AF_INET6, socket.SOCK_STREAM],
        [40, socket.SOCK_STREAM],  # AF_VSOCK
        [16, socket.SOCK_RAW],  # AF_NETLINK (route)
    ]
    out = bare_sandbox.run([Job(keyrings, "f", calls), Job(sockets, "f", families)])
    assert out[0].values == [str(errno.EPERM)] * len(calls), out[0]
    assert out[1].values == ["'made'"] * 3 + [str(errno.EAFNOSUPPORT)] * 2, out[1]


@needs_bwrap
@pytest.mark.skipif(not SECCOMP, reason="no seccomp filter for this machine")
def test_a_program_cannot_lock_the_hosts_runtime_files(bare_sandbox):
    """The runtime is the host's own files, bind-mounted: a lock taken inside would hold
    the host's (`flock -n` fails) for the program's wall clock. flock, fcntl's record
    locks and leases answer EPERM; the host locks the files all along."""
    import fcntl

    hold = (
        "import fcntl, os, time\ndef f(path):\n    fd = os.open(path, os.O_RDONLY)\n"
        "    got = []\n"
        "    for lock in (lambda: fcntl.flock(fd, fcntl.LOCK_EX),\n"
        "                 lambda: fcntl.lockf(fd, fcntl.LOCK_SH),\n"
        "                 lambda: fcntl.fcntl(fd, 1024, fcntl.F_RDLCK)):  # F_SETLEASE\n"
        "        try:\n            lock()\n            got.append('locked')\n"
        "        except OSError as e:\n            got.append(e.errno)\n"
        "    time.sleep(1.5)  # held (if taken) while the host tries\n"
        "    return got"
    )
    paths = [os.path.realpath(os.__file__)]
    paths += [p for p in ("/etc/ld.so.cache",) if os.path.exists(p)]
    out: list = []
    worker = threading.Thread(
        target=lambda: out.extend(bare_sandbox.run([Job(hold, "f", [[p] for p in paths])]))
    )
    worker.start()
    refused = set()
    while worker.is_alive():  # the host's `flock -n` on each, for the program's life
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                refused.add(p)
            finally:
                os.close(fd)
        time.sleep(0.02)
    worker.join()
    assert not refused
    assert out[0].values == [str([errno.EPERM] * 3)] * len(paths), out[0]


@needs_bwrap
def test_the_program_sees_its_own_hostname_and_writes_only_its_scratch(bare_sandbox):
    """A fixed hostname (not the host's); the root and /dev are read-only (without root
    the program owns those tmpfs mounts); as root each scratch tmpfs holds at most
    Limits.scratch_inodes files (an inode's kernel memory is outside its size)."""
    names = "import os, socket\ndef f():\n    return [socket.gethostname(), os.uname().nodename]"
    write = (
        "def f(path):\n    try:\n        open(path, 'w').close()\n        return 'written'\n"
        "    except OSError as e:\n        return e.errno"
    )
    many = (
        "import os\ndef f(d):\n    n = 0\n    try:\n        while n < 3000:\n"
        "            open(os.path.join(d, 'f%d' % n), 'w').close()\n            n += 1\n"
        "    except OSError as e:\n        return [n, e.errno]\n    return [n, 0]"
    )
    spots = [["/x"], ["/dev/x"], ["/work/x"], ["/tmp/x"], ["/dev/shm/x"], ["/dev/null"]]
    out = bare_sandbox.run(
        [Job(names, "f", [[]]), Job(write, "f", spots), Job(many, "f", [["/tmp"], ["."]])]
    )
    assert out[0].values == [str(["sandbox"] * 2)] and socket.gethostname() != "sandbox"
    assert out[1].values[2:] == ["'written'"] * 4, out[1]
    assert set(out[1].values[:2]) <= {str(errno.EROFS), str(errno.EACCES)}, out[1]
    if ROOT_LINUX:
        made = [eval(v) for v in out[2].values]
        limit = FAST.scratch_inodes
        assert all(limit - 4 <= n < limit and e == errno.ENOSPC for n, e in made), made
    else:  # a nested user namespace owns no mount: no bound (docs/sandbox.md)
        assert all(eval(v)[0] == 3000 for v in out[2].values), out[2]


@needs_bwrap
def test_a_host_unix_socket_cannot_be_reached(bare_sandbox, tmp_path):
    path = tmp_path / "host.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen(1)
    try:
        prog = (
            "import socket\ndef f(p):\n    s = socket.socket(socket.AF_UNIX)\n"
            "    try:\n        s.connect(p)\n        return 'connected'\n"
            "    except OSError as e:\n        return type(e).__name__"
        )
        out = bare_sandbox.run([Job(prog, "f", [[str(path)], ["\0abstract-mlx-grpo"]])])
    finally:
        srv.close()
    assert out[0].values == ["'FileNotFoundError'", "'ConnectionRefusedError'"], out


@needs_bwrap
def test_the_hook_switched_off_from_inside_changes_nothing(bare_sandbox, fast_sandbox):
    """The closure-cell trick that disarms the audit hook, then a shell: the kernel ends
    the program (seccomp) and it scores 0, hook or no hook."""
    disarm = (
        "import os\n"
        "lam = os.mkfifo\n"
        "deny = dict(zip(lam.__code__.co_freevars, lam.__closure__))['deny'].cell_contents\n"
        "cells = dict(zip(deny.__code__.co_freevars, deny.__closure__))\n"
        "cells['_exit'].cell_contents = lambda *a: None\n"
        "cells['_write'].cell_contents = lambda *a: 0\n"
        "def f(x):\n    os.system('echo escaped > /tmp/escaped')\n    return 2 * x"
    )
    out = code_reward.reward_batch([_task()], [[_fenced(disarm)]])[0][0]
    want = "process" if SECCOMP else "process_limit"
    assert out["failure"] == want and out["passes"] == out["compiles"] == 0.0, out
    plain = "import os\ndef f(x):\n    os.system('true')\n    return 2 * x"
    assert bare_sandbox.run([Job(plain, "f", [[3]])])[0].reason == want


@needs_bwrap
def test_threads_and_forked_memory_count_against_the_job(bare_sandbox):
    """No second process or thread: a thread bomb is `process_limit`, and a forked
    memory hog never gets a second address space."""
    threads = (
        "import threading, time\ndef f():\n"
        "    while True:\n        threading.Thread(target=time.sleep, args=(5,)).start()"
    )
    hog = (
        "import os\ndef f():\n    for _ in range(8):\n        if os.fork() == 0:\n"
        "            x = bytearray(200 * 2**20)\n            while True:\n                pass\n"
        "    return 1"
    )
    out = bare_sandbox.run([Job(threads, "f", [[]]), Job(hog, "f", [[]])])
    assert out[0].reason == "process_limit", out[0]
    assert out[1].reason == ("process" if SECCOMP else "process_limit"), out[1]


def _sandboxed_pids(under: int | None = None) -> list[int]:
    """Pids of sandboxed programs (the child interpreter, not bubblewrap), only those
    descended from `under` when given: other test runs on the machine have theirs."""
    out = []
    for p in Path("/proc").iterdir():
        try:
            cmd = (p / "cmdline").read_bytes() if p.name.isdigit() else b""
            program = cmd.split(b"\0")[-2:-1]  # the last argument: the child script
            if program in ([b"/sandbox/child.py"], [str(CHILD).encode()]):
                if under is None or under in _ancestors(int(p.name)):
                    out.append(int(p.name))
        except OSError:
            continue
    return out


def _zombie(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        try:
            pid = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
        chain.append(pid)
    return chain


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("isolation", ["strong", "weak"])
def test_no_program_outlives_a_killed_trainer(isolation):
    """kill -9 of the process that runs the sandbox (a program sleeping inside, well
    within its wall clock) leaves no sandboxed process behind."""
    if isolation == "strong" and not STRONG:
        pytest.skip("strong isolation on Linux needs bubblewrap")
    import signal
    import subprocess

    script = (
        "from mlx_grpo.sandbox import Job, Limits, Sandbox\n"
        f"sb = Sandbox(Limits(wall_s=120, cpu_s=60), workers=1, isolation={isolation!r})\n"
        "sb.run([Job('import time\\ndef f():\\n    time.sleep(100)', 'f', [[]])])\n"
    )
    trainer = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300  # start-up: imports, the runtime's ldd, a probe
        while not (mine := set(_sandboxed_pids(under=trainer.pid))):
            assert trainer.poll() is None, trainer.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the program never started"
            time.sleep(0.05)
        time.sleep(0.5)  # let it settle into its sleep: the kill is not meant to race its start
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()

    def alive() -> set[int]:
        return {pid for pid in mine if Path(f"/proc/{pid}").exists() and not _zombie(pid)}

    for _ in range(100):
        if not alive():
            break
        time.sleep(0.05)
    assert not alive()


def test_weak_isolation_must_be_asked_for(monkeypatch, capsys):
    """Without bubblewrap the code recipe refuses in one line that says what to install
    and how to opt in; opting in runs, with one warning line."""
    from mlx_grpo.config import ConfigError
    from recipes.code.tasks import make_tasks

    monkeypatch.setattr(sandbox_module, "_bwrap", lambda: None)
    monkeypatch.setattr(sandbox_module.sys, "platform", "linux")
    sandbox_module.strong_isolation.cache_clear()
    monkeypatch.setattr(code_reward, "_SANDBOX", None)
    sandbox_module.warn_weak.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable) as e:
            Sandbox(FAST, workers=1)
        assert "bubblewrap" in str(e.value) and "\n" not in str(e.value)
        with pytest.raises(ConfigError) as e:
            make_tasks("train", 2, 0)
        assert "apt-get install bubblewrap" in str(e.value) and "isolation=weak" in str(e.value)
        tasks = make_tasks("train", 2, 0, isolation="weak")
        assert code_reward.sandbox().isolation == "weak"
        assert capsys.readouterr().err.count("weak isolation") == 1
        good = code_reward.reward_batch(tasks[:1], [["```python\ndef nope(): pass\n```"]])
        assert good[0][0]["failure"] == "no_function"
    finally:
        sandbox_module.strong_isolation.cache_clear()
        if code_reward._SANDBOX is not None:
            code_reward._SANDBOX.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_kill_from_outside_is_not_blamed_on_the_cpu_limit():
    """SIGKILL comes from RLIMIT_CPU's hard limit, to a program that ignored SIGXCPU, or
    from outside the sandbox (the OOM killer; here this test). Under seccomp, a kill
    sooner than the hard limit's CPU seconds could have run out is the latter."""
    spinner = (
        "import signal\ndef f():\n    signal.signal(signal.SIGXCPU, signal.SIG_IGN)\n"
        "    while True:\n        pass"
    )
    with Sandbox(Limits(wall_s=20.0, cpu_s=1), workers=1) as sb:  # 2 s of CPU, loaded or not
        out = sb.run([Job(spinner, "f", [[]])])[0]
    assert out.reason == "cpu_time" and "SIGKILL" in out.detail, out
    if not SECCOMP:
        return  # threads can outrun the clock: a kill is not told apart

    sleeper = "import time\ndef f():\n    time.sleep(60)"
    killed: list[int] = []

    def kill_the_interpreter():  # as the OOM killer would: the process that holds memory
        deadline = time.monotonic() + 30
        while not killed and time.monotonic() < deadline:
            pids = _sandboxed_pids(under=os.getpid())  # bubblewrap's processes match too
            inner = [p for p in pids if not set(pids) - {p} - set(_ancestors(p))]
            for pid in inner[:1]:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)

    killer = threading.Thread(target=kill_the_interpreter)
    killer.start()
    with Sandbox(Limits(wall_s=60.0, cpu_s=10), workers=1) as sb:  # 11 s before a hard-limit kill
        out = sb.run([Job(sleeper, "f", [[]])])[0]
    killer.join()
    assert killed and out.reason == "killed" and "outside" in out.detail, (killed, out)
