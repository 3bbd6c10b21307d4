"""The GRPO loop: sample tasks, roll out groups, score, update the adapters, log, save."""

from __future__ import annotations

import json
import math
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from mlx_grpo.checkpoint import (
    CheckpointError,
    TrainState,
    load_arrays,
    load_checkpoint,
    load_start,
    publish,
    save_arrays,
    save_checkpoint,
    save_start,
)
from mlx_grpo.compiled import CompiledLossAndGrad
from mlx_grpo.config import GRPOConfig, OptimizerConfig, RunConfig
from mlx_grpo.curriculum import Curriculum
from mlx_grpo.dist import Dist
from mlx_grpo.durable import FULL_DISK, cut_jsonl, write_atomic
from mlx_grpo.env import turn_spans
from mlx_grpo.grpo import (
    LOSS_METRICS,
    LossInputs,
    entropy_bonus_on,
    group_advantages,
    grpo_loss,
    lane_pieces,
    micro_batches,
    next_beta,
    next_entropy_coef,
    split_guided,
    split_reinforced,
    zero_variance_groups,
)
from mlx_grpo.guidance import demonstration_advantages, demonstration_starts, guide_groups
from mlx_grpo.lanes import Lanes, update_lanes
from mlx_grpo.log import JsonlWriter
from mlx_grpo.logprobs import completion_logprobs, shares_inputs
from mlx_grpo.models import adapters_disabled, adapters_set
from mlx_grpo.procmem import descendants_bytes, keep_freed_memory
from mlx_grpo.recipe import INFRASTRUCTURE_FAILURES, Recipe, Scored, Task
from mlx_grpo.rollout import Completion, Rollout, ill_formed_turns, keyed_samplers, rollout_tasks
from mlx_grpo.runfolder import RunFolder
from mlx_grpo.trackers import Trackers
from mlx_grpo.warmstart import check_ranks, warm_start


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. too many non-finite updates in a row)."""


class Interrupted(Exception):
    """Ctrl-C: the run stopped at the end of step `step`, saved there."""

    def __init__(self, step: int):
        super().__init__(f"interrupted after step {step}")
        self.step = step


class _CtrlC:
    """The first Ctrl-C asks the loop to stop at the end of the step, with a checkpoint;
    a second one stops at once (KeyboardInterrupt). Only a single-process run in the
    main thread takes over SIGINT; elsewhere Ctrl-C stops at once, as before."""

    def __init__(self, say, enabled: bool):
        self.say, self.requested, self.prev = say, False, None
        self.enabled = enabled and threading.current_thread() is threading.main_thread()

    def __enter__(self):
        if self.enabled:
            self.prev = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc):
        if self.enabled:
            signal.signal(signal.SIGINT, self.prev)

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.say("Ctrl-C: stopping at the end of this step, with a checkpoint (Ctrl-C again: now)")


def build_optimizer(cfg: OptimizerConfig, total_updates: int) -> optim.AdamW:
    """AdamW with linear warm-up then cosine decay (or constant)."""
    lr = cfg.learning_rate
    warmup = min(cfg.warmup_steps, max(total_updates - 1, 0))  # short runs still decay
    decay_steps = max(1, total_updates - warmup)
    main = (
        optim.cosine_decay(lr, decay_steps, end=lr * cfg.min_lr_ratio)
        if cfg.schedule == "cosine"
        else (lambda _: mx.array(lr))
    )
    if warmup:
        # Starts above 0 so that the first update already moves the adapters.
        warm = optim.linear_schedule(lr / (warmup + 1), lr, warmup)
        schedule = optim.join_schedules([warm, main], [warmup])
    else:
        schedule = main
    return optim.AdamW(learning_rate=schedule, weight_decay=cfg.weight_decay)


def build_loss_inputs(
    rollout: Rollout,
    advantages: mx.array,
    max_new_tokens: int,
    mask_truncated: bool,
    groups: list[int] | None = None,
    silent: frozenset[int] = frozenset(),
    reinforce_ill_formed: bool = True,
    fold: bool = True,
    blame_replies: str = "all",
) -> LossInputs:
    """The prompts of `groups` (default: all), their right-padded [N, C] completions
    and the loss mask (the model's own tokens; never the environment's). The rows in
    `silent` (indices into `rollout.completions`) keep their place with an empty mask:
    they add nothing to the loss and cost nothing in its passes (`effective_lengths`),
    but count in its divisors. Without `reinforce_ill_formed`, the replies its
    environment marked ill-formed (`ill_formed_turns`) leave the mask of an episode with
    a positive advantage; `withheld_turns` counts them. With `blame_replies="compared"`,
    the replies of a below-average episode that `uncompared_turns` finds leave its
    mask. With `fold`, a group's alike rows fold into one (`fold_alike_rows`); off where
    rows must stay apart (LoRA dropout draws a mask per row)."""
    g = rollout.group_size
    groups = list(range(len(rollout.prompts))) if groups is None else groups
    rows = [gi * g + j for gi in groups for j in range(g)]
    comps = [rollout.completions[r] for r in rows]
    adv = advantages[mx.array(rows)] if len(rows) != advantages.size else advantages
    withheld = [] if reinforce_ill_formed else withheld_turns(comps, np.array(adv))
    if blame_replies == "compared":
        withheld += uncompared_turns(comps, np.array(adv), g)
    c_max = max(len(c.tokens) for c in comps)
    tokens = np.zeros((len(comps), c_max), dtype=np.int32)
    mask = np.zeros((len(comps), c_max), dtype=np.float32)
    for i, (row, c) in enumerate(zip(rows, comps)):
        tokens[i, : len(c.tokens)] = c.tokens
        if not (mask_truncated and c.truncated) and row not in silent:
            mask[i, : len(c.tokens)] = 1.0 if c.loss_mask is None else c.loss_mask
    for i, (lo, hi) in withheld:
        mask[i, lo:hi] = 0.0
    demos = [float(c.demonstration) for c in comps]
    if fold:
        fold_alike_rows(tokens, mask, np.array(adv), demos, g)
    return LossInputs(
        prompts=[mx.array(rollout.prompts[gi]) for gi in groups],
        completions=mx.array(tokens),
        mask=mx.array(mask),
        advantages=adv,
        old_logprobs=None,
        ref_logprobs=None,
        max_new_tokens=max_new_tokens,
        guided=mx.array(demos) if any(demos) else None,
    )


def fold_alike_rows(
    tokens: np.ndarray, mask: np.ndarray, advantages: np.ndarray, demos: list, group_size: int
) -> int:
    """Rows of a group that are the same episode (the same tokens, loss mask, advantage
    and kind) add the same terms to the loss: the first of k alike rows takes a mask of
    k on its loss tokens and the others an empty one, in place. Every reduction of the
    loss and its metrics weighs a token by its mask, so loss and gradients are those of
    the k rows up to float32 rounding (without LoRA dropout, which would draw k
    masks), and the k - 1 empty rows cost nothing in the reference and policy passes
    (`effective_lengths`); they still count as rows in the divisors. A policy that has
    grown sure of itself samples most of a group alike. Returns the rows emptied.

    >>> t = np.array([[5, 6], [5, 6], [5, 7], [5, 6]]); m = np.ones((4, 2), np.float32)
    >>> fold_alike_rows(t, m, np.array([0.5, 0.5, -1.0, 0.5]), [0.0] * 4, 4), m[:, 0].tolist()
    (2, [3.0, 0.0, 1.0, 0.0])
    """
    folded = 0
    for lo in range(0, len(tokens), group_size):
        first: dict[tuple, int] = {}
        for i in range(lo, lo + group_size):
            if not mask[i].any():
                continue
            key = (tokens[i].tobytes(), mask[i].tobytes(), float(advantages[i]), demos[i])
            if key in first:
                mask[first[key]] += mask[i]
                mask[i] = 0.0
                folded += 1
            else:
                first[key] = i
    return folded


def uncompared_turns(
    comps: list[Completion], advantages: np.ndarray, group_size: int
) -> list[tuple[int, tuple]]:
    """(row, [start, end)) of each reply of a below-average episode (negative advantage)
    that no above-average episode of its group was there to be compared with: none of
    them had played the same tokens up to the reply's start. What
    `grpo.blame_replies="compared"` leaves out of the loss; a group's first replies all
    start from its prompt, so they always stay.

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
            for start, end in turn_spans(c.loss_mask):
                if not any(t[:start] == c.tokens[:start] for t in ahead if len(t) > start):
                    out.append((r, (start, end)))
    return out


