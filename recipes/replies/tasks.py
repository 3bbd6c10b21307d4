"""Reply to a short post: 45 posts written for this project (posts.jsonl), three levels.

level 1: news or a plain question     level 2: an opinion or a choice to engage with
level 3: bad news, a complaint or a worry, where tact matters

A post's split is a function of its id (a hash, one in five to eval). A post may be
drawn again in training (replies have no single answer); the eval posts never appear
in training. See rewards/replies.py for the six components.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from pathlib import Path

from mlx_grpo.recipe import Task
from rewards.replies import reward, reward_batch  # noqa: F401  (the recipe's reward)

POSTS = Path(__file__).with_name("posts.jsonl")
EVAL_SHARE = 5
SYSTEM = (
    "You reply to posts on a friendly forum. Write one short reply of one to three "
    "sentences: warm, specific to the post, in plain words."
)


def split_of(post_id: str) -> str:
    h = int(hashlib.sha256(post_id.encode()).hexdigest()[:8], 16)
    return "eval" if h % EVAL_SHARE == 0 else "train"


def load_posts() -> list[dict]:
    return [json.loads(line) for line in POSTS.read_text().splitlines() if line.strip()]


def make_tasks(
    split: str,
    n: int,
    seed: int,
    levels: Sequence[int] = (1, 2, 3),
    min_words: int = 8,
    max_words: int = 50,
) -> list[Task]:
    """The posts of `split` at `levels`, shuffled by `seed`, at most `n`; a reply should
    have `min_words`..`max_words` words."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if not 0 < min_words <= max_words:
        raise ValueError(f"need 0 < min_words <= max_words, got {min_words}, {max_words}")
    posts = [p for p in load_posts() if p["level"] in levels and split_of(p["id"]) == split]
    random.Random(f"replies-{seed}").shuffle(posts)
    return [
        Task(
            id=f"{split}-{p['id']}",
            level=p["level"],
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": p["post"]},
            ],
            payload={
                "post": p["post"],
                "keywords": p["keywords"],
                "min_words": min_words,
                "max_words": max_words,
            },  # fmt: skip
        )
        for p in posts[:n]
    ]
