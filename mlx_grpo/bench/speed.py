"""`python -m mlx_grpo.bench` (`make bench`): mlx-grpo against TRL and mlx-lm-lora on
one fixed GRPO work unit, side by side in one run, and against the machine's floor.

    python -m mlx_grpo.bench                 # all three systems, floor, scaling (~15 min)
    python -m mlx_grpo.bench --smoke         # one step of mlx-grpo only (+ its profile)
    python -m mlx_grpo.bench --systems mlx-grpo,trl --steps 3 --no-scaling

The work unit (mlx_grpo/bench/work_unit.py): SmolLM2-135M-Instruct in float32
(the embedded model, dequantized; exported once to an HF folder for the peers), 2
prompts x 8 completions, 64 new tokens, temperature 0.8, top-p 0.95, top-k 20, LoRA r8
scale 10 on every linear layer, beta 0.04, lr 1e-5, loss `grpo`, one update per rollout,
16 seeded two-digit additions scored 1 when the right number appears.

Each system runs in its own process (the peers in their own virtual environments,
created on first use: .venv-bench-trl, .venv-bench-mlxlmlora) and prints its per-step
times. mlx-lm-lora runs on the BLAS that mlx-grpo chose, without mlx-grpo's skinny-GEMM
front (mlx_grpo/skinny.c), which is mlx-grpo's and not the BLAS's; `--peer-front` gives
it the front too. Reported per system: median step time without the first step,
rollout time and tokens/s, the rest of the step ("update": reference and policy passes,
optimizer, scoring), the time from process start to the end of the first step, and peak
RSS.
Then mlx-grpo's step against the floor (GEMM rate and memory bandwidth measured in
the same run; mlx_grpo/bench/floor.py), split by phase and op class, and
mlx-grpo's scaling in G and new tokens. Results go to bench/results/<date>.json
(+ .md) and the terminal. The machines are noisy: read the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mlx_grpo._paths import cache_root
from mlx_grpo.bench.work_unit import RESULT_TAG, STEP_TAG

# The folder holding the mlx_grpo package (a checkout): the peers' runners import it from
# there, and their virtual environments live there.
ROOT = Path(__file__).resolve().parents[2]
LINUX = sys.platform == "linux"
# Pinned so that a re-run measures the same peers; the torch pin is the CPU build on
# Linux (a plain `torch` from PyPI is the multi-GB CUDA build there).
PEERS = {
    "trl": {
        "venv": ".venv-bench-trl",
        "first": ["torch==2.13.0+cpu" if LINUX else "torch==2.13.0"],
        "reqs": ["trl==1.16.0", "peft==0.21.2", "transformers==5.23.0", "datasets"],
        "runner": "mlx_grpo.bench.run_trl",
    },
    "mlx-lm-lora": {
        "venv": ".venv-bench-mlxlmlora",
        "first": [],
        "reqs": ["mlx-lm-lora==5.10.2", "mlx[cpu]==0.32.4" if LINUX else "mlx==0.32.4"],
        "runner": "mlx_grpo.bench.run_mlx_lm_lora",
    },
}
SYSTEMS = ("mlx-grpo", "trl", "mlx-lm-lora")
SCALING = [(4, 64), (16, 64), (8, 128), (8, 256)]  # (G, new tokens); (8, 64) is the main run
BASE_DIR = cache_root() / "bench" / "smollm2-base-f32"


class BenchError(RuntimeError):
    """A system could not be set up or run; the message is one line."""


def say(msg: str) -> None:
    print(f"bench: {msg}", flush=True)


def ensure_venv(name: str) -> Path:
    """The peer's virtual environment, created (or updated) when its pins change."""
    spec = PEERS[name]
    venv = ROOT / spec["venv"]
    py = venv / "bin" / "python"
    key = hashlib.sha256(json.dumps([spec["first"], spec["reqs"]]).encode()).hexdigest()[:12]
    stamp = venv / f".installed-{key}"
    if stamp.exists():
        return py
    say(f"creating {venv.name} ({', '.join(spec['first'] + spec['reqs'])}); once, takes minutes")
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    for group in (spec["first"], spec["reqs"]):  # torch first and alone: pip keeps its build
        if group:
            r = subprocess.run(
                [str(py), "-m", "pip", "install", "-q", *group], capture_output=True, text=True
            )
            if r.returncode:
                last = (r.stderr.strip().splitlines() or ["pip failed"])[-1]
                raise BenchError(f"{venv.name}: pip install {' '.join(group)}: {last}")
    for old in venv.glob(".installed-*"):
        old.unlink()
    stamp.touch()
    return py


