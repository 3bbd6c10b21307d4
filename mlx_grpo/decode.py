"""Compiled batch decoding (`rollout.compile_decode`): one `mx.compile`d call per token.

mlx_lm's batch generator runs each decode step op by op, with a KV cache that grows
(and so changes shape) at every token; on a CPU most of a small model's decode time is
then the dispatch of its hundreds of small ops (norms, rotary, activations, the
sampler), not arithmetic. Here the rows of a turn share one fixed-capacity cache
(`StaticCache`): keys and values are written at an index that is an array, and every
step attends over the whole capacity through a mask, so all steps of a turn have the
same shapes and run one compiled graph (model call, the keyed draw and the entropy).
Even compiled, MLX runs a graph's primitives one by one on a CPU, so for the families
it knows (llama, qwen2, qwen3, `lean_applies`) the model call is `lean_logits`: the same
computation for one token a row in about half the primitives.

The cache of row i holds, from left to right: padding; its prefix (`caches[i]`) and its
tail but the last token, contiguous and ending at column L for every row; then one
column per step. The tails are prefilled first, in buckets of like lengths, each over a
cache of its own rows (`CompiledDecoder._prefill`). The mask keeps the padding out of
every query, and the rotary positions count from each row's first column, so each row
computes what it would alone: the same tokens as the op-by-op path (`rollout._decode`)
for the same keys, up to float32 rounding of the attention over a longer (masked) row.
"""

from __future__ import annotations

import weakref

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from mlx_grpo import fastmath
from mlx_grpo.logprobs import length_buckets

MIN_CAPACITY = 64  # columns


def capacity(columns: int) -> int:
    """The cache width for a turn that needs `columns`: the next of four sizes an octave
    (64, 80, 96, 112, 128, 160, ...), so turns whose contexts round to the same size
    share a trace, traces stay few (four an octave of context), and every step's
    attention runs over less than 1.25x the columns it needs.

    >>> [capacity(n) for n in (1, 64, 65, 110, 129, 765, 1100)]
    [64, 64, 80, 112, 160, 768, 1280]
    """
    if columns <= MIN_CAPACITY:
        return MIN_CAPACITY
    step = 1 << ((columns - 1).bit_length() - 3)
    return -(-columns // step) * step


# What a separate prefill pass over a bucket of rows costs beyond its padded positions,
# in positions (its dispatch, and the gather and scatter of those rows' caches): it sets
# how finely a turn's tails are bucketed by length (`logprobs.length_buckets`).
PREFILL_BUCKET_OVERHEAD = 32


class StaticCache:
    """One layer's KV cache for a batch: [B, H, capacity, D] keys and values, written at
    column `pos` (an array, the same for every row). Speaks the part of mlx_lm's cache
    protocol that attention layers use: `offset` (the rotary position of each row's
    next token), `update_and_fetch`, `make_mask`."""

    def __init__(self, keys, values, pos, left, prefix_end, tail_start, shift):
        self.keys, self.values, self.pos = keys, values, pos
        self.left, self.prefix_end = left, prefix_end
        self.tail_start, self.shift = tail_start, shift

    @property
    def offset(self) -> mx.array:
        return self.pos - self.shift

    def update_and_fetch(self, keys, values):
        self.keys = mx.slice_update(self.keys, keys, self.pos[None], axes=(2,))
        self.values = mx.slice_update(self.values, values, self.pos[None], axes=(2,))
        self.pos = self.pos + keys.shape[2]
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, **kwargs) -> mx.array:
        """[B, 1, n, capacity]: the n queries from column `pos` see their row's prefix,
        its tail up to themselves, and themselves (a padding query in the gap must see
        something, or its softmax is NaN)."""
        k = mx.arange(self.keys.shape[2])[None, None, None, :]
        q = (self.pos + mx.arange(n))[None, None, :, None]
        per_row = lambda x: x[:, None, None, None]  # noqa: E731
        prefix = (k >= per_row(self.left)) & (k < self.prefix_end)
        tail = (k >= per_row(self.tail_start)) & (k <= q)
        return prefix | tail | (k == q)


