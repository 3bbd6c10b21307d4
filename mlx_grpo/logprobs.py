"""Log-probs of sampled completions under the policy, the engine under the GRPO loss
(`mlx_grpo.grpo`) and the reference pass.

`completion_logprobs` gives, for every completion token, log p(token | prompt, earlier
tokens) and the entropy of that position's distribution, differentiably and in float32.
For models whose attention the device seam gave the CPU's (`device.adapt_model`: llama,
qwen2, qwen3 on a Linux CPU), the whole micro-batch is one packed pass (`_Packed`):
- every token that feeds a prediction sits once in one [N, 1] batch (each group's
  prompt once, then each completion up to its length, no padding, less the inputs it
  opens with alike an earlier completion of its group: `shared_inputs`), so each
  linear layer is one GEMM over N rows, where per-group, per-length passes made many
  small ones whose cost is mostly fixed (packing the weights, dispatch);
- only attention sees the structure: each prompt attends causally to itself, and each
  completion to its prompt and its own earlier tokens (wherever they sit);
- the vocabulary-wide output head runs only at the positions that count (within
  `lengths`, and on `mask` when given), in row chunks of at most `chunk_floats`
  logits, each of which also yields its log-probs' gradient with respect to the hidden
  states (`_head_chunk`), so no logits outlive their chunk or are computed twice.
Other models with plain KV caches run group by group: the prompt once, its keys and
values shared by the group's completions (`PrefixCache`), the completions in length
buckets. Each path has a test against full passes of the model through MLX's own
log-softmax; any other model runs such full passes (`_full_sequence_logprobs`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, create_attention_mask, make_prompt_cache

from mlx_grpo import fastmath
from mlx_grpo.device import packs_rows


def output_head(model: nn.Module):
    """The model's vocab projection, so logits can be computed for chosen positions only."""
    if getattr(model, "lm_head", None) is not None:
        return model.lm_head
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embed is not None and hasattr(embed, "as_linear"):
        return embed.as_linear
    return None


def _logprobs_of(logits: mx.array, targets: mx.array) -> tuple[mx.array, mx.array]:
    """(log p(target), entropy) per position from [..., V] logits, in float32. The
    entropy is a constant of the gradient (only logged): its backward pass would be
    vocabulary-wide work for nothing.

    One `exp` over the vocabulary serves the normaliser, the entropy and (through the
    saved output of `exp`) the backward pass: on CPUs a vocabulary-wide exp costs more
    than the GEMM that made the logits, and logsumexp + softmax would take three.
    """
    shifted = logits.astype(mx.float32)
    shifted = shifted - mx.stop_gradient(fastmath.row_max(shifted, keepdims=True))
    e = fastmath.exp(shifted)
    total = fastmath.row_sum(e)
    log_total = mx.log(total)
    picked = mx.take_along_axis(shifted, mx.stop_gradient(targets)[..., None], axis=-1)
    entropy = log_total - fastmath.row_sum(e * shifted) / total
    return picked.squeeze(-1) - log_total, mx.stop_gradient(entropy)


class PrefixCache:
    """A differentiable KV cache for one group: the prompt's keys/values, computed once,
    then shared (broadcast, not copied) by the group's G completions.

    It speaks the part of mlx_lm's cache protocol that attention layers use
    (`offset`, `update_and_fetch`, `make_mask`) and keeps everything in the graph, so
    gradients reach the LoRA weights through the prompt positions too.
    """

    def __init__(self):
        self.keys = self.values = None
        self.offset = 0

    def update_and_fetch(self, keys, values):
        if self.keys is not None:
            keys = mx.concatenate([self.keys, keys], axis=2)
            values = mx.concatenate([self.values, values], axis=2)
        self.keys, self.values = keys, values
        self.offset = keys.shape[2]
        return keys, values

    def shared(self, rows: int) -> PrefixCache:
        """A cache for `rows` completions on top of this (prompt) cache, which stays as is."""
        out = PrefixCache()
        out.keys = mx.broadcast_to(self.keys, (rows, *self.keys.shape[1:]))
        out.values = mx.broadcast_to(self.values, (rows, *self.values.shape[1:]))
        out.offset = self.offset
        return out

    def make_mask(self, n, return_array=False, window_size=None):
        return create_attention_mask(n, self.offset, return_array, window_size)


