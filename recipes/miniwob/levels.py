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
    ap.add_argument("--seed", type=int, default=0, help="held-out block (compare's --seed)")
    args = ap.parse_args(argv)
    types = args.types if args.types in ("suite", "train", "transfer") else args.types.split(",")
    names = resolve_types(types, TRAIN)
    overrides = {"recipe": {"params": {"types": names}}}
    cfg = build_config(recipe_defaults("miniwob"), overrides=overrides, source="levels")
    recipe = Recipe.from_config(cfg.recipe)
    tasks = recipe.tasks("eval", args.seeds * len(names), args.seed)
    model, tokenizer = load_side(resolve_side("a", args.model))
    share: dict[str, float] = {}
    print(f"| type | greedy success ({args.seeds} held-out seeds) |\n| --- | --- |", flush=True)
    tic = time.perf_counter()
    for name in names:  # one type at a time, its episodes in one batch
        of_type = [t for t in tasks if t.payload["task"] == name]
        results = evaluate(model, tokenizer, recipe, of_type, cfg.rollout, batch_tasks=len(of_type))
        share[name] = sum(r.components["success"][0] for r in results) / len(results)
        print(f"| {name} | {share[name]:.0%} |", flush=True)
    mean = sum(share.values()) / len(share)
    print(f"| mean over {len(share)} types | {mean:.1%} |")
    print(f"{len(tasks)} episodes in {time.perf_counter() - tic:.0f} s")
    if args.model == "default":
        BASE_FILE.write_text(json.dumps(dict(sorted(share.items())), indent=1) + "\n")


if __name__ == "__main__":
    main()
