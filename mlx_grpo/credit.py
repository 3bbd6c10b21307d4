"""Credit assignment: from a step's scored episodes to the advantages the update weighs
and the groups it trains.

The rules, in order (`assign_credit`):

1. A completion that failed for the machine's sake (`recipe.INFRASTRUCTURE_FAILURES`:
   a browser that died) is neither blamed nor credited: it takes the mean reward of
   its group's others, and its advantage is exactly 0.
2. With guidance (`guidance.enabled`), a demonstration replaces a sample of a group in
   which no sample succeeded, with its reward; the advantages are computed over the
   group with the demonstration in. A demonstration is never an infrastructure failure.
3. Advantages are group-relative: the reward minus its group's mean, scaled as
   `grpo.scale_rewards` says (`grpo.group_advantages`).
4. A group whose rewards are all equal carries no policy gradient (no signal). With
   `credit.signal_component`, a group in which no sample scored above 0 on that
   component has no signal either (its variance is partial credit alone), unless a
   demonstration was guided into it.
5. With `guidance.advantage="demonstration"`, each sample keeps the advantage of
   its own on-policy group and only the demonstration takes the guided one; the
   samples of a group without signal of their own then stay in the batch with no loss
   tokens (`Credit.silent`), so that the demonstration trains alone.
6. The update trains the groups with signal, at most `train.batch_size` of them;
   without `credit.skip_zero_variance_groups` the groups of equal rewards join them
   (never the unscored ones).
7. The curriculum hears each group's on-policy rewards, an unscored group's as their
   mean (it taught nothing).

Within an episode that trains, `update.build_loss_inputs` leaves out of the loss the
ill-formed replies of a reinforced episode (`withheld_turns`, unless
`credit.reinforce_ill_formed`) and, with `credit.blame_replies="compared"`, the replies of
a below-average episode that no better episode was there to be compared with
(`uncompared_turns`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import mlx.core as mx
import numpy as np

from mlx_grpo.config import RunConfig
from mlx_grpo.env import turn_spans
from mlx_grpo.grpo import group_advantages, zero_variance_groups
from mlx_grpo.guidance import demonstration_advantages
from mlx_grpo.recipe import INFRASTRUCTURE_FAILURES, Scored
from mlx_grpo.rollout import Completion, Rollout, ill_formed_turns


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. too many non-finite updates in a row)."""


@dataclass
class CompletionRecord:
    """One completion as a step's metrics, the curriculum, the samples log and the
    other ranks see it (ranks exchange these as JSON)."""

    reward: float
    components: dict[str, float]
    error: str | None
    failure: str | None
    truncated: bool
    tokens: int  # the model's own tokens
    turns: int | None  # episode turns (multi-turn recipes)
    text: str | None = None  # only on steps whose samples are logged
    finish_reason: str | None = None
    ill_formed: int = 0  # replies its environment marked ill-formed (`ill_formed_turns`)
    ended_ill_formed: bool = False  # the episode ended there (`rollout.end_on_ill_formed`)
    # The mean entropy of the distributions its tokens were drawn from (`Completion.entropy`)
    entropy: float | None = None

    @classmethod
    def of(cls, completion, scored: Scored, with_text: bool) -> CompletionRecord:
        return cls(
            reward=scored.reward,
            components=scored.components,
            error=scored.error,
            failure=scored.failure,
            truncated=completion.truncated,
            tokens=completion.model_tokens,
            turns=completion.episode.turns if completion.episode is not None else None,
            text=completion.text if with_text else None,
            finish_reason=completion.finish_reason if with_text else None,
            ill_formed=len(ill_formed_turns(completion)),
            ended_ill_formed=completion.finish_reason == "ill_formed",
            entropy=completion.entropy,
        )


def share_record(rollout: Rollout, scored: list[Scored], with_text: bool) -> dict:
    """What a rank reports about its groups: per completion, what the metrics, the
    curriculum and the advantages need (and the text when samples are written)."""
    records = [
        asdict(CompletionRecord.of(c, s, with_text)) for c, s in zip(rollout.completions, scored)
    ]
    return {
        "records": records,
        "tokens": rollout.generated_tokens,
        "seconds": rollout.seconds,
        "env_seconds": rollout.env_seconds,
        "shared_tail_tokens": rollout.shared_tail_tokens,
        "tools": rollout.tool_stats,  # [] without tools; waves and ranks concatenate
    }


