"""The embedded model's greedy success per MiniWoB++ task type, which orders the levels.

    python -m recipes.miniwob.levels [--model default] [--seeds 20] [--types suite]

Plays `--seeds` held-out episodes of every type (greedy, the recipe's settings), prints
a table and, for the default model, writes base.json (type -> success share), from which
tasks.py numbers the levels.
"""

from __future__ import annotations

import argparse
import json
import time

from mlx_grpo.config import build_config
from mlx_grpo.evaluate import evaluate
from mlx_grpo.recipe import Recipe, recipe_defaults
from mlx_grpo.sides import load_side, resolve_side
from recipes.miniwob.tasks import BASE_FILE, TRAIN, resolve_types


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="a compare side: default, a run folder...")
    ap.add_argument("--seeds", type=int, default=20, help="held-out episodes per type")
    ap.add_argument("--types", default="suite", help="'suite', 'train', 'transfer' or a,b,c")
    args = ap.parse_args(argv)
    types = args.types if args.types in ("suite", "train", "transfer") else args.types.split(",")
    names = resolve_types(types, TRAIN)
    overrides = {"recipe": {"params": {"types": names}}}
    cfg = build_config(recipe_defaults("miniwob"), overrides=overrides, source="levels")
    recipe = Recipe.from_config(cfg.recipe)
    tasks = recipe.tasks("eval", args.seeds * len(names), cfg.seed)
    model, tokenizer = load_side(resolve_side("a", args.model))
    tic = time.perf_counter()
    results = evaluate(model, tokenizer, recipe, tasks, cfg.rollout, batch_tasks=32)
    seconds = time.perf_counter() - tic
    by_type: dict[str, list[float]] = {}
    for task, r in zip(tasks, results):
        by_type.setdefault(task.payload["task"], []).append(r.components["success"][0])
    share = {t: sum(v) / len(v) for t, v in by_type.items()}
    print(f"| type | greedy success ({args.seeds} held-out seeds) |\n| --- | --- |")
    for t in sorted(share, key=lambda t: (-share[t], t)):
        print(f"| {t} | {share[t]:.0%} |")
    mean = sum(share.values()) / len(share)
    print(
        f"| mean over {len(share)} types | {mean:.1%} |\n{len(tasks)} episodes in {seconds:.0f} s"
    )
    if args.model == "default":
        BASE_FILE.write_text(json.dumps(dict(sorted(share.items())), indent=1) + "\n")


if __name__ == "__main__":
    main()
