"""metrics.jsonl, samples.jsonl and what a person watches: a rich live panel on a
terminal, one line per step elsewhere (CI logs, pipes)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from mlx_grpo.durable import append_record

# Figures of the process that ran a step rather than of the run: seconds, memory, and the
# shapes compiled so far (a resumed process traces its shapes again). A resumed run, a
# loaded machine or another CPU gives other values for the same step, so anything that
# compares two runs step by step leaves these out.
PROCESS_METRICS = ("time/", "rollout/tokens_per_s", "memory/", "compile/")

KEY_METRICS = (
    "reward/mean",
    "reward/std",
    "groups/zero_variance_frac",
    "kl",
    "guard/kl_x_median",
    "loss/total",
    "entropy",
    "entropy/reinforced",
    "entropy/sampled",
    "guard/entropy_x_median",
    "guard/entropy_reinforced_x_median",
    "guard/entropy_sampled_x_median",
    "grad_norm",
    "completion/len_mean",
    "rollout/tokens_per_s",
    "time/rollout_s",
    "time/env_s",
    "time/update_s",
    "memory/children_gb",
    "episode/turns_mean",
    "turns/withheld",
    "episodes/ended_ill_formed",
    "tools/calls_per_episode",
    "tools/failures",
    "curriculum/max_level",
    "curriculum/replay_frac",
    "curriculum/score_mean",
)


def _extra_keys(m: dict) -> list[str]:
    """Reward components and held-out figures, shown after the key metrics."""
    return [
        k
        for k in sorted(m)
        if (k.startswith("reward/") or k.startswith("eval/")) and k not in KEY_METRICS
    ]


def level_mix(m: dict) -> str:
    """'L1 25% L2 75%' from curriculum/level_N shares."""
    lv = sorted(
        (int(k.rsplit("_", 1)[1]), v) for k, v in m.items() if k.startswith("curriculum/level_")
    )
    return " ".join(f"L{n} {v:.0%}" for n, v in lv)


class JsonlWriter:
    """Appends one record per call, durably (mlx_grpo.durable)."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, record: dict) -> None:
        append_record(self.path, record)


class Display:
    """Live progress + key figures + reward components; plain lines when not a tty."""

    def __init__(self, total_steps: int, start_step: int, live: str, title: str):
        self.console = Console(stderr=False)
        self.live_on = live == "yes" or (live == "auto" and sys.stdout.isatty())
        self.total = total_steps
        self.title = title
        self.history: list[float] = []
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("step {task.fields[secs]:.1f}s"),
            TimeRemainingColumn(),
            console=self.console,
        )
        self.task = self.progress.add_task(title, total=total_steps, completed=start_step, secs=0.0)
        self.live: Live | None = None
        self._t = time.perf_counter()

    def __enter__(self):
        if self.live_on:
            self.live = Live(self._render({}), console=self.console, refresh_per_second=4)
            self.live.__enter__()
        return self

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.__exit__(*exc)

    def _render(self, m: dict):
        table = Table(show_header=True, header_style="bold", expand=False)
        table.add_column("metric")
        table.add_column("value", justify="right")
        # What a user watches first on top: a terminal of 24 rows cuts the panel's end.
        head = [k for k in ("reward/mean", "reward/std") if k in m]
        for k in [*head, *_extra_keys(m)]:
            table.add_row(k, f"{m[k]:.4g}")
        if level_mix(m):
            table.add_row("curriculum levels", level_mix(m))
        for k in KEY_METRICS:
            if k in m and k not in head:
                table.add_row(k, f"{m[k]:.4g}")
        spark = _sparkline(self.history[-40:])
        return Group(self.progress, f"reward  {spark}", table) if m else Group(self.progress)

    def step(self, step: int, metrics: dict) -> None:
        self.history.append(metrics.get("reward/mean", 0.0))
        secs = time.perf_counter() - self._t
        self._t = time.perf_counter()
        self.progress.update(self.task, completed=step, secs=secs)
        if self.live is not None:
            self.live.update(self._render(metrics))
        else:
            parts = [f"step {step}/{self.total}"] + [
                f"{k}={metrics[k]:.4g}" for k in KEY_METRICS if k in metrics
            ]
            comps = [f"{k}={metrics[k]:.3g}" for k in _extra_keys(metrics)]
            mix = [f"levels=[{level_mix(metrics)}]"] if level_mix(metrics) else []
            line = " ".join(parts + comps + mix)
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    # Text from the run (an exception quoting model output: "[/INST] 42") is printed as
    # it is: read as rich markup it raised MarkupError mid-step, or vanished.
    def warn(self, text: str) -> None:
        line = Text.assemble(("warning:", "yellow"), " ", text)
        self.console.print(line, highlight=False, soft_wrap=True)

    def info(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)


def _sparkline(values: list[float]) -> str:
    if not values:
        return ""
    bars = "▁▂▃▄▅▆▇█"
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(bars[int((v - lo) / span * (len(bars) - 1))] for v in values) + (
        f"  {lo:.3g}..{hi:.3g}"
    )