@dataclass
class Credit:
    """What `assign_credit` decides for one step (rows: completions of the whole batch,
    groups contiguous)."""

    scored: np.ndarray  # [rows] the rewards as the recipe scored them
    rewards: np.ndarray  # [rows] on-policy, infrastructure failures at their group's mean
    advantages: mx.array  # [rows] what the update weighs each completion by
    zero_var: np.ndarray  # [groups] on-policy rewards all equal
    unscored: np.ndarray  # [groups] variance from partial credit alone (rule 4)
    no_signal: np.ndarray  # [groups] nothing for the update
    quiet: np.ndarray  # [groups] whose samples are silent (rule 5)
    silent: frozenset[int]  # rows that stay in the batch with no loss tokens (rule 5)
    train_groups: list[int]  # the groups the update trains (rule 6)
    heard: np.ndarray  # [groups, G] the rewards the curriculum hears (rule 7)
    guided_groups: set[int]  # groups a demonstration was guided into


def assign_credit(
    records: list[CompletionRecord],
    guided: list[tuple[int, float]],
    demos: list[int],
    cfg: RunConfig,
) -> Credit:
    """The module's rules applied to a step's `records`; `guided` holds (row, reward)
    of each demonstration guided into the batch and `demos` the rows that hold one.
    Reads the run's `grpo.scale_rewards`, `credit` and `guidance.advantage`."""
    g, scale, credit = cfg.grpo.num_generations, cfg.grpo.scale_rewards, cfg.credit
    scored = np.array([r.reward for r in records], dtype=np.float32)
    broke = np.array([r.failure in INFRASTRUCTURE_FAILURES for r in records])
    rewards = without_infrastructure_failures(scored, broke, g)
    update_rewards = scored.copy()
    for row, r in guided:
        update_rewards[row] = r
    broke[demos] = False  # (a demonstration took the place; a crash rescored stays)
    update_rewards = without_infrastructure_failures(update_rewards, broke, g)
    advantages = group_advantages(mx.array(update_rewards), g, scale)
    zero_var = np.array(zero_variance_groups(mx.array(rewards), g))
    unscored = unscored_groups(records, g, credit.signal_component) & ~zero_var
    quiet = np.zeros_like(zero_var)
    if demos and cfg.guidance.advantage == "demonstration":
        own = group_advantages(mx.array(rewards), g, scale)
        advantages = mx.array(demonstration_advantages(np.array(advantages), np.array(own), demos))
        quiet = zero_var | unscored
    silent = frozenset(r for r in range(len(records)) if quiet[r // g] and r not in demos)
    if broke.any():  # exactly 0, not the float32 rounding of mean - mean
        advantages = mx.where(mx.array(broke), 0.0, advantages)
    guided_groups = {row // g for row, _ in guided}
    no_signal = np.array(zero_variance_groups(mx.array(update_rewards), g))
    no_signal |= unscored & ~np.isin(np.arange(len(zero_var)), list(guided_groups))
    heard = rewards.reshape(-1, g).copy()
    heard[unscored] = heard[unscored].mean(axis=1, keepdims=True)
    train_groups = groups_to_train(
        no_signal, cfg.train.batch_size, credit.skip_zero_variance_groups, no_signal & unscored
    )
    return Credit(
        scored, rewards, advantages, zero_var, unscored, no_signal, quiet, silent,
        train_groups, heard, guided_groups,
    )  # fmt: skip


def without_infrastructure_failures(
    rewards: np.ndarray, broke: np.ndarray, group_size: int
) -> np.ndarray:
    """`rewards` with each completion that failed by INFRASTRUCTURE_FAILURES (`broke`)
    given the mean of its group's other rewards (in float64: others that are equal
    give their value exactly), so that the group's mean is theirs and the policy is
    neither blamed for the crash nor the others credited for it; `assign_credit` then
    sets its advantage to exactly 0. A group of nothing but such failures gets equal
    rewards (no signal).

    >>> broke = np.array([False, False, False, True])
    >>> without_infrastructure_failures(np.array([1.0, 0.0, 0.5, 0.0]), broke, 4).tolist()
    [1.0, 0.0, 0.5, 0.5]
    >>> alike = np.array([1.05] * 7 + [0.0], dtype=np.float32)  # (a float32 mean: 1 ulp off)
    >>> bool((without_infrastructure_failures(alike, np.arange(8) == 7, 8) == alike[0]).all())
    True
    """
    out = rewards.astype(np.float32).reshape(-1, group_size)
    broke = broke.reshape(-1, group_size)
    for i in np.flatnonzero(broke.any(axis=1)):
        others = out[i, ~broke[i]].astype(np.float64)
        out[i, broke[i]] = np.float32(others.mean()) if others.size else 0.0
    return out.reshape(-1)


def groups_to_train(
    zero_var: np.ndarray, batch_size: int, skip_zero_variance: bool, unscored=None
) -> list:
    """Indices of the groups the update uses: those with reward variance first (groups
    whose rewards are all equal carry no policy gradient, so they are left out of the
    loss and its divisors unless `skip_zero_variance` is off), at most `batch_size`
    (`filter` rolls out more groups than it trains). `unscored` groups (variance from
    partial credit alone, `credit.signal_component`) never train.

    >>> groups_to_train(np.array([True, False, False, True]), 1, True)
    [1]
    >>> groups_to_train(np.array([True, False, False, True]), 3, False)
    [0, 1, 2]
    >>> groups_to_train(np.array([True, False, True, True]), 4, False, np.array([1, 0, 0, 0]))
    [1, 2, 3]
    """
    n = len(zero_var)
    keep = [i for i in range(n) if not zero_var[i]]
    if not skip_zero_variance:
        keep += [i for i in range(n) if zero_var[i] and not (unscored is not None and unscored[i])]
    return sorted(keep[:batch_size])


def unscored_groups(records: list[CompletionRecord], group_size: int, component) -> np.ndarray:
    """Per group: True when `component` is set and none of the group's samples scored
    above 0 on it (a completion whose reward raised has no components: 0).

    >>> rec = lambda s: CompletionRecord(1.0, {"success": s}, None, None, False, 1, None)
    >>> unscored_groups([rec(0.0), rec(0.0), rec(0.0), rec(1.0)], 2, "success")
    array([ True, False])
    >>> unscored_groups([rec(0.0), rec(0.0)], 2, None)
    array([False])
    """
    if not component:
        return np.zeros(len(records) // group_size, dtype=bool)
    names = {k for r in records for k in r.components}
    if names and component not in names:
        raise TrainingError(
            f"credit.signal_component: the recipe's rewards have no component '{component}' "
            f"(they have: {', '.join(sorted(names))})"
        )
    scores = np.array([r.components.get(component, 0.0) for r in records])
    return ~(scores.reshape(-1, group_size) > 0).any(axis=1)


def uncompared_turns(
    comps: list[Completion], advantages: np.ndarray, group_size: int
) -> list[tuple[int, tuple]]:
    """(row, [start, end)) of each reply of a below-average episode (negative advantage)
    that no above-average episode of its group was there to be compared with: none of
    them had played the same tokens up to the reply's start. What
    `credit.blame_replies="compared"` leaves out of the loss; a group's first replies all
    start from its prompt, so they always stay, and so does a reply its environment
    marked ill-formed (`ill_formed_turns`): it is wrong whatever a better episode did,
    and left out it would grow unchecked in the states no success reached.

    >>> ok = Completion(0, [1, 2, 9, 3, 4], "", "stop", [1, 1, 0, 1, 1])
    >>> near = Completion(0, [1, 2, 9, 5, 6], "", "stop", [1, 1, 0, 1, 1])
    >>> lost = Completion(0, [7, 8, 9, 5, 6], "", "stop", [1, 1, 0, 1, 1])
    >>> uncompared_turns([ok, near, lost], np.array([1.0, -0.5, -0.5]), 3)
    [(2, (3, 5))]
    """
    out = []
    for lo in range(0, len(comps), group_size):
        rows = range(lo, lo + group_size)
        ahead = [comps[r].tokens for r in rows if advantages[r] > 0]
        for r in rows:
            c = comps[r]
            if advantages[r] >= 0 or c.loss_mask is None:
                continue
            wrong = set(ill_formed_turns(c))
            for start, end in turn_spans(c.loss_mask):
                if (start, end) in wrong:
                    continue
                if not any(t[:start] == c.tokens[:start] for t in ahead if len(t) > start):
                    out.append((r, (start, end)))
    return out


def withheld_turns(comps: list[Completion], advantages: np.ndarray) -> list[tuple[int, tuple]]:
    """(row, [start, end)) of each ill-formed reply in an episode that the update would
    reinforce (positive advantage): what `reinforce_ill_formed=False` leaves out."""
    return [
        (i, span) for i, c in enumerate(comps) if advantages[i] > 0 for span in ill_formed_turns(c)
    ]
