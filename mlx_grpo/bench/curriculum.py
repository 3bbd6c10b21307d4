"""`make bench-curriculum`: does the UED curriculum beat uniform task sampling?

    python -m mlx_grpo.bench.curriculum --recipe web_browsing --seeds 0,1,2 \\
        --token-budget 20000 --eval-every 4 --eval-tasks 48

Each strategy (`uniform`, `learnability`, `filter`) trains once per seed, from the same
adapters' initialisation, until the same number of rollout tokens has been generated
(`train.token_budget`: the sampling cost, rejected groups of `filter` included), with a
greedy held-out evaluation before training and every `--eval-every` steps. Runs go to
`<out>/runs/<strategy>-s<seed>/`; a finished run is not trained again, so an interrupted
bench continues where it stopped.

The report, per strategy:
- final held-out success (the recipe's main component, `success` when it has one): the
  mean over seeds x eval tasks, with a 95% percentile bootstrap interval over tasks
  (resampled within each seed);
- the paired difference to uniform on the same tasks (seed by seed), with its interval;
- the rollout tokens at which the seed-averaged held-out curve first reaches 90% of
  uniform's best seed-averaged score (none when it never does).
Results go to `<out>/curriculum-<date>.json` and a table on the terminal.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlx_grpo.durable import read_jsonl
from mlx_grpo.runfolder import RunFolder
from mlx_grpo.stats import bootstrap_indices, percentile_interval

STRATEGIES = ("uniform", "learnability", "filter")


@dataclass
class Curve:
    """One run's held-out evaluations: rollout tokens spent, and per-task success."""

    tokens: list[int]
    per_task: list[dict[str, float]]  # task id -> success, one dict per evaluation

    @property
    def means(self) -> list[float]:
        return [float(np.mean(list(d.values()))) for d in self.per_task]


def read_curve(eval_jsonl: Path, key: str = "success") -> Curve:
    """The evaluations a run wrote to eval.jsonl (`key`: the component scored; the
    weighted reward when the recipe has no such component)."""
    tokens, per_task = [], []
    for rec in read_jsonl(eval_jsonl)[0]:
        tokens.append(int(rec["rollout_tokens"]))
        per_task.append(
            {
                r["id"]: float(np.mean(r["components"].get(key, r["rewards"])))
                for r in rec["results"]
            }
        )
    if not tokens:
        raise ValueError(f"{eval_jsonl}: no evaluations")
    return Curve(tokens, per_task)


def _clustered_boot(groups: list[np.ndarray], resamples: int, seed: int) -> np.ndarray:
    """Bootstrap means of the pooled values, resampling within each group (seed)."""
    total = np.zeros(resamples)
    n = sum(len(g) for g in groups)
    for i, g in enumerate(groups):
        idx = bootstrap_indices(len(g), resamples, seed + i)
        total += g[idx].sum(1)
    return total / n


def tokens_to_reach(tokens: list[float], scores: list[float], target: float) -> float | None:
    """The first point of a curve at or above `target` (None if it never gets there).

    >>> tokens_to_reach([0, 100, 200], [0.1, 0.3, 0.5], 0.3), tokens_to_reach([0], [0.1], 0.2)
    (100, None)
    """
    for t, s in zip(tokens, scores):
        if s >= target - 1e-9:
            return t
    return None


def mean_curve(curves: list[Curve]) -> tuple[list[float], list[float]]:
    """Seed-averaged curve, point by point (evaluations are at the same steps; runs
    that stopped earlier are cut to the shortest)."""
    n = min(len(c.tokens) for c in curves)
    tokens = [float(np.mean([c.tokens[i] for c in curves])) for i in range(n)]
    scores = [float(np.mean([c.means[i] for c in curves])) for i in range(n)]
    return tokens, scores


def analyse(
    curves: dict[str, dict[int, Curve]],
    baseline: str = "uniform",
    resamples: int = 10_000,
    seed: int = 0,
) -> list[dict]:
    """One row per strategy: final success with its interval, the paired difference to
    `baseline` with its interval, and the tokens to reach 90% of the baseline's best."""
    base_tokens, base_scores = mean_curve(list(curves[baseline].values()))
    target = 0.9 * max(base_scores)
    rows = []
    for name, by_seed in curves.items():
        seeds = sorted(by_seed)
        finals = [by_seed[s].per_task[-1] for s in seeds]
        values = [np.array(list(f.values())) for f in finals]
        boot = _clustered_boot(values, resamples, seed)
        lo, hi = percentile_interval(boot)
        row = {
            "strategy": name,
            "seeds": seeds,
            "final_success": float(np.mean(np.concatenate(values))),
            "ci": [lo, hi],
            "per_seed": [float(v.mean()) for v in values],
            "final_tokens": [by_seed[s].tokens[-1] for s in seeds],
        }
        if name != baseline:
            diffs = []
            for s, f in zip(seeds, finals):
                ref = curves[baseline][s].per_task[-1]
                diffs.append(np.array([f[t] - ref[t] for t in f]))
            dboot = _clustered_boot(diffs, resamples, seed + 100)
            row["diff"] = float(np.mean(np.concatenate(diffs)))
            row["diff_ci"] = list(percentile_interval(dboot))
        tokens, scores = mean_curve(list(by_seed.values()))
        row["target"] = target
        row["tokens_to_target"] = tokens_to_reach(tokens, scores, target)
        row["curve"] = {"tokens": tokens, "success": scores}
        rows.append(row)
    return rows


