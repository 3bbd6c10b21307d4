"""Group rollouts: G sampled completions for each of B prompts, in one batch.

Each prompt is prefilled once; its KV cache is shared by its G samples, which then
decode together with every other prompt's samples through mlx_lm's BatchGenerator
(one forward per new token for all B*G sequences). The sampled token ids are kept
as they are (never re-tokenised), including the stop token when there is one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from mlx_grpo.config import RolloutConfig


@dataclass
class Completion:
    """One sampled completion of one prompt."""

    prompt_index: int
    tokens: list[int]  # sampled ids, stop token included when finish_reason == "stop"
    text: str  # decoded, without the stop token
    finish_reason: str  # "stop" (EOS) or "length" (hit max_new_tokens)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass
class Rollout:
    """B prompts x G completions; completions are grouped by prompt, contiguously."""

    prompts: list[list[int]]
    completions: list[Completion]
    group_size: int
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    stats: dict = field(default_factory=dict)

    @property
    def generated_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.completions)


def encode_prompt(tokenizer, messages: list[dict], max_prompt_tokens: int) -> list[int]:
    """Chat-template the messages; cut from the left so the generation prompt survives."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "input_ids"):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    ids = list(ids)
    return ids[-max_prompt_tokens:] if len(ids) > max_prompt_tokens else ids


def make_rollout_sampler(cfg: RolloutConfig):
    return make_sampler(
        temp=cfg.temperature,
        top_p=cfg.top_p if cfg.top_p < 1.0 else 0.0,
        min_p=cfg.min_p,
        top_k=cfg.top_k,
    )


def _prefill(model: nn.Module, prompt: list[int]) -> list:
    """A KV cache holding all prompt tokens but the last (which starts decoding)."""
    cache = make_prompt_cache(model)
    if len(prompt) > 1:
        model(mx.array(prompt[:-1])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def generate_groups(
    model: nn.Module,
    tokenizer,
    prompts: list[list[int]],
    group_size: int,
    cfg: RolloutConfig,
    sampler=None,
) -> Rollout:
    """Sample `group_size` completions for every prompt, all decoding in one batch."""
    if not prompts:
        raise ValueError("generate_groups needs at least one prompt")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt")
    n = len(prompts) * group_size
    tic = time.perf_counter()
    caches = [_prefill(model, p) for p in prompts]
    prefill_s = time.perf_counter() - tic

    gen = BatchGenerator(
        model,
        max_tokens=cfg.max_new_tokens,
        stop_tokens=[[t] for t in sorted(tokenizer.eos_token_ids)],
        sampler=sampler or make_rollout_sampler(cfg),
        completion_batch_size=n,
        prefill_batch_size=n,
    )
    try:
        owners = [i for i in range(len(prompts)) for _ in range(group_size)]
        uids = gen.insert(
            [[prompts[i][-1]] for i in owners],
            caches=[caches[i] for i in owners],  # shared, never mutated by merge
        )
        tokens: dict[int, list[int]] = {u: [] for u in uids}
        finish: dict[int, str] = {}
        while responses := gen.next_generated():
            for r in responses:
                tokens[r.uid].append(r.token)
                if r.finish_reason is not None:
                    finish[r.uid] = r.finish_reason
    finally:
        gen.close()

    completions = []
    for uid, owner in zip(uids, owners):
        toks = tokens[uid]
        reason = finish.get(uid, "length")
        body = toks[:-1] if reason == "stop" else toks
        completions.append(Completion(owner, toks, tokenizer.decode(body), reason))
    return Rollout(
        prompts=prompts,
        completions=completions,
        group_size=group_size,
        seconds=time.perf_counter() - tic,
        prefill_seconds=prefill_s,
    )