def splittable(model: nn.Module) -> bool:
    """True for mlx_lm models with an inner `.model`, an output head we can call on
    chosen positions, and plain KV caches (no sliding windows or SSM state)."""
    inner = getattr(model, "model", None)
    return (
        inner is not None
        and output_head(model) is not None
        and all(isinstance(c, KVCache) for c in make_prompt_cache(model))
    )


# A separate pass for a bucket of completions costs about as much as this many more
# padded positions (dispatch and Python work per layer); it sets how finely rows are
# bucketed by length.
BUCKET_OVERHEAD_POSITIONS = 24


def length_buckets(lengths: list[int], overhead: int | None = None) -> list[list[int]]:
    """Rows grouped so that padding each group to its own longest row costs least.

    Rows of length 0 are left out (nothing of them enters the loss). Sorted by length,
    the best split into contiguous runs is found exactly (cost: rows x longest +
    `overhead` per run).

    >>> length_buckets([64, 3, 60, 2, 0])
    [[0, 2], [1, 3]]
    >>> length_buckets([64, 60, 62])
    [[0, 2, 1]]
    """
    overhead = BUCKET_OVERHEAD_POSITIONS if overhead is None else overhead
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    n = len(order)
    best, cut = [0] + [float("inf")] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            cost = best[i] + (j - i) * lengths[order[i]] + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    out, j = [], n
    while j > 0:
        out.append(order[cut[j] : j])
        j = cut[j]
    return out[::-1]


def _group_logprobs(
    model, head, prompt, completions, lengths, chunk_floats, vocab, mask=None, grad=True
):
    """(log-probs, entropies) [G, C] of one group's completions: the pass on GPUs (off
    a Linux CPU), and on one for models with plain KV caches whose attention
    `device.adapt_model` left as mlx_lm's (architectures other than llama, qwen2, qwen3).

    The prompt runs once ([1, P]); its keys and values are shared (broadcast) by the
    completions, which run in length buckets, each padded only to its own longest
    row. Completion token j is predicted from position P - 1 + j: the prompt's last
    position for j = 0, then the completion's own positions. Positions at or past a
    row's length are returned as 0, and so are positions off `mask` (numpy [G, C] bool,
    or None for all) when the head skips them (see _head_logprobs_at).
    """
    g, c = completions.shape
    cache = [PrefixCache() for _ in model.layers]
    h_last = model.model(prompt[None], cache=cache)[:, -1:]
    parts, rows = [], []
    for bucket in length_buckets(lengths):
        n, cb = len(bucket), max(lengths[i] for i in bucket)
        if n == g:
            bucket = list(range(g))  # the whole group, in order: no gather
        tokens = completions[mx.array(bucket)] if n < g else completions
        first = mx.broadcast_to(h_last, (n, 1, h_last.shape[-1]))
        if cb > 1:
            h = model.model(tokens[:, : cb - 1], cache=[pc.shared(n) for pc in cache])
            first = mx.concatenate([first, h], axis=1)
        on = None if mask is None else mask[bucket, :cb]
        if on is not None and on.mean() < SPARSE_HEAD_SHARE:
            lp, ent = _head_logprobs_at(head, first, tokens[:, :cb], on, chunk_floats, vocab, grad)
        else:
            lp, ent = head_logprobs(head, first, tokens[:, :cb], chunk_floats, vocab, grad)
        if cb < c:
            lp, ent = mx.pad(lp, [(0, 0), (0, c - cb)]), mx.pad(ent, [(0, 0), (0, c - cb)])
        parts.append((lp, ent))
        rows += bucket
    if len(rows) < g:  # rows with nothing in the loss
        parts.append((mx.zeros((g - len(rows), c)), mx.zeros((g - len(rows), c))))
        done = set(rows)
        rows += [i for i in range(g) if i not in done]
    lp = mx.concatenate([p[0] for p in parts], axis=0)
    ent = mx.concatenate([p[1] for p in parts], axis=0)
    if rows != list(range(g)):
        back = mx.array(np.argsort(rows))
        lp, ent = lp[back], ent[back]
    return lp, ent