def ensure_base_export() -> Path:
    """The embedded model, dequantized to float32, as an HF folder (the peers' weights)."""
    if (BASE_DIR / "model.safetensors").exists():
        return BASE_DIR
    say(f"exporting the embedded model to {BASE_DIR}")
    BASE_DIR.parent.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_grpo",
            "export",
            "default",
            "--format",
            "base",
            "--dtype",
            "float32",
            "--out",
            str(BASE_DIR),
            "--force",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(),
    )
    if r.returncode:
        raise BenchError(f"export of the base model failed: {r.stderr.strip()[-300:]}")
    return BASE_DIR


def _env(front: bool = True) -> dict:
    from mlx_grpo.device import blas_library

    env = dict(os.environ)
    if not front:
        env["MLX_GRPO_SKINNY"] = "0"  # the BLAS alone, as MLX would call it
    # Every MLX system runs on the BLAS this process chose (peers' venvs hold other wheels)
    if (blas := blas_library()) is not None:
        env["MLX_GRPO_OPENBLAS"] = blas
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_runner(
    python: str, module: str, args: list[str], timeout: float, log: Path, front: bool = True
) -> dict:
    """Run one system's runner in a fresh process; its tagged JSON line is the result.
    `front`: MLX's products may go through mlx-grpo's skinny-GEMM front (where it is in
    use), else straight to the BLAS."""
    t0 = time.time()
    cmd = [str(python), "-m", module, "--t0", repr(t0), *args]
    log.parent.mkdir(parents=True, exist_ok=True)

    def keep_log(out, err) -> None:
        log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{out}\n--- stderr\n{err}")

    try:
        r = subprocess.run(
            cmd, capture_output=True, text=True, cwd=ROOT, env=_env(front), timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        # What the runner printed before it was stopped: its finished steps' records.
        out, err = (_text(x) for x in (e.stdout, e.stderr))
        keep_log(out, err)
        done = [json.loads(x[len(STEP_TAG) :]) for x in err.splitlines() if x.startswith(STEP_TAG)]
        times = ", ".join(f"{d['step_s']:.1f}" for d in done)
        raise BenchError(
            f"{module} ran past {timeout:.0f} s after {len(done)} finished step(s)"
            + (f" ({times} s)" if done else "")
            + f" (log: {log})"
        ) from None
    keep_log(r.stdout, r.stderr)
    for line in r.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            out = json.loads(line[len(RESULT_TAG) :])
            out["wall_s"] = time.time() - t0
            return out
    tail = (r.stderr.strip() or r.stdout.strip()).splitlines()[-1:] or ["no output"]
    raise BenchError(f"{module} exited {r.returncode}: {tail[0][:200]} (log: {log})")


def _text(x: bytes | str | None) -> str:
    """A TimeoutExpired's captured output: bytes whatever `text=` said, or None."""
    if x is None:
        return ""
    return x.decode(errors="replace") if isinstance(x, bytes) else x


def summarize(res: dict) -> dict:
    """Medians over the steps after the first (all steps when there is only one)."""
    steps = res["steps"][1:] or res["steps"]

    def med(f):
        return statistics.median(f(s) for s in steps)

    return {
        "step_s": med(lambda s: s["step_s"]),
        "rollout_s": med(lambda s: s["rollout_s"]),
        "update_s": med(lambda s: s["update_s"]),
        "rollout_tok_s": med(lambda s: s["gen_tokens"] / max(s["rollout_s"], 1e-9)),
        "gen_tokens": med(lambda s: s["gen_tokens"]),
        "reward_mean": statistics.mean(s["reward_mean"] or 0.0 for s in res["steps"]),
        "time_to_first_step_s": res["time_to_first_step_s"],
        "peak_rss_gb": res["peak_rss_mb"] / 1024,
        "steps_measured": len(steps),
        "trainable_params": res.get("trainable_params"),
    }


def floor_report(res: dict) -> dict:
    """mlx-grpo's step as a multiple of the floor (per step, then the median), and the
    profiled step's phases and op classes against their floors."""
    from mlx_grpo.bench.floor import floor_seconds

    prof = res["profile"]
    rates = prof["rates"]
    steps = res["steps"][1:] or res["steps"]
    multiples = [s["step_s"] / floor_seconds(s["work"], rates)["total"] for s in steps]
    floors = floor_seconds(prof["work"], rates)
    phases = prof["phases_s"]
    rows = {}
    for phase, secs in phases.items():
        rows[phase] = {
            "measured_s": secs,
            "floor_s": floors.get(phase, 0.0),
            "ops_s": prof["op_classes_s"].get(phase, {}),
        }
    return {
        "rates": rates,
        "step_floor_s": statistics.median(floor_seconds(s["work"], rates)["total"] for s in steps),
        "step_over_floor": statistics.median(multiples),
        "profiled_step": {
            "floor": floors,
            "phases": rows,
            "completion_tokens": prof["work"]["completion_tokens"],
        },
    }


def machine() -> str:
    cpu, kind = platform.processor() or platform.machine(), ""
    if LINUX:
        from mlx_grpo.device import cpu_signature

        signature = cpu_signature()
        names = [line for line in signature.splitlines() if line.startswith("model name")]
        cpu = names[0].split(":", 1)[1].strip() if names else cpu
        kind = cpu_kind(signature)
    mem = ""
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        mem = f", {pages / 2**30:.0f} GiB RAM"
    except (ValueError, OSError, AttributeError):
        pass
    where = f"{cpu}{kind}, {os.cpu_count()} cores{mem}, {platform.system()} {platform.release()}"
    return where + _mlx_device()


def cpu_kind(cpuinfo: str) -> str:
    r"""An x86-64 CPU's family, model and widest vector instructions from /proc/cpuinfo's
    fields, as the machine line shows them (tables of two CPU kinds, one with AVX-512 and
    one without, are told apart by it); "" for other CPUs.

    >>> cpu_kind("cpu family\t: 25\nmodel\t\t: 1\nflags\t\t: fpu avx avx2 fma")
    ' (family 25, model 1; AVX2, no AVX-512)'
    >>> cpu_kind("cpu family\t: 6\nmodel\t\t: 207\nflags\t\t: avx2 avx512f avx512bw")
    ' (family 6, model 207; AVX-512)'
    >>> cpu_kind("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd")
    ''
    """
    fields: dict[str, str] = {}
    for line in cpuinfo.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    if "cpu family" not in fields:
        return ""
    flags = set(fields.get("flags", "").split())
    widest = (
        "AVX-512" if "avx512f" in flags
        else "AVX2, no AVX-512" if "avx2" in flags
        else "AVX, no AVX2" if "avx" in flags
        else "no AVX"
    )  # fmt: skip
    return f" (family {fields['cpu family']}, model {fields.get('model', '?')}; {widest})"


def _mlx_device() -> str:
    """MLX's device when it is not the CPU: a GPU run's tables name the GPU."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return ""
    info = mx.device_info()
    return (
        f"; MLX {mx.__version__} on {info.get('device_name') or info.get('architecture', 'a GPU')}"
    )


# ---- tables -----------------------------------------------------------------------


def _f(v, nd=1):
    return "-" if v is None else f"{v:.{nd}f}"


def tables(report: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) for each table: the systems side by side, then, where the
    run has them, mlx-grpo's step against the floor and mlx-grpo's scaling."""
    out = [_systems_table(report)]
    fl = report.get("floor")
    if fl:
        out.append(_floor_table(fl))
    sc = report.get("scaling")
    if sc:
        out.append(_scaling_table(sc))
    return out


def _systems_table(report: dict) -> tuple[str, list[str], list[list[str]]]:
    """One row per system on the work unit, with mlx-grpo's step time over each one's
    (the ratio to read, the machines being noisy); a failed system's row says why."""
    sysrows = report["systems"]
    ours = sysrows.get("mlx-grpo", {}).get("summary")
    rows = []
    for name, r in sysrows.items():
        if "error" in r:
            rows.append([name, f"failed: {r['error']}"] + [""] * 8)
            continue
        s = r["summary"]
        if name == "mlx-grpo":
            ratio = "1.00"
        elif ours:
            ratio = f"{ours['step_s'] / s['step_s']:.2f}"
        else:  # no ratio against a failed mlx-grpo run
            ratio = "-"
        rows.append(
            [
                name,
                _f(s["step_s"]),
                _f(s["rollout_s"]),
                _f(s["rollout_tok_s"], 0),
                _f(s["update_s"]),
                _f(s["time_to_first_step_s"]),
                _f(s["peak_rss_gb"], 2),
                "-" if s.get("trainable_params") is None else f"{s['trainable_params']:,}",
                f"{s['reward_mean']:.2f}",
                ratio,
            ]
        )
    return (
        "Work unit: SmolLM2-135M fp32, B=2 x G=8, 64 new tokens, LoRA r8 all linears "
        + (
            f"(median of the {report['steps'] - 1} steps after the first)"
            if report["steps"] > 1
            else "(one step)"
        ),
        [
            "system",
            "step s",
            "rollout s",
            "rollout tok/s",
            "update s",
            "first step s",
            "peak RSS GB",
            "LoRA params",
            "reward",
            "mlx-grpo / system",
        ],
        rows,
    )


def _floor_table(fl: dict) -> tuple[str, list[str], list[list[str]]]:
    """mlx-grpo's profiled step by phase and op class against the floor (`floor_report`);
    the title carries the measured rates and the whole step's multiple of its floor."""
    rates = fl["rates"]
    ps = fl["profiled_step"]
    rows = []
    for phase, r in ps["phases"].items():
        ops = r["ops_s"]
        rows.append(
            [
                phase,
                _f(r["measured_s"], 2),
                _f(r["floor_s"], 2),
                _f(r["measured_s"] / r["floor_s"], 1) if r["floor_s"] else "-",
                *[_f(ops.get(k), 2) for k in ("gemm", "attention", "elementwise", "python")],
            ]
        )
    return (
        f"Floor: GEMM {rates['gemm_gflops']:.0f} GFLOP/s, bandwidth "
        f"{rates['bandwidth_gbs']:.1f} GB/s; mlx-grpo step = {fl['step_over_floor']:.1f}x "
        f"its floor ({fl['step_floor_s']:.2f} s). Profiled step by phase and op class "
        "(seconds; op classes estimated from isolated ops at the real shapes, "
        "scaled down to the measured phase where they exceed it)",
        [
            "phase",
            "measured s",
            "floor s",
            "x floor",
            "GEMM",
            "attention",
            "elementwise",
            "python/other",
        ],
        rows,
    )


def _scaling_table(sc: list[dict]) -> tuple[str, list[str], list[list[str]]]:
    """mlx-grpo's step at each (G, new tokens) of the scaling runs; a failed run's row
    says why."""
    rows = [
        [
            str(r["group"]),
            str(r["max_new_tokens"]),
            *(
                [f"failed: {r['error']}", "", "", "", ""]
                if "error" in r
                else [
                    _f(r["summary"]["step_s"]),
                    _f(r["summary"]["rollout_s"]),
                    _f(r["summary"]["update_s"]),
                    _f(r["summary"]["peak_rss_gb"], 2),
                    _f(r["mlx_peak_gb"], 2),
                ]
            ),
        ]
        for r in sc
    ]
    return (
        "mlx-grpo scaling (B=2)",
        [
            "G",
            "new tokens",
            "step s",
            "rollout s",
            "update s",
            "peak RSS GB",
            "MLX peak GB",
        ],
        rows,
    )


def blas_line(report: dict) -> str:
    """Which BLAS each MLX system's products went to ('' where none says)."""
    used = [f"{n}: {r['blas']}" for n, r in report["systems"].items() if r.get("blas")]
    return "; ".join(used)


def markdown(report: dict) -> str:
    lines = [
        f"Machine: {report['machine']}. Command: `{report['command']}` ({report['date']}).",
        "",
    ]
    if blas := blas_line(report):
        lines += [f"BLAS: {blas}.", ""]
    for title, header, rows in tables(report):
        lines += [f"**{title}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines.append("")
    return "\n".join(lines)


def print_tables(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 140))
    console.print(f"[bold]machine[/bold]: {report['machine']}")
    if blas := blas_line(report):
        console.print(f"[bold]BLAS[/bold]: {blas}")
    for title, header, rows in tables(report):
        t = Table(title=title, title_justify="left")
        for h in header:
            t.add_column(h, justify="left" if h in ("system", "phase") else "right")
        for r in rows:
            t.add_row(*r)
        console.print(t)


# ---- main -------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """The bench: each system on the work unit, then mlx-grpo against the floor and its
    scaling; prints the tables and writes them to the results folder. Exit status 2 for
    a bad --systems, 1 when a peer cannot be set up or mlx-grpo's run failed."""
    args = _parser().parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        print(
            f"error: --systems: unknown {', '.join(bad)} (known: {', '.join(SYSTEMS)})",
            file=sys.stderr,
        )
        return 2
    if args.smoke:
        systems, args.steps, args.no_scaling = ["mlx-grpo"], 1, True
    if "mlx-grpo" not in systems:
        print("error: --systems must include mlx-grpo (the ratios are against it)", file=sys.stderr)
        return 2
    out_dir = args.out or (None if args.smoke else Path("bench") / "results")
    stamp = time.strftime("%Y-%m-%d-%H%M%S")
    logs = Path(out_dir or "/tmp") / f"logs-{stamp}"
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine(),
        "command": " ".join(
            ["python -m mlx_grpo.bench", *(argv if argv is not None else sys.argv[1:])]
        ),
        "steps": args.steps,
        "systems": {},
    }
    try:
        peers = {}
        for name in systems:
            if name != "mlx-grpo":
                peers[name] = ensure_venv(name)
        base = ensure_base_export() if peers else None
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    report["systems"] = _run_systems(systems, peers, base, args, logs)
    ours = report["systems"].get("mlx-grpo", {})
    if "profile" in ours:
        report["floor"] = floor_report(ours)
    if not args.no_scaling:
        report["scaling"] = _run_scaling(ours, args, logs)

    print_tables(report)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{stamp}.json"
        path.write_text(json.dumps(report, indent=1) + "\n")
        (out_dir / f"{stamp}.md").write_text(markdown(report))
        say(f"results: {path} (+ .md); logs: {logs}")
    failed = [n for n, r in report["systems"].items() if "error" in r]
    return 1 if "mlx-grpo" in failed else 0


