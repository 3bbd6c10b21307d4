"""Monitoring: a step's metrics, the guards that watch entropy and KL, the warnings
a run prints, and which samples it writes.

Every metric has one name everywhere (metrics.jsonl, trackers, the live display);
docs/metrics.md lists them.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from mlx_grpo.config import RunConfig
from mlx_grpo.credit import CompletionRecord, Credit, uncompared_turns
from mlx_grpo.procmem import descendants_bytes
from mlx_grpo.recipe import Task
from mlx_grpo.runstate import Counters
from mlx_grpo.tools import ToolStats, stats_metrics
from mlx_grpo.trackers import Trackers


def open_trackers(run_dir, cfg: RunConfig, dist, say, info) -> Trackers:
    """Rank 0's trackers (their files, a wandb login: a failure stops every rank); the
    other ranks get a tracker that reports nowhere."""
    made = []
    dist.run_on_main(
        lambda: made.append(Trackers(run_dir, cfg.output.report_to, cfg.model_dump(), say))
    )
    trackers = made[0] if made else Trackers(run_dir, [], cfg.model_dump())
    if trackers.names:
        info(f"report_to: {trackers.where()}")
    return trackers


def step_metrics(
    step: int,
    shares: list[dict],
    records: list[CompletionRecord],
    rewards: np.ndarray,
    advantages: mx.array,
    zero_var: np.ndarray,
    it_metrics: list[dict],
    *,
    lr: float = 0.0,
    delta: float = 0.0,
    trained: int = 0,
    counters: Counters | None = None,
    update_s: float = 0.0,
    curriculum: dict | None = None,
    ranks: int = 1,
    sync_s: float = 0.0,
) -> dict:
    """A step's metrics (docs/metrics.md), all built here."""
    counters = counters or Counters()
    generated = sum(sh["tokens"] for sh in shares)
    lens = np.array([r.tokens for r in records])
    seconds = max(sh["seconds"] for sh in shares)  # the slowest rank's rollout
    out = {
        "step": step,
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "advantage/abs_mean": float(mx.abs(advantages).mean().item()),
        "groups/zero_variance_frac": float(zero_var.mean()),
        "completion/len_mean": float(lens.mean()),
        "completion/truncated_frac": float(np.mean([r.truncated for r in records])),
        "rollout/tokens": generated,
        "rollout/tokens_per_s": generated / max(seconds, 1e-9),
        "time/rollout_s": seconds,
    }
    env_s = max(sh.get("env_seconds", 0.0) for sh in shares)
    if env_s:  # multi-turn: the environments' part of the rollout
        out["time/env_s"] = env_s
        # Prefill saved by episodes of a group that played alike (rollout.share_tails).
        out["rollout/shared_tail_tokens"] = sum(sh.get("shared_tail_tokens", 0) for sh in shares)
    turns = [r.turns for r in records if r.turns is not None]
    if turns:
        out["episode/turns_mean"] = float(np.mean(turns))
    out.update(tool_step_metrics(shares))
    sampled = [(r.entropy, r.tokens) for r in records if r.entropy is not None]
    if sampled:  # every sampled token of the step, whatever the loss leaves out
        h, n = np.array(sampled, dtype=np.float64).T
        out["entropy/sampled"] = float((h * n).sum() / n.sum())
    # Every component any completion has: a completion whose reward raised has none.
    for name in dict.fromkeys(k for r in records for k in r.components):
        out[f"reward/{name}"] = float(np.mean([r.components.get(name, 0.0) for r in records]))
    # Why completions failed, as the reward named it (sandbox limits, wrong answers...).
    for reason in sorted({r.failure for r in records if r.failure}):
        out[f"fail/{reason}"] = sum(r.failure == reason for r in records)
    for key in it_metrics[0] if it_metrics else ():  # averaged over num_iterations updates
        out[key] = float(np.mean([m[key] for m in it_metrics]))
    out.update(
        {
            "lr": lr,
            "adapter/delta_norm": delta,
            "reward/errors": sum(r.error is not None for r in records),
            "nonfinite/skipped": counters.nonfinite_skipped,
            "groups/trained": trained,
            "groups/discarded": len(zero_var) - trained,
            "time/update_s": update_s,
            "memory/peak_gb": mx.get_peak_memory() / 1e9,
            "memory/children_gb": descendants_bytes() / 1e9,
            **(curriculum or {}),
        }
    )
    if ranks > 1:
        out["dist/ranks"] = ranks
        out["time/sync_s"] = sync_s
    out["rollout/tokens_total"] = counters.rollout_tokens
    return out


def tool_step_metrics(shares: list[dict]) -> dict:
    """`tools/calls_per_episode`, `tools/failures` and `tools/fail/<tool>/<kind>` over
    every rank's episodes (`tools.tool_metrics`), from what each shared of them
    (`Rollout.tool_stats`, under "tools"); none for a recipe without tools."""
    episodes = [ToolStats.from_record(r) for sh in shares for r in sh.get("tools", ())]
    return stats_metrics(episodes)