def head_logprobs(head, hidden, targets, chunk_floats, vocab, grad=True):
    """Log-probs and entropies from hidden states, in row chunks of at most
    `chunk_floats` logits. `grad`: whether a gradient is taken through the log-probs
    (the entropies never carry one); False: the forward alone.

    For the log-probs' gradient alone, through a frozen head (`_frozen_head_weight`),
    each chunk also computes, while its softmax p is at hand, the gradient of each
    position's log-prob with respect to its hidden state, W[y] - p W (`_head_chunk`):
    a [rows, hidden] matrix, so the backward pass is one product with the upstream
    gradient, and no vocabulary-wide array outlives its chunk. Otherwise the chunks
    are recomputed in the backward pass (`mx.checkpoint`), which repeats the head's
    matmul and its vocabulary-wide elementwise work."""
    n, c = targets.shape
    weight = _frozen_head_weight(head) if grad else None
    if weight is not None:
        h, y = hidden.reshape(n * c, -1), targets.reshape(-1)
        fused = lambda h, y: _head_chunk(weight, h, y)[:2]  # noqa: E731
        lp, ent = _in_turn(fused, h, y, max(1, chunk_floats // vocab))
        return lp.reshape(n, c), mx.stop_gradient(ent).reshape(n, c)

    def chunk(h, y):
        return _logprobs_of(head(h), y)

    rows = max(1, chunk_floats // max(1, c * vocab))
    if rows < n and grad:
        # the head's own trainable parameters pass in, or they would get no gradient
        chunk = nn.utils.checkpoint(getattr(head, "__self__", head), chunk)
    return _in_turn(chunk, hidden, targets, rows)


def _in_turn(fn, x: mx.array, y: mx.array, rows: int) -> tuple[mx.array, mx.array]:
    """fn over row chunks of (x, y), concatenated, each chunk's inputs made to depend on
    the previous chunk's outputs (`mx.depends`): MLX evaluates a graph breadth-first
    (up to `MLX_BFS_MAX_WIDTH`, which mlx_grpo widens on CPUs), and would otherwise run
    the chunks side by side, every one's vocabulary-wide arrays held at once (at 3,000
    positions of the embedded model, the head's forward took 2.4x as long)."""
    parts, after = [], None
    for i in range(0, x.shape[0], rows):
        xi, yi = x[i : i + rows], y[i : i + rows]
        if after is not None:
            xi = mx.depends(xi, after)
        parts.append(fn(xi, yi))
        after = parts[-1][0]
    if len(parts) == 1:
        return parts[0]
    return mx.concatenate([p[0] for p in parts]), mx.concatenate([p[1] for p in parts])


def _frozen_head_weight(head) -> mx.array | None:
    """The [V, hidden] weight of an output head that is a plain product with it (an
    `nn.Linear` without bias, or an `nn.Embedding`'s `as_linear`) and takes no
    gradient (frozen); None for any other head (quantized, adapted, biased, trained)."""
    module = getattr(head, "__self__", head)  # a bound `as_linear`: its embedding
    plain = type(module) is nn.Linear and "bias" not in module
    if getattr(head, "__func__", None) is nn.Embedding.as_linear:
        plain = type(module) is nn.Embedding
    if not plain or module.trainable_parameters():
        return None
    return module.weight


@mx.custom_function
def _head_chunk(weight: mx.array, h: mx.array, y: mx.array):
    """(log p(y), entropy, d log p(y) / d h) for hidden states h [m, d] and targets y
    [m] through the head `h @ weight.T`, in float32; the gradient is
    W[y] - softmax(h W^T) W. As `_logprobs_of`: one exp over the vocabulary."""
    shifted = (h @ weight.T).astype(mx.float32)
    shifted = shifted - fastmath.row_max(shifted, keepdims=True)
    e = fastmath.exp(shifted)
    total = fastmath.row_sum(e, keepdims=True)
    log_total = mx.log(total)
    picked = mx.take_along_axis(shifted, y[:, None], axis=-1)
    entropy = log_total - fastmath.row_sum(e * shifted, keepdims=True) / total
    toward = weight[y] - (e * (1.0 / total)).astype(weight.dtype) @ weight
    return (picked - log_total)[:, 0], entropy[:, 0], toward.astype(h.dtype)


@_head_chunk.vjp
def _head_chunk_vjp(primals, cotangents, outputs):
    weight, h, y = primals
    d_h = cotangents[0][:, None].astype(h.dtype) * outputs[2]
    return mx.zeros_like(weight), d_h, mx.zeros_like(y)


# Below this share of loss positions in a bucket, the output head runs only on those
# positions: in a multi-turn episode most positions are the environment's observations,
# and the head (a vocab-sized matmul and log-softmax per position) would dominate.
SPARSE_HEAD_SHARE = 0.5


def _head_logprobs_at(head, hidden, targets, on, chunk_floats, vocab, grad=True):
    """head_logprobs at the positions where `on` ([n, c] numpy bool) is set, 0 elsewhere:
    the hidden states there are gathered into one [M, 1] batch, and the results are
    gathered back (the backward pass scatters their gradients to the same positions)."""
    n, c = targets.shape
    flat = np.flatnonzero(on.reshape(-1))
    if len(flat) == 0:
        return mx.zeros((n, c)), mx.zeros((n, c))
    pick = mx.array(flat)
    h = hidden.reshape(n * c, -1)[pick][:, None]
    y = targets.reshape(-1)[pick][:, None]
    lp, ent = head_logprobs(head, h, y, chunk_floats, vocab, grad)
    return _placed(lp[:, 0], flat, (n, c)), _placed(ent[:, 0], flat, (n, c))


def _placed(values: mx.array, flat: np.ndarray, shape: tuple[int, int]) -> mx.array:
    """An array of `shape` holding values[i] at flat position flat[i] and 0 elsewhere,
    as a gather (whose backward sends each position's gradient to its value)."""
    back = np.full(shape[0] * shape[1], len(flat))  # the others read the trailing 0
    back[flat] = np.arange(len(flat))
    return mx.concatenate([values, mx.zeros((1,))])[mx.array(back)].reshape(shape)


# A completion that begins with at least this many of the same inputs as an earlier one
# of its group takes their positions from it instead of running them again
# (`shared_inputs`); below this, the saving is not worth another run in the layout.
MIN_SHARED_INPUTS = 8


def shared_inputs(
    completions: np.ndarray, lengths: list[int], g: int, least: int | None = None
) -> list[tuple[int, int] | None]:
    """Per row, None, or (an earlier row of its group, how many first inputs the two
    share) where that is `least` or more (default `MIN_SHARED_INPUTS`): the earlier row
    with the most. A row's inputs are its first length - 1 tokens; positions that hold
    the same inputs after the same prompt compute the same hidden states (attention is
    causal), so the row needs its own positions only from where it departs. Episodes of
    a multi-turn group that open with the same actions share those turns and the
    environment's answers to them.

    >>> rows = np.array([[5, 6, 7, 8, 9], [5, 6, 7, 1, 2], [5, 6, 7, 8, 3], [4, 6, 7, 8, 9]])
    >>> shared_inputs(rows, [5, 5, 5, 5], 4, least=2)
    [None, (0, 3), (0, 4), None]
    >>> shared_inputs(rows, [5, 5, 5, 5], 2, least=2)  # two groups: no sharing across them
    [None, (0, 3), None, None]
    """
    least = MIN_SHARED_INPUTS if least is None else least
    out: list[tuple[int, int] | None] = []
    for r, length in enumerate(lengths):
        best = None
        for i in range(r - r % g, r):
            m = min(length, lengths[i]) - 1
            if m < max(least, 1):
                continue
            same = completions[r, :m] == completions[i, :m]
            s = m if same.all() else int(np.argmin(same))
            if s >= least and (best is None or s > best[1]):
                best = (i, s)
        out.append(best)
    return out


class _Packed:
    """The layout of one packed pass, and the cache its layers see.

    Positions are ordered group by group: the prompt (P tokens, rotary positions
    0..P-1), then each completion's inputs, the tokens that predict its later ones
    (length - 1 of them, positions P..), less those it shares with an earlier row
    (`shared`, from `shared_inputs`): their positions are that row's. The model runs on
    [N, 1] tokens, a batch of N one-token rows, so that the rotary embedding takes each
    position's own offset and every linear layer sees N rows. As every layer's cache,
    this object passes keys and values through and answers the attention (`attend`,
    reached through `mlx_grpo.cpu.layers`' attention)."""

    def __init__(
        self,
        prompt_lens: list[int],
        g: int,
        lengths: list[int],
        shared: list[tuple[int, int] | None] | None = None,
    ):
        shared = shared or [None] * len(lengths)
        positions = []
        # per group: the prompt's (start, length), its completions' buckets (each a list
        # of rows, a row as the runs of positions that hold its inputs, and the bucket's
        # width), and, in row order, each row with own positions as ((bucket, place in
        # it), shared inputs, own inputs)
        self.plan = []
        # per row, the runs (first position, count) that hold its inputs, in order
        self.runs: list[list[tuple[int, int]]] = []
        # per position, the runs of keys it sees before its own (its prompt's, then those
        # of the inputs its row shares) and its own run's first position
        seen = []
        start = 0  # of the next position
        self.prompt_end = []
        for b, p in enumerate(prompt_lens):
            rows = [max(lengths[b * g + j] - 1, 0) for j in range(g)]
            prompt = (start, p)
            positions.append(np.arange(p))
            seen.append(([], start, p))
            start += p
            self.prompt_end.append(start)
            taken = []
            for j, m in enumerate(rows):
                r = b * g + j
                s = 0 if shared[r] is None else shared[r][1]
                before = [] if s == 0 else _first_inputs(self.runs[shared[r][0]], s)
                positions.append(np.arange(p + s, p + m))
                seen.append(([prompt, *before], start, m - s))
                self.runs.append([*before, (start, m - s)] if m > s else before)
                taken.append(s)
                start += m - s
            buckets, where = [], [None] * g
            for bucket in length_buckets(rows):
                for i, j in enumerate(bucket):
                    where[j] = (len(buckets), i)
                width = max(rows[j] for j in bucket)
                buckets.append(([self.runs[b * g + j] for j in bucket], width))
            order = [(w, taken[j], rows[j] - taken[j]) for j, w in enumerate(where) if w]
            self.plan.append((prompt, buckets, [x for x in order if x[2] > 0]))
        self.offset = mx.array(np.concatenate(positions).astype(np.int32))
        width = max(len(runs) for runs, _, _ in seen)
        meta = np.zeros((start, 2 * width + 1), np.int32)
        at = 0
        for runs, own, count in seen:
            row = [x for run in runs for x in run] + [0, 0] * (width - len(runs)) + [own]
            meta[at : at + count] = row
            at += count
        self.seen = mx.array(meta)

    def update_and_fetch(self, keys, values):
        return keys, values

    def make_mask(self, n, return_array=False, window_size=None):
        return None  # `attend` knows the structure

    def attend(self, queries, keys, values, scale: float) -> mx.array:
        """Attention of every position ([N, H, 1, D] queries, [N, Hkv, 1, D] keys and
        values) to its own prompt and its own row's earlier positions: one op where the
        native one loaded (`fastmath.packed_attention`, Linux CPUs). Otherwise, with
        MLX's ops, rows are cut out as slices (a row that shares inputs with an earlier
        one also takes those positions, whose outputs it drops) and padded at their end
        (after what the padding could affect, the mask being causal), not gathered: a
        gather's backward is a scatter, which costs a CPU twice as much."""
        q, k, v = queries[:, :, 0], keys[:, :, 0], values[:, :, 0]
        out = fastmath.packed_attention(q, k, v, self.seen, scale)
        if out is not None:
            return out[:, :, None]

        def block(x, rows, width):  # [n, H, width, D]
            parts = []
            for runs in rows:
                pieces = [x[f : f + c] for f, c in runs]
                row = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces)
                parts.append(mx.pad(row, [(0, width - row.shape[0]), (0, 0), (0, 0)]))
            return mx.stack(parts).transpose(0, 2, 1, 3)

        outs = []
        for (start, p), buckets, order in self.plan:
            qp, kp, vp = (x[start : start + p].swapaxes(0, 1)[None] for x in (q, k, v))
            outs.append(fastmath.attention(qp, kp, vp, scale, "causal")[0].swapaxes(0, 1))
            done = []
            for rows, width in buckets:
                n = len(rows)
                # [n, H, P + width, D]: the prompt's keys and values, then the row's own
                kr, vr = (
                    mx.concatenate(
                        [mx.broadcast_to(x, (n, *x.shape[1:])), block(y, rows, width)], axis=2
                    )
                    for x, y in ((kp, k), (vp, v))
                )
                o = fastmath.attention(block(q, rows, width), kr, vr, scale, "causal")
                done.append(o.transpose(0, 2, 1, 3))  # [n, width, H, D]
            outs += [done[bucket][i, s : s + m] for (bucket, i), s, m in order]
        return mx.concatenate(outs)[:, :, None]

    def input_positions(self, r: int) -> np.ndarray:
        """The positions that hold row r's inputs, in order."""
        parts = [np.arange(f, f + c) for f, c in self.runs[r]]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _draws_dropout(model: nn.Module) -> bool:
    """Whether a pass draws dropout masks (LoRA dropout while training): every position
    then has draws of its own, and no row's positions are another's to share."""
    return any(isinstance(m, nn.Dropout) and m.training and m._p_1 < 1 for m in model.modules())


def shares_inputs(model: nn.Module) -> bool:
    """Whether `completion_logprobs` runs the rows that open alike on shared positions
    (`shared_inputs`): in the packed pass, drawing no dropout."""
    return splittable(model) and _packable(model) and not _draws_dropout(model)


def _first_inputs(runs: list[tuple[int, int]], s: int) -> list[tuple[int, int]]:
    """The runs of positions that hold the first `s` inputs of a row held by `runs`."""
    out = []
    for f, c in runs:
        if s <= 0:
            break
        out.append((f, min(c, s)))
        s -= c
    return out


def _packable(model: nn.Module) -> bool:
    """Whether every layer's attention hands a `_Packed` cache the attention (on a Linux
    CPU, once `device.adapt_model` gave the layers the CPU's attention)."""
    return packs_rows(model)


def _packed_logprobs(model, head, prompts, completions, lengths, on, chunk_floats, vocab, grad):
    """`completion_logprobs` in one packed pass (see `_Packed`): the pass on a Linux CPU
    once `device.adapt_model` gave the layers the CPU's attention. Against the group
    pass at the bench work unit's lengths (an AMD EPYC; docs/performance.md): the
    reference pass 1.44 s against 2.03-2.05 s, the policy's forward and backward
    4.37-4.43 s against 5.88-6.19 s; on web_browsing's long episodes, where the group
    pass's GEMMs are large already, the same (update 135.7 s against 133.2 s)."""
    n, c = completions.shape
    g = n // len(prompts)
    comp = np.array(completions)
    shared = [None] * n if _draws_dropout(model) else shared_inputs(comp, lengths, g)
    layout = _Packed([len(p) for p in prompts], g, lengths, shared)
    tokens, source, flat = [], [], []
    for b, prompt in enumerate(prompts):
        tokens.append(np.array(prompt))
        for r in range(b * g, (b + 1) * g):
            tokens.append(
                comp[r, 0 if shared[r] is None else shared[r][1] : max(lengths[r] - 1, 0)]
            )
            # position j of row r is predicted by the prompt's last (j = 0) or the
            # position of the row's input j - 1
            j = np.arange(lengths[r])
            if on is not None:
                j = j[on[r, : lengths[r]]]
            before = np.concatenate([[layout.prompt_end[b] - 1], layout.input_positions(r)])
            source.append(before[j])
            flat.append(r * c + j)
    source, flat = np.concatenate(source), np.concatenate(flat)
    if len(flat) == 0:
        return mx.zeros((n, c)), mx.zeros((n, c))
    x = mx.array(np.concatenate(tokens).astype(np.int32))[:, None]
    hidden = model.model(x, cache=[layout] * len(model.layers))
    h = hidden[mx.array(source)]  # [m, 1, d]
    y = completions.reshape(-1)[mx.array(flat)][:, None]
    lp, ent = head_logprobs(head, h, y, chunk_floats, vocab, grad)
    return _placed(lp[:, 0], flat, (n, c)), _placed(ent[:, 0], flat, (n, c))


def effective_lengths(mask: mx.array) -> list[int]:
    """Per row, one past the last position whose mask is set (0 for an empty row):
    later positions cannot affect the loss (the attention is causal)."""
    m = np.array(mask) > 0
    last = m.shape[1] - np.argmax(m[:, ::-1], axis=1)
    return np.where(m.any(axis=1), last, 0).tolist()


def completion_logprobs(
    model: nn.Module,
    prompts: list[mx.array],
    completions: mx.array,
    chunk_floats: int = 1 << 25,
    lengths: list[int] | None = None,
    mask: mx.array | None = None,
    grad: bool = True,
) -> tuple[mx.array, mx.array]:
    """Log-probs and entropies of the completion tokens, [N, C] each.

    `prompts` holds the B prompts (1-D token arrays); `completions` is [N, C] with
    N = B * G, group b in rows b*G..(b+1)*G-1, right-padded (padding sits after the
    tokens it could affect, so the causal mask keeps it out). `lengths` (default: C
    for every row) says how many leading positions of each row are needed; the others
    cost nothing and their values are not defined (0, or what their row's bucket
    computed). Each prompt runs once for its whole group, and logits are computed only
    at the positions that predict completion tokens, in row chunks of at most
    `chunk_floats` logits that no backward pass needs again (`head_logprobs`).
    With `mask` ([N, C], the loss mask), the lengths come from it, and logits are
    computed only on the mask (log-probs and entropies off it are 0): always in the
    packed pass, and in the per-group pass where the mask is sparse (the environment's
    tokens of a multi-turn episode). The entropies carry no gradient. Without `grad` (a
    pass no gradient is taken through: the reference pass), the output head does only
    its forward work.
    """
    n, c = completions.shape
    g = n // len(prompts)
    if g * len(prompts) != n:
        raise ValueError(f"{n} completions do not split into {len(prompts)} groups")

    if not splittable(model):  # any other architecture: full sequences, full logits
        return _full_sequence_logprobs(model, prompts, completions, g)

    head = output_head(model)
    on = None if mask is None else np.array(mask) > 0
    if lengths is None:
        lengths = [c] * n if mask is None else effective_lengths(mask)
    lengths = [min(int(x), c) for x in lengths]
    vocab = vocab_size_of(model, head, completions)
    if _packable(model):
        return _packed_logprobs(
            model, head, prompts, completions, lengths, on, chunk_floats, vocab, grad
        )
    parts = [
        _group_logprobs(
            model,
            head,
            p,
            completions[b * g : (b + 1) * g],
            lengths[b * g : (b + 1) * g],
            chunk_floats,
            vocab,
            None if on is None else on[b * g : (b + 1) * g],
            grad,
        )
        for b, p in enumerate(prompts)
    ]
    if len(parts) == 1:
        return parts[0]
    return (
        mx.concatenate([p[0] for p in parts], axis=0),
        mx.concatenate([p[1] for p in parts], axis=0),
    )


def _full_sequence_logprobs(model, prompts, completions, g):
    """`completion_logprobs` of any mlx_lm model, where the other passes do not apply
    (no output head to call on chosen positions, or caches other than plain KV: sliding
    windows, SSM state): each row's whole sequence, prompt repeated per row, through the
    model's own call, with logits at every position. A capability fallback, not a speed
    choice: no shared prompt, no length buckets, and full logits in memory."""
    n, c = completions.shape
    rows = [mx.concatenate([prompts[i // g], completions[i]]) for i in range(n)]
    t = max(r.shape[0] for r in rows)
    tokens = mx.stack([mx.pad(r, (0, t - r.shape[0])) for r in rows])
    starts = mx.array([prompts[i // g].shape[0] - 1 for i in range(n)])
    pos = starts[:, None] + mx.arange(c)[None, :]
    logits = mx.take_along_axis(model(tokens), pos[..., None], axis=1)
    return _logprobs_of(logits, completions)


def vocab_size_of(model: nn.Module, head, completions: mx.array) -> int:
    args = getattr(model, "args", None)
    if args is not None and getattr(args, "vocab_size", None):
        return int(args.vocab_size)
    return int(model(completions[:1, :1]).shape[-1])
