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

What is compared: per-task values, with the intervals and tests of `mlx_grpo.stats`
(paired bootstrap of B - A, sign-flip permutation and sign tests, unbiased pass@k).
- A sample succeeds when the component named by `--success-key` reaches its best
  value (1): by default the `success` component when the reward has one, else the
  weighted reward reaching the recipe's best (`Recipe.max_reward`, every weighted
  component at 1).
- Win / tie / loss: tasks where B's mean reward is above / equal to / below A's.

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
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlx_grpo.config import ConfigError, ModelConfig, RunConfig, build_config, parse_overrides
from mlx_grpo.evaluate import TaskResult
from mlx_grpo.recipe import Recipe, Task, recipe_defaults, recipe_dir
from mlx_grpo.runfolder import RunFolder
from mlx_grpo.stats import TOL, StatsConfig, compare_values, pass_at_k
from mlx_grpo.textstats import distinct_n, self_bleu


class CompareError(RuntimeError):
    """Two sides that cannot be compared as asked; the message is one line."""


# ------------------------------------------------------------------- per-task values


@dataclass
class SuccessRule:
    """A sample succeeds when `key` (a component, or 'reward' for the weighted reward)
    reaches `best`."""

    key: str
    best: float

    def __call__(self, result: TaskResult) -> list[bool]:
        vals = result.rewards if self.key == "reward" else result.components.get(self.key)
        if vals is None:  # a sample whose reward raised has only the weighted components
            vals = [0.0] * len(result.rewards)
        return [v >= self.best - TOL for v in vals]

    def describe(self) -> str:
        name = "weighted reward" if self.key == "reward" else f"component '{self.key}'"
        return f"{name} >= {self.best:g}"


def success_rule(key: str, recipe: Recipe, results: list[TaskResult]) -> SuccessRule:
    """`auto`: the `success` (else `passes`) component when the reward has one, else the
    weighted reward at the recipe's best. A component is in [0, 1], so its best is 1."""
    comps = {k for r in results for k in r.components}
    if key == "auto":
        key = next((k for k in ("success", "passes") if k in comps), "reward")
    if key == "reward":
        return SuccessRule("reward", recipe.max_reward)
    if key not in comps:
        raise CompareError(
            f"--success-key: the reward has no component '{key}' "
            f"(components: {', '.join(sorted(comps))}; or 'reward')"
        )
    return SuccessRule(key, 1.0)


def task_values(
    results: list[TaskResult], components: list[str], success: SuccessRule, ks: list[int]
) -> dict[str, np.ndarray]:
    """{metric: per-task value}: reward, each component, pass@k, completion length, and,
    with two or more samples per task, the diversity of a task's samples (Self-BLEU,
    lower is more diverse, and distinct-2)."""
    out = {"eval/reward": np.array([np.mean(r.rewards) for r in results])}
    for k in components:
        out[f"eval/{k}"] = np.array([np.mean(r.components.get(k, [0.0])) for r in results])
    for k in ks:
        out[f"eval/pass@{k}"] = np.array(
            [pass_at_k(len(r.rewards), sum(success(r)), k) for r in results]
        )
    out["eval/completion/len_mean"] = np.array([np.mean(r.tokens) for r in results])
    if all(len(r.texts) >= 2 for r in results):
        out["eval/self_bleu"] = np.array([self_bleu(r.texts) for r in results])
        out["eval/distinct_2"] = np.array([distinct_n(r.texts, 2) for r in results])
    return out


@dataclass
class Report:
    rows: list[dict]  # overall, one per metric
    levels: list[dict]  # per level: reward and pass@1
    wins: dict  # {"b": n, "tie": n, "a": n} on per-task mean reward
    differ: list[dict]  # tasks where the sides differ most, with their first samples
    success: str
    ks: list[int]
    level: float = 0.95  # of the intervals


LEVEL_METRICS = ("reward", "pass@1")


