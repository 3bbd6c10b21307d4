"""mlx-grpo on the benchmark's work unit: `steps` steps of the real training loop.

    python -m mlx_grpo.bench.run_mlx_grpo --steps 4 [--group 8] [--max-new-tokens 64]

Prints one tagged JSON line (see mlx_grpo.bench.work_unit.emit). With --profile it then
re-runs each phase of one step alone on the last step's rollout (prefill, decode,
reference forward, policy forward+backward, optimizer) and times the ops of the model
in isolation at the same shapes (mlx_grpo.bench.floor).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from mlx_grpo.bench import work_unit as wu  # first: loads OpenBLAS before mlx


class FixedOrder:
    """The work unit's tasks in order, B per step, cycled (no curriculum decisions,
    so every system sees the same prompts at the same step)."""

    oversample = 1.0

    def __init__(self, tasks):
        self.tasks = tasks
        self.next = 0

    def sample(self, n):
        out = [self.tasks[(self.next + i) % len(self.tasks)] for i in range(n)]
        self.next = (self.next + n) % len(self.tasks)
        return out

    def update(self, tasks, group_rewards):
        pass

    def metrics(self):
        return {}

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = state["next"]


def config(
    steps: int,
    group: int,
    max_new_tokens: int,
    model: str,
    out_dir: str,
    compile: bool = False,
    compile_decode: bool | None = None,
):
    from mlx_grpo.config import build_config

    recipe = str(Path(__file__).parent / "work_unit_recipe")
    return build_config(
        None,
        None,
        {
            "model": {"path": model},
            "lora": {"rank": wu.LORA_RANK, "scale": wu.LORA_SCALE, "dropout": wu.LORA_DROPOUT},
            "rollout": {
                "max_new_tokens": max_new_tokens,
                "temperature": wu.TEMPERATURE,
                "top_p": wu.TOP_P,
                "top_k": wu.TOP_K,
                **({} if compile_decode is None else {"compile_decode": compile_decode}),
            },
            "grpo": {
                "num_generations": group,
                "beta": wu.BETA,
                "epsilon": wu.EPSILON,
                "num_iterations": wu.NUM_ITERATIONS,
                "loss_type": wu.LOSS_TYPE,
                "scale_rewards": "group",
            },
            # The peers update on every group, even those whose rewards are all
            # equal; mlx-grpo by default skips them. Same work for all here.
            "credit": {"skip_zero_variance_groups": False},
            "engine": {"compile": compile},
            "optimizer": {
                "learning_rate": wu.LEARNING_RATE,
                "schedule": "constant",
                "warmup_steps": 0,
                "max_grad_norm": wu.MAX_GRAD_NORM,
            },
            "train": {"steps": steps, "batch_size": wu.BATCH, "sample_every": 0, "seed": 0},
            "recipe": {"name": recipe, "train_size": wu.N_TASKS},
            "output": {"dir": out_dir, "run": "bench", "save_every": 10**6, "live": "no"},
        },
        source="bench",
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--t0", type=float, default=None, help="the launcher's time.time()")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--group", type=int, default=wu.GROUP)
    p.add_argument("--max-new-tokens", type=int, default=wu.MAX_NEW_TOKENS)
    p.add_argument("--model", default="default")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--compile", action="store_true", help="--engine.compile=true")
    p.add_argument(
        "--compile-decode",
        choices=["true", "false"],
        default=None,
        help="--rollout.compile_decode (default: the config's default)",
    )
    args = p.parse_args(argv)
    clock = wu.StepClock(args.t0 or time.time())

    import mlx.core as mx

    import mlx_grpo
    from mlx_grpo.device import blas_in_use, native_in_use
    from mlx_grpo.models import apply_lora, load_model, trainable_count
    from mlx_grpo.recipe import Recipe
    from mlx_grpo.trainer import build_optimizer, train

    with tempfile.TemporaryDirectory() as out_dir:
        decode = None if args.compile_decode is None else args.compile_decode == "true"
        cfg = config(
            args.steps, args.group, args.max_new_tokens, args.model, out_dir, args.compile, decode
        )
        recipe = Recipe(cfg.recipe.name, cfg.recipe.weights, cfg.recipe.params)
        model, tokenizer = load_model(cfg.model)
        apply_lora(model, cfg.lora, seed=cfg.train.seed)
        optimizer = build_optimizer(cfg.optimizer, cfg.train.steps)
        curriculum = FixedOrder(recipe.tasks("train", wu.N_TASKS, 0))
        last = [time.time()]
        captured = {}

        from mlx_grpo.bench.floor import Shapes, step_work

        shapes = Shapes(model, cfg.lora.rank)

        def on_step(step: int, m: dict) -> None:
            now = time.time()
            ro = captured["rollout"]
            work = step_work(
                shapes,
                [len(q) for q in ro.prompts],
                [len(c.tokens) for c in ro.completions],
                args.group,
            )
            step_s, last[0] = now - last[0], now
            clock.record(
                step_s=step_s,
                rollout_s=m["time/rollout_s"],
                update_s=step_s - m["time/rollout_s"],
                gen_tokens=m["rollout/tokens"],
                reward_mean=m["reward/mean"],
                groups_trained=m["groups/trained"],
                mlx_peak_gb=m["memory/peak_gb"],
                prefill_s=ro.prefill_seconds,
                work=work,
            )

        run_dir = Path(out_dir) / "bench"
        run_dir.mkdir(parents=True)
        train(
            model,
            tokenizer,
            optimizer,
            recipe,
            curriculum,
            cfg,
            run_dir,
            {},
            callback=on_step,
            say=lambda s: None,
            rollout_fn=_capturing(captured),
        )
        extra = {
            "trainable_params": trainable_count(model),
            "blas": blas_in_use() + (" + native attention and SwiGLU" if native_in_use() else ""),
            "device": str(mx.default_device()),
            "group": args.group,
            "max_new_tokens": args.max_new_tokens,
        }
        if args.profile:
            from mlx_grpo.bench.floor import profile_step

            extra["profile"] = profile_step(model, tokenizer, optimizer, cfg, captured["rollout"])
        wu.emit(clock.result("mlx-grpo", mlx_grpo.__version__, **extra))


def _capturing(captured: dict):
    """The trainer's rollout, keeping the latest one (for the phase profile)."""
    from mlx_grpo.rollout import rollout_tasks

    def keep(*a, **k):
        captured["rollout"] = rollout_tasks(*a, **k)
        return captured["rollout"]

    return keep


if __name__ == "__main__":
    main()