_PROJECTIONS = (
    ("self_attn", "q_proj"),
    ("self_attn", "k_proj"),
    ("self_attn", "v_proj"),
    ("self_attn", "o_proj"),
    ("mlp", "gate_proj"),
    ("mlp", "up_proj"),
    ("mlp", "down_proj"),
)


def _plain_linear(m) -> bool:
    return type(m) is nn.Linear


def _tied(model: nn.Module) -> bool:
    """Whether the output head is the embedding's transpose (mlx_lm's default)."""
    return getattr(model.args, "tie_word_embeddings", True)


def lean_applies(model: nn.Module) -> bool:
    """Whether `lean_logits` computes this model's decode step: an mlx_lm llama, qwen2
    or qwen3 (with the CPU's attention and MLP of `device.adapt_model` too) whose
    projections are plain `nn.Linear`s (adapters folded, not quantized) and whose
    rotary embedding turns the whole head as one half against the other (`traditional`
    off)."""
    from mlx_lm.models import llama, qwen2, qwen3

    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not layers or type(getattr(inner, "embed_tokens", None)) is not nn.Embedding:
        return False
    if not _tied(model) and not _plain_linear(getattr(model, "lm_head", None)):
        return False
    families = (llama.TransformerBlock, qwen2.TransformerBlock, qwen3.TransformerBlock)
    for layer in layers:
        if not isinstance(layer, families) or getattr(layer, "use_sliding", False):
            return False
        if not all(_plain_linear(getattr(getattr(layer, a), n, None)) for a, n in _PROJECTIONS):
            return False
        attn = layer.self_attn
        whole_head = getattr(attn.rope, "dims", None) == _head_dim(attn)
        if getattr(attn.rope, "traditional", True) or not whole_head:
            return False
    return True


def _head_dim(attn: nn.Module) -> int:
    return attn.q_proj.weight.shape[0] // attn.n_heads


def lean_weights(model: nn.Module) -> list[mx.array]:
    """The transposed weights `lean_logits` multiplies by (seven a layer, then the
    head's), as views: made once a turn, outside the compiled step, where a `w.T` in
    it is one more primitive for each of them at every step."""
    inner = model.model
    out = [
        getattr(getattr(layer, a), n).weight.T for layer in inner.layers for a, n in _PROJECTIONS
    ]
    return out + [(inner.embed_tokens if _tied(model) else model.lm_head).weight.T]


def _linear(layer: nn.Linear, x: mx.array, weight_t: mx.array) -> mx.array:
    y = x @ weight_t
    return y + layer.bias if "bias" in layer else y