def compare_results(
    a: list[TaskResult],
    b: list[TaskResult],
    success: SuccessRule,
    ks: list[int] = (1,),
    stats: StatsConfig = StatsConfig(),
    show: int = 3,
) -> Report:
    """Every figure of the comparison from the two sides' results on the same tasks."""
    if not a:
        raise CompareError("the eval set is empty: nothing to compare")
    if [r.id for r in a] != [r.id for r in b]:
        raise CompareError("A and B were not evaluated on the same tasks in the same order")
    # A reward that returns a float has the one component "reward": eval/reward already.
    components = sorted({k for r in (*a, *b) for k in r.components} - {"reward"})
    va = task_values(a, components, success, list(ks))
    vb = task_values(b, components, success, list(ks))
    rows = [compare_values(m, va[m], vb[m], stats) for m in va]

    levels = []
    level_of = np.array([r.level for r in a])
    for level in sorted(set(level_of.tolist())):
        at = level_of == level
        for name in LEVEL_METRICS:
            row = compare_values(
                f"eval/level_{level}/{name}", va[f"eval/{name}"][at], vb[f"eval/{name}"][at], stats
            )
            levels.append({"level": level, **row})

    d = vb["eval/reward"] - va["eval/reward"]
    wins = {
        "b": int((d > TOL).sum()),
        "tie": int((np.abs(d) <= TOL).sum()),
        "a": int((d < -TOL).sum()),
    }
    order = [i for i in np.argsort(-np.abs(d), kind="stable") if abs(d[i]) > TOL][:show]
    differ = [
        {
            "id": a[i].id,
            "level": a[i].level,
            "a_reward": float(va["eval/reward"][i]),
            "b_reward": float(vb["eval/reward"][i]),
            "a_text": a[i].texts[0] if a[i].texts else "",
            "b_text": b[i].texts[0] if b[i].texts else "",
        }
        for i in order
    ]
    return Report(rows, levels, wins, differ, success.describe(), list(ks), stats.level)


# ----------------------------------------------------------------------------- sides


@dataclass
class Side:
    """One model to evaluate: a base model and, optionally, LoRA adapters."""

    flag: str  # "a" or "b": the command-line option that named it
    spec: str  # as given
    model: ModelConfig
    adapter: Path | None = None  # folder with adapters.safetensors + adapter_config.json
    run_dir: Path | None = None
    run_config: RunConfig | None = None
    step: int | None = None

    @property
    def name(self) -> str:
        return self.flag.upper()

    def describe(self) -> str:
        if self.run_dir is not None:
            at = f", step {self.step}" if self.step is not None else ""
            return f"run {self.run_dir}{at} (model {self.model.path} + LoRA)"
        if self.adapter is not None:
            return f"{self.model.path} + adapter {self.adapter}"
        return "default (embedded SmolLM2-135M-Instruct)" if self.spec == "default" else self.spec

    def to_dict(self) -> dict:
        return {
            "spec": self.spec,
            "description": self.describe(),
            "model": self.model.model_dump(),
            "adapter": str(self.adapter) if self.adapter else None,
            "run": str(self.run_dir) if self.run_dir else None,
            "step": self.step,
            "trained_on": self.run_config.recipe.model_dump() if self.run_config else None,
        }


def _read_run_config(run_dir: Path, flag: str) -> RunConfig:
    path = RunFolder(run_dir).config_file
    try:
        return build_config(json.loads(path.read_text()), source="config")
    except (ValueError, ConfigError) as e:
        first = str(e).strip().splitlines()[0]
        raise CompareError(f"--{flag}: {path}: {first}") from None


def _check_adapter(path: Path, what: str) -> None:
    names = (RunFolder.ADAPTERS, RunFolder.ADAPTER_CONFIG)
    missing = [f for f in names if not (path / f).exists()]
    if missing:
        raise CompareError(f"{what}: {path} has no {' or '.join(missing)}")


def _looks_local(spec: str) -> bool:
    """A path the user meant as a folder here (not a Hub repo id `org/name`)."""
    if spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        return True
    return Path(spec).parent.is_dir()  # e.g. checkpoints/<run> with checkpoints/ here


