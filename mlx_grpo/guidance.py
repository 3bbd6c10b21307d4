"""Off-policy guidance (LUFFY, Yan et al. 2025): a demonstration where a group has no signal.

A group in which no sample succeeds (a level the policy cannot yet solve) gives GRPO
no gradient toward success: none when its G samples all score the same, and only the
partial credit's when they differ. With `guidance.enabled`, the recipe's own replies for
the task (`demonstrate(task)` in its tasks.py: a scripted solution) are played through
the same environment and chat template as a sampled episode, scored by the same
reward, and put in place of the group's lowest-scoring sample when they score higher
than every sample. The group then has one high reward among G: the demonstration's
tokens get a positive advantage, the failed samples a negative one. Its old log-probs are the policy's own
(as for every sample with num_iterations = 1), so its ratio starts at 1 and the clipped
surrogate is a policy-gradient step toward the demonstration, weighted by its advantage.
"""

from __future__ import annotations

import numpy as np

from mlx_grpo.config import RolloutConfig
from mlx_grpo.env import Episode
from mlx_grpo.recipe import Recipe, Scored, Task
from mlx_grpo.rollout import (
    Completion,
    Rollout,
    TurnTemplate,
    close_env,
    episode_prompt,
    take_turn,
)


def demonstration(
    recipe: Recipe, tokenizer, task: Task, index: int, prompt: list[int], cfg: RolloutConfig
) -> Completion | None:
    """The recipe's demonstration of `task` as a Completion of prompt `index`, token for
    token what sampling its replies would have produced (each reply ends with EOS), or
    None when the recipe has none or a reply is longer than `rollout.max_new_tokens`.

    `recipe.demonstrate(task)` gives the replies in advance (a list, one per turn) or
    a policy `reply(env, observation) -> str | None` asked at each turn (a scripted
    agent that reads the page; None: it has nothing to do)."""
    plan = _as_policy(recipe.demonstrate(task))
    if plan is None:
        return None
    eos = tokenizer.eos_token_id

    def encode(reply: str) -> list[int] | None:
        toks = tokenizer.encode(reply, add_special_tokens=False) + [eos]
        return toks if len(toks) <= cfg.max_new_tokens else None

    if not recipe.multi_turn:
        reply = plan(None, task.messages[-1]["content"])
        toks = None if reply is None else encode(reply)
        return None if toks is None else Completion(index, toks, reply, "stop", demonstration=True)
    env = recipe.make_env(task)
    try:
        first = recipe.first_messages(task, env)
        if episode_prompt(tokenizer, first, env, cfg.max_prompt_tokens) != prompt:
            raise ValueError(f"recipe {recipe.name}: env.reset() differs between runs of {task.id}")
        episode, history, mask = Episode(env=env), [], []
        template, reason, observation = TurnTemplate(tokenizer), "length", first[-1]["content"]
        for turn in range(cfg.max_turns):
            reply = plan(env, observation)
            if reply is None:  # the demonstration gave up before the episode ended
                reason = "length"
                break
            toks = encode(reply)
            if toks is None:
                return None
            extra, reason, _ = take_turn(
                episode, reply, toks, "stop", turn, len(prompt), history, mask, template, cfg
            )
            if extra is None:
                break
            observation = episode.results[-1].observation
    finally:
        close_env(env)
    finish = "stop" if episode.done else reason
    return Completion(
        index, history, episode.text, finish, loss_mask=mask, episode=episode, demonstration=True
    )


def _as_policy(plan):
    """`demonstrate(task)`'s answer as a policy `reply(env, observation)` (or None)."""
    if plan is None or callable(plan):
        return plan
    replies = iter(plan)
    return lambda env, observation: next(replies, None)


def demonstration_replies(recipe: Recipe, task: Task, cfg: RolloutConfig) -> list[str]:
    """The replies of the task's demonstration as it plays in a fresh environment, or
    [] when there is none or it does not end the episode within `rollout.max_turns`."""
    plan = _as_policy(recipe.demonstrate(task))
    if plan is None:
        return []
    env, replies = recipe.make_env(task), []
    try:
        observation = recipe.first_messages(task, env)[-1]["content"]
        for _ in range(cfg.max_turns):
            reply = plan(env, observation)
            if reply is None:
                return []
            replies.append(reply)
            result = env.step(reply)
            if result.done:
                return replies
            observation = result.observation
    finally:
        close_env(env)
    return []


