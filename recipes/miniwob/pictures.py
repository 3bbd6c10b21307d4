"""Pictures of what the agent did: the page at each step of a MiniWoB++ episode, with
the action written under it.

    python -m recipes.miniwob.pictures --model checkpoints/<run> --task click-option \\
        [--seed 1000000] [--out episode.png]

Plays one greedy episode of the held-out seed with the model (`default`, a run folder,
`RUN@step-NNNNNN`, as in compare), screenshotting the page before each action.
"""

from __future__ import annotations

import argparse
import io
import textwrap
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

TASK_W, TASK_H = 160, 210  # MiniWoB's task area, at the page's top left
SCALE = 2
CAPTION_LINES = 4


def _frame(png: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(png)).convert("RGB")
    return img.crop((0, 0, TASK_W, TASK_H)).resize((TASK_W * SCALE, TASK_H * SCALE))


def strip(goal: str, frames: list[bytes], captions: list[str]) -> Image.Image:
    """Frames side by side, each captioned; the goal on top."""
    font = ImageFont.load_default()
    w, h = TASK_W * SCALE, TASK_H * SCALE
    line_h = 14
    top = line_h * 2 + 8
    out = Image.new(
        "RGB", (max(1, len(frames)) * (w + 8) + 8, top + h + line_h * CAPTION_LINES + 16), "white"
    )
    draw = ImageDraw.Draw(out)
    for i, line in enumerate(textwrap.wrap(f"Goal: {goal}", 110)[:2]):
        draw.text((8, 4 + i * line_h), line, fill="black", font=font)
    for i, (png, caption) in enumerate(zip(frames, captions)):
        x = 8 + i * (w + 8)
        out.paste(_frame(png), (x, top))
        draw.rectangle((x - 1, top - 1, x + w, top + h), outline="gray")
        lines = textwrap.wrap(f"{i + 1}. {caption}", 48)[:CAPTION_LINES]
        for j, line in enumerate(lines):
            draw.text((x, top + h + 6 + j * line_h), line, fill="black", font=font)
    return out


def main(argv: list[str] | None = None) -> None:
    from mlx_lm.sample_utils import make_sampler

    from mlx_grpo.config import build_config
    from mlx_grpo.recipe import Recipe, recipe_defaults
    from mlx_grpo.rollout import rollout_tasks
    from mlx_grpo.sides import load_side, resolve_side

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--task", required=True, help="a MiniWoB task type")
    ap.add_argument(
        "--seed", type=int, default=None, help="episode seed (default: the first held-out)"
    )
    ap.add_argument("--out", type=Path, default=Path("episode.png"))
    args = ap.parse_args(argv)
    cfg = build_config(
        recipe_defaults("miniwob"), overrides={"recipe": {"params": {"types": [args.task]}}}
    )
    recipe = Recipe.from_config(cfg.recipe)
    task = recipe.tasks("eval", 1, cfg.seed)[0]
    task.payload["record"] = True  # screenshots at each step
    if args.seed is not None:
        task.payload["seed"] = args.seed
    model, tokenizer = load_side(resolve_side("a", args.model))
    model.eval()
    rollout = rollout_tasks(
        model, tokenizer, recipe, [task], 1, cfg.rollout, make_sampler(temp=0.0)
    )
    episode = rollout.completions[0].episode
    env = episode.env
    captions = [
        f"{reply.strip()}  ->  {result.info.get('error') or 'ok'}"
        for reply, result in zip(episode.actions, episode.results)
    ]
    verdict = "success" if env.outcome().success else f"failure (raw reward {env.raw_reward})"
    image = strip(
        f"{env.goal}   [{args.task}, seed {task.payload['seed']}: {verdict}]",
        env.screenshots,
        captions,
    )
    image.save(args.out)
    print(f"{args.out}: {len(env.screenshots)} steps, {verdict}")


if __name__ == "__main__":
    main()