def _parser() -> argparse.ArgumentParser:
    """The bench's command line (the module docstring's first line is its description)."""
    p = argparse.ArgumentParser(prog="python -m mlx_grpo.bench", description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="one step of mlx-grpo only (+ profile)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"subset of {','.join(SYSTEMS)}")
    p.add_argument("--steps", type=int, default=4, help="steps per system (the first is excluded)")
    p.add_argument("--scaling-steps", type=int, default=2)
    p.add_argument("--no-scaling", action="store_true")
    p.add_argument("--model", default="default", help="mlx-grpo's model (smoke tests: a tiny one)")
    p.add_argument(
        "--out", type=Path, default=None, help="results folder (default ./bench/results)"
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds per system run")
    p.add_argument(
        "--peer-front",
        action="store_true",
        help="run mlx-lm-lora on mlx-grpo's skinny-GEMM front too (default: the same BLAS alone)",
    )
    return p


def _run_systems(systems: list[str], peers: dict, base: Path | None, args, logs: Path) -> dict:
    """Each system's run on the work unit, one after the other, with its summary; a
    system that fails is recorded as {"error": ...} and the others still run (mlx-grpo
    with its profile, for the floor report; the peers from their venvs on `base`)."""
    results = {}
    for name in systems:
        say(f"{name}: {args.steps} step(s)")
        try:
            if name == "mlx-grpo":
                res = run_runner(
                    sys.executable,
                    "mlx_grpo.bench.run_mlx_grpo",
                    ["--steps", str(args.steps), "--model", args.model, "--profile"],
                    args.timeout,
                    logs / f"{name}.log",
                )
            else:
                res = run_runner(
                    peers[name],
                    PEERS[name]["runner"],
                    ["--steps", str(args.steps), "--model", str(base)],
                    args.timeout,
                    logs / f"{name}.log",
                    front=args.peer_front,
                )
            res["summary"] = summarize(res)
            say(f"{name}: step {res['summary']['step_s']:.1f} s")
        except BenchError as e:
            say(f"{name}: {e}")
            res = {"error": str(e)}
        results[name] = res
    return results


def _run_scaling(ours: dict, args, logs: Path) -> list[dict]:
    """mlx-grpo at each (G, new tokens) of SCALING, in order, with the main run's
    (8, 64) taken from `ours` (mlx-grpo's main run) rather than run again; a failed run
    is recorded as {"error": ...}."""
    rows = []
    main_row = ours.get("summary")
    for g, t in sorted(SCALING + [(8, 64)]):
        if (g, t) == (8, 64) and main_row:
            rows.append(
                {
                    "group": 8,
                    "max_new_tokens": 64,
                    "summary": main_row,
                    "mlx_peak_gb": max(s["mlx_peak_gb"] for s in ours["steps"]),
                }
            )
            continue
        say(f"scaling: G={g}, {t} new tokens")
        try:
            res = run_runner(
                sys.executable,
                "mlx_grpo.bench.run_mlx_grpo",
                [
                    "--steps",
                    str(args.scaling_steps),
                    "--model",
                    args.model,
                    "--group",
                    str(g),
                    "--max-new-tokens",
                    str(t),
                ],
                args.timeout,
                logs / f"scaling-G{g}-T{t}.log",
            )
            rows.append(
                {
                    "group": g,
                    "max_new_tokens": t,
                    "summary": summarize(res),
                    "mlx_peak_gb": max(s["mlx_peak_gb"] for s in res["steps"]),
                    "steps": res["steps"],
                }
            )
        except BenchError as e:
            rows.append({"group": g, "max_new_tokens": t, "error": str(e)})
    return rows


if __name__ == "__main__":
    sys.exit(main())