# Guards: entropy or KL above GUARD_FACTOR x its usual value (the median over the last
# GUARD_WINDOW steps that updated) for GUARD_STEPS steps in a row, once GUARD_WARMUP
# steps are in (KL grows from 0 over the first twenty or so steps: it waits longer).
# `entropy/reinforced` is watched on its own too: it is what the update teaches, while
# `entropy` can be carried by a few long failures that the update pushes down; and
# `entropy/sampled`, the policy's over every reply it sampled, whatever trains.
GUARDED = ("entropy", "entropy/reinforced", "entropy/sampled", "kl")
GUARD_CONTEXT = ("completion/len_mean", "curriculum/max_level")
GUARD_WARMUP = {"entropy": 10, "entropy/reinforced": 10, "entropy/sampled": 10, "kl": 20}
GUARD_WINDOW, GUARD_FACTOR, GUARD_STEPS = 20, 2.0, 3


def guards(step: int, metrics: dict, counters: Counters, cfg: RunConfig, say) -> None:
    """Log `guard/<metric>_x_median` (the step's value over its usual one; `/` in the
    metric's name as `_`) and warn, with the likely cause, when entropy or KL stays
    above GUARD_FACTOR x it."""
    hist = counters.history
    ratios = {}
    for key in GUARDED + GUARD_CONTEXT:
        past = hist.get(key, [])[-GUARD_WINDOW:]
        if key in metrics and len(hist.get(key, [])) >= GUARD_WARMUP.get(key, 10):
            usual = float(np.median(past))
            if usual > 0:
                ratios[key] = metrics[key] / usual
    for key in GUARDED:
        if key not in ratios:
            continue
        metrics[guard_key(key)] = ratios[key]
        streak = counters.guard_streak.get(key, 0) + 1 if ratios[key] > GUARD_FACTOR else 0
        counters.guard_streak[key] = streak
        if streak == GUARD_STEPS:
            say(
                f"step {step}: {key} {metrics[key]:.3g} has been above {GUARD_FACTOR:g}x its "
                f"median of the last {GUARD_WINDOW} steps for {streak} steps "
                f"({ratios[key]:.1f}x now): " + guard_cause(key, ratios, hist, cfg)
            )
    for key in GUARDED + GUARD_CONTEXT:
        if key in metrics:
            hist.setdefault(key, []).append(float(metrics[key]))


def guard_key(metric: str) -> str:
    """The logged ratio of `metric` to its usual value: 'guard/entropy_reinforced_x_median'."""
    return f"guard/{metric.replace('/', '_')}_x_median"


def guard_cause(key: str, ratios: dict, hist: dict, cfg: RunConfig) -> str:
    taught = ratios.get("entropy/reinforced")
    if key == "entropy" and taught is not None and taught <= GUARD_FACTOR:
        return (
            f"the replies the update reinforces are near their usual entropy ({taught:.1f}x "
            "their median, entropy/reinforced): it is in failed replies that ramble, which "
            "the update pushes down, in a batch of few groups; not a drift of what is "
            "taught (this step's samples.jsonl shows them)"
        )
    levels = hist.get("curriculum/max_level", [])
    if len(levels) > 5 and levels[-1] > levels[-6]:
        gate = ""
        if not cfg.credit.signal_component and "success" in cfg.recipe.weights:
            gate = "training only groups with a success (--credit.signal_component=success), "
        return (
            f"the curriculum opened level {levels[-1]:g} in the last 5 steps and its groups "
            f"give little signal; {gate}a lower learning rate or a later unlock "
            "(--curriculum.unlock_at) keeps the policy from drifting there"
        )
    if ratios.get("completion/len_mean", 1.0) > 1.5:
        return (
            f"completions are {ratios['completion/len_mean']:.1f}x their usual length: long "
            f"failed replies weigh most in a token-mean loss (grpo.loss_type="
            f"{cfg.grpo.loss_type}); --grpo.loss_type=turn (multi-turn) or dr_grpo, or a "
            "lower learning rate"
        )
    if key == "kl":
        return (
            "the policy is moving away fast: lower --optimizer.learning_rate or raise --grpo.beta"
        )
    return "the updates are too large for this signal: lower --optimizer.learning_rate"


def watch(step, metrics, credit: Credit, records, counters: Counters, cfg, say) -> None:
    """A step's warnings (no signal, no movement) and, where it updated, its guards."""
    idle = credit.zero_var | (credit.unscored & credit.no_signal)
    signal_warnings(step, metrics, credit.rewards, records, idle, counters, cfg, say)
    if not credit.no_signal.all():
        guards(step, metrics, counters, cfg, say)


