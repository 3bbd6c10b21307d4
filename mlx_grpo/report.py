"""The report of `python -m mlx_grpo.compare`: per-task values, the rows with their
intervals and p-values (`mlx_grpo.stats`), the terminal table, the per-level plot and
compare.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlx_grpo.durable import write_atomic
from mlx_grpo.evaluate import TaskResult
from mlx_grpo.recipe import Recipe
from mlx_grpo.runfolder import RunFolder
from mlx_grpo.sides import CompareError
from mlx_grpo.stats import TOL, StatsConfig, compare_values, pass_at_k
from mlx_grpo.textstats import distinct_n, self_bleu


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


def _num(v: float, signed: bool = False) -> str:
    s = "+" if signed else ""
    if abs(v) >= 100:
        return f"{v:{s}.0f}"
    if abs(v) >= 10:
        return f"{v:{s}.1f}"
    return f"{v:{s}.3f}"


def _p(p: float) -> str:
    # four places below 0.1: 0.0496 and 0.0504 must not both read 0.050
    return "<0.0001" if p < 1e-4 else f"{p:.4f}" if p < 0.1 else f"{p:.3f}"


def _with_ci(v: float, lo: float, hi: float, signed: bool = False) -> str:
    return f"{_num(v, signed)} [{_num(lo, signed)}, {_num(hi, signed)}]"


def _diff_style(row: dict) -> str:
    return {"b": "green", "a": "red"}.get(row["better"], "")


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
    colors = [{"b": "tab:green", "a": "tab:red"}.get(r["better"], "tab:gray") for r in rows]
    ax_d.axhline(0, color="black", lw=0.8)
    ax_d.errorbar(x, diffs, yerr=err, fmt="none", ecolor="black", capsize=4)
    ax_d.scatter(x, diffs, c=colors, zorder=3)
    ax_d.set_xticks(x, labels)
    ax_d.set_ylabel("B - A")
    ax_d.set_title("paired difference B - A, 95% bootstrap CI")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(data: dict, report: Report, out: Path, adapters: Path | None, console) -> list:
    """compare.json and compare.png in `out`; compare.json also beside the adapters B
    was (a run folder, or the step folder of `RUN@step`), where the export's model card
    looks for it: comparing an earlier step leaves the run's own result in place."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "compare.json"
    write_atomic(path, json.dumps(data, indent=2) + "\n")  # (an earlier one stays whole)
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
    copy = RunFolder(adapters).compare_file if adapters is not None else None
    if copy is not None and path.resolve() != copy.resolve():
        try:
            write_atomic(copy, path.read_bytes())
            written.append(copy)
        except OSError as e:  # a read-only run, a step the run has since pruned
            console.print(
                f"warning: {copy} not written ({e.strerror}), so an export's model card "
                "will not quote this compare",
                highlight=False,
            )
    return written


def task_dict(r: TaskResult) -> dict:
    """A task's result for compare.json, without the id and level its row holds."""
    d = r.to_dict()
    d.pop("id")
    d.pop("level")
    return d