def resolve_side(flag: str, spec: str, adapter: str | None = None) -> Side:
    """Parse a side's spec (see the module docstring); nothing is loaded yet."""
    opt = f"--{flag} {spec}"
    step_dir = None
    head, at, tail = spec.rpartition("@")
    if at and head and Path(head).expanduser().is_dir():
        run_dir = Path(head).expanduser()
        step_dir = RunFolder(run_dir).find_step(tail)  # RUN@20 or RUN@step-..
        if step_dir is None:
            have = [p.name for p in RunFolder(run_dir).step_dirs(complete=False)]
            raise CompareError(
                f"{opt}: no checkpoint '{tail}' in {run_dir} (has: {', '.join(have) or 'none'})"
            )
    else:
        path = Path(spec).expanduser()
        if spec == "default":
            return _with_adapter(Side(flag, spec, ModelConfig(path="default")), adapter)
        if not path.exists():
            if _looks_local(spec):
                raise CompareError(f"{opt}: no such run or model folder")
            return _with_adapter(Side(flag, spec, ModelConfig(path=spec)), adapter)  # Hub id
        if not path.is_dir():
            raise CompareError(f"{opt}: not a folder (give a run folder or a model folder)")
        if held := RunFolder.holding(path):
            run_dir, step_dir = held[0].path, (held[1] if held[1] != held[0].path else None)
        elif (path / RunFolder.CONFIG).exists():
            return _with_adapter(Side(flag, spec, ModelConfig(path=spec)), adapter)
        else:
            raise CompareError(f"{opt}: neither a model folder nor a run folder (no config.json)")

    if adapter is not None:
        raise CompareError(f"--{flag}-adapter: {spec} is a run folder, which has its own adapters")
    cfg = _read_run_config(run_dir, flag)
    folder = step_dir or run_dir
    if not (folder / RunFolder.ADAPTERS).exists():
        raise CompareError(f"{opt}: {folder} has no adapters.safetensors (no checkpoint saved yet)")
    _check_adapter(folder, opt)
    return Side(flag, spec, cfg.model, folder, run_dir, cfg, RunFolder.saved_step(folder))


def _with_adapter(side: Side, adapter: str | None) -> Side:
    if adapter is not None:
        side.adapter = Path(adapter).expanduser()
        _check_adapter(side.adapter, f"--{side.flag}-adapter")
    return side


def load_side(side: Side):
    """(model, tokenizer) of a side: the base through models.load_model (dequantized on
    CPU), then its adapters with mlx_lm's load_adapters, as `mlx_lm.load(...,
    adapter_path=...)` would."""
    from mlx_lm.tuner.utils import load_adapters

    from mlx_grpo.models import ModelLoadError, load_model

    try:
        model, tokenizer = load_model(side.model)
    except ModelLoadError as e:
        raise CompareError(f"--{side.flag} {side.spec}: {e}") from None
    if side.adapter is not None:
        try:
            load_adapters(model, str(side.adapter))
        except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
            lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
            more = f" ({lines[1]}{'; ...' if len(lines) > 2 else ''})" if len(lines) > 1 else ""
            raise CompareError(
                f"--{side.flag} {side.spec}: the adapters in {side.adapter} do not fit "
                f"{side.model.path}: {lines[0] if lines else type(e).__name__}{more}"
            ) from None
    return model, tokenizer


def _load_tokenizer(side: Side):
    from mlx_lm.utils import load_tokenizer

    from mlx_grpo.models import resolve_model_path

    try:
        return load_tokenizer(resolve_model_path(side.model.path))
    except Exception as e:  # hub, file and tokenizer errors of many types: one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CompareError(
            f"--{side.flag} {side.spec}: cannot load the tokenizer of {side.model.path}: {first}"
        ) from None


