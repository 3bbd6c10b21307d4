"""`python -m mlx_grpo.compare`: does model B really beat model A on a recipe's held-out
tasks? Both play the same eval tasks with the same seeds; the answer comes with
confidence intervals and a p-value.

    python -m mlx_grpo.compare --a default --b checkpoints/web-1
    python -m mlx_grpo.compare --a default --b checkpoints/web-1@step-000020 \\
        --recipe web_browsing --n-tasks 100 --samples 8 --temperature 0.8

A side is `default` (the embedded model), a model folder or a Hub id (plus, optionally,
`--a-adapter DIR` / `--b-adapter DIR`), a run folder (its base model with its latest
adapters), one of its `step-NNNNNN` folders, or `RUN@step-NNNNNN` (also `RUN@20`).
A is loaded, evaluated and freed before B is loaded.

The parts: `mlx_grpo.sides` resolves and loads a side, this module picks the recipe and
tasks and evaluates each side, `mlx_grpo.report` builds the rows (statistics from
`mlx_grpo.stats`), prints them, plots them and writes compare.json.

What is compared: per-task values, with the intervals and tests of `mlx_grpo.stats`
(paired bootstrap of B - A, sign-flip permutation and sign tests, unbiased pass@k).
- A sample succeeds when the component named by `--success-key` reaches its best
  value (1): by default the `success` component when the reward has one, else the
  weighted reward reaching the recipe's best (`Recipe.max_reward`, every weighted
  component at 1).
- Win / tie / loss: tasks where B's mean reward is above / equal to / below A's.
- A difference is marked (green, red; `better` in the rows) when its interval leaves
  out 0 and its p-value is below 0.05: the bootstrap alone is too narrow on few tasks.
- A task where the machinery failed under a sample of either side (a crashed browser)
  is left out of both sides' rows, and named (`eval.left_out`).

Metric names are the ones the training log uses for held-out evaluation (`eval/reward`,
`eval/<component>`, `eval/level_<L>/reward`), plus `eval/pass@k` and
`eval/completion/len_mean` (model tokens per sample).

Writes to `--out` (default `<run B>/compare/` when B is a run, else
`compare-<timestamp>/`): `compare.json` (both sides' settings, every task's results, and
"rows": {metric, a, b, diff, ci_low, ci_high, p_value}, which the export's model card
reads; a copy goes to `<run B>/compare.json`) and `compare.png` (per level, with
intervals; needs matplotlib: `pip install 'mlx-grpo[plot]'`).
"""

from __future__ import annotations

# isort: off
import mlx_grpo  # noqa: F401  (first: loads OpenBLAS before mlx)

# isort: on
import argparse
import gc
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from mlx_grpo import evalcache
from mlx_grpo.config import ConfigError, RunConfig, build_config, parse_overrides
from mlx_grpo.device import prepare_training as keep_freed_memory
from mlx_grpo.durable import check_writable
from mlx_grpo.evaluate import TaskResult
from mlx_grpo.recipe import INFRASTRUCTURE_FAILURES, Recipe, Task, recipe_defaults, recipe_dir
from mlx_grpo.report import (
    Report,
    SuccessRule,
    compare_results,
    print_report,
    success_rule,
    task_dict,
    write_outputs,
)
from mlx_grpo.runfolder import RunFolder
from mlx_grpo.sides import CompareError, Side, check_tokenizers, load_side, resolve_side
from mlx_grpo.stats import StatsConfig

# -------------------------------------------------------------------- recipe & tasks


def _recipe_key(cfg) -> tuple:
    try:
        where = str(recipe_dir(cfg.name).resolve())
    except ConfigError:
        where = cfg.name
    return where, json.dumps(cfg.weights, sort_keys=True), json.dumps(cfg.params, sort_keys=True)


