"""The CPU's attention and gated MLP in mlx_lm's llama, qwen2 and qwen3 blocks
(`device.adapt_model`, Linux CPUs only).

MLX's CPU backend computes `mx.fast.scaled_dot_product_attention` unfused with its
scalar exp over the whole score array, and mlx_lm's `swiglu` with a scalar sigmoid;
`fastmath.attention` and `fastmath.swiglu` here are several times faster (README "How
fast"), and the packed pass (`logprobs._Packed`) needs every layer to hand it the
attention.

mlx_lm offers no public seam for either: its attention layers call the module-level
`scaled_dot_product_attention` of their model file (which goes to MLX's SDPA unless
the cache is quantized), and its MLPs the module-level `swiglu`, with no argument,
hook or registry that could give another op. An attention module of our own in each
block would copy each family's layer code (projections, norms, rotary embedding,
cache). So each block's module gets a subclass of its own class instead: the MLP's
`__call__` is mlx_lm's one-line formula with this `swiglu`; the attention's is mlx_lm's
own code object, run with a copy of its globals in which `scaled_dot_product_attention`
is `_fast_sdpa` (mlx_lm's modules and classes are not modified). The modules keep
their class names, children and so parameter names (adapters, checkpoints and exports
are unchanged), and stay instances of mlx_lm's classes. Only `device.adapt_model`
calls this, and only on a Linux CPU; on a GPU the layers stay mlx_lm's.
"""

from __future__ import annotations

import types

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention as _mlx_lm_sdpa

from mlx_grpo.cpu import fastmath


def adapt(model: nn.Module) -> int:
    """Give every block the CPU's MLP and attention (`use_fast_swiglu`,
    `use_fast_attention`); returns how many modules changed."""
    return use_fast_swiglu(model) + use_fast_attention(model)


def _swiglu_mlps() -> tuple[type, ...]:
    """mlx_lm's gated MLPs whose call is exactly down(swiglu(gate(x), up(x)))."""
    from mlx_lm.models import llama, qwen2, qwen3

    return llama.MLP, qwen2.MLP, qwen3.MLP


_FAST_MLPS: dict[type, type] = {}


def _fast_mlp_class(cls: type) -> type:
    if cls not in _FAST_MLPS:

        def __call__(self, x: mx.array) -> mx.array:
            return self.down_proj(fastmath.swiglu(self.gate_proj(x), self.up_proj(x)))

        _FAST_MLPS[cls] = type(cls.__name__, (cls,), {"__call__": __call__})
    return _FAST_MLPS[cls]


def use_fast_swiglu(model: nn.Module) -> int:
    """Give every block's gated MLP `fastmath.swiglu` in place of mlx_lm's (whose sigmoid
    is scalar on MLX's CPU backend); returns how many MLPs changed. The module keeps
    its class's name, its children and so its parameter names (adapters, checkpoints
    and exports are unchanged); on a GPU `fastmath.swiglu` is mlx_lm's."""
    return _swap_classes(model, "mlp", _swiglu_mlps(), _fast_mlp_class)


def _swap_classes(model: nn.Module, attr: str, plain: tuple[type, ...], subclass) -> int:
    """Give each block's `attr` module whose class is one of `plain` the class
    `subclass(its class)`; returns how many changed."""
    n = 0
    for layer in getattr(model, "layers", []):
        module = getattr(layer, attr, None)
        if type(module) in plain:
            module.__class__ = subclass(type(module))
            n += 1
    return n


def _fast_sdpa(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx_lm's `scaled_dot_product_attention` with `fastmath.attention` for the plain
    case; quantized caches and attention sinks keep mlx_lm's own, and a cache that
    knows its own attention pattern (`logprobs._Packed`) answers it."""
    if sinks is None and hasattr(cache, "attend"):
        return cache.attend(queries, keys, values, scale)
    if sinks is not None or hasattr(cache, "bits"):
        return _mlx_lm_sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    return fastmath.attention(queries, keys, values, scale, mask)


def _attentions() -> tuple[type, ...]:
    """mlx_lm's attention layers whose call reaches SDPA through their module's
    `scaled_dot_product_attention`."""
    from mlx_lm.models import llama, qwen2, qwen3

    return llama.Attention, qwen2.Attention, qwen3.Attention


_FAST_ATTENTIONS: dict[type, type] = {}


def _fast_attention_class(cls: type) -> type:
    """A subclass whose `__call__` is mlx_lm's own code, run with `_fast_sdpa` as its
    `scaled_dot_product_attention` (nothing of mlx_lm's is modified or copied)."""
    if cls not in _FAST_ATTENTIONS:
        call = cls.__call__
        scope = {**call.__globals__, "scaled_dot_product_attention": _fast_sdpa}
        fast = types.FunctionType(
            call.__code__, scope, call.__name__, call.__defaults__, call.__closure__
        )
        fast.__kwdefaults__, fast.__qualname__ = call.__kwdefaults__, call.__qualname__
        _FAST_ATTENTIONS[cls] = type(cls.__name__, (cls,), {"__call__": fast})
    return _FAST_ATTENTIONS[cls]


def attends_through_cache(attention: nn.Module) -> bool:
    """Whether this attention layer's SDPA is `_fast_sdpa` (see `use_fast_attention`)."""
    return type(attention) in _FAST_ATTENTIONS.values()


def use_fast_attention(model: nn.Module) -> int:
    """Give every block's attention `fastmath.attention` in place of
    `mx.fast.scaled_dot_product_attention`, which MLX's CPU backend computes unfused with
    its scalar exp over the whole score array; returns how many layers changed. As for
    `use_fast_swiglu`, the class name, children and parameter names stay; on a GPU
    `fastmath.attention` is MLX's own."""
    plain = tuple(
        c for c in _attentions() if "scaled_dot_product_attention" in c.__call__.__code__.co_names
    )
    return _swap_classes(model, "self_attn", plain, _fast_attention_class)
