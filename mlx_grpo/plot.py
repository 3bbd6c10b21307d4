"""`python -m mlx_grpo plot checkpoints/<run>`: one PNG of a run's metrics.jsonl.

Four panels over steps: the reward and each of its components (smoothed), held-out
figures (when `train.eval_every` was set), KL to the reference with the policy's
entropy (over the update's tokens, and over every token the rollout sampled), and the
share of each level in the tasks the curriculum drew.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mlx_grpo.durable import read_jsonl
from mlx_grpo.runfolder import RunFolder

# The third panel's lines: metrics.jsonl key, legend label.
KL_AND_ENTROPY = (
    ("kl", "KL to reference"),
    ("entropy", "entropy of the update's tokens"),
    ("entropy/sampled", "entropy of every sampled token"),
)


class PlotError(ValueError):
    """A run folder that cannot be plotted; one line."""


def read_metrics(run_dir: Path) -> list[dict]:
    path = RunFolder(run_dir).metrics_file
    if not path.exists():
        raise PlotError(f"{path}: not found (is {run_dir} a run folder?)")
    rows = [r for r in read_jsonl(path)[0] if isinstance(r.get("step"), int)]
    if not rows:
        raise PlotError(f"{path}: no steps logged yet")
    return rows


def _series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    if not pts:
        return np.array([]), np.array([])
    steps, vals = zip(*pts)
    return np.array(steps), np.array(vals, dtype=float)


def _smooth(v: np.ndarray, width: int) -> np.ndarray:
    if len(v) < 3 or width <= 1:
        return v
    width = min(width, len(v))
    kernel = np.ones(width) / width
    padded = np.concatenate([np.full(width - 1, v[0]), v])
    return np.convolve(padded, kernel, mode="valid")


def held_out(run_dir: Path, rows: list[dict]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Held-out figures by step: from eval.jsonl when the run has one (it also holds the
    evaluation before training, step 0), else the eval/ keys of metrics.jsonl."""
    path = RunFolder(run_dir).eval_file
    if path.exists():
        from mlx_grpo.evaluate import TaskResult, summarize

        recs = read_jsonl(path)[0]
        sums = [(r["step"], summarize([TaskResult(**t) for t in r["results"]])) for r in recs]
        keys = {k for _, d in sums for k in d if "/level_" not in k}
        return {
            k: (np.array([st for st, d in sums]), np.array([d.get(k, np.nan) for _, d in sums]))
            for k in keys
        }
    keys = {k for r in rows for k in r if k.startswith("eval/") and "/level_" not in k}
    keys.discard("time/eval_s")
    return {k: _series(rows, k) for k in keys}


def plot_run(run_dir: Path, out: Path | None = None, smooth: int = 5) -> Path:
    """Write the PNG (default `<run>/metrics.png`) and return its path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("plot needs matplotlib: pip install 'mlx-grpo[plot]'") from None
    rows = read_metrics(run_dir)
    out = out or run_dir / "metrics.png"
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    fig.suptitle(f"{run_dir.name}: {len(rows)} steps")

    ax = axes[0, 0]
    comps = sorted(
        k
        for k in {k for r in rows for k in r}
        if k.startswith("reward/") and k not in ("reward/std", "reward/errors")
    )
    for k in comps:
        s, v = _series(rows, k)
        ax.plot(
            s,
            _smooth(v, smooth),
            label=k.removeprefix("reward/"),
            lw=2 if k == "reward/mean" else 1,
        )
    ax.set_title(f"training reward and components (moving mean of {smooth})")
    ax.set_xlabel("step")
    ax.legend(fontsize=8)

    ax = axes[0, 1]
    held = held_out(run_dir, rows)
    for k in sorted(held):
        s, v = held[k]
        ax.plot(s, v, marker="o", label=k.removeprefix("eval/"))
    ax.set_title("held-out (greedy)" if held else "held-out: not evaluated (train.eval_every=0)")
    ax.set_xlabel("step")
    if held:
        ax.legend(fontsize=8)

    ax = axes[1, 0]
    for k, label in KL_AND_ENTROPY:
        s, v = _series(rows, k)
        if len(s):
            ax.plot(s, _smooth(v, smooth), label=label)
    ax.set_title("KL and entropy (per token)" if ax.lines else "KL and entropy: not logged yet")
    ax.set_xlabel("step")
    if ax.lines:
        ax.legend(fontsize=8)

    ax = axes[1, 1]
    levels = sorted(
        {int(k.rsplit("_", 1)[1]) for r in rows for k in r if k.startswith("curriculum/level_")}
    )
    if levels:
        steps = np.array([r["step"] for r in rows])
        shares = np.array([[r.get(f"curriculum/level_{lv}", 0.0) for r in rows] for lv in levels])
        shares = np.stack([_smooth(x, smooth) for x in shares])
        ax.stackplot(steps, shares, labels=[f"level {lv}" for lv in levels])
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8, loc="upper left")
    ax.set_title("levels drawn by the curriculum")
    ax.set_xlabel("step")

    try:
        fig.savefig(out, dpi=110)
    except OSError as e:
        raise PlotError(f"--out: cannot write {out} ({e.strerror})") from None
    except ValueError as e:  # an extension matplotlib does not write
        raise PlotError(
            f"--out: {out}: {(str(e).splitlines() or ['cannot write it'])[0]}"
        ) from None
    finally:
        plt.close(fig)
    return out