def resolve_eval_config(recipe: str | None, overrides: dict, sides: list[Side]) -> RunConfig:
    """The recipe and rollout settings both sides are evaluated with: `--recipe`'s
    defaults, else the run's own (B's when both are runs; their recipe, weights and
    params must then agree, or the eval splits and rewards would differ), then any
    `--recipe.*` / `--rollout.*` flags."""
    bad = sorted(set(overrides) - {"recipe", "rollout"})
    if bad:
        raise CompareError(f"--{bad[0]}.*: compare takes only --recipe.* and --rollout.* settings")
    runs = [s for s in sides if s.run_config is not None]
    if recipe is not None:
        base = recipe_defaults(recipe)
    elif not runs:
        raise CompareError("--recipe NAME is needed: neither side is a run folder")
    else:
        recs = [s.run_config.recipe for s in runs]
        if len(recs) == 2 and _recipe_key(recs[0]) != _recipe_key(recs[1]):
            ra, rb = recs
            if _recipe_key(ra)[0] != _recipe_key(rb)[0]:
                what = "recipes"
            else:
                what = "reward weights" if ra.weights != rb.weights else "recipe params"
            raise CompareError(
                f"A and B were trained with different {what} (A: {ra.name} {ra.weights} "
                f"{ra.params}; B: {rb.name} {rb.weights} {rb.params}), so their eval splits "
                "or rewards differ; choose one with --recipe NAME"
            )
        cfg = runs[-1].run_config  # B's, when B is a run
        # A training run's rollout settings, as evaluation plays them (to each episode's end)
        rollout = cfg.rollout.model_dump(exclude={"end_on_ill_formed"})
        base = {"recipe": cfg.recipe.model_dump(), "rollout": rollout}
    return build_config(base, overrides=overrides, source="compare")


# ------------------------------------------------------------------------- evaluation


def evaluate_side(
    side: Side,
    recipe: Recipe,
    tasks: list[Task],
    cfg: RunConfig,
    samples: int,
    temperature: float,
    seed: int,
    batch_tasks: int,
) -> tuple[list[TaskResult], float]:
    """Load one side, play every task, free the model; (results, seconds)."""
    import mlx.core as mx

    from mlx_grpo.evaluate import evaluate

    model, tokenizer = load_side(side)
    tic = time.perf_counter()
    results = evaluate(
        model,
        tokenizer,
        recipe,
        tasks,
        cfg.rollout,
        samples=samples,
        temperature=temperature,
        batch_tasks=batch_tasks,
        seed=seed,
    )
    seconds = time.perf_counter() - tic
    del model, tokenizer
    gc.collect()
    mx.clear_cache()
    return results, seconds


# ------------------------------------------------------------------------------- CLI


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, like every other error here
        raise CompareError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m mlx_grpo.compare",
        allow_abbrev=False,
        description="Evaluate models A and B on the same held-out tasks of a recipe and "
        "report B - A with bootstrap intervals and a paired permutation p-value. Also "
        "takes --recipe.FIELD=VALUE and --rollout.FIELD=VALUE settings.",
    )
    side = "'default', a model folder or Hub id, a run folder, RUN@step-NNNNNN"
    p.add_argument("--a", required=True, help=f"side A ({side})")
    p.add_argument("--b", required=True, help=f"side B ({side})")
    p.add_argument("--a-adapter", default=None, help="LoRA adapter folder to apply to model A")
    p.add_argument("--b-adapter", default=None, help="LoRA adapter folder to apply to model B")
    p.add_argument("--recipe", default=None, help="recipe name or folder (default: the run's)")
    p.add_argument(
        "--n-tasks", type=int, default=None, help="eval tasks (default: the recipe's eval_size)"
    )
    p.add_argument("--seed", type=int, default=0, help="tasks, sampling and resampling seed")
    p.add_argument("--samples", type=int, default=1, help="samples per task (k)")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (then --samples must be 1)"
    )
    p.add_argument(
        "--pass-k", type=int, default=None, help="report pass@K besides pass@1 (default: --samples)"
    )
    p.add_argument(
        "--success-key",
        default="auto",
        help="component that defines a successful sample (at 1), or 'reward' (at the "
        "recipe's best); auto: 'success' if the reward has it, else 'reward'",
    )
    p.add_argument("--batch-tasks", type=int, default=16, help="tasks rolled out together")
    p.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples")
    p.add_argument(
        "--permutations", type=int, default=20_000, help="random sign flips (n > 16 tasks)"
    )
    p.add_argument("--show", type=int, default=3, help="differing tasks to show side by side")
    p.add_argument("--out", type=Path, default=None, help="output folder")
    p.add_argument(
        "--no-cache",
        action="store_true",
        help="evaluate both sides anew (by default a side evaluated before with the same "
        "model, adapters, code, tasks and settings is read from $MLX_GRPO_CACHE/evals)",
    )
    p.add_argument(
        "--allow-tokenizer-mismatch",
        action="store_true",
        help="compare even when the two tokenizers encode the prompts differently",
    )
    return p