def withheld_turns(comps: list[Completion], advantages: np.ndarray) -> list[tuple[int, tuple]]:
    """(row, [start, end)) of each ill-formed reply in an episode that the update would
    reinforce (positive advantage): what `reinforce_ill_formed=False` leaves out."""
    return [
        (i, span) for i, c in enumerate(comps) if advantages[i] > 0 for span in ill_formed_turns(c)
    ]


@dataclass
class Counters:
    """Run-level counters, checkpointed with the run."""

    nonfinite_skipped: int = 0
    nonfinite_streak: int = 0
    zero_signal_streak: int = 0
    reward_errors: int = 0
    rollout_tokens: int = 0
    warned: list[str] = field(default_factory=list)
    # What the guards compare each step with: the values of the steps that updated.
    history: dict[str, list[float]] = field(default_factory=dict)
    guard_streak: dict[str, int] = field(default_factory=dict)
    entropy_coef: float | None = None  # the adaptive entropy bonus's weight (None: not begun)
    beta: float | None = None  # the KL weight, adaptive under grpo.kl_target (None: not begun)


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


def _zero_signal_cause(rewards: np.ndarray, truncated: np.ndarray, best: float) -> str:
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


def train(
    model: nn.Module,
    tokenizer,
    optimizer: optim.Optimizer,
    recipe: Recipe,
    curriculum: Curriculum,
    cfg: RunConfig,
    run_dir: Path,
    adapter_cfg: dict,
    resume_from: Path | None = None,
    callback: Callable[[int, dict], None] | None = None,
    say: Callable[[str], None] = print,
    evaluate_fn: Callable[[int, dict], dict] | None = None,
    info: Callable[[str], None] = print,
    dist: Dist | None = None,
    rollout_fn: Callable[..., Rollout] | None = None,
    loss: Callable | None = None,
) -> list[dict]:
    """Run GRPO from step 0 (or from `resume_from`) to `cfg.train.steps`.

    Returns this call's per-step metrics. `callback(step, metrics)` sees each step's
    metrics after they are logged; `say` receives warnings and `info` notes; `evaluate_fn()`
    returns held-out metrics before training and every `train.eval_every` steps
    (`evaluate_fn(step, extra)`). The parts of a step can be swapped: `rollout_fn` samples
    the groups (default `rollout.rollout_tasks`, same signature) and `loss(model, batch,
    grpo_cfg) -> (loss, metrics)` is what the update differentiates (default
    `grpo.grpo_loss`).

    Under `mlx.launch` (`dist.size > 1`) every rank runs this loop: all draw the same
    tasks, each rolls out and scores its share of the groups, rewards are gathered so
    that advantages, the curriculum and the metrics see the whole batch, and the
    gradients are summed before clipping, so all ranks take the same step. Rank 0
    alone writes logs and checkpoints (and runs `evaluate_fn`).

    From here on the process keeps the memory it frees (`procmem.keep_freed_memory`):
    every step allocates what the last one freed.
    """
    g, b = cfg.grpo.num_generations, cfg.train.batch_size
    dist = dist or Dist()
    main = dist.is_main
    if dist.size > b:
        raise TrainingError(
            f"train.batch_size={b} is smaller than the {dist.size} ranks: "
            "each rank needs at least one group"
        )
    for option, on in [
        ("grpo.guidance", cfg.grpo.guidance),
        ("grpo.demo_starts", cfg.grpo.demo_starts),
        ("train.sft_steps", cfg.train.sft_steps),
    ]:
        if on and not callable(getattr(recipe.module, "demonstrate", None)):
            raise TrainingError(
                f"{option}: recipe {recipe.name} defines no demonstrate(task) in its tasks.py"
            )
    check_ranks(cfg.train, dist)  # before the base evaluation, not after it
    if cfg.grpo.demo_starts and not recipe.multi_turn:
        raise TrainingError(f"grpo.demo_starts: recipe {recipe.name} is single-turn")
    if not main:  # (rank 0 speaks for the run)
        say = info = _silent
    keep_freed_memory()  # (once the settings are known to be sound)
    run = RunFolder(run_dir)
    metrics_log, samples_log = JsonlWriter(run.metrics_file), JsonlWriter(run.samples_file)
    # A run stopped before its first checkpoint keeps what it had done (the base
    # evaluation, warm-start steps) when started again with the same settings.
    settings = _start_settings(cfg)
    kept = _kept_start(run, settings) if resume_from is None and dist.size == 1 else None
    go_on = cfg.output.on_full_disk == "continue"
    start, counters = _begin(
        dist, run, resume_from, model, optimizer, curriculum, say, kept and kept.get("base")
    )
    # (a resume's once its checkpoint has loaded: one that fails changes nothing)
    dist.run_on_main(lambda: run.write_config(cfg))
    if counters.entropy_coef is None:  # a new run, or one from before the option
        counters.entropy_coef = cfg.grpo.entropy_coef
    if counters.beta is None or cfg.grpo.kl_target is None:  # new, older, or a fixed beta
        counters.beta = cfg.grpo.beta
    made = []  # rank 0's trackers (their files, a wandb login): a failure stops every rank
    dist.run_on_main(
        lambda: made.append(Trackers(run_dir, cfg.output.report_to, cfg.model_dump(), say))
    )
    trackers = made[0] if made else Trackers(run_dir, [], cfg.model_dump())
    if trackers.names:
        info(f"report_to: {trackers.where()}")

    def base_eval() -> None:
        """The base model's held-out figures: where the curves in eval.jsonl start."""
        nonlocal kept
        if evaluate_fn is None:
            return
        base = kept and kept.get("base")
        if base:
            info("held-out before training: kept from the start that was stopped")
        else:
            base = evaluate_fn(0, {"rollout_tokens": 0})
            kept = {"settings": settings, "base": base, "sft_step": 0}
            if dist.size == 1:
                _keep_start(run, kept, None, None, go_on, say)
        trackers.log(0, base)
        shown = {
            k: round(v, 3) for k, v in base.items() if k.count("/") == 1 and k != "time/eval_s"
        }
        info(f"held-out before training: {shown}")

    if cfg.train.eval_every and resume_from is None:
        dist.run_on_main(base_eval)  # (a failure there stops every rank)
    rollout_fn = rollout_fn or rollout_tasks
    if cfg.grpo.compile:
        if loss is not None:
            raise TrainingError("grpo.compile compiles the GRPO loss; a custom loss runs eagerly")
        loss_and_grad = CompiledLossAndGrad(model, cfg.grpo)
    else:
        loss = loss or grpo_loss
        loss_and_grad = nn.value_and_grad(model, lambda m, batch: loss(m, batch, cfg.grpo))
    history: list[dict] = []

    def checkpoint(step: int, go_on: bool) -> None:
        """Save step `step` on rank 0 only (a failure there stops every rank); with
        `go_on`, a full disk costs only this checkpoint (`_save`)."""
        state = TrainState(step, counters.__dict__.copy(), curriculum.state_dict())
        args = (run_dir, step, model, optimizer, adapter_cfg, state, cfg.output.keep_last)
        dist.run_on_main(lambda: _save(args, go_on, say))

    # The trackers close however the loop ends (a kill is what resuming mends).
    with trackers, _CtrlC(say, dist.size == 1) as ctrl_c:
        if cfg.train.sft_steps and resume_from is None:  # (a step-0 resume is past it)
            tasks = recipe.tasks("train", cfg.recipe.train_size, cfg.train.seed)
            base = (kept or {}).get("base")

            def keep(k: int, sft_optimizer, nll: list[float], seconds: float) -> None:
                if dist.size == 1 and k < cfg.train.sft_steps:  # (step 0's checkpoint then)
                    state = {"settings": settings, "base": base, "sft_step": k}
                    state.update(nll=nll, seconds=seconds)
                    _keep_start(run, state, model, sft_optimizer, go_on, say)

            if kept and kept.get("sft_step"):
                info(f"warm start: continuing after its step {kept['sft_step']}")
            warm = warm_start(model, tokenizer, recipe, tasks, cfg, say, dist, kept, keep)
            dist.run_on_main(lambda: write_atomic(run.warmstart_file, json.dumps(warm) + "\n"))
            nll = warm["nll"]
            info(
                f"warm start: {cfg.train.sft_steps} steps on {warm['demonstrations']} "
                f"demonstrations (per level {warm['levels']}), NLL {nll[0]:.3f} -> "
                f"{nll[-1]:.3f}, {warm['seconds']:.0f} s"
            )
        # (before step 0's checkpoint, so that a resume from it finds the reference)
        reference = _start_reference(cfg, run, model, resume_from, dist)
        if cfg.train.sft_steps and resume_from is None:
            # Checkpoint step 0: a kill before step save_every keeps the warm start,
            # and `compare --b <run>@0` measures it alone.
            checkpoint(0, cfg.output.on_full_disk == "continue")
        for step in range(start + 1, cfg.train.steps + 1):
            mx.reset_peak_memory()
            # Sampling and LoRA dropout draw from keys fixed by (seed, step), so a resumed
            # run samples exactly what the uninterrupted run would have sampled. Each
            # completion has its own key, so it does not depend on how many ranks share
            # the step.
            step_seed = cfg.train.seed * 1_000_003 + step
            mx.random.seed(step_seed)
            n_tasks = math.ceil(b * curriculum.oversample)
            tasks = curriculum.sample(n_tasks)  # the same on every rank
            mine = dist.share(n_tasks)
            my_tasks = tasks[mine.start : mine.stop]
            keys = mx.random.split(mx.random.key(step_seed), n_tasks * g)
            samplers = keyed_samplers(cfg.rollout, keys[mine.start * g : mine.stop * g])
            extra = {}
            starts = [[] for _ in tasks]
            if cfg.grpo.demo_starts:  # the same draw on every rank, and after a resume
                rng = np.random.default_rng([cfg.train.seed, step])
                starts = demonstration_starts(
                    recipe, tasks, cfg.grpo.demo_starts, rng, cfg.rollout, say
                )
                extra["starts"] = starts[mine.start : mine.stop]

            # Roll out and score this rank's groups; every rank then sees every record.
            model.eval()
            rollout = rollout_fn(
                model, tokenizer, recipe, my_tasks, g, cfg.rollout, samplers, **extra
            )
            scored = recipe.score_rollout(my_tasks, rollout)
            # The text travels with every record: a step whose entropy or KL leaves its
            # usual range writes its samples too (`_samples_due`), known after the update.
            share = _share_record(rollout, scored, with_text=bool(cfg.train.sample_every))
            if cfg.grpo.guidance:  # after the on-policy record: only the update sees it
                tic = time.perf_counter()
                mine_partway = frozenset(
                    i for i, s in enumerate(starts[mine.start : mine.stop]) if s
                )
                changed = guide_groups(
                    recipe, tokenizer, my_tasks, rollout, scored, cfg.rollout, say, mine_partway,
                    cfg.grpo.signal_component,
                )  # fmt: skip
                share["guided"] = [(mine.start * g + row, reward) for row, reward in changed]
                share["demos"] = [
                    mine.start * g + row
                    for row, c in enumerate(rollout.completions)
                    if c.demonstration
                ]
                share["guidance_seconds"] = time.perf_counter() - tic
            tic = time.perf_counter()
            shares = dist.gather(share)
            gather_s = time.perf_counter() - tic
            records = [CompletionRecord(**r) for sh in shares for r in sh["records"]]
            scored_rewards = np.array([r.reward for r in records], dtype=np.float32)
            broke = np.array([r.failure in INFRASTRUCTURE_FAILURES for r in records])
            rewards = without_infrastructure_failures(scored_rewards, broke, g)
            if errors := [r.error for r in records if r.error]:
                say(
                    f"reward raised on {len(errors)} completion(s), scored as failures: {errors[0]}"
                )
            counters.reward_errors += len(errors)
            counters.rollout_tokens += sum(sh["tokens"] for sh in shares)

            # Advantages; the curriculum hears the rewards; the groups with signal train
            # (with guidance, the update's rewards have the demonstrations in).
            guided = [(row, r) for sh in shares for row, r in sh.get("guided", ())]
            demos = [row for sh in shares for row in sh.get("demos", ())]
            update_rewards = scored_rewards.copy()
            for row, r in guided:
                update_rewards[row] = r
            broke[demos] = False  # (a demonstration took the place; a crash rescored stays)
            update_rewards = without_infrastructure_failures(update_rewards, broke, g)
            advantages = group_advantages(mx.array(update_rewards), g, cfg.grpo.scale_rewards)
            zero_var = np.array(zero_variance_groups(mx.array(rewards), g))
            # Groups of failures that differ only in partial credit (grpo.signal_component).
            unscored = _unscored_groups(records, g, cfg.grpo.signal_component) & ~zero_var
            silent = frozenset()
            if demos and cfg.grpo.guidance_advantage == "demonstration":
                own = group_advantages(mx.array(rewards), g, cfg.grpo.scale_rewards)
                advantages = mx.array(
                    demonstration_advantages(np.array(advantages), np.array(own), demos)
                )
                # The samples of a group with no signal of its own: an unguided run
                # skips the group; here its demonstration trains alone.
                silent = frozenset(
                    r - mine.start * g
                    for r in range(mine.start * g, mine.stop * g)
                    if (zero_var | unscored)[r // g] and r not in demos
                )
            if broke.any():  # exactly 0, not the float32 rounding of mean - mean
                advantages = mx.where(mx.array(broke), 0.0, advantages)
            no_signal = np.array(zero_variance_groups(mx.array(update_rewards), g))
            # A guided group trains: its demonstration is a success.
            no_signal |= unscored & ~np.isin(np.arange(n_tasks), [row // g for row, _ in guided])
            # The curriculum hears the groups that started at the start.
            partway = [i for i in range(n_tasks) if starts[i]]
            whole = [i for i in range(n_tasks) if not starts[i]]
            by_group = rewards.reshape(n_tasks, g)
            heard = by_group.copy()
            heard[unscored] = by_group[unscored].mean(axis=1, keepdims=True)
            curriculum.update([tasks[i] for i in whole], heard[whole].tolist())
            train_groups = _groups_to_train(
                no_signal, b, cfg.grpo.skip_zero_variance_groups, no_signal & unscored
            )
            tic = time.perf_counter()
            it_metrics, delta, sync_s = [], 0.0, 0.0
            entropy_coef, beta = counters.entropy_coef, counters.beta
            if train_groups:  # the same on every rank: all of them join the update
                local = [i - mine.start for i in train_groups if i in mine]
                batch = None
                if local:
                    batch = build_loss_inputs(
                        rollout,
                        advantages[mine.start * g : mine.stop * g],
                        cfg.rollout.max_new_tokens * cfg.rollout.max_turns,
                        cfg.grpo.mask_truncated_completions,
                        local,
                        silent,
                        cfg.grpo.reinforce_ill_formed,
                        fold=cfg.lora.dropout == 0,
                        blame_replies=cfg.grpo.blame_replies,
                    )
                    batch.entropy_coef, batch.beta = entropy_coef, beta
                it_metrics, delta, sync_s = update_step(
                    model, optimizer, loss_and_grad, batch, cfg, counters, step, say, dist,
                    len(train_groups) * g, reference,
                )  # fmt: skip
            update_s = time.perf_counter() - tic
            if it_metrics and "entropy" in it_metrics[-1]:  # (not from demonstrations alone)
                entropy = it_metrics[-1]["entropy"]
                counters.entropy_coef = next_entropy_coef(entropy_coef, entropy, cfg.grpo)
            if it_metrics and "kl" in it_metrics[-1]:
                counters.beta = next_beta(beta, it_metrics[-1]["kl"], cfg.grpo)

            budget = cfg.train.token_budget
            last = step == cfg.train.steps or bool(budget and counters.rollout_tokens >= budget)
            metrics = _step_metrics(
                step, shares, records, scored_rewards, advantages, zero_var, it_metrics,
                lr=float(optimizer.learning_rate), delta=delta, trained=len(train_groups),
                counters=counters, update_s=update_s, curriculum=curriculum.metrics(),
                ranks=dist.size, sync_s=gather_s + sync_s,
            )  # fmt: skip
            if cfg.grpo.signal_component:
                metrics["groups/unscored_frac"] = float(unscored.mean())
            if not cfg.grpo.reinforce_ill_formed and records[0].turns is not None:
                # The ill-formed replies of reinforced episodes (`build_loss_inputs`);
                # a silent row's replies are out of the loss anyway.
                silenced = demos and cfg.grpo.guidance_advantage == "demonstration"
                adv = np.array(advantages)
                metrics["turns/withheld"] = sum(
                    records[r].ill_formed
                    for gi in train_groups
                    if not (silenced and (zero_var | unscored)[gi])
                    for r in range(gi * g, (gi + 1) * g)
                    if adv[r] > 0
                )
            if cfg.grpo.blame_replies == "compared" and train_groups:
                # (this rank's groups)
                rows = [gi * g + j for gi in local for j in range(g)]
                adv = np.array(advantages[mine.start * g : mine.stop * g])
                comps = [rollout.completions[r] for r in rows]
                metrics["turns/uncompared"] = len(uncompared_turns(comps, adv[rows], g))
            if cfg.rollout.end_on_ill_formed and records[0].turns is not None:
                metrics["episodes/ended_ill_formed"] = float(
                    np.mean([r.ended_ill_formed for r in records])
                )
            if cfg.grpo.demo_starts:
                metrics["starts/groups"] = len(partway)
                if partway:
                    metrics["starts/reward_mean"] = float(by_group[partway].mean())
            if cfg.grpo.guidance:
                metrics["guidance/groups"] = len({row // g for row, _ in guided})
                metrics["time/guidance_s"] = max(sh["guidance_seconds"] for sh in shares)
            if entropy_bonus_on(cfg.grpo):
                metrics["entropy/coef"] = entropy_coef  # the weight this step's update used
            if cfg.grpo.kl_target is not None:
                metrics["kl/beta"] = beta  # the KL weight this step's update used
            if cfg.grpo.compile:
                metrics["compile/traces"] = loss_and_grad.traces
            if (decoder := getattr(model, "_compiled_decoder", None)) is not None:
                metrics["compile/decode_traces"] = decoder.traces
            if cfg.train.eval_every and (step % cfg.train.eval_every == 0 or last):
                tokens = {"rollout_tokens": counters.rollout_tokens}
                held_out = partial(evaluate_fn, step, tokens) if evaluate_fn else dict
                metrics.update(dist.run_on_main(held_out))  # (a failure stops every rank)
            idle = zero_var | (unscored & no_signal)
            _warnings(step, metrics, rewards, records, idle, counters, cfg, say)
            if not no_signal.all():
                _guards(step, metrics, counters, cfg, say)
            due = _samples_due(step, start, metrics, cfg.train.sample_every)
            logs = (metrics_log, samples_log, trackers)
            samples = partial(_sample_records, step, tasks, records, g) if due else list
            dist.run_on_main(partial(_write_logs, logs, step, metrics, samples))
            history.append(metrics)
            stopping = ctrl_c.requested
            if step % cfg.output.save_every == 0 or last or stopping:
                checkpoint(step, cfg.output.on_full_disk == "continue" and not (last or stopping))
            if callback is not None:
                callback(step, metrics)
            if stopping and not last:
                raise Interrupted(step)
            if last:
                if step < cfg.train.steps:
                    say(f"step {step}: rollout token budget {budget} reached, stopping")
                break
    return history


def _unless_full_disk(write, go_on: bool, say, what: str):
    """`write()`'s result; with `go_on`, a full disk (CheckpointError from one) costs only
    this write: one line, and None."""
    try:
        return write()
    except CheckpointError as e:
        full = isinstance(e.__cause__, OSError) and e.__cause__.errno in FULL_DISK
        if not (go_on and full):
            raise
        if e.saved:
            say(f"{e}; going on (output.on_full_disk=continue)")
            return None
        say(f"{e}; going on without {what} (output.on_full_disk=continue)")
        return None


def _save(args: tuple, go_on: bool, say) -> str:
    """save_checkpoint(*args); with `go_on`, a full disk costs only this checkpoint. A
    checkpoint written, the run's kept start (`start.partial`) is past."""
    final = _unless_full_disk(lambda: save_checkpoint(*args), go_on, say, "this checkpoint")
    if final is None:
        return ""
    shutil.rmtree(RunFolder(args[0]).start_dir, ignore_errors=True)
    return str(final)


def _start_settings(cfg: RunConfig) -> dict:
    """What decides a run's base evaluation and warm start: all its settings but its
    length and where it writes (a run may be started again to go further)."""
    settings = cfg.model_dump(mode="json", exclude={"output"})
    settings["train"].pop("steps", None)
    return settings


def _kept_start(run: RunFolder, settings: dict) -> dict | None:
    """The kept start of a run (`checkpoint.save_start`) when its settings are
    `settings` (`_start_settings`), else None (and nothing of it is kept)."""
    kept = load_start(run.path)
    if kept is None or kept.get("settings") != settings:
        shutil.rmtree(run.start_dir, ignore_errors=True)
        return None
    return kept


def _write_logs(logs: tuple, step: int, metrics: dict, samples) -> None:
    """The step's metrics, `samples()` and their trackers' copy (on rank 0)."""
    metrics_log, samples_log, trackers = logs
    metrics_log.write(metrics)
    records = samples()
    for record in records:
        samples_log.write(record)
    trackers.log(step, metrics, records)


def _keep_start(run: RunFolder, state: dict, model, optimizer, go_on: bool, say) -> None:
    """`save_start`; with `go_on`, a full disk costs only this (as a checkpoint)."""
    _unless_full_disk(lambda: save_start(run.path, state, model, optimizer), go_on, say, "it")


def _begin(
    dist: Dist, run: RunFolder, resume_from, model, optimizer, curriculum, say, keep_base=False
):
    """(first step to run - 1, counters): restored from `resume_from`, whose step the
    logs are cut back to; else fresh, with the same adapters on every rank (and
    eval.jsonl's base evaluation kept with `keep_base`)."""
    if resume_from is None:

        def clear() -> None:  # a run started again before its first checkpoint: no old steps
            for log in run.logs:
                cut_jsonl(log, 0 if keep_base and log == run.eval_file else -1)

        dist.run_on_main(clear)
        if dist.size > 1:  # the same adapters everywhere even if the ranks' RNGs differ
            sent = dist.broadcast_arrays(_adapters(model) if dist.is_main else None)
            model.load_weights(list(sent.items()), strict=False)
        return 0, Counters()
    st = _resume(dist, resume_from, model, optimizer)
    curriculum.load_state_dict(st.curriculum)

    def mend() -> None:
        shutil.rmtree(run.start_dir, ignore_errors=True)  # (past it)
        for log in run.logs:
            if note := cut_jsonl(log, st.step):
                say(note)
        publish(resume_from)

    dist.run_on_main(mend)
    return st.step, Counters(**st.counters)


def _start_reference(cfg: RunConfig, run: RunFolder, model, resume_from, dist: Dist):
    """The adapters the KL term holds the policy near under `grpo.reference=start`:
    the model's as the GRPO steps begin, kept in the run folder, or read back from it
    on a resume. None: the base (the adapters switched off), which is also where a run
    without a warm start or an initial adapter starts."""
    if not cfg.reference_is_start:
        return None
    if resume_from is None:
        reference = _adapters(model)
        dist.run_on_main(lambda: save_arrays(run.reference_file, reference))
        return reference

    held = []

    def read():
        if not run.reference_file.exists():
            raise TrainingError(
                f"grpo.reference=start: {run.reference_file} not found (the run was "
                "started with grpo.reference=base; resume it with that)"
            )
        held.append(load_arrays(run.reference_file))

    dist.run_on_main(read)  # (raises on every rank)
    return dist.broadcast_arrays(held[0] if held else None)


def without_infrastructure_failures(
    rewards: np.ndarray, broke: np.ndarray, group_size: int
) -> np.ndarray:
    """`rewards` with each completion that failed by INFRASTRUCTURE_FAILURES (`broke`)
    given the mean of its group's other rewards (in float64: others that are equal
    give their value exactly), so that the group's mean is theirs and the policy is
    neither blamed for the crash nor the others credited for it; the trainer then sets
    its advantage to exactly 0. A group of nothing but such failures gets equal
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


def _groups_to_train(
    zero_var: np.ndarray, batch_size: int, skip_zero_variance: bool, unscored=None
) -> list:
    """Indices of the groups the update uses: those with reward variance first (groups
    whose rewards are all equal carry no policy gradient, so they are left out of the
    loss and its divisors unless `skip_zero_variance` is off), at most `batch_size`
    (`filter` rolls out more groups than it trains). `unscored` groups (variance from
    partial credit alone, `grpo.signal_component`) never train.

    >>> _groups_to_train(np.array([True, False, False, True]), 1, True)
    [1]
    >>> _groups_to_train(np.array([True, False, False, True]), 3, False)
    [0, 1, 2]
    >>> _groups_to_train(np.array([True, False, True, True]), 4, False, np.array([1, 0, 0, 0]))
    [1, 2, 3]
    """
    n = len(zero_var)
    keep = [i for i in range(n) if not zero_var[i]]
    if not skip_zero_variance:
        keep += [i for i in range(n) if zero_var[i] and not (unscored is not None and unscored[i])]
    return sorted(keep[:batch_size])


def _unscored_groups(records: list[CompletionRecord], group_size: int, component) -> np.ndarray:
    """Per group: True when `component` is set and none of the group's samples scored
    above 0 on it (a completion whose reward raised has no components: 0).

    >>> rec = lambda s: CompletionRecord(1.0, {"success": s}, None, None, False, 1, None)
    >>> _unscored_groups([rec(0.0), rec(0.0), rec(0.0), rec(1.0)], 2, "success")
    array([ True, False])
    >>> _unscored_groups([rec(0.0), rec(0.0)], 2, None)
    array([False])
    """
    if not component:
        return np.zeros(len(records) // group_size, dtype=bool)
    names = {k for r in records for k in r.components}
    if names and component not in names:
        raise TrainingError(
            f"grpo.signal_component: the recipe's rewards have no component '{component}' "
            f"(they have: {', '.join(sorted(names))})"
        )
    scores = np.array([r.components.get(component, 0.0) for r in records])
    return ~(scores.reshape(-1, group_size) > 0).any(axis=1)


def _silent(_: str) -> None:
    pass


def _adapters(model: nn.Module) -> dict[str, mx.array]:
    return dict(tree_flatten(model.trainable_parameters()))


def _resume(dist: Dist, step_dir: Path, model, optimizer) -> TrainState:
    """Rank 0 reads the checkpoint and sends it to the others (which need no copy
    of the run folder)."""
    if dist.size == 1:
        return load_checkpoint(step_dir, model, optimizer)
    st = dist.run_on_main(lambda: load_checkpoint(step_dir, model, optimizer).__dict__)
    adapters = dist.broadcast_arrays(_adapters(model) if dist.is_main else None)
    opt = dist.broadcast_arrays(dict(tree_flatten(optimizer.state)) if dist.is_main else None)
    if not dist.is_main:
        model.load_weights(list(adapters.items()), strict=False)
        optimizer.state = tree_unflatten(list(opt.items()))
        mx.eval(model.parameters(), optimizer.state)
    return TrainState(**st)


def _share_record(rollout: Rollout, scored: list[Scored], with_text: bool) -> dict:
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
    }


def reference_pass(
    model,
    batch: LossInputs,
    grpo: GRPOConfig,
    reference: dict[str, mx.array] | None = None,
    lanes: Lanes | None = None,
) -> None:
    """Fill in the log-probs the loss compares against: the reference policy's (the
    adapters switched off, or set to `reference`) when the KL term is on, and the
    sampling policy's when several updates reuse one rollout. Both are constants of the
    update; they are computed micro-batch by micro-batch (`grpo.micro_batch_tokens`),
    each micro-batch's pieces side by side in `lanes`."""
    lanes = lanes or Lanes(1)

    def piece_logprobs(p: LossInputs) -> mx.array:
        lp, _ = completion_logprobs(
            model, p.prompts, p.completions, grpo.logits_chunk, mask=p.mask, grad=False
        )
        return lp

    def logprobs() -> mx.array:
        parts = []
        share = shares_inputs(model)
        for piece in micro_batches(batch, grpo.micro_batch_tokens, share):
            parts += lanes.map(piece_logprobs, lane_pieces(piece, lanes.n, share))
        return mx.stop_gradient(parts[0] if len(parts) == 1 else mx.concatenate(parts))

    if grpo.beta > 0:
        off = adapters_disabled(model) if reference is None else adapters_set(model, reference)
        with off:
            batch.ref_logprobs = logprobs()
    if grpo.num_iterations > 1:
        batch.old_logprobs = logprobs()
    mx.eval(batch.ref_logprobs, batch.old_logprobs)


def policy_gradient(
    model,
    loss_and_grad,
    batch: LossInputs | None,
    dist: Dist,
    max_norm: float,
    micro_batch_tokens: int | None = None,
    lanes: Lanes | None = None,
):
    """(loss, metrics, clipped gradients, their norm before clipping, seconds spent
    exchanging) of one update: the value and gradient of the loss on this rank's share,
    summed over its micro-batches (each one's pieces side by side in `lanes`) and over
    ranks, clipped to `max_norm` in global norm. A rank with no share (`batch` None)
    joins with zeros."""
    if batch is not None:
        lanes = lanes or Lanes(1)
        loss, m, grads = None, None, None
        # as the pass decides; the compiled loss runs each group alone, sharing nothing
        share = shares_inputs(model) and not isinstance(loss_and_grad, CompiledLossAndGrad)
        for piece in micro_batches(batch, micro_batch_tokens, share):
            pieces = lane_pieces(piece, lanes.n, share)
            parts = lanes.map(lambda p: loss_and_grad(model, p), pieces)
            for (p_loss, p_m), p_grads in parts:
                if loss is None:
                    loss, m, grads = p_loss, p_m, p_grads
                else:
                    loss = loss + p_loss
                    m = {k: m[k] + p_m[k] for k in m}
                    grads = tree_map(mx.add, grads, p_grads)
            mx.eval(loss, m, grads)  # frees this piece's activations before the next
    else:
        loss = mx.array(0.0)
        m = {k: mx.array(0.0) for k in LOSS_METRICS}
        grads = tree_map(mx.zeros_like, model.trainable_parameters())
    sync_s = 0.0
    if dist.size > 1:
        mx.eval(loss, m, grads)
        tic = time.perf_counter()
        # One exchange per dtype for gradients, loss and metrics together.
        summed = dist.sum_tree({"grads": grads, "loss": loss, "m": m})
        mx.eval(summed)
        sync_s = time.perf_counter() - tic
        grads, loss, m = summed["grads"], summed["loss"], summed["m"]
    grads, grad_norm = optim.clip_grad_norm(grads, max_norm)
    mx.eval(loss, grad_norm, m)
    return loss, m, grads, grad_norm, sync_s


def apply_update(model, optimizer, grads) -> None:
    """One AdamW step on the adapters."""
    optimizer.update(model, grads)
    mx.eval(model.trainable_parameters(), optimizer.state)


def update_step(
    model,
    optimizer,
    loss_and_grad,
    batch: LossInputs | None,
    cfg: RunConfig,
    counters,
    step,
    say,
    dist: Dist,
    total_rows: int,
    reference: dict[str, mx.array] | None = None,
):
    """One update of the adapters on a rollout's batch: the reference pass, then
    `grpo.num_iterations` times the clipped policy gradient and an AdamW step (skipped,
    and counted, when non-finite). Returns (metrics per iteration, |delta| of the
    adapters, seconds spent exchanging gradients).

    `batch` is this rank's share (None when all its groups were left out: it still
    joins every exchange, with zero gradients)."""
    lanes = update_lanes(cfg.grpo.update_lanes, cfg.grpo.compile)
    if batch is not None:
        reference_pass(model, batch, cfg.grpo, reference, lanes)
    if dist.size > 1:
        # Every rank divides by the whole batch's counts (see grpo.aggregate).
        tokens = dist.all_sum(batch.mask.sum() if batch is not None else mx.array(0.0)).item()
        if batch is not None:
            batch.total_rows, batch.total_tokens = total_rows, tokens

    model.train()
    before = _adapters(model)
    it_metrics: list[dict] = []
    sync_s = 0.0
    for _ in range(cfg.grpo.num_iterations):
        loss, m, grads, grad_norm, exchange_s = policy_gradient(
            model,
            loss_and_grad,
            batch,
            dist,
            cfg.optimizer.max_grad_norm,
            cfg.grpo.micro_batch_tokens,
            lanes,
        )
        sync_s += exchange_s
        finite = math.isfinite(loss.item()) and math.isfinite(grad_norm.item())
        if finite:
            apply_update(model, optimizer, grads)
            counters.nonfinite_streak = 0
        else:
            counters.nonfinite_skipped += 1
            counters.nonfinite_streak += 1
            say(f"step {step}: non-finite loss or gradient, update skipped")
            if counters.nonfinite_streak >= cfg.train.max_nonfinite_steps:
                raise TrainingError(
                    f"{counters.nonfinite_streak} non-finite updates in a row at step "
                    f"{step}; lower optimizer.learning_rate or check the reward"
                )
        it_metrics.append(
            split_reinforced(
                split_guided(
                    {
                        "loss/total": loss.item(),
                        "grad_norm": grad_norm.item(),
                        **{k: v.item() for k, v in m.items()},
                    }
                )
            )
        )
    model.eval()
    after = _adapters(model)
    delta = math.sqrt(sum(float(((after[k] - before[k]) ** 2).sum()) for k in after))
    return it_metrics, delta, sync_s


def _step_metrics(
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
    """A step's metrics (README "What a run prints and writes"), all built here."""
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


def _guards(step: int, metrics: dict, counters: Counters, cfg: RunConfig, say) -> None:
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
                f"({ratios[key]:.1f}x now): " + _guard_cause(key, ratios, hist, cfg)
            )
    for key in GUARDED + GUARD_CONTEXT:
        if key in metrics:
            hist.setdefault(key, []).append(float(metrics[key]))


def guard_key(metric: str) -> str:
    """The logged ratio of `metric` to its usual value: 'guard/entropy_reinforced_x_median'."""
    return f"guard/{metric.replace('/', '_')}_x_median"


def _guard_cause(key: str, ratios: dict, hist: dict, cfg: RunConfig) -> str:
    if key.startswith("entropy") and entropy_bonus_on(cfg.grpo):
        return (
            "the loss pays for entropy (grpo.entropy_coef / entropy_target): lower "
            "--grpo.entropy_target or --grpo.entropy_coef_max, or turn the bonus off"
        )
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
        if not cfg.grpo.signal_component and "success" in cfg.recipe.weights:
            gate = "training only groups with a success (--grpo.signal_component=success), "
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
        if cfg.grpo.kl_target is not None:
            return (
                "the policy is moving away faster than the adaptive beta follows: raise "
                "--grpo.kl_rate or lower --grpo.kl_target or --optimizer.learning_rate"
            )
        return (
            "the policy is moving away fast: lower --optimizer.learning_rate, raise "
            "--grpo.beta, or let a controller hold it near a target (--grpo.kl_target)"
        )
    return "the updates are too large for this signal: lower --optimizer.learning_rate"


def _warnings(step, metrics, rewards, records, zero_var, counters: Counters, cfg, say) -> None:
    if zero_var.all():
        counters.zero_signal_streak += 1
        if counters.zero_signal_streak == cfg.train.zero_signal_warn_steps:
            truncated = np.array([r.truncated for r in records])
            best = sum(w for w in cfg.recipe.weights.values() if w > 0) or 1.0
            cause = _zero_signal_cause(rewards, truncated, best)
            comp = cfg.grpo.signal_component
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


def _samples_due(step: int, start: int, metrics: dict, every: int) -> bool:
    """Whether a step writes its samples: every `every` steps, a run's first step, and a
    step whose entropy or KL is above GUARD_FACTOR x its median (what drifted, to read).

    >>> [_samples_due(s, 0, {}, 10) for s in (1, 2, 10)], _samples_due(5, 4, {}, 10)
    ([True, False, True], True)
    >>> _samples_due(7, 0, {"guard/kl_x_median": 2.5}, 10), _samples_due(7, 0, {}, 0)
    (True, False)
    """
    if not every:
        return False
    drifted = any(metrics.get(guard_key(k), 0.0) > GUARD_FACTOR for k in GUARDED)
    return step % every == 0 or step == start + 1 or drifted


def _sample_records(
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
