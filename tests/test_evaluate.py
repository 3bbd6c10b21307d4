"""Held-out evaluation (`mlx_grpo.evaluate`) at a temperature: seeded keyed sampling."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from mlx_grpo.config import RolloutConfig
from mlx_grpo.evaluate import evaluate
from mlx_grpo.recipe import Recipe

TOY_ENV = Path(__file__).parent / "data" / "toy_env"


def test_a_sampled_evaluation_draws_the_same_replies_for_a_seed(tiny):
    """At a temperature each sample draws from its own key, split from `seed`: the same
    seed plays the same replies whether the tasks go 4 or 1 at a time, whatever MLX's
    global random state, on either decode path; another seed plays other replies."""
    model, tok = tiny
    recipe = Recipe(str(TOY_ENV), {"finished": 1.0, "short": 0.5}, {})
    tasks = recipe.tasks("eval", 4, 0)

    def replies(seed: int, batch: int, compiled: bool = True) -> list[list[str]]:
        mx.random.seed(100 + batch)  # the global random state plays no part
        cfg = RolloutConfig(max_new_tokens=10, max_turns=2, compile_decode=compiled)
        results = evaluate(
            model, tok, recipe, tasks, cfg, samples=3, temperature=1.0, batch_tasks=batch, seed=seed
        )
        return [r.texts for r in results]

    want = replies(5, 4)
    assert len({t for texts in want for t in texts}) > 6  # the samples really differ
    assert replies(5, 1) == want
    assert replies(5, 2, compiled=False) == want
    assert replies(6, 4) != want