def _check_args(args) -> None:
    if not args.temperature >= 0 or math.isinf(args.temperature):  # (and not nan)
        raise CompareError(f"--temperature {args.temperature:g}: must be a number >= 0")
    if args.samples < 1:
        raise CompareError(f"--samples {args.samples}: must be >= 1")
    if args.samples > 1 and args.temperature == 0:
        raise CompareError(
            f"--samples {args.samples} with --temperature 0: greedy samples are identical; "
            "give --temperature > 0 (e.g. 0.8) or --samples 1"
        )
    if args.n_tasks is not None and args.n_tasks < 1:
        raise CompareError(f"--n-tasks {args.n_tasks}: the eval set is empty; give at least 1 task")
    k = args.pass_k if args.pass_k is not None else args.samples
    if not 1 <= k <= args.samples:
        raise CompareError(f"--pass-k {k}: needs 1 <= k <= --samples ({args.samples})")
    if args.resamples < 100 or args.permutations < 100:
        raise CompareError("--resamples and --permutations: at least 100 each")
    if args.batch_tasks < 1:
        raise CompareError(f"--batch-tasks {args.batch_tasks}: must be >= 1")
    if args.show < 0:
        raise CompareError(f"--show {args.show}: must be >= 0")


def _setting(cfg: RunConfig, recipe: Recipe, tasks: list[Task], args) -> str:
    if args.temperature == 0:
        mode = "greedy"
    else:
        mode = f"{args.samples} samples at temperature {args.temperature:g}"
        mode += f", top_p {cfg.rollout.top_p:g}" if cfg.rollout.top_p < 1 else ""
    turns = f", up to {cfg.rollout.max_turns} turns" if recipe.multi_turn else ""
    return (
        f"recipe {cfg.recipe.name}: {len(tasks)} eval tasks (seed {args.seed}), {mode}, "
        f"{cfg.rollout.max_new_tokens} new tokens{turns}"
    )


def run_compare(argv: list[str], console=None) -> dict:
    """The whole command: resolve and check both sides, evaluate A then B, print the
    report and write the files; returns compare.json's content."""
    from rich.console import Console

    args, rest = build_parser().parse_known_args(argv)
    _check_args(args)
    overrides = parse_overrides(rest)
    a = resolve_side("a", args.a, args.a_adapter)
    b = resolve_side("b", args.b, args.b_adapter)
    cfg = resolve_eval_config(args.recipe, overrides, [a, b])
    out = _out_folder(args.out, b)
    recipe = Recipe.from_config(cfg.recipe)
    tasks = _eval_tasks(recipe, args.n_tasks or cfg.recipe.eval_size, args.seed)
    if not args.allow_tokenizer_mismatch:
        check_tokenizers(a, b, recipe, tasks, cfg.rollout.max_prompt_tokens)

    console = console or Console()
    for s in (a, b):
        trained_on = s.run_config.recipe if s.run_config else None
        if trained_on and _recipe_key(trained_on)[0] != _recipe_key(cfg.recipe)[0]:
            console.print(
                f"note: {s.name} was trained on recipe {trained_on.name}", highlight=False
            )
    ev = _evaluate_both(a, b, recipe, tasks, cfg, args, console)
    k = args.pass_k if args.pass_k is not None else args.samples
    ks = [1] if k == 1 else [1, k]
    stats = StatsConfig(args.resamples, args.permutations, seed=args.seed)
    report = compare_results(ev.results["a"], ev.results["b"], ev.success, ks, stats, args.show)
    setting = _setting(cfg, recipe, tasks, args)
    print_report(report, _header(a, b, setting, len(tasks), ev), console)
    data = _compare_json(a, b, cfg, args, ks, stats, report, ev, len(tasks))
    _write_files(data, report, out, a, b, ev, args.no_cache, console)
    return data


def _out_folder(out: Path | None, b: Side) -> Path:
    """`--out`, else B's run's compare/ folder, else a new compare-<timestamp>/; checked
    writable now, so that a folder the files cannot go to wastes no evaluation."""
    out = out or (
        b.run_dir / "compare" if b.run_dir else Path(time.strftime("compare-%Y%m%d-%H%M%S"))
    )
    try:  # before any evaluation
        check_writable(out)
    except OSError as e:
        raise CompareError(f"--out: cannot write in {out} ({e.strerror})") from None
    return out


def _eval_tasks(recipe: Recipe, count: int, seed: int) -> list[Task]:
    """The recipe's `count` eval tasks for `seed`. The sides are paired task by task by
    id, so two tasks with one id are refused."""
    tasks = recipe.tasks("eval", count, seed)
    ids = [t.id for t in tasks]
    if twice := next((i for n, i in enumerate(ids) if i in ids[:n]), None):
        raise CompareError(
            f"recipe {recipe.name}: two eval tasks have the id {twice!r}, so they cannot be "
            "paired (a task file's lines without an id are named by their messages: give "
            "each line an id)"
        )
    return tasks