def print_table(rows: list[dict], baseline: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"held-out success at equal rollout tokens (vs {baseline})")
    for col in ("strategy", "final success [95% CI]", f"- {baseline} [95% CI]", "tokens to 90%"):
        t.add_column(col, justify="right" if col != "strategy" else "left")
    for r in rows:
        diff = (
            f"{r['diff']:+.3f} [{r['diff_ci'][0]:+.3f}, {r['diff_ci'][1]:+.3f}]"
            if "diff" in r
            else "-"
        )
        reach = "never" if r["tokens_to_target"] is None else f"{r['tokens_to_target']:,.0f}"
        t.add_row(
            r["strategy"],
            f"{r['final_success']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]",
            diff,
            reach,
        )
    Console().print(t)
    target = rows[0]["target"]
    Console().print(f"90% of {baseline}'s best seed-averaged held-out success = {target:.3f}")


def check_run(run: Path, strategy: str, seed: int, args) -> None:
    """A run folder left by an earlier bench is reused only when it was trained with the
    same recipe, strategy, seed, budget and evaluation; otherwise one line says why."""
    folder = RunFolder(run)
    if not folder.config_file.exists():
        return
    wanted = {  # what the bench asks: (config section, field) -> value
        ("recipe", "name"): args.recipe,
        ("curriculum", "strategy"): strategy,
        ("train", "seed"): seed,
        ("train", "token_budget"): args.token_budget,
        ("train", "eval_tasks"): args.eval_tasks,
        ("train", "eval_every"): args.eval_every,
    }
    try:
        cfg = json.loads(folder.config_file.read_text())
        found = {key: cfg[key[0]][key[1]] for key in wanted}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"error: {folder.config_file}: not a run config ({e})") from None
    differ = [
        f"{a}.{b} {found[a, b]} (asked {v})" for (a, b), v in wanted.items() if found[a, b] != v
    ]
    if differ:
        raise SystemExit(
            f"error: {run} was trained with {', '.join(differ)}; pass another --out, or remove it"
        )


def _run_done(run: Path, budget: int) -> bool:
    folder = RunFolder(run)
    ev = folder.eval_file
    if not ev.exists() or folder.latest_step_dir() is None:
        return False
    last = read_curve(ev).tokens[-1]
    return last >= budget


def train_one(run: Path, strategy: str, seed: int, args, extra: list[str]) -> None:
    flags = [
        "--recipe",
        args.recipe,
        f"--curriculum.strategy={strategy}",
        f"--train.seed={seed}",
        f"--train.token_budget={args.token_budget}",
        f"--train.steps={args.max_steps}",
        f"--train.eval_every={args.eval_every}",
        f"--train.eval_tasks={args.eval_tasks}",
        "--optimizer.schedule=constant",
        # The strategies are compared on GRPO from the base policy: a recipe's warm
        # start would show every strategy the same demonstrations first.
        "--train.sft_steps=0",
        f"--output.dir={run.parent}",
        f"--output.run={run.name}",
        "--output.live=no",
        f"--output.save_every={args.eval_every}",
        *extra,
    ]
    if RunFolder(run).latest_step_dir() is not None:  # interrupted: continue it
        flags = ["--resume", str(run), *extra]
    cmd = [sys.executable, "-m", "mlx_grpo", "train", *flags]
    print(f"[{strategy} seed {seed}] {' '.join(cmd[2:])}", flush=True)
    log = run.parent / f"{run.name}.log"
    with open(log, "a") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise SystemExit(f"error: {strategy} seed {seed} failed (exit {rc}): {tail[0]}; see {log}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m mlx_grpo.bench.curriculum",
        description="Curriculum strategies at an equal rollout-token budget, on held-out tasks.",
    )
    p.add_argument("--recipe", default="web_browsing")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--token-budget", type=int, default=20_000, help="rollout tokens per run")
    p.add_argument("--max-steps", type=int, default=1000, help="a cap; the budget stops runs")
    p.add_argument("--eval-every", type=int, default=4, help="steps between held-out evals")
    p.add_argument("--eval-tasks", type=int, default=48, help="held-out tasks per eval")
    p.add_argument("--key", default="success", help="the component scored")
    p.add_argument("--out", type=Path, default=Path("bench/curriculum"))
    p.add_argument("--analyse-only", action="store_true", help="report on finished runs")
    args, extra = p.parse_known_args(argv)
    strategies = [s for s in args.strategies.split(",") if s]
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad or "uniform" not in strategies:
        p.error(f"--strategies: from {', '.join(STRATEGIES)}, uniform included (got {bad})")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        p.error(f"--seeds: integers separated by commas (got '{args.seeds}')")
    runs = args.out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    tic = time.time()
    curves: dict[str, dict[int, Curve]] = {}
    for seed in seeds:
        for strategy in strategies:
            run = runs / f"{strategy}-s{seed}"
            check_run(run, strategy, seed, args)
            if not args.analyse_only and not _run_done(run, args.token_budget):
                train_one(run, strategy, seed, args, extra)
            if (ev := RunFolder(run).eval_file).exists():
                curves.setdefault(strategy, {})[seed] = read_curve(ev, args.key)
    if "uniform" not in curves:
        raise SystemExit("error: no finished uniform run to compare with")
    rows = analyse(curves)
    print_table(rows, "uniform")
    out = args.out / f"curriculum-{time.strftime('%Y%m%d-%H%M')}.json"
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    out.write_text(
        json.dumps(
            {"settings": settings, "overrides": extra, "seconds": time.time() - tic, "rows": rows},
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