def prompt_tokens(tokenizer, recipe: Recipe, tasks: list[Task], max_prompt_tokens: int):
    """The token ids of every task's first prompt, as the rollout encodes it."""
    from mlx_grpo.rollout import encode_prompt

    out = []
    for t in tasks:
        env = recipe.make_env(t) if recipe.multi_turn else None
        out.append(encode_prompt(tokenizer, recipe.first_messages(t, env), max_prompt_tokens))
    return out


def check_tokenizers(a: Side, b: Side, recipe: Recipe, tasks: list[Task], max_prompt_tokens: int):
    """Refuse when the two sides would see different prompt tokens: then the same task
    is not the same input, and the sides' token counts and truncation differ."""
    if a.model.path == b.model.path:
        return
    ta, tb = _load_tokenizer(a), _load_tokenizer(b)
    pa = prompt_tokens(ta, recipe, tasks, max_prompt_tokens)
    pb = prompt_tokens(tb, recipe, tasks, max_prompt_tokens)
    for task, x, y in zip(tasks, pa, pb):
        if x != y:
            at = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            raise CompareError(
                f"A ({a.model.path}) and B ({b.model.path}) tokenize the prompts differently "
                f"(task {task.id}: {len(x)} vs {len(y)} tokens, first difference at token "
                f"{at}); compare models that share a tokenizer, or pass "
                "--allow-tokenizer-mismatch"
            )


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
        base = {"recipe": cfg.recipe.model_dump(), "rollout": cfg.rollout.model_dump()}
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


# ---------------------------------------------------------------------------- output


def _num(v: float, signed: bool = False) -> str:
    s = "+" if signed else ""
    if abs(v) >= 100:
        return f"{v:{s}.0f}"
    if abs(v) >= 10:
        return f"{v:{s}.1f}"
    return f"{v:{s}.3f}"


def _p(p: float) -> str:
    return "<0.0001" if p < 1e-4 else f"{p:.4f}" if p < 0.01 else f"{p:.3f}"


def _with_ci(v: float, lo: float, hi: float, signed: bool = False) -> str:
    return f"{_num(v, signed)} [{_num(lo, signed)}, {_num(hi, signed)}]"


def _diff_style(row: dict) -> str:
    if row["ci_low"] > 0:
        return "green"
    if row["ci_high"] < 0:
        return "red"
    return ""


def _short(text: str, width: int = 120) -> str:
    text = " ".join(text.replace("\n", " \u23ce ").split())
    return text if len(text) <= width else text[: width - 1] + "\u2026"