@dataclass
class _Evaluations:
    """Both sides' evaluations as the report and compare.json use them; each dict is
    keyed by side ("a", "b")."""

    results: dict[str, list[TaskResult]]  # per task, without the tasks in `left_out`
    left_out: list[str]  # ids of the tasks an infrastructure failure took out
    failures: dict[str, dict[str, int]]  # samples per named failure, left-out tasks included
    errors: dict[str, int]  # samples whose reward raised (scored 0)
    seconds: dict[str, float]  # evaluation time; 0.0 for an evaluation kept from the cache
    cached: dict[str, str]  # when each kept evaluation was made
    stored: set[str]  # sides whose new evaluation went into the cache
    success: SuccessRule


def _evaluate_both(
    a: Side, b: Side, recipe: Recipe, tasks: list[Task], cfg: RunConfig, args, console
) -> _Evaluations:
    """Evaluate A, then B (or read a side from the evaluation cache, unless --no-cache),
    then leave out of both the tasks the machinery broke under either."""
    seconds, results, success, cached, stored = {}, {}, None, {}, set()
    shared = evalcache.settings_material(
        cfg, recipe.dir, tasks, args.samples, args.temperature, args.seed, args.batch_tasks
    )
    for s in (a, b):
        key = evalcache.side_key(s, shared)
        kept = None if args.no_cache else evalcache.load(key, [t.id for t in tasks])
        if kept is not None:
            results[s.flag], seconds[s.flag] = kept[0], 0.0
            cached[s.flag] = kept[1]["saved"]
            console.print(
                f"{s.name}: {s.describe()}: evaluated {kept[1]['saved']} with the same model, "
                f"code, tasks and settings ({kept[1]['seconds']:.0f} s then); --no-cache "
                "evaluates it anew",
                highlight=False,
            )
        else:
            # Each batch of episodes allocates what the last one freed: keep it rather
            # than fault in fresh pages (rollouts took up to 40% longer without, on a
            # 2-core Linux VM).
            keep_freed_memory()
            console.print(f"evaluating {s.name}: {s.describe()} ...", highlight=False)
            results[s.flag], seconds[s.flag] = evaluate_side(
                s, recipe, tasks, cfg, args.samples, args.temperature, args.seed, args.batch_tasks
            )
            if evalcache.store(key, results[s.flag], seconds[s.flag]):
                stored.add(s.flag)
        # The reward's components are known once A has played: check --success-key
        # before B's evaluation is spent.
        success = success or success_rule(args.success_key, recipe, results[s.flag])
    failures = {s: _failures(results[s]) for s in "ab"}
    results, left_out = _without_broken_tasks(results)
    errors = {s: sum(r.errors for r in results[s]) for s in "ab"}
    return _Evaluations(
        results=results,
        left_out=left_out,
        failures=failures,
        errors=errors,
        seconds=seconds,
        cached=cached,
        stored=stored,
        success=success,
    )


def _header(a: Side, b: Side, setting: str, n_tasks: int, ev: _Evaluations) -> list[str]:
    """The lines above the report: both sides, the setting and each side's time, then a
    warning or note for each thing that makes the numbers say less than they seem to."""
    cached, seconds, left_out = ev.cached, ev.seconds, ev.left_out
    header = [
        f"A: {a.describe()}",
        f"B: {b.describe()}",
        f"{setting}; "
        + ", ".join(
            f"{f.upper()} {f'kept from {cached[f]}' if f in cached else f'{seconds[f]:.1f} s'}"
            for f in "ab"
        ),
    ]
    header += [
        f"warning: the reward raised on {n} samples of {s.upper()} (scored 0)"
        for s, n in ev.errors.items()
        if n
    ]
    if left_out:
        header.append(
            f"warning: {len(left_out)} of {n_tasks} tasks left out of the comparison: "
            f"{' or '.join(sorted(INFRASTRUCTURE_FAILURES))} failed under a sample of A or B "
            f"(not the model's doing): {', '.join(left_out[:5])}" + ", ..." * (len(left_out) > 5)
        )
    header += [
        f"note: {n} samples of {s.upper()} ended by {why} (scored 0; a limit of time can "
        "depend on the machine's load at the moment)"
        for s in "ab"
        for why, n in sorted(ev.failures[s].items())
        if why in evalcache.TRANSIENT - INFRASTRUCTURE_FAILURES
    ]
    return header


