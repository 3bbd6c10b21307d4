"""Where one mlx-grpo step's time goes, and what the machine could do at best.

- `machine_rates()`: the float32 GEMM rate (best of MLX and NumPy on large square
  matmuls) and the memory read bandwidth (summing a 256 MB array), measured now.
- `step_work()`: the FLOPs of one step of the work unit (prefill, policy forward and
  backward, reference forward; decode FLOPs too) and the bytes of weights that the
  decode steps read, from the model's shapes and the step's real token counts.
- `profile_step()`: re-runs each phase of a step alone on a real rollout (prefill,
  decode, reference forward, policy forward+backward, optimizer), then times the
  model's ops in isolation at the same shapes, grouped as GEMMs (every linear layer,
  LoRA and the vocab head), attention (scaled dot-product attention), elementwise
  (norms, RoPE, SwiGLU, residuals, log-softmax, sampling). What a phase takes beyond
  the sum of its ops is "python" (graph building, dispatch, scheduling, copies).
  The split is an estimate: isolated ops miss fusion and cache effects.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np


def _times(fn, reps: int) -> list[float]:
    """Seconds of `reps` calls of `fn`, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return times


def _best(fn, reps: int) -> float:
    return min(_times(fn, reps))


def machine_rates(quick: bool = False) -> dict:
    """{'gemm_gflops', 'bandwidth_gbs'} measured on this machine now."""
    n = 512 if quick else 2048
    reps = 2 if quick else 4
    a = mx.random.normal((n, n))
    b = mx.random.normal((n, n))
    mx.eval(a, b)
    mlx_t = _best(lambda: mx.eval(a @ b), reps)
    an, bn = np.array(a), np.array(b)
    np_t = _best(lambda: an @ bn, reps)
    gemm = 2 * n**3 / min(mlx_t, np_t) / 1e9
    size = (16 if quick else 256) << 20  # bytes
    big = np.ones(size // 4, dtype=np.float32)
    big_mx = mx.array(big)
    mx.eval(big_mx)
    np_bw = size / _best(lambda: big.sum(), reps) / 1e9
    mx_bw = size / _best(lambda: mx.eval(big_mx.sum()), reps) / 1e9
    return {
        "gemm_gflops": gemm,
        "gemm_gflops_mlx": 2 * n**3 / mlx_t / 1e9,
        "gemm_gflops_numpy": 2 * n**3 / np_t / 1e9,
        "bandwidth_gbs": max(np_bw, mx_bw),
        "gemm_n": n,
        "bandwidth_bytes": size,
    }


class Shapes:
    """The dimensions of an mlx_lm llama-style model."""

    def __init__(self, model: nn.Module, lora_rank: int):
        a = model.args
        self.d = a.hidden_size
        self.layers = a.num_hidden_layers
        self.inter = a.intermediate_size
        self.heads = a.num_attention_heads
        self.kv_heads = a.num_key_value_heads
        self.head_dim = getattr(a, "head_dim", None) or self.d // self.heads
        self.vocab = a.vocab_size
        self.rank = lora_rank
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        # (in, out) of every linear layer of a block, all LoRA-adapted
        self.linears = [
            (self.d, q),
            (self.d, kv),
            (self.d, kv),
            (q, self.d),
            (self.d, self.inter),
            (self.d, self.inter),
            (self.inter, self.d),
        ]
        self.block_params = sum(i * o for i, o in self.linears)
        self.weight_bytes = 4 * (self.layers * self.block_params + self.vocab * self.d)

    def linear_flops(self, tokens: int) -> float:
        return 2.0 * tokens * self.layers * self.block_params

    def lora_flops(self, tokens: int) -> float:
        return 2.0 * tokens * self.layers * sum(self.rank * (i + o) for i, o in self.linears)

    def head_flops(self, tokens: int) -> float:
        return 2.0 * tokens * self.d * self.vocab

    def attn_flops(self, queries: int, context: float) -> float:
        return 4.0 * queries * context * self.heads * self.head_dim * self.layers


def step_work(shapes: Shapes, prompt_lens: list[int], comp_lens: list[int], group: int) -> dict:
    """FLOPs and decode weight bytes of one step (real prompt and completion lengths).

    The floor counts the least work a GRPO step needs: each prompt prefilled once and
    shared by its G samples; logits only where a completion token is predicted; a
    backward pass that needs input gradients only for the frozen weights (plus LoRA's
    weight gradients); every decode step reading all weights once.
    """
    s = shapes
    prefill_tok = sum(p - 1 for p in prompt_lens)
    comp_tok = sum(comp_lens)
    steps = max(comp_lens) if comp_lens else 0
    prefill = s.linear_flops(prefill_tok) + s.lora_flops(prefill_tok)
    prefill += sum(s.attn_flops(p - 1, (p - 1) / 2) for p in prompt_lens)
    # Decode: one token per live sequence per step, attending to prompt + generated.
    decode = s.linear_flops(comp_tok) + s.lora_flops(comp_tok) + s.head_flops(comp_tok)
    groups = [comp_lens[i : i + group] for i in range(0, len(comp_lens), group)]
    decode += sum(s.attn_flops(c, p + c / 2) for p, grp in zip(prompt_lens, groups) for c in grp)
    # Update forward: prompts once per group + completion positions, head on completions.
    fwd_tok = sum(prompt_lens) + comp_tok
    attn = sum(s.attn_flops(p, p / 2) for p in prompt_lens) + sum(
        s.attn_flops(c, p + c / 2) for p, grp in zip(prompt_lens, groups) for c in grp
    )
    ref_fwd = s.linear_flops(fwd_tok) + s.head_flops(comp_tok) + attn
    pol_fwd = ref_fwd + s.lora_flops(fwd_tok)
    # Backward: input gradients through frozen weights (= forward GEMMs), LoRA input and
    # weight gradients (2x LoRA forward), attention backward (2x its forward).
    pol_bwd = (
        s.linear_flops(fwd_tok) + s.head_flops(comp_tok) + 2 * s.lora_flops(fwd_tok) + 2 * attn
    )
    return {
        "prefill_flops": prefill,
        "decode_flops": decode,
        "decode_steps": steps,
        "decode_weight_bytes": steps * s.weight_bytes,
        "ref_forward_flops": ref_fwd,
        "policy_fwd_bwd_flops": pol_fwd + pol_bwd,
        "completion_tokens": comp_tok,
        "weight_bytes": s.weight_bytes,
    }


def floor_seconds(work: dict, rates: dict) -> dict:
    """The floor of each phase: FLOPs at the GEMM rate; decode steps at the slower of
    reading every weight once (bandwidth) and their FLOPs (GEMM rate)."""
    g = rates["gemm_gflops"] * 1e9
    bw = rates["bandwidth_gbs"] * 1e9
    per_step_bytes = work["weight_bytes"] / bw
    per_step_flops = work["decode_flops"] / max(work["decode_steps"], 1) / g
    decode = work["decode_steps"] * max(per_step_bytes, per_step_flops)
    out = {
        "prefill": work["prefill_flops"] / g,
        "decode": decode,
        "ref_forward": work["ref_forward_flops"] / g,
        "policy_fwd_bwd": work["policy_fwd_bwd_flops"] / g,
    }
    out["total"] = sum(out.values())
    return out


# ---- isolated ops at the real shapes ------------------------------------------------


def _time(fn, inputs, grad: bool, reps: int) -> float:
    """Seconds for fn(*inputs) (grad: forward + backward w.r.t. the first input)."""
    if grad:

        def run():
            out, vjps = mx.vjp(fn, inputs, [mx.ones_like(fn(*inputs))])
            mx.eval(out, vjps[0])

    else:

        def run():
            mx.eval(fn(*inputs))

    return statistics.median(_times(run, reps))


def _block_ops(s: Shapes, rows: int, q_len: int, ctx: int, grad: bool, reps: int) -> dict:
    """Seconds per op class for one transformer block on [rows, q_len] queries that
    attend to `ctx` keys, forward (or forward + backward)."""
    m = rows * q_len
    x = mx.random.normal((m, s.d)) * 0.1
    gemm = 0.0
    for i, o in set(s.linears):
        n_same = s.linears.count((i, o))
        xi = mx.random.normal((m, i)) * 0.1
        w = mx.random.normal((o, i)) * 0.02
        a = mx.random.normal((i, s.rank)) * 0.02
        b = mx.random.normal((s.rank, o)) * 0.02
        mx.eval(xi, w, a, b)
        base = _time(lambda t, w=w: t @ w.T, [xi], grad, reps)
        lora = _time(lambda t, a=a, b=b: (t @ a) @ b, [xi], grad, reps)
        gemm += n_same * (base + lora)
    q = mx.random.normal((rows, s.heads, q_len, s.head_dim))
    k = mx.random.normal((rows, s.kv_heads, ctx, s.head_dim))
    v = mx.random.normal((rows, s.kv_heads, ctx, s.head_dim))
    mx.eval(q, k, v)
    mask = "causal" if q_len > 1 else None
    scale = s.head_dim**-0.5

    def sdpa(t):
        return mx.fast.scaled_dot_product_attention(t, k, v, scale=scale, mask=mask)

    attention = _time(sdpa, [q], grad, reps)
    g = mx.random.normal((m, s.inter))
    u = mx.random.normal((m, s.inter))
    wn = mx.ones((s.d,))
    qr = mx.random.normal((rows, s.heads, q_len, s.head_dim))
    mx.eval(x, g, u, wn, qr)
    elementwise = (
        2 * _time(lambda t: mx.fast.rms_norm(t, wn, 1e-5), [x], grad, reps)
        + 2
        * _time(
            lambda t: mx.fast.rope(
                t, s.head_dim, traditional=False, base=1e5, scale=1.0, offset=ctx - q_len
            ),
            [qr],
            grad,
            reps,
        )
        + _time(lambda t: nn.silu(t) * u, [g], grad, reps)
        + 2 * _time(lambda t: t + x, [x], grad, reps)
    )
    return {"gemm": gemm, "attention": attention, "elementwise": elementwise}


def _head_ops(s: Shapes, m: int, grad: bool, reps: int, sampler=None) -> dict:
    """The vocab head on m positions, then log-softmax (update) or the draw (decode:
    a `KeyedSampler`'s `draw_logits` with its normaliser and entropy, as in the compiled
    decode step)."""
    h = mx.random.normal((m, s.d)) * 0.1
    emb = mx.random.normal((s.vocab, s.d)) * 0.02
    logits = mx.random.normal((m, s.vocab))
    mx.eval(h, emb, logits)
    gemm = _time(lambda t: t @ emb.T, [h], grad, reps)
    if sampler is not None:
        keys = mx.random.split(mx.random.key(0), m)
        elementwise = _time(lambda t: sampler.draw_logits(keys, t), [logits], False, reps)
    else:
        elementwise = _time(
            lambda t: t - mx.logsumexp(t, axis=-1, keepdims=True), [logits], grad, reps
        )
    return {"gemm": gemm, "attention": 0.0, "elementwise": elementwise}


def _add(acc: dict, part: dict, times: float = 1.0) -> None:
    for k, v in part.items():
        acc[k] = acc.get(k, 0.0) + v * times


def op_split(s: Shapes, prompt_lens, comp_lens, group, sampler, reps: int = 3) -> dict:
    """Estimated seconds per op class for each phase of the step; `sampler` (a
    `KeyedSampler` of the rollout's settings) draws the decode steps' tokens."""
    steps = max(comp_lens)
    out = {}
    # prefill: each prompt once (all but its last token), logits for every position
    acc: dict = {}
    for p in prompt_lens:
        _add(acc, _block_ops(s, 1, p - 1, p - 1, False, reps), s.layers)
        _add(acc, _head_ops(s, p - 1, False, reps))
    out["prefill"] = acc
    # decode: `steps` steps of a [live, 1] batch at the mean context (sequences leave
    # the batch when they stop: the mean live batch is sum(lens) / steps)
    live = max(1, round(sum(comp_lens) / steps))
    ctx = round(statistics.mean(prompt_lens) + steps / 2)
    acc = {}
    _add(acc, _block_ops(s, live, 1, ctx, False, reps), s.layers * steps)
    _add(acc, _head_ops(s, live, False, reps, sampler=sampler), steps)
    out["decode"] = acc
    # update: per group, the prompt once, then its completions in length buckets (as
    # mlx_grpo.grpo runs them), each padded to its longest row, on the shared cache
    from mlx_grpo.logprobs import length_buckets

    for phase, grad in (("ref_forward", False), ("policy_fwd_bwd", True)):
        acc = {}
        for b, p in enumerate(prompt_lens):
            lens = comp_lens[b * group : (b + 1) * group]
            _add(acc, _block_ops(s, 1, p, p, grad, reps), s.layers)
            for bucket in length_buckets(lens):
                cb = max(lens[i] for i in bucket)
                _add(acc, _block_ops(s, len(bucket), cb, p + cb, grad, reps), s.layers)
                _add(acc, _head_ops(s, len(bucket) * cb, grad, reps))
        out[phase] = acc
    return out


def profile_step(model, tokenizer, optimizer, cfg, rollout, reps: int = 3) -> dict:
    """Each phase of one step alone on `rollout` (seconds), and its op-class estimate."""
    from mlx_grpo.device import update_lanes
    from mlx_grpo.dist import Dist
    from mlx_grpo.grpo import group_advantages, grpo_loss
    from mlx_grpo.rollout import KeyedSampler, prefill_prompts
    from mlx_grpo.update import apply_update, build_loss_inputs, policy_gradient, reference_pass

    g = rollout.group_size
    prompts = rollout.prompts
    comp_lens = [len(c.tokens) for c in rollout.completions]
    rewards = mx.array([float(i % 2) for i in range(len(comp_lens))])  # every group trains
    batch = build_loss_inputs(
        rollout, group_advantages(rewards, g), cfg.rollout.max_new_tokens, False
    )
    lanes = update_lanes(cfg.engine.update_lanes, cfg.engine.compile)
    model.eval()

    def prefill():  # as the rollout does it: a prefix all prompts share, once
        prefill_prompts(model, prompts)

    # The trainer's own update_step, timed by its parts, in its lanes.
    def ref():
        reference_pass(model, batch, cfg.grpo, lanes=lanes)

    ref()
    loss_and_grad = nn.value_and_grad(model, lambda m, b: grpo_loss(m, b, cfg.grpo))
    grads_box = {}

    def fwd_bwd():
        model.train()
        grads_box["g"] = policy_gradient(
            model,
            loss_and_grad,
            batch,
            Dist(),
            cfg.optimizer.max_grad_norm,
            cfg.engine.micro_batch_tokens,
            lanes,
        )[2]
        model.eval()

    def opt():
        apply_update(model, optimizer, grads_box["g"])

    def median(fn, k):
        return statistics.median(_times(fn, k))

    phases = {
        "prefill": median(prefill, reps),
        "decode": max(rollout.seconds - rollout.prefill_seconds, 0.0),
        "ref_forward": median(ref, 2),
        "policy_fwd_bwd": median(fwd_bwd, 2),
        "optimizer": median(opt, 2),
    }
    shapes = Shapes(model, cfg.lora.rank)
    sampler = KeyedSampler(cfg.rollout, mx.random.key(0))  # (draw_logits takes the keys)
    ops = op_split(shapes, [len(p) for p in prompts], comp_lens, g, sampler, reps=2)
    for phase, acc in ops.items():
        # Timed alone, each small op pays a synchronisation that a whole graph overlaps
        # (decode's [16, 1] GEMMs most): estimates above the measured phase are scaled
        # down to it, keeping their proportions; the remainder is Python and dispatch.
        estimated = sum(acc.values())
        if estimated > phases[phase] > 0:
            for k in acc:
                acc[k] *= phases[phase] / estimated
        acc["python"] = max(phases[phase] - sum(acc.values()), 0.0)
    ops["optimizer"] = {
        "gemm": 0.0,
        "attention": 0.0,
        "elementwise": phases["optimizer"],
        "python": 0.0,
    }
    return {
        "phases_s": phases,
        "op_classes_s": ops,
        "prompt_lens": [len(p) for p in prompts],
        "completion_lens": comp_lens,
        "group": g,
        "shapes": {"weight_bytes": shapes.weight_bytes, "layers": shapes.layers},
        "rates": machine_rates(quick=shapes.d < 256),
        "work": step_work(shapes, [len(p) for p in prompts], comp_lens, g),
    }
