"""One multi-turn rollout, op by op and compiled, turn by turn.

    python -m mlx_grpo.bench.multiturn [--recipe web_browsing] [--levels 4,5] [--groups 4]
        [--way both|op|compiled]

Plays `--groups` training tasks of the chosen levels x G episodes with the recipe's
rollout settings, from the base model with fresh (zero) adapters, on the same keys:
with mlx_lm's batch generator (`rollout.compile_decode=false`), then with the compiled
decoder, or one of them (`--way`). Prints, per turn, the decode call's seconds, its
rows, the tokens of the pages fed on top of the episodes' caches (their sum and
longest), the contexts and the tokens sampled; then each way's total and, with both,
whether they sampled the same tokens. The second way of a process runs faster for
having the first before it (its memory already mapped: a compiled first turn of the
default took 10.0 s second and 15.5 s alone): time the ways in separate processes.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import numpy as np

import mlx_grpo.rollout as rollout_mod
from mlx_grpo.config import build_config
from mlx_grpo.models import apply_lora, load_model
from mlx_grpo.recipe import Recipe, recipe_defaults


def play(model, tok, recipe, tasks, cfg, compiled: bool):
    """(rollout, per-turn records) of one rollout with `compile_decode` as given."""
    rcfg = cfg.rollout.model_copy(update={"compile_decode": compiled})
    g = cfg.grpo.num_generations
    turns = []
    decode = rollout_mod._decode

    def timed(model, tokenizer, tails, caches, dcfg, sampler):
        tic = time.perf_counter()
        out = decode(model, tokenizer, tails, caches, dcfg, sampler)
        ctx = [c[0].offset for c in caches]
        turns.append(
            {
                "s": time.perf_counter() - tic,
                "rows": len(tails),
                "page_sum": sum(len(t) - 1 for t in tails),
                "page_max": max(len(t) - 1 for t in tails),
                "context_mean": int(np.mean(ctx)),
                "context_max": max(ctx),
                "sampled": sum(len(o[0]) for o in out),
            }
        )
        return out

    samplers = rollout_mod.keyed_samplers(rcfg, mx.random.split(mx.random.key(11), len(tasks) * g))
    rollout_mod._decode = timed
    try:
        out = rollout_mod.rollout_tasks(model, tok, recipe, tasks, g, rcfg, samplers)
    finally:
        rollout_mod._decode = decode
    return out, turns


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mlx_grpo.bench.multiturn", description=__doc__)
    ap.add_argument("--recipe", default="web_browsing")
    ap.add_argument("--levels", default="4,5", help="task levels drawn from")
    ap.add_argument("--groups", type=int, default=4, help="training tasks played")
    ap.add_argument("--way", choices=("both", "op", "compiled"), default="both")
    args = ap.parse_args(argv)
    cfg = build_config(recipe_defaults(args.recipe))
    recipe = Recipe.from_config(cfg.recipe)
    if not recipe.multi_turn:
        raise SystemExit(f"recipe {recipe.name} is single-turn")
    levels = {int(x) for x in args.levels.split(",")}
    pool = [t for t in recipe.tasks("train", cfg.recipe.train_size, 0) if t.level in levels]
    if len(pool) < args.groups:
        raise SystemExit(f"--levels {args.levels}: {len(pool)} training tasks, fewer than --groups")
    pick = np.random.default_rng(3).choice(len(pool), args.groups, replace=False)
    tasks = [pool[i] for i in pick]
    model, tok = load_model(cfg.model)
    apply_lora(model, cfg.lora, seed=0)
    model.eval()
    tokens = {}
    ways = {"both": (False, True), "op": (False,), "compiled": (True,)}[args.way]
    for compiled in ways:
        tic = time.perf_counter()
        out, turns = play(model, tok, recipe, tasks, cfg, compiled)
        total = time.perf_counter() - tic
        name = "compiled" if compiled else "op by op"
        for i, t in enumerate(turns):
            print(
                f"{name:9s} turn {i + 1}: {t['s']:6.1f} s  {t['rows']:3d} rows  pages "
                f"{t['page_sum']:5d} tokens (longest {t['page_max']:3d})  context "
                f"{t['context_mean']:5d} mean, {t['context_max']:5d} max  sampled {t['sampled']}"
            )
        turns_mean = np.mean([c.episode.turns for c in out.completions])
        print(
            f"{name:9s} total {total:6.1f} s (prompt prefill {out.prefill_seconds:.1f} s, "
            f"environments {out.env_seconds:.1f} s), {turns_mean:.2f} turns an episode, "
            f"{out.generated_tokens} sampled tokens",
            flush=True,
        )
        tokens[compiled] = [c.tokens for c in out.completions]
    if len(tokens) == 2:
        print("same tokens both ways:", tokens[False] == tokens[True])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