def lean_logits(
    model: nn.Module, tokens: mx.array, cache: list[StaticCache], weights: list[mx.array]
) -> mx.array:
    """The next-token logits ([B, V]) of `model(tokens[:, None], cache=cache)[:, -1]`
    for a model that `lean_applies` to, written for one token a row, with fewer ops: the
    hidden states stay [B, hidden]; the mask, and the rotary cosines and sines, are
    made once for all layers (the latter by the layers' own rotary module, turning a
    unit vector, so any frequencies or scaling it has are kept); the attention's
    softmax is MLX's. Under `mx.compile` the graph of a step of the embedded 30-layer
    model has about 1,480 nodes, inputs included, instead of 3,170 (MLX runs its
    primitives one by one on a CPU)."""
    inner = model.model
    attn0 = inner.layers[0].self_attn
    b, d = tokens.shape[0], _head_dim(attn0)
    half = d // 2
    unit = mx.concatenate([mx.ones((half,)), mx.zeros((half,))]).astype(mx.float32)
    turned = attn0.rope(mx.broadcast_to(unit, (b, 1, 1, d)), offset=cache[0].offset)
    cos, sin = turned[..., :half], turned[..., half:]  # [B, 1, 1, d/2]
    cos2 = mx.concatenate([cos, cos], axis=-1)
    sin2 = mx.concatenate([-sin, sin], axis=-1)

    def rotate(x):  # x [B, heads, rows, d]: x cos + (the halves swapped) sin
        swapped = x.reshape(*x.shape[:-1], 2, half)[..., ::-1, :].reshape(x.shape)
        return x * cos2 + swapped * sin2

    bias = mx.where(cache[0].make_mask(1), 0.0, -mx.inf)  # [B, 1, 1, capacity]
    seen = bias.reshape(b, -1)
    h = inner.embed_tokens(tokens)
    for i, (layer, c) in enumerate(zip(inner.layers, cache)):
        attn, mlp = layer.self_attn, layer.mlp
        n = len(_PROJECTIONS)
        wq, wk, wv, wo, wg, wu, wd = weights[n * i : n * i + n]
        hq, hkv = attn.n_heads, attn.n_kv_heads
        x = layer.input_layernorm(h)
        q = _linear(attn.q_proj, x, wq).reshape(b, hkv, hq // hkv, d)
        k = _linear(attn.k_proj, x, wk).reshape(b, hkv, 1, d)
        v = _linear(attn.v_proj, x, wv).reshape(b, hkv, 1, d)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        keys, values = c.update_and_fetch(rotate(k).astype(k.dtype), v)
        q = rotate(q).astype(q.dtype) * attn.scale
        out = fastmath.decode_attention(q.reshape(b, hq, d), keys, values, seen)
        if out is None:
            scores = q @ keys.swapaxes(-1, -2) + bias
            out = mx.softmax(scores, axis=-1, precise=True) @ values  # [B, hkv, rep, d]
        h = h + _linear(attn.o_proj, out.reshape(b, hq * d), wo)
        x = layer.post_attention_layernorm(h)
        g, u = _linear(mlp.gate_proj, x, wg), _linear(mlp.up_proj, x, wu)
        h = h + _linear(mlp.down_proj, fastmath.swiglu(g, u), wd)
    h = inner.norm(h)
    if _tied(model):
        return h @ weights[-1]
    return _linear(model.lm_head, h, weights[-1])


def supported(caches: list[list]) -> bool:
    """Whether every layer of every row is a plain `KVCache` (no rotating window, no
    quantized keys, no recurrent state): what `StaticCache` stands in for; and at least
    one row holds keys (their head count and width shape the batch cache)."""
    plain = all(type(c) is KVCache for row in caches for c in row)
    return plain and any(row[0].offset > 0 for row in caches)


class CompiledDecoder:
    """Samples one turn for a batch of rows with a compiled step; built once per model
    and reused (its traces are keyed by batch size and capacity).

    It holds its model weakly, and the compiled steps take the model's arrays as
    implicit inputs only while a turn decodes (`_inputs`), so a decoder kept for a model
    (`rollout.compiled_decoder`) does not keep the model alive."""

    def __init__(self, model: nn.Module):
        self._model = weakref.ref(model)
        self._inputs: list[nn.Module] = []  # [the model] during a call, else empty
        self._steps: dict[tuple, object] = {}
        self.traces = 0  # compiled shapes so far (for tests and logs)

    @property
    def model(self) -> nn.Module:
        model = self._model()
        if model is None:
            raise ReferenceError("CompiledDecoder: its model was freed")
        return model

    def _step(self, sampler, n_layers: int, lean: bool):
        settings = (sampler.settings, lean)
        if settings not in self._steps:
            inputs = self._inputs

            def step(tokens, keys, pos, left, prefix_end, tail_start, shift, weights, *kv):
                self.traces += 1  # runs only while tracing
                model = inputs[0]  # its arrays are the tracers here
                cache = [
                    StaticCache(kv[2 * i], kv[2 * i + 1], pos, left, prefix_end, tail_start, shift)
                    for i in range(n_layers)
                ]
                if lean:
                    logits = lean_logits(model, tokens, cache, weights)
                else:
                    logits = model(tokens[:, None], cache=cache)[:, -1, :]
                nxt, entropy, keys = sampler.draw_logits(keys, logits)
                nxt = nxt.astype(mx.int32)
                out = [a for c in cache for a in (c.keys, c.values)]
                return (nxt, entropy, keys, cache[0].pos, *out)

            # `inputs` holds the model (its state) while `__call__` runs: each call
            # reads the model's current arrays, as `inputs=model.state` would.
            self._steps[settings] = mx.compile(step, inputs=inputs)
        return self._steps[settings]

    def _prefill(self, tails, prefixes, plens, rests, bucket) -> list[list[mx.array]]:
        """The keys and values ([1, H, rests[j], D] per layer and part) of the tails
        but their last tokens, for the rows j of `bucket`, in one pass over a cache of
        their own: row j holds padding, its prefix (ending at the bucket's longest,
        column P), a gap, then its tail, right-aligned at column P + the longest tail.
        The padding queries of a shorter tail write into its gap, which no query sees."""
        p, r = max(plens[j] for j in bucket), max(rests[j] for j in bucket)
        left = [p - plens[j] for j in bucket]
        tail_start = [p + r - rests[j] for j in bucket]
        layers = []
        for li, like in enumerate(prefixes[bucket[0]]):
            h, d, dtype = like.shape[1], like.shape[3], like.dtype
            rows = [
                mx.concatenate(
                    [mx.zeros((1, h, a, d), dtype), prefixes[j][li], mx.zeros((1, h, r, d), dtype)],
                    axis=2,
                )
                for j, a in zip(bucket, left)
            ]
            layers.append(mx.concatenate(rows))
        meta = (
            mx.array(left),
            mx.array(p),
            mx.array(tail_start),
            mx.array([t - plens[j] for t, j in zip(tail_start, bucket)]),
        )
        cache = [
            StaticCache(layers[2 * i], layers[2 * i + 1], mx.array(p), *meta)
            for i in range(len(layers) // 2)
        ]
        self.model(mx.array([[0] * (r - rests[j]) + tails[j][:-1] for j in bucket]), cache=cache)
        out = [
            [x[q : q + 1, :, p + r - rests[j] :, :] for c in cache for x in (c.keys, c.values)]
            for q, j in enumerate(bucket)
        ]
        mx.eval(out)
        return out

    def __call__(self, tails, caches, max_tokens: int, stop_ids, samplers):
        """As `rollout._decode`: per row, (sampled ids, "stop" or "length", its own
        cache holding `caches[i]`, the tail and every sampled id, the entropy of each
        sampled id's distribution). `samplers` are `KeyedSampler`s of one setting (or
        `GreedySampler`s); each ends with the key the op-by-op path leaves it (one split
        per draw, including the draw after its last token)."""
        self._inputs[:] = [self.model]
        try:
            return self._turn(tails, caches, max_tokens, stop_ids, samplers)
        finally:
            self._inputs.clear()

    def _turn(self, tails, caches, max_tokens: int, stop_ids, samplers):
        b = len(tails)
        n_layers = len(caches[0])
        plens = [c[0].offset for c in caches]
        rests = [len(t) - 1 for t in tails]
        ends = [n + r for n, r in zip(plens, rests)]
        width = max(ends)  # L: the column of the tails' last tokens
        cap = capacity(width + max_tokens + 1)
        start = [width - e for e in ends]  # each row's first column
        full = caches[plens.index(max(plens))]  # a row with keys, for their shape
        shapes = [(x.shape[1], x.shape[3], x.dtype) for c in full for x in (c.keys, c.values)]
        prefixes = [
            [
                mx.zeros((1, h, 0, d), dtype) if x is None else x[..., :n, :]
                for (h, d, dtype), x in zip(shapes, (x for c in row for x in (c.keys, c.values)))
            ]
            for row, n in zip(caches, plens)
        ]
        # The tails but their last tokens (eagerly). Rows with a one-token tail (a
        # turn's first row, or rows whose answer `share_tails` prefilled) have nothing
        # to prefill. The others run in buckets of like lengths, each over its own
        # rows' prefixes and padded to its own longest tail, not to the longest of all
        # (a turn's pages run from a few tokens to hundreds).
        tail_kv = [[] for _ in range(b)]
        if max(rests):
            for bucket in length_buckets(rests, PREFILL_BUCKET_OVERHEAD):
                for j, kv in zip(bucket, self._prefill(tails, prefixes, plens, rests, bucket)):
                    tail_kv[j] = kv
        # Row i: padding, its prefix and its tail from column start[i] to L, then one
        # column for each step.
        layers = []
        for li, (h, d, dtype) in enumerate(shapes):
            rows = []
            for i in range(b):
                parts = [mx.zeros((1, h, start[i], d), dtype), prefixes[i][li]]
                parts += tail_kv[i][li : li + 1]
                parts.append(mx.zeros((1, h, cap - width, d), dtype))
                rows.append(mx.concatenate(parts, axis=2))
            layers.append(mx.concatenate(rows))
        del prefixes, tail_kv
        mx.eval(layers)
        at = mx.array(start)  # no prefix part: the row's tail part is all of it
        meta = (at, mx.array(0), at, at)
        pos = mx.array(width)  # column L: each row's last tail token, the first step's input
        lean = lean_applies(self.model)
        step = self._step(samplers[0], n_layers, lean)
        keys = mx.stack([s.key for s in samplers])
        tokens = mx.array([t[-1] for t in tails])
        out: list[list[int]] = [[] for _ in range(b)]
        entropies: list[list[float]] = [[] for _ in range(b)]
        finish: list[str | None] = [None] * b
        final_keys: list[mx.array | None] = [None] * b
        caches_out: list[list | None] = [None] * b
        rows = list(range(b))  # the original index of each row of the batch

        def extract(j: int, i: int) -> list:
            """Row i's own cache from batch row j: its prefix, its tail, its ids."""
            end = width + 1 + len(out[i])  # its tail's last token and every sampled id
            parts = []
            for x in layers:
                parts.append(x[j : j + 1, :, start[i] : end, :])
            own = []
            for li in range(n_layers):
                c = KVCache()
                c.keys, c.values = parts[2 * li], parts[2 * li + 1]
                c.offset = c.keys.shape[2]
                own.append(c)
            return own

        weights = lean_weights(self.model) if lean else []
        nxt, ent, keys, pos, *layers = step(tokens, keys, pos, *meta, weights, *layers)
        mx.async_eval(nxt, ent)
        while True:
            # Queue the next step (it feeds this step's tokens) before reading them.
            after, after_ent, after_keys, after_pos, *after_layers = step(
                nxt, keys, pos, *meta, weights, *layers
            )
            layers = None  # the graph holds the last cache alone: written in place
            mx.async_eval(after, after_ent)
            drawn, h = nxt.tolist(), ent.tolist()
            for j, i in enumerate(rows):
                if finish[i] is not None:
                    continue
                out[i].append(drawn[j])
                entropies[i].append(h[j])
                if drawn[j] in stop_ids:
                    finish[i] = "stop"
                elif len(out[i]) >= max_tokens:
                    finish[i] = "length"
                if finish[i] is not None:  # the step just queued fed its last token
                    final_keys[i] = after_keys[j]
            nxt, ent, keys, pos, layers = after, after_ent, after_keys, after_pos, after_layers
            live = [j for j, i in enumerate(rows) if finish[i] is None]
            if not live:
                break
            if len(live) < len(rows):
                # Rows that have ended leave, and the rest decode as a smaller batch:
                # every row costs a step its share of the matmuls and elementwise work
                # (the embedded model's step takes about 94 ms at 16 rows, 67 at 8 and
                # 55 at 4 on two Zen 3 cores). One compiled shape per batch size, so
                # at most B of them for a capacity.
                for j, i in enumerate(rows):
                    if finish[i] is not None:
                        caches_out[i] = extract(j, i)
                take = mx.array(live)
                nxt, ent, keys = nxt[take], ent[take], keys[take]
                layers = [x[take] for x in layers]
                meta = tuple(m[take] if m.ndim else m for m in meta)
                rows = [rows[j] for j in live]
        for j, i in enumerate(rows):
            caches_out[i] = extract(j, i)
        mx.eval(final_keys, [c.state for own in caches_out for c in own])
        for s, k in zip(samplers, final_keys):
            s.key = k
        return [(out[i], finish[i], caches_out[i], entropies[i]) for i in range(b)]