def _compare_json(
    a: Side,
    b: Side,
    cfg: RunConfig,
    args,
    ks: list[int],
    stats: StatsConfig,
    report: Report,
    ev: _Evaluations,
    n_tasks: int,
) -> dict:
    """compare.json's content: both sides and the settings, enough to repeat the
    comparison, the rows the export's model card reads, and every task's results."""
    exact = n_tasks <= stats.exact_max
    return {
        "model_a": a.describe(),
        "model_b": b.describe(),
        "sides": {"a": a.to_dict(), "b": b.to_dict()},
        "recipe": cfg.recipe.model_dump(),
        "rollout": cfg.rollout.model_dump(),
        "eval": {
            "n_tasks": n_tasks,
            "seed": args.seed,
            "samples": args.samples,
            "temperature": args.temperature,
            "pass_k": ks,
            "success": report.success,
            "ci_level": stats.level,
            "bootstrap_resamples": stats.resamples,
            "p_value": "paired sign-flip permutation, two-sided, "
            + ("exact" if exact else f"{stats.permutations} random flips, +1 corrected"),
            "seconds": ev.seconds,
            "cached": ev.cached,  # side -> when its kept evaluation was made
            "reward_errors": ev.errors,
            "failures": ev.failures,  # side -> {reason: samples}, left-out tasks included
            "left_out": ev.left_out,  # tasks an infrastructure failure took out of the rows
        },
        "rows": report.rows,
        "levels": report.levels,
        "wins": report.wins,
        "differ": report.differ,
        "tasks": [
            {"id": ra.id, "level": ra.level, "a": task_dict(ra), "b": task_dict(rb)}
            for ra, rb in zip(ev.results["a"], ev.results["b"])
        ],
    }


def _write_files(
    data: dict,
    report: Report,
    out: Path,
    a: Side,
    b: Side,
    ev: _Evaluations,
    no_cache: bool,
    console,
) -> None:
    """Write the files to `out` (and compare.json beside B's adapters, unless A and B
    are the same); a failed write names what a second try would cost."""
    same = a.model == b.model and _adapter_bytes(a) == _adapter_bytes(b)
    if same:
        kept = "; the compare.json the export's model card reads is left as it was"
        console.print(
            "note: A and B are the same model and adapters, so every difference is 0"
            + (kept if b.run_dir else ""),
            highlight=False,
        )
    keep_in = b.adapter if b.run_dir and not same else None
    try:
        written = write_outputs(data, report, out, keep_in, console)
    except OSError as e:  # a full disk, say: the table is printed, the evaluations kept
        again = (ev.stored | ev.cached.keys()) == {"a", "b"}
        kept = "; the evaluations are kept, so the same command" * again
        kept += " without --no-cache" * (again and no_cache) + " only writes" * again
        raise CompareError(f"--out: writing in {out} failed ({e.strerror or e}){kept}") from None
    console.print(f"wrote {', '.join(map(str, written))}", highlight=False)


def _failures(results: list[TaskResult]) -> dict[str, int]:
    """Samples per named failure over a side's tasks."""
    out: dict[str, int] = {}
    for r in results:
        for why, n in r.failures.items():
            out[why] = out.get(why, 0) + n
    return out


def _without_broken_tasks(
    results: dict[str, list[TaskResult]],
) -> tuple[dict[str, list[TaskResult]], list[str]]:
    """Both sides without the tasks where a sample of either failed by the machinery
    (INFRASTRUCTURE_FAILURES: a crashed browser scores 0 and would count against the
    side it happened to), and those tasks' ids."""
    pairs = list(zip(results["a"], results["b"]))
    broken = [
        ra.id
        for ra, rb in pairs
        if INFRASTRUCTURE_FAILURES & (ra.failures.keys() | rb.failures.keys())
    ]
    if len(broken) == len(pairs):
        raise CompareError(
            f"{' or '.join(sorted(INFRASTRUCTURE_FAILURES))} failed on every one of the "
            f"{len(pairs)} tasks: nothing left to compare"
        )
    out = set(broken)
    kept = {s: [r for r in results[s] if r.id not in out] for s in "ab"}
    return kept, broken


def _adapter_bytes(side: Side) -> bytes | None:
    """The side's adapters as stored, weights and config (its scale decides as much):
    a run's top-level copy equals its step's."""
    if side.weights is None:
        return None
    names = (RunFolder.ADAPTERS, RunFolder.ADAPTER_CONFIG)
    return b"".join((side.weights / n).read_bytes() for n in names)


def main(argv: list[str] | None = None) -> None:
    from mlx_grpo.env import EnvError
    from mlx_grpo.models import ModelLoadError

    argv = sys.argv[1:] if argv is None else argv
    try:
        run_compare(argv)
    except (CompareError, ConfigError, ModelLoadError, EnvError) as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(0)


if __name__ == "__main__":
    main()