def print_report(report: Report, header: list[str], console=None) -> None:
    """The summary, per-level and differing-task tables on the terminal."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    for line in header:
        console.print(line, highlight=False)
    pct = f"{report.level:.0%}"
    t = Table(
        title=f"B vs A: means with {pct} bootstrap intervals over tasks", title_justify="left"
    )
    t.add_column("metric")
    t.add_column(f"A [{pct} CI]", justify="right")
    t.add_column(f"B [{pct} CI]", justify="right")
    t.add_column(f"B - A [{pct} CI]", justify="right")
    t.add_column("p (perm.)", justify="right")
    t.add_column("p (sign)", justify="right")
    for r in report.rows:
        t.add_row(
            r["metric"],
            _with_ci(r["a"], r["a_low"], r["a_high"]),
            _with_ci(r["b"], r["b_low"], r["b_high"]),
            f"[{_diff_style(r)}]{_with_ci(r['diff'], r['ci_low'], r['ci_high'], True)}[/]"
            if _diff_style(r)
            else _with_ci(r["diff"], r["ci_low"], r["ci_high"], True),
            _p(r["p_value"]),
            _p(r["p_sign"]),
        )
    console.print(t)
    w = report.wins
    console.print(
        f"per-task mean reward: B better on {w['b']} tasks, tie on {w['tie']}, "
        f"A better on {w['a']}; success: {report.success}",
        highlight=False,
    )

    t = Table(title="per level", title_justify="left")
    t.add_column("level", justify="right")
    t.add_column("tasks", justify="right")
    for name in LEVEL_METRICS:
        t.add_column(f"{name} A", justify="right")
        t.add_column(f"{name} B", justify="right")
        t.add_column(f"{name} B - A [{pct} CI]", justify="right")
    t.add_column("p (reward)", justify="right")
    for level in sorted({r["level"] for r in report.levels}):
        cells, p = [], None
        for name in LEVEL_METRICS:
            r = next(x for x in report.levels if x["level"] == level and x["metric"].endswith(name))
            cells += [
                _num(r["a"]),
                _num(r["b"]),
                _with_ci(r["diff"], r["ci_low"], r["ci_high"], True),
            ]
            p = r["p_value"] if p is None else p
        n = next(x["n"] for x in report.levels if x["level"] == level)
        t.add_row(str(level), str(n), *cells, _p(p))
    console.print(t)

    if report.differ:
        t = Table(title="tasks where A and B differ most (first sample)", title_justify="left")
        t.add_column("task")
        t.add_column("A", overflow="fold")
        t.add_column("B", overflow="fold")
        for x in report.differ:
            t.add_row(
                f"{x['id']} (L{x['level']})",
                f"{_num(x['a_reward'])}: {_short(x['a_text'])}",
                f"{_num(x['b_reward'])}: {_short(x['b_text'])}",
            )
        console.print(t)


def plot_levels(report: Report, path: Path, title: str) -> Path | None:
    """compare.png: per level (and overall) each side's mean reward with its interval,
    and B - A with its paired interval. None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    overall = next(r for r in report.rows if r["metric"] == "eval/reward")
    rows = [r for r in report.levels if r["metric"].endswith("/reward")] + [overall]
    labels = [f"L{r['level']}\n{r['n']} tasks" for r in rows[:-1]] + [f"all\n{rows[-1]['n']} tasks"]
    x = np.arange(len(rows))
    fig, (ax, ax_d) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    fig.suptitle(title, fontsize=10)
    for off, side, color in ((-0.2, "a", "tab:gray"), (0.2, "b", "tab:blue")):
        means = np.array([r[side] for r in rows])
        err = np.array(
            [means - [r[f"{side}_low"] for r in rows], [r[f"{side}_high"] for r in rows] - means]
        )
        ax.bar(x + off, means, 0.4, yerr=err, capsize=3, color=color, label=side.upper())
    ax.set_xticks(x, labels)
    ax.set_ylabel("mean reward")
    ax.set_title("mean reward per level, 95% bootstrap CI")
    ax.legend()
    diffs = np.array([r["diff"] for r in rows])
    err = np.array([diffs - [r["ci_low"] for r in rows], [r["ci_high"] for r in rows] - diffs])
    colors = [
        "tab:green" if r["ci_low"] > 0 else "tab:red" if r["ci_high"] < 0 else "tab:gray"
        for r in rows
    ]
    ax_d.axhline(0, color="black", lw=0.8)
    ax_d.errorbar(x, diffs, yerr=err, fmt="none", ecolor="black", capsize=4)
    ax_d.scatter(x, diffs, c=colors, zorder=3)
    ax_d.set_xticks(x, labels)
    ax_d.set_ylabel("B - A")
    ax_d.set_title("paired difference B - A, 95% bootstrap CI")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
        "--allow-tokenizer-mismatch",
        action="store_true",
        help="compare even when the two tokenizers encode the prompts differently",
    )
    return p