def demonstration_starts(
    recipe: Recipe,
    tasks: list[Task],
    share: float,
    rng: np.random.Generator,
    cfg: RolloutConfig,
    say=print,
) -> list[list[str]]:
    """`guidance.demo_starts`: the replies each task's group starts after ([]: from the
    start). A share of the tasks, drawn with `rng`, start after the first k of the n
    replies of their demonstration, k uniform in 1..n-1: a reverse curriculum over the
    demonstration's states (Salimans & Chen 2018; R3, Xi et al. 2024). From there the
    goal is a few turns away, so a task that no sample solves from its start gives
    groups with mixed rewards, on the policy's own tokens. Tasks whose demonstration
    takes one turn, or raises (said), start at the start."""
    starts = []
    for task in tasks:
        replies = []
        if rng.random() < share:
            try:
                replies = demonstration_replies(recipe, task, cfg)
            except Exception as e:  # the recipe's script or env: this group starts at 0
                say(f"guidance.demo_starts: the demonstration of {task.id} raised: {e!r}")
        starts.append(replies[: int(rng.integers(1, len(replies)))] if len(replies) > 1 else [])
    return starts


def guide_groups(
    recipe: Recipe,
    tokenizer,
    tasks: list[Task],
    rollout: Rollout,
    scored: list[Scored],
    cfg: RolloutConfig,
    say=print,
    skip: frozenset[int] = frozenset(),
    signal: str | None = None,
) -> list[tuple[int, float]]:
    """In each group that no sample solved (`solved`) and that the recipe's
    demonstration beats (it ends its episode and scores higher than every sample), put
    it in place of the lowest-scoring sample (the last of equals), in `rollout` and
    `scored`. A recipe that scores a group as a whole
    (`reward_batch`) scores it again with the demonstration in. Groups whose reward
    raised, and demonstrations that raise (said once each), are left as sampled.
    Groups in `skip` (those that started partway: `guidance.demo_starts`) are left alone.
    `signal`: `credit.signal_component`. Returns the (row, reward) of the demonstration
    and of every row whose reward changed."""
    g = rollout.group_size
    whole = callable(getattr(recipe.module, "reward_batch", None))
    changed = []
    for i, task in enumerate(tasks):
        group = scored[i * g : (i + 1) * g]
        rewards = [s.reward for s in group]
        if i in skip or solved(group, signal, recipe.max_reward) or any(s.error for s in group):
            continue  # nothing to beat, or nothing to trust
        try:
            demo = demonstration(recipe, tokenizer, task, i, rollout.prompts[i], cfg)
        except Exception as e:  # the recipe's script or env: this group goes unguided
            say(f"guidance.enabled: the demonstration of {task.id} raised, left out: {e!r}")
            continue
        if demo is None or demo.finish_reason != "stop":
            continue
        out = g - 1 - rewards[::-1].index(min(rewards))  # the last of the lowest
        if whole:
            comps = rollout.completions[i * g : (i + 1) * g]
            comps[out] = demo
            new = recipe.score_groups([task], [[c.episode or c.text for c in comps]])[0]
        else:
            new = list(group)
            new[out] = recipe.score_groups([task], [[demo.episode or demo.text]])[0][0]
        others = new[:out] + new[out + 1 :]
        if new[out].error or new[out].reward <= max(s.reward for s in others) + 1e-6:
            continue
        rollout.completions[i * g + out] = demo
        scored[i * g : (i + 1) * g] = new
        changed += [
            (i * g + j, s.reward) for j, s in enumerate(new) if j == out or s.reward != rewards[j]
        ]
    return changed


def solved(group: list[Scored], signal: str | None, best: float) -> bool:
    """A sample of the group did the task: it scored on `signal` (credit.signal_component,
    else the reward's `success` when it has one), or, for a reward with neither, reached
    the recipe's best. (A success that lost a little elsewhere, an extra step's
    efficiency, is still a success: a demonstration must not take its place.)

    >>> ok, slow = Scored(1.07, {"success": 1.0}), Scored(0.0, {"success": 0.0})
    >>> solved([slow, ok], None, 1.1), solved([slow, slow], None, 1.1)
    (True, False)
    >>> solved([Scored(0.5, {"partial": 0.5})], None, 1.0)
    False
    """
    key = signal or ("success" if any("success" in s.components for s in group) else None)
    if key is not None:
        return any(s.components.get(key, 0.0) > 0 for s in group)
    return max(s.reward for s in group) >= best - 1e-6


def demonstration_advantages(
    guided: np.ndarray, sampled: np.ndarray, demo_rows: list[int]
) -> np.ndarray:
    """`guidance.advantage="demonstration"`: each row's advantage in its own
    sampled group (`sampled`, from the on-policy rewards), except the demonstration
    rows, which keep theirs in the group with the demonstration in (`guided`).

    >>> demonstration_advantages(np.array([2.5, -0.5, -0.5]), np.zeros(3), [0]).tolist()
    [2.5, 0.0, 0.0]
    """
    out = np.array(sampled, dtype=np.float32, copy=True)
    out[demo_rows] = np.asarray(guided)[demo_rows]
    return out