def signal_warnings(
    step, metrics, rewards, records, zero_var, counters: Counters, cfg, say
) -> None:
    if zero_var.all():
        counters.zero_signal_streak += 1
        if counters.zero_signal_streak == cfg.train.zero_signal_warn_steps:
            truncated = np.array([r.truncated for r in records])
            best = sum(w for w in cfg.recipe.weights.values() if w > 0) or 1.0
            cause = zero_signal_cause(rewards, truncated, best)
            comp = cfg.credit.signal_component
            groups = rewards.reshape(len(zero_var), -1)
            if comp and np.ptp(groups, axis=1).max() > 0:  # the variance was partial credit
                cause = f"no sample scored on {comp}: the open levels are beyond the policy"
            equal = "every group's rewards were equal" + (
                f" or none of its samples scored on {comp}" if comp else ""
            )
            say(
                f"step {step}: no learning signal for {counters.zero_signal_streak} steps "
                f"({equal}): {cause}"
            )
        return  # no update was made
    counters.zero_signal_streak = 0
    grad = metrics.get("grad_norm", 0.0)
    if grad == 0.0:
        say(f"step {step}: gradient norm is 0 although some groups had reward variance")
    moved = metrics["adapter/delta_norm"] > 0 or not math.isfinite(grad) or grad == 0
    moved = moved or metrics["lr"] == 0
    if not moved and "moved" not in counters.warned:
        counters.warned.append("moved")
        say(f"step {step}: the adapters did not move (learning rate {metrics['lr']:.3g})")


def zero_signal_cause(rewards: np.ndarray, truncated: np.ndarray, best: float) -> str:
    """The likely reason why every group's rewards were equal (`best`: the recipe's
    best reward)."""
    if truncated.all():
        return "every completion hit rollout.max_new_tokens (raise it)"
    if np.all(rewards <= 1e-6):
        return "every completion scored 0 (tasks too hard, or the reward never fires)"
    if np.all(rewards >= best - 1e-6):
        return "every completion got the best reward (tasks too easy: raise the level)"
    return (
        f"rewards were equal within each group (between {rewards.min():.3g} and "
        f"{rewards.max():.3g}): the reward is too coarse for these tasks"
    )


def samples_due(step: int, start: int, metrics: dict, every: int) -> bool:
    """Whether a step writes its samples: every `every` steps, a run's first step, and a
    step whose entropy or KL is above GUARD_FACTOR x its median (what drifted, to read).

    >>> [samples_due(s, 0, {}, 10) for s in (1, 2, 10)], samples_due(5, 4, {}, 10)
    ([True, False, True], True)
    >>> samples_due(7, 0, {"guard/kl_x_median": 2.5}, 10), samples_due(7, 0, {}, 0)
    (True, False)
    """
    if not every:
        return False
    drifted = any(metrics.get(guard_key(k), 0.0) > GUARD_FACTOR for k in GUARDED)
    return step % every == 0 or step == start + 1 or drifted


def sample_records(
    step: int, tasks: list[Task], records: list[CompletionRecord], group_size: int
) -> list[dict]:
    """The step's samples.jsonl records: every completion with its reward components."""
    return [
        {
            "step": step,
            "task": tasks[i // group_size].id,
            "level": tasks[i // group_size].level,
            "completion": r.text,
            "finish_reason": r.finish_reason,
            "reward": r.reward,
            "components": r.components,
            **({"error": r.error} if r.error else {}),
            **({"failure": r.failure} if r.failure else {}),
            **({"entropy": r.entropy} if r.entropy is not None else {}),
        }
        for i, r in enumerate(records)
    ]


def option_metrics(
    cfg: RunConfig,
    credit: Credit,
    records: list[CompletionRecord],
    shares: list[dict],
    local_batch: tuple | None,
    starts: list,
) -> dict:
    """The metrics of the options a run has on: what credit assignment left out of the
    loss, guidance and demonstration starts. `starts[i]`: where group i's episodes
    started (`guidance.demo_starts`; empty for the start)."""
    g, out = cfg.grpo.num_generations, {}
    partway = [i for i, s in enumerate(starts) if s]
    multi_turn = records[0].turns is not None
    if cfg.credit.signal_component:
        out["groups/unscored_frac"] = float(credit.unscored.mean())
    if not cfg.credit.reinforce_ill_formed and multi_turn:
        # The ill-formed replies of reinforced episodes (`build_loss_inputs`); a silent
        # row's replies are out of the loss anyway.
        adv = np.array(credit.advantages)
        out["turns/withheld"] = sum(
            records[r].ill_formed
            for gi in credit.train_groups
            if not credit.quiet[gi]
            for r in range(gi * g, (gi + 1) * g)
            if adv[r] > 0
        )
    if cfg.credit.blame_replies == "compared" and local_batch is not None:
        comps, adv = local_batch  # (this rank's trained rows)
        out["turns/uncompared"] = len(uncompared_turns(comps, adv, g))
    if cfg.rollout.end_on_ill_formed and multi_turn:
        out["episodes/ended_ill_formed"] = float(np.mean([r.ended_ill_formed for r in records]))
    if cfg.guidance.demo_starts:
        out["starts/groups"] = len(partway)
        if partway:
            out["starts/reward_mean"] = float(credit.rewards.reshape(-1, g)[partway].mean())
    if cfg.guidance.enabled:
        out["guidance/groups"] = len(credit.guided_groups)
        out["time/guidance_s"] = max(sh["guidance_seconds"] for sh in shares)
    return out