def _check_args(args) -> None:
    if args.temperature < 0:
        raise CompareError(f"--temperature {args.temperature:g}: must be >= 0")
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
    recipe = Recipe.from_config(cfg.recipe)
    tasks = recipe.tasks("eval", args.n_tasks or cfg.recipe.eval_size, args.seed)
    if not args.allow_tokenizer_mismatch:
        check_tokenizers(a, b, recipe, tasks, cfg.rollout.max_prompt_tokens)

    console = console or Console()
    for s in (a, b):
        trained_on = s.run_config.recipe if s.run_config else None
        if trained_on and _recipe_key(trained_on)[0] != _recipe_key(cfg.recipe)[0]:
            console.print(
                f"note: {s.name} was trained on recipe {trained_on.name}", highlight=False
            )
    seconds, results, success = {}, {}, None
    for s in (a, b):
        console.print(f"evaluating {s.name}: {s.describe()} ...", highlight=False)
        results[s.flag], seconds[s.flag] = evaluate_side(
            s, recipe, tasks, cfg, args.samples, args.temperature, args.seed, args.batch_tasks
        )
        # The reward's components are known once A has played: check --success-key
        # before B's evaluation is spent.
        success = success or success_rule(args.success_key, recipe, results[s.flag])
    k = args.pass_k if args.pass_k is not None else args.samples
    ks = [1] if k == 1 else [1, k]
    stats = StatsConfig(args.resamples, args.permutations, seed=args.seed)
    report = compare_results(results["a"], results["b"], success, ks, stats, args.show)

    errors = {s: sum(r.errors for r in results[s]) for s in "ab"}
    header = [
        f"A: {a.describe()}",
        f"B: {b.describe()}",
        f"{_setting(cfg, recipe, tasks, args)}; A {seconds['a']:.1f} s, B {seconds['b']:.1f} s",
    ]
    header += [
        f"warning: the reward raised on {n} samples of {s.upper()} (scored 0)"
        for s, n in errors.items()
        if n
    ]
    print_report(report, header, console)

    exact = len(tasks) <= stats.exact_max
    data = {
        "model_a": a.describe(),
        "model_b": b.describe(),
        "sides": {"a": a.to_dict(), "b": b.to_dict()},
        "recipe": cfg.recipe.model_dump(),
        "rollout": cfg.rollout.model_dump(),
        "eval": {
            "n_tasks": len(tasks),
            "seed": args.seed,
            "samples": args.samples,
            "temperature": args.temperature,
            "pass_k": ks,
            "success": report.success,
            "ci_level": stats.level,
            "bootstrap_resamples": stats.resamples,
            "p_value": "paired sign-flip permutation, two-sided, "
            + ("exact" if exact else f"{stats.permutations} random flips, +1 corrected"),
            "seconds": seconds,
            "reward_errors": errors,
        },
        "rows": report.rows,
        "levels": report.levels,
        "wins": report.wins,
        "differ": report.differ,
        "tasks": [
            {"id": ra.id, "level": ra.level, "a": _task_dict(ra), "b": _task_dict(rb)}
            for ra, rb in zip(results["a"], results["b"])
        ],
    }
    out = args.out or (
        b.run_dir / "compare" if b.run_dir else Path(time.strftime("compare-%Y%m%d-%H%M%S"))
    )
    written = write_outputs(data, report, out, b.run_dir, console)
    console.print(f"wrote {', '.join(map(str, written))}", highlight=False)
    return data


def write_outputs(data: dict, report: Report, out: Path, run_dir: Path | None, console) -> list:
    """compare.json and compare.png in `out`; compare.json also into B's run folder,
    where the export's model card looks for it."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "compare.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    written = [path]
    png = plot_levels(report, out / "compare.png", f"A: {data['model_a']}   B: {data['model_b']}")
    if png is None:
        console.print(
            "warning: matplotlib is not installed, so no compare.png "
            "(pip install 'mlx-grpo[plot]')",
            highlight=False,
        )
    else:
        written.append(png)
    copy = RunFolder(run_dir).compare_file if run_dir is not None else None
    if copy is not None and path.resolve() != copy.resolve():
        shutil.copyfile(path, copy)
        written.append(copy)
    return written


def _task_dict(r: TaskResult) -> dict:
    d = r.to_dict()
    d.pop("id")
    d.pop("level")
    return d


def main(argv: list[str] | None = None) -> None:
    from mlx_grpo.models import ModelLoadError

    argv = sys.argv[1:] if argv is None else argv
    try:
        run_compare(argv)
    except (CompareError, ConfigError, ModelLoadError) as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(0)


if __name__ == "__main__":
    main()
