"""Where a run's ill-formed replies come from: each sampled episode of a run folder's
`samples.jsonl` is played again in its task's browser, and every reply is counted by
what came before it (the episode's first reply, a reply after an action that worked,
a reply after an invalid action) and whether it was well formed, per level and block of
steps.

    python -m recipes.web_browsing.after_errors checkpoints/<run> [--block 10]

The run must keep its samples (`train.sample_every=1` keeps every step's). The train
tasks are rebuilt from the run's `config.json` (recipe params, train size and seed).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path

from recipes.web_browsing.tasks import make_env, make_tasks

CONTEXTS = ("first", "after a valid action", "after an invalid action")


def reply_contexts(task, replies: list[str]) -> list[tuple[str, bool]]:
    """(context, well formed) of each reply of an episode of `task`, played again; the
    replies after the episode ended (none in a sample) are left out.

    A reply after a wrong element id is one after an invalid action:
    >>> from recipes.web_browsing.tasks import make_tasks
    >>> task = next(t for t in make_tasks("train", 40, 0) if t.level == 4)
    >>> reply_contexts(task, ['click "Nothing" [99]', "Sorry, let me try again."])
    [('first', True), ('after an invalid action', False)]
    """
    env = make_env(task)
    env.reset()
    out, context = [], CONTEXTS[0]
    for reply in replies:
        if env.done:
            break
        info = env.step(reply).info
        out.append((context, bool(info["format"])))
        context = CONTEXTS[2] if info["error"] is not None else CONTEXTS[1]
    return out


def tabulate(run: Path, block: int) -> dict[tuple[int, int], Counter]:
    """{(block index, level): Counter of (context, well formed)} over the run's samples."""
    cfg = json.loads((run / "config.json").read_text())
    recipe = cfg["recipe"]
    tasks = make_tasks("train", recipe["train_size"], cfg["train"]["seed"], **recipe["params"])
    by_id = {t.id: t for t in tasks}
    counts: dict[tuple[int, int], Counter] = defaultdict(Counter)
    with open(run / "samples.jsonl") as f:
        for line in f:
            s = json.loads(line)
            task = by_id.get(s["task"])
            if task is None:
                raise SystemExit(f"{run}/samples.jsonl: task {s['task']} is not a train task")
            # An action is one line (rollout.stop_at_newline): one reply a line.
            key = ((s["step"] - 1) // block, task.level)
            counts[key].update(reply_contexts(task, s["completion"].split("\n")))
    return counts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a run folder with samples.jsonl")
    ap.add_argument("--block", type=int, default=10, help="steps per row")
    args = ap.parse_args(argv)
    counts = tabulate(args.run, args.block)
    print("| steps | level | " + " | ".join(f"ill-formed {c}" for c in CONTEXTS) + " |")
    print("| --- | --- |" + " --- |" * len(CONTEXTS))
    for b, level in sorted(counts):
        c = counts[(b, level)]
        cells = [f"{c[(x, False)]}/{c[(x, False)] + c[(x, True)]}" for x in CONTEXTS]
        steps = f"{b * args.block + 1}-{(b + 1) * args.block}"
        print(f"| {steps} | {level} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
