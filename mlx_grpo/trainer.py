"""The GRPO loop: sample tasks, roll out groups, score, assign credit, update the
adapters, log, save.

How a step departs from paper GRPO (each an option; `grpo.py` states the objective):
- multi-turn episodes against an environment, with only the model's tokens trained;
- groups without reward variance are left out of the update (and, with
  `credit.signal_component`, groups whose variance is partial credit alone);
- a completion that failed for the machine's sake is neither blamed nor credited;
- optionally, a supervised warm start on demonstrations before the first step
  (`train.sft_steps`), and demonstrations guided into groups no sample solved
  (`guidance.enabled`);
- the tasks come from a curriculum that hears each group's rewards.
The rules of credit assignment are in `credit.py`, the update in `update.py`, the
run's state on disk in `runstate.py`, its metrics and guards in `monitor.py`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from mlx_grpo.config import RunConfig
from mlx_grpo.credit import CompletionRecord, Credit, TrainingError, assign_credit, share_record
from mlx_grpo.curriculum import Curriculum
from mlx_grpo.device import prepare_training
from mlx_grpo.dist import Dist
from mlx_grpo.grpo import grpo_loss
from mlx_grpo.guidance import demonstration_starts, guide_groups
from mlx_grpo.monitor import (
    open_trackers,
    option_metrics,
    sample_records,
    samples_due,
    step_metrics,
    watch,
)
from mlx_grpo.recipe import Recipe
from mlx_grpo.rollout import Rollout, decode_traces, join_rollouts, keyed_samplers, rollout_tasks
from mlx_grpo.runstate import Counters, CtrlC, Interrupted, RunState
from mlx_grpo.update import build_loss_inputs, build_optimizer, loss_and_grad_of, update_step
from mlx_grpo.warmstart import check_ranks, warm_start

__all__ = ["Interrupted", "TrainingError", "build_optimizer", "train"]


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
    """Run GRPO from step 0 (or from `resume_from`) to `cfg.train.steps`; returns this
    call's per-step metrics. `callback(step, metrics)` sees each step's metrics once
    logged; `say` gets warnings and `info` notes; `evaluate_fn(step, extra)` returns
    held-out metrics before training and every `train.eval_every` steps. `rollout_fn`
    (default `rollout.rollout_tasks`) and `loss(model, batch, grpo_cfg) -> (loss,
    metrics)` (default `grpo.grpo_loss`) swap those parts of a step.

    Under `mlx.launch` every rank runs this loop: all draw the same tasks, each rolls
    out and scores its share of the groups, credit and the curriculum see the whole
    batch, and the summed gradients give every rank the same step. Rank 0 alone
    writes logs and checkpoints (and runs `evaluate_fn`).
    """
    g = cfg.grpo.num_generations
    dist = dist or Dist()
    _check_settings(recipe, cfg, dist, loss)
    if not dist.is_main:  # (rank 0 speaks for the run)
        say = info = _silent
    prepare_training()  # (once the settings are known to be sound)
    run = RunState(cfg, run_dir, model, optimizer, curriculum, adapter_cfg, dist, say, resume_from)
    counters, fresh = run.counters, resume_from is None
    trackers = open_trackers(run_dir, cfg, dist, say, info)
    if cfg.train.eval_every and fresh and evaluate_fn is not None:
        dist.run_on_main(lambda: run.base_eval(evaluate_fn, trackers, info))
    loss_and_grad = loss_and_grad_of(model, cfg, loss or grpo_loss)
    history: list[dict] = []
    # The trackers close however the loop ends (a kill is what resuming mends).
    with trackers, CtrlC(say, dist.size == 1) as ctrl_c:
        reference = _begin(run, tokenizer, recipe, say, info)
        for step in range(run.start + 1, cfg.train.steps + 1):
            mx.reset_peak_memory()
            # Sampling and LoRA dropout draw from keys fixed by (seed, step), so a resumed
            # run samples exactly what the uninterrupted run would have sampled.
            mx.random.seed(step_seed(cfg, step))
            # Roll out and score groups in waves until `train.batch_size` of them have
            # signal (`curriculum.max_waves`); every rank sees every group's record.
            got = _collect(model, tokenizer, recipe, curriculum, step, cfg, dist, counters, say,
                           rollout_fn or rollout_tasks)  # fmt: skip
            tasks, starts, shares, records = got.tasks, got.starts, got.shares, got.records

            # Credit: advantages and the groups that train. The curriculum hears the
            # groups that started at the start.
            credit = assign_credit(records, *_guided(shares), cfg)
            whole = [i for i in range(len(tasks)) if not starts[i]]
            curriculum.update([tasks[i] for i in whole], credit.heard[whole].tolist())

            # The update (every rank joins when any group trains).
            upd = _update(model, optimizer, loss_and_grad, got.rollout, credit, got.mine, cfg, run,
                          step, say, reference)  # fmt: skip

            # Metrics, the held-out evaluation, warnings and guards, logs, checkpoint.
            budget = cfg.train.token_budget
            last = step == cfg.train.steps or bool(budget and counters.rollout_tokens >= budget)
            metrics = step_metrics(
                step, shares, records, credit.scored, credit.advantages, credit.zero_var,
                upd.it_metrics, lr=float(optimizer.learning_rate), delta=upd.delta,
                trained=len(credit.train_groups), counters=counters, update_s=upd.seconds,
                curriculum=curriculum.metrics(), ranks=dist.size, sync_s=got.gather_s + upd.sync_s,
            )  # fmt: skip
            metrics.update(got.metrics())
            metrics.update(option_metrics(cfg, credit, records, shares, upd.mine, starts))
            metrics.update(_compile_metrics(model, loss_and_grad, cfg))
            if cfg.train.eval_every and (step % cfg.train.eval_every == 0 or last):
                done = {"rollout_tokens": counters.rollout_tokens}
                held_out = partial(evaluate_fn, step, done) if evaluate_fn else dict
                metrics.update(dist.run_on_main(held_out))  # (a failure stops every rank)
            watch(step, metrics, credit, records, counters, cfg, say)
            due = samples_due(step, run.start, metrics, cfg.train.sample_every)
            samples = partial(sample_records, step, tasks, records, g) if due else list
            run.write_step(step, metrics, samples, trackers)
            history.append(metrics)
            stopping = ctrl_c.requested
            if step % cfg.output.save_every == 0 or last or stopping:
                run.checkpoint(step, run.go_on and not (last or stopping))
            if callback is not None:
                callback(step, metrics)
            if stopping and not last:
                raise Interrupted(step)
            if last:
                if step < cfg.train.steps:
                    say(f"step {step}: rollout token budget {budget} reached, stopping")
                break
    return history


def step_seed(cfg: RunConfig, step: int) -> int:
    """The seed of a step's draws (the global RNG for LoRA dropout, the keys of its
    completions): fixed by (train.seed, step), so a resumed run draws what the
    uninterrupted one would have."""
    return cfg.train.seed * 1_000_003 + step


def _check_settings(recipe: Recipe, cfg: RunConfig, dist: Dist, loss) -> None:
    """Settings that the recipe, the ranks or the loss cannot serve, as one-line errors
    before anything runs."""
    if dist.size > cfg.train.batch_size:
        raise TrainingError(
            f"train.batch_size={cfg.train.batch_size} is smaller than the {dist.size} ranks: "
            "each rank needs at least one group"
        )
    for option, on in [
        ("guidance.enabled", cfg.guidance.enabled),
        ("guidance.demo_starts", cfg.guidance.demo_starts),
        ("train.sft_steps", cfg.train.sft_steps),
    ]:
        if on and not callable(getattr(recipe.module, "demonstrate", None)):
            raise TrainingError(
                f"{option}: recipe {recipe.name} defines no demonstrate(task) in its tasks.py"
            )
    check_ranks(cfg.train, dist)  # before the base evaluation, not after it
    if cfg.guidance.demo_starts and not recipe.multi_turn:
        raise TrainingError(f"guidance.demo_starts: recipe {recipe.name} is single-turn")
    if cfg.engine.compile and loss is not None:
        raise TrainingError("engine.compile compiles the GRPO loss; a custom loss runs eagerly")


def _begin(state: RunState, tokenizer, recipe: Recipe, say, info):
    """What comes before step 1 of a new run: the warm start (`train.sft_steps`) and
    step 0's checkpoint, which a kill before step `output.save_every` keeps and which
    `compare --b <run>@0` measures alone. Returns the KL term's reference adapters
    (`RunState.reference`; set before step 0's checkpoint, so that a resume finds them)."""
    warm = state.cfg.train.sft_steps and state.resume_from is None  # (a step-0 resume is past it)
    if warm:
        _warm_start(state, tokenizer, recipe, say, info)
    reference = state.reference()
    if warm:
        state.checkpoint(0, state.go_on)
    return reference


def _warm_start(state: RunState, tokenizer, recipe: Recipe, say, info) -> None:
    """The supervised warm start (`warmstart.py`), continued from a kept start's step."""
    cfg = state.cfg
    tasks = recipe.tasks("train", cfg.recipe.train_size, cfg.train.seed)
    kept = state.kept
    if kept and kept.get("sft_step"):
        info(f"warm start: continuing after its step {kept['sft_step']}")
    keep = state.warm_start_keeper()
    warm = warm_start(state.model, tokenizer, recipe, tasks, cfg, say, state.dist, kept, keep)
    state.write_warm_start(warm)
    nll = warm["nll"]
    info(
        f"warm start: {cfg.train.sft_steps} steps on {warm['demonstrations']} "
        f"demonstrations (per level {warm['levels']}), NLL {nll[0]:.3f} -> "
        f"{nll[-1]:.3f}, {warm['seconds']:.0f} s"
    )


@dataclass
class _Groups:
    """A step's groups from all its waves, in the order of its records: rank by rank,
    and within a rank wave by wave (one wave: the order the curriculum drew)."""

    tasks: list
    starts: list  # where each task's episodes start (`guidance.demo_starts`)
    rollout: Rollout  # this rank's groups
    shares: list[dict]  # what each rank shared (`share_record`), its waves joined
    records: list[CompletionRecord]
    mine: range  # this rank's groups
    waves: int
    signal: int  # groups with something to teach (`Credit.no_signal` False)
    gather_s: float

    def metrics(self) -> dict:
        return {
            "groups/rolled_out": len(self.tasks),
            "groups/signal": self.signal,
            "groups/waves": self.waves,
        }


def _collect(model, tokenizer, recipe, curriculum, step, cfg, dist, counters, say, fn) -> _Groups:
    """Roll out and score waves of `train.batch_size x curriculum.oversample` groups until
    `train.batch_size` of them have signal or `curriculum.max_waves` waves are out (DAPO's
    dynamic sampling: the groups of equal rewards are replaced, not trained)."""
    b, waves, signal, gather_s = cfg.train.batch_size, [], 0, 0.0
    for wave in range(cfg.curriculum.max_waves):
        n = math.ceil(b * curriculum.oversample)
        tasks = curriculum.sample(n)  # the same on every rank
        out = _roll_out(model, tokenizer, recipe, tasks, dist.share(n), step, wave, cfg, say, fn)
        tic = time.perf_counter()
        shares = dist.gather(out[1])
        gather_s += time.perf_counter() - tic
        records = _records(shares, counters, say)
        signal += int((~assign_credit(records, *_guided(shares), cfg).no_signal).sum())
        waves.append((tasks, out[2], out[0], shares))
        if signal >= b:
            break
    return _join_waves(waves, dist, signal, gather_s)


def _join_waves(waves: list[tuple], dist: Dist, signal: int, gather_s: float) -> _Groups:
    """The waves' (tasks, starts, this rank's rollout, shares) as one batch, rank by rank."""
    tasks, starts, shares = [], [], []
    for rank in range(dist.size):
        for wave_tasks, wave_starts, *_ in waves:
            own = dist.share(len(wave_tasks), rank)
            tasks += wave_tasks[own.start : own.stop]
            starts += wave_starts[own.start : own.stop]
        shares.append(_join_shares([w[3][rank] for w in waves]))
    lo = sum(len(sh["records"]) for sh in shares[: dist.rank])
    records = [CompletionRecord(**r) for sh in shares for r in sh["records"]]
    rollout = join_rollouts([w[2] for w in waves])
    first = lo // rollout.group_size
    mine = range(first, first + len(rollout.prompts))
    return _Groups(tasks, starts, rollout, shares, records, mine, len(waves), signal, gather_s)


def _join_shares(parts: list[dict]) -> dict:
    """One rank's shares of several waves as one: records in order, the rows of its
    guided demonstrations shifted by the records before their wave, counts added."""
    if len(parts) == 1:
        return parts[0]
    out, rows = {}, 0
    for part in parts:
        for key, value in part.items():
            if key == "guided":
                value = [(rows + row, reward) for row, reward in value]
            elif key == "demos":
                value = [rows + row for row in value]
            out[key] = out[key] + value if key in out else value
        rows += len(part["records"])
    return out


def _roll_out(model, tokenizer, recipe, tasks, mine: range, step, wave, cfg: RunConfig, say, fn):
    """(rollout, share, starts): this rank's groups of a wave sampled and scored, what it
    shares with the other ranks (with guidance, the demonstrations it put in, by its
    own rows), and where each task's episodes start (`guidance.demo_starts`; [] for
    the start)."""
    g = cfg.grpo.num_generations
    my_tasks = tasks[mine.start : mine.stop]
    # Each completion has its own key, so it does not depend on how many ranks share.
    keys = mx.random.split(_wave_key(cfg, step, wave), len(tasks) * g)
    samplers = keyed_samplers(cfg.rollout, keys[mine.start * g : mine.stop * g])
    extra, starts = {}, [[] for _ in tasks]
    if cfg.guidance.demo_starts:  # the same draw on every rank, and after a resume
        rng = np.random.default_rng([cfg.train.seed, step] + ([wave] if wave else []))
        starts = demonstration_starts(
            recipe, tasks, cfg.guidance.demo_starts, rng, cfg.rollout, say
        )
        extra["starts"] = starts[mine.start : mine.stop]
    model.eval()
    rollout = fn(model, tokenizer, recipe, my_tasks, g, cfg.rollout, samplers, **extra)
    scored = recipe.score_rollout(my_tasks, rollout)
    # The text travels with every record: a step whose entropy or KL leaves its usual
    # range writes its samples too (`samples_due`), known after the update.
    share = share_record(rollout, scored, with_text=bool(cfg.train.sample_every))
    if cfg.guidance.enabled:  # after the on-policy record: only the update sees it
        tic = time.perf_counter()
        partway = frozenset(i for i, s in enumerate(starts[mine.start : mine.stop]) if s)
        changed = guide_groups(
            recipe, tokenizer, my_tasks, rollout, scored, cfg.rollout, say, partway,
            cfg.credit.signal_component,
        )  # fmt: skip
        share["guided"] = list(changed)
        share["demos"] = [r for r, c in enumerate(rollout.completions) if c.demonstration]
        share["guidance_seconds"] = time.perf_counter() - tic
    return rollout, share, starts


def _wave_key(cfg: RunConfig, step: int, wave: int) -> mx.array:
    """The key a wave's completion keys are split from: fixed by (seed, step, wave), and
    for the first wave the step's own (`step_seed`)."""
    key = mx.random.key(step_seed(cfg, step))
    return key if wave == 0 else mx.random.split(key, wave + 1)[wave]


def _records(shares: list[dict], counters: Counters, say) -> list[CompletionRecord]:
    """Every rank's records of a wave, counted in the run's reward errors (said once
    a wave) and rollout tokens."""
    records = [CompletionRecord(**r) for sh in shares for r in sh["records"]]
    if errors := [r.error for r in records if r.error]:
        say(f"reward raised on {len(errors)} completion(s), scored as failures: {errors[0]}")
    counters.reward_errors += len(errors)
    counters.rollout_tokens += sum(sh["tokens"] for sh in shares)
    return records


def _guided(shares: list[dict]) -> tuple[list[tuple[int, float]], list[int]]:
    """(row, reward) of each demonstration guided into the batch, and the rows that
    hold one (`guidance.enabled`); each rank shares them by its own rows."""
    guided, demos, lo = [], [], 0
    for sh in shares:
        guided += [(lo + row, r) for row, r in sh.get("guided", ())]
        demos += [lo + row for row in sh.get("demos", ())]
        lo += len(sh["records"])
    return guided, demos


@dataclass
class _Update:
    it_metrics: list[dict]  # per iteration (`grpo.num_iterations`)
    delta: float  # how far the adapters moved
    sync_s: float  # seconds spent exchanging gradients
    seconds: float
    mine: tuple  # this rank's trained (completions, advantages)


def _update(model, optimizer, loss_and_grad, rollout, credit, mine, cfg, state, step, say, ref):
    """The step's update of the adapters on the groups that train (every rank joins, with
    zeros if none of them is its own)."""
    tic, counters = time.perf_counter(), state.counters
    it_metrics, delta, sync_s, mine_trained = [], 0.0, 0.0, None
    if credit.train_groups:
        batch, mine_trained = _rank_batch(rollout, credit, mine, cfg)
        rows = len(credit.train_groups) * cfg.grpo.num_generations
        it_metrics, delta, sync_s = update_step(
            model, optimizer, loss_and_grad, batch, cfg, counters, step, say, state.dist, rows, ref
        )
    seconds = time.perf_counter() - tic
    return _Update(it_metrics, delta, sync_s, seconds, mine_trained)


def _rank_batch(rollout: Rollout, credit: Credit, mine: range, cfg: RunConfig):
    """(loss inputs, (completions, advantages)) of this rank's trained groups; (None,
    empty) when none of them is its own."""
    g = cfg.grpo.num_generations
    lo, hi = mine.start * g, mine.stop * g
    local = [i - mine.start for i in credit.train_groups if i in mine]
    if not local:
        return None, ([], np.zeros(0, np.float32))
    advantages = credit.advantages[lo:hi]
    batch = build_loss_inputs(
        rollout,
        advantages,
        cfg.rollout.max_new_tokens * cfg.rollout.max_turns,
        cfg.grpo.mask_truncated_completions,
        local,
        frozenset(r - lo for r in credit.silent if lo <= r < hi),
        cfg.credit.reinforce_ill_formed,
        fold=cfg.lora.dropout == 0,
        blame_replies=cfg.credit.blame_replies,
    )
    batch.logits_chunk = cfg.engine.logits_chunk
    rows = [gi * g + j for gi in local for j in range(g)]
    return batch, ([rollout.completions[r] for r in rows], np.array(advantages)[rows])


def _compile_metrics(model, loss_and_grad, cfg: RunConfig) -> dict:
    """The shapes this process compiled so far, for the update and for decoding."""
    out = {}
    if cfg.engine.compile:
        out["compile/traces"] = loss_and_grad.traces
    if (traces := decode_traces(model)) is not None:
        out["compile/decode_traces"] = traces
    return out


def _silent(_: str) -> None:
    pass
