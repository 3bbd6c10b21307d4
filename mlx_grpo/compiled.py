"""The update's loss and gradient under `mx.compile` (`--engine.compile`).

`mx.compile` traces a function once per input shape and then replays one graph whose
elementwise runs are fused into single kernels: fewer, larger kernels, which is what
removes per-op dispatch on a GPU. It pays only when shapes repeat, so here each group
runs alone, in a shape taken from a small set:
- the prompt is left-padded to a multiple of `PAD` tokens, its padding hidden from
  every query (`_LeftPadded`). Rotary embeddings see only distances between positions,
  so a prompt shifted right by its padding gives the same attention as the unpadded one;
- completions are right-padded to a multiple of `PAD` (padding sits after what it could
  affect, so the causal mask keeps it out), and log-probs off the loss mask are set to
  0, as `completion_logprobs` returns them where it skips positions;
- a call takes a whole group (G rows) or a run of rows of a group cut by
  `micro_batch_tokens` (1 to G rows; padding those with empty rows would cost memory
  where memory is what the cut saves).
Everything that depends on values rather than shapes (prompt lengths, the loss mask, its
turn weights, the demonstration rows, the batch's counts) enters as arrays, so a new
batch with the same padded shapes replays the trace. The objective is `grpo.objective`,
the one the eager path uses; the prompt is run once per group and shared by its rows,
as there.

What is not carried over from the eager path: length buckets inside a group and the
sparse output head for multi-turn episodes (both choose their work from the mask's
values, which a trace cannot). `traces` counts the shapes compiled so far; the trainer
logs it as `compile/traces`.

Which device it is for: GPUs; it is off by default. On an H200 the compiled update of
the bench's work unit took 1.03-1.95 s against the eager 2.35-3.09 s (steps 2-3, one
process a configuration, one sample a cell; docs/gpu.md, third lease). On a CPU it is
slower: on an AMD EPYC without AVX-512 (2 cores) the update took 15.0-17.3 s against
9.4-12.3 s eager on steps 2-5, and the first step's 66 s against 14 s, 52 s of it
tracing and compiling (docs/performance.md). MLX's CPU backend runs a compiled graph's
primitives one by one, so fusion saves no launches there, and the padded shapes give
up what is listed above.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map

from mlx_grpo.config import LOGITS_CHUNK
from mlx_grpo.grpo import LOSS_METRICS, LossInputs, objective, turn_weights
from mlx_grpo.logprobs import (
    PrefixCache,
    effective_lengths,
    head_logprobs,
    output_head,
    splittable,
    vocab_size_of,
)

PAD = 32  # tokens: prompts and completions are padded to multiples of this


def padded(n: int, multiple: int = PAD) -> int:
    """`n` rounded up to a multiple of `multiple` (at least one multiple).

    >>> padded(1), padded(32), padded(33)
    (32, 32, 64)
    """
    return max(1, -(-n // multiple)) * multiple


class _LeftPadded(PrefixCache):
    """A `PrefixCache` for a prompt whose first `start` positions are padding: no query
    sees them (a padding query sees itself only, so that its row stays finite)."""

    def __init__(self, start: mx.array):
        super().__init__()
        self.start = start

    def shared(self, rows: int) -> _LeftPadded:
        out = _LeftPadded(self.start)
        out.keys = mx.broadcast_to(self.keys, (rows, *self.keys.shape[1:]))
        out.values = mx.broadcast_to(self.values, (rows, *self.values.shape[1:]))
        out.offset = self.offset
        return out

    def make_mask(self, n, return_array=False, window_size=None):
        if window_size is not None:
            raise ValueError("engine.compile does not support sliding-window attention")
        q = mx.arange(self.offset, self.offset + n)[:, None]
        k = mx.arange(self.offset + n)[None]
        return (k <= q) & ((k >= self.start) | (k == q))


class CompiledLossAndGrad:
    """A drop-in for `nn.value_and_grad(model, grpo_loss)` in `policy_gradient`:
    `(model, batch) -> ((loss, metrics), grads)`, the sum of one compiled call per group.
    `traces` counts the shapes traced (each costs one compilation). `cfg` is the
    objective (`GRPOConfig`).

    For GPUs: faster than the eager update on an H200 (1.03-1.95 s against 2.35-3.09 s
    on the work unit, one sample a cell), slower on a CPU (15.0-17.3 s against 9.4-12.3
    s, first step 66 s against 14 s); the module's docstring has the sources."""

    def __init__(self, model: nn.Module, cfg, logits_chunk: int = LOGITS_CHUNK):
        if not splittable(model):
            raise ValueError(
                "engine.compile needs an mlx_lm model with an output head and plain KV "
                "caches; this model has neither, set --engine.compile=false"
            )
        self.model, self.cfg, self.chunk = model, cfg, logits_chunk
        self.traces = 0
        self.head = output_head(model)
        self.vocab = vocab_size_of(model, self.head, mx.zeros((1, 1), mx.int32))
        value_and_grad = nn.value_and_grad(model, self._loss)

        def traced(*arrays):
            self.traces += 1  # Python runs here only while tracing a new shape
            return value_and_grad(model, *arrays)

        # value_and_grad leaves its (traced) parameters in the model: they go back out.
        self._step = mx.compile(traced, inputs=model.state, outputs=model.state)

    def _loss(self, model, prompt, start, comp, mask, adv, old, ref, weights, guided, counts):
        r, c = comp.shape
        cache = [_LeftPadded(start) for _ in model.layers]
        hidden = model.model(prompt, cache=cache)[:, -1:]  # the last prompt token is real
        hidden = mx.broadcast_to(hidden, (r, 1, hidden.shape[-1]))
        if c > 1:
            rest = model.model(comp[:, : c - 1], cache=[pc.shared(r) for pc in cache])
            hidden = mx.concatenate([hidden, rest], axis=1)
        lp, ent = head_logprobs(self.head, hidden, comp, self.chunk, self.vocab)
        on = mask > 0
        lp, ent = mx.where(on, lp, 0.0), mx.where(on, ent, 0.0)
        batch = LossInputs(
            prompts=[],
            completions=comp,
            mask=mask,
            advantages=adv,
            old_logprobs=old if self.cfg.num_iterations > 1 else None,
            ref_logprobs=ref if self.cfg.beta > 0 else None,
            max_new_tokens=counts[2],
            total_rows=counts[0],
            total_tokens=counts[1],
            guided=guided,
        )
        return objective(lp, ent, batch, self.cfg, weights=weights)

    def group_inputs(self, batch: LossInputs, lengths: list[int], b: int, lo: int, hi: int):
        """The padded arrays of rows lo..hi (prompt `b`), or None when none has a loss
        token."""
        c_eff = max(lengths[lo:hi])
        if c_eff == 0:
            return None
        rows, c = hi - lo, padded(c_eff)
        p = np.array(batch.prompts[b]).astype(np.int32)
        plen = padded(len(p))
        prompt = np.zeros((1, plen), np.int32)
        prompt[0, plen - len(p) :] = p

        def block(x, dtype):
            out = np.zeros((rows, c), dtype)
            x = np.array(x[lo:hi])[:, :c]
            out[: x.shape[0], : x.shape[1]] = x
            return mx.array(out)

        mask = np.zeros((rows, c), np.float32)
        mask[: hi - lo, : min(c, batch.mask.shape[1])] = np.array(batch.mask[lo:hi])[:, :c]
        adv = np.zeros(rows, np.float32)
        adv[: hi - lo] = np.array(batch.advantages[lo:hi])
        guided = np.zeros(rows, np.float32)
        if batch.guided is not None:
            guided[: hi - lo] = np.array(batch.guided[lo:hi])
        zeros = mx.zeros((rows, c))
        return (
            mx.array(prompt),
            mx.array(plen - len(p), mx.int32),
            block(batch.completions, np.int32),
            mx.array(mask),
            mx.array(adv),
            zeros if batch.old_logprobs is None else block(batch.old_logprobs, np.float32),
            zeros if batch.ref_logprobs is None else block(batch.ref_logprobs, np.float32),
            turn_weights(mx.array(mask), self.cfg.loss_type == "episode"),
            mx.array(guided),
        )

    def __call__(self, model: nn.Module, batch: LossInputs):
        if model is not self.model:
            raise ValueError("CompiledLossAndGrad was built for another model")
        n, b = batch.completions.shape[0], len(batch.prompts)
        per = n // b  # rows per prompt: G, or a run of one cut group
        total_rows = n if batch.total_rows is None else batch.total_rows
        total_tokens = batch.total_tokens
        if total_tokens is None:
            total_tokens = batch.mask.sum().item()
        lengths = effective_lengths(batch.mask)
        loss, metrics, grads = mx.array(0.0), {k: mx.array(0.0) for k in LOSS_METRICS}, None
        for g in range(b):
            lo, hi = g * per, (g + 1) * per
            arrays = self.group_inputs(batch, lengths, g, lo, hi)
            if arrays is None:
                continue
            counts = mx.array([total_rows, total_tokens, batch.max_new_tokens], mx.float32)
            (g_loss, g_m), g_grads = self._step(*arrays, counts)
            loss = loss + g_loss
            metrics = {k: metrics[k] + g_m[k] for k in metrics}
            grads = g_grads if grads is None else tree_map(mx.add, grads, g_grads)
            mx.eval(loss, metrics, grads)  # one group's activations at a time
        if grads is None:
            grads = tree_map(mx.zeros_like, model.trainable_parameters())
        return (loss, metrics), grads
