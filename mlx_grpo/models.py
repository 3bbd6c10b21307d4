"""Load the policy, give it LoRA adapters, and switch them off for the reference."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from mlx_lm.tuner.lora import LoRALinear
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import dequantize_model, load

from mlx_grpo.config import LoRAConfig, ModelConfig
from mlx_grpo.device import adapt_model

DEFAULT_MODEL = "default"


class ModelLoadError(RuntimeError):
    """The model could not be found or loaded; the message is one line."""


def on_gpu() -> bool:
    return mx.default_device() == mx.gpu


def resolve_model_path(path: str) -> str:
    """'default' -> the converted embedded model folder; anything else is returned as is."""
    if path == DEFAULT_MODEL:
        from mlx_grpo.gguf import ensure_default_model

        return str(ensure_default_model())
    return path


def _is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for m in model.modules())


def load_model(cfg: ModelConfig):
    """Load (model, tokenizer) through mlx_lm and prepare the weights for this device.

    On a CPU, quantized weights are dequantized and floats cast to float32 unless the
    config says otherwise (quantized and half-precision matmuls are slow on MLX's CPU
    backend); on a GPU the checkpoint's own format is kept. Last, the device seam gives
    the blocks this device's attention and MLP (`device.adapt_model`).
    """
    try:
        path = resolve_model_path(cfg.path)
    except FileNotFoundError as e:  # the embedded model's package is not installed
        raise ModelLoadError(f"model.path: {e}") from None
    local = Path(path).expanduser()
    if not local.exists() and (path.startswith((".", "/", "~")) or path.count("/") > 1):
        raise ModelLoadError(f"model.path: {path} does not exist (and is not a Hub repo id)")
    if local.exists() and not (local / "config.json").exists():
        raise ModelLoadError(f"model.path: {path} has no config.json (not an MLX/HF model folder)")
    if local.exists():
        try:
            json.loads((local / "config.json").read_text())
        except ValueError as e:
            raise ModelLoadError(
                f"model.path: {local / 'config.json'}: not valid JSON ({e})"
            ) from None
    try:
        model, tokenizer = load(path)
    except FileNotFoundError as e:
        raise ModelLoadError(f"model.path: cannot load '{path}': {e}") from None
    except Exception as e:  # mlx_lm/hub raise many types; keep the user's line short
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"model.path: cannot load '{path}': {first}") from None

    dequant = cfg.dequantize == "yes" or (cfg.dequantize == "auto" and not on_gpu())
    if dequant and _is_quantized(model):
        model = dequantize_model(model)
    dtype = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}.get(cfg.dtype)
    if dtype is None and cfg.dtype == "auto" and not on_gpu():
        dtype = mx.float32
    if dtype is not None:
        model.update(
            tree_map(
                lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p,
                model.parameters(),
            )
        )
    mx.eval(model.parameters())
    adapt_model(model)
    return model, tokenizer


def lora_parameters(cfg: LoRAConfig) -> dict:
    """The `lora_parameters` block of mlx_lm's adapter_config.json."""
    out = {"rank": cfg.rank, "scale": cfg.scale, "dropout": cfg.dropout}
    if cfg.keys is not None:
        out["keys"] = list(cfg.keys)
    return out


def num_lora_layers(model: nn.Module, cfg: LoRAConfig) -> int:
    n = len(model.layers)
    return n if cfg.num_layers < 0 else min(cfg.num_layers, n)


def apply_lora(model: nn.Module, cfg: LoRAConfig, seed: int = 0) -> nn.Module:
    """Freeze the model and add trainable LoRA adapters with mlx_lm's tuner.

    The LoRA A matrices are drawn from `seed` so that a run is reproducible.
    """
    model.freeze()
    mx.random.seed(seed)
    # The new LoRA layers wrap the frozen base layers; only lora_a/lora_b train.
    linear_to_lora_layers(model, num_lora_layers(model, cfg), lora_parameters(cfg))
    mx.eval(model.parameters())
    return model


def lora_from_adapter(folder: str | Path) -> dict:
    """The lora-section values of an mlx_lm adapter folder's adapter_config.json."""
    path = Path(folder).expanduser() / "adapter_config.json"
    if not path.exists():
        raise ModelLoadError(f"model.init_adapter: {path} not found (not an mlx_lm adapter folder)")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"model.init_adapter: {path}: invalid JSON: {e.msg}") from None
    kind = meta.get("fine_tune_type", "lora")
    if kind != "lora":
        raise ModelLoadError(f"model.init_adapter: {path}: fine_tune_type '{kind}' (only 'lora')")
    params = meta.get("lora_parameters", {})
    out = {"num_layers": meta.get("num_layers", -1)}
    for k in ("rank", "scale", "dropout", "keys"):
        if k in params:
            out[k] = params[k]
    return out


def load_init_adapter(model: nn.Module, folder: str | Path) -> None:
    """Set the LoRA weights (already applied with the folder's config) from the folder;
    every missing, unexpected or mis-shaped tensor is reported in one line."""
    path = Path(folder).expanduser() / "adapters.safetensors"
    if not path.exists():
        raise ModelLoadError(f"model.init_adapter: {path} not found")
    weights = mx.load(str(path))
    own = dict(tree_flatten(model.trainable_parameters()))
    missing = sorted(set(own) - set(weights))
    extra = sorted(set(weights) - set(own))
    shapes = [k for k in own if k in weights and weights[k].shape != own[k].shape]
    if missing or extra or shapes:
        parts = [
            f"{what} {len(ks)} (e.g. {ks[0]})"
            for what, ks in (("missing", missing), ("unexpected", extra), ("wrong shape", shapes))
            if ks
        ]
        raise ModelLoadError(
            f"model.init_adapter: {path} does not fit the model: {'; '.join(parts)}"
        )
    model.load_weights([(k, weights[k].astype(own[k].dtype)) for k in own], strict=False)
    mx.eval(model.parameters())


def adapter_config(cfg: LoRAConfig, model: nn.Module, base: str) -> dict:
    """adapter_config.json as `mlx_lm.load(..., adapter_path=...)` reads it."""
    return {
        "fine_tune_type": "lora",
        "num_layers": num_lora_layers(model, cfg),
        "lora_parameters": lora_parameters(cfg),
        "model": base,
    }


def trainable_count(model: nn.Module) -> int:
    return sum(v.size for _, v in tree_flatten(model.trainable_parameters()))


@contextlib.contextmanager
def adapters_set(model: nn.Module, adapters: dict[str, mx.array]):
    """Inside this block the trainable weights are `adapters` (flat names, as
    `tree_flatten(model.trainable_parameters())` gives them); the model's own come back
    after it. MLX arrays are immutable, so a dict taken from the model earlier is a
    snapshot of its adapters then."""
    own = tree_flatten(model.trainable_parameters())
    model.update(tree_unflatten(list(adapters.items())))
    try:
        yield model
    finally:
        model.update(tree_unflatten(own))


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """The reference policy: inside this block every LoRALinear is replaced by its base.

    No weights are copied: the frozen base layer (`LoRALinear.linear`) is the same
    object, so the reference costs one forward pass and no memory.
    """
    lora = [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]
    if not lora:
        yield model
        return
    model.update_modules(tree_unflatten([(name, m.linear) for name, m in lora]))
    try:
        yield model
    finally:
        model.update_modules(tree_unflatten(lora))


@contextlib.contextmanager
def adapters_folded(model: nn.Module):
    """For sampling: inside this block each float32 LoRALinear is one Linear holding
    W + scale * (A B)^T, so a decode step runs one matmul per layer instead of three
    (base, A, B) and about 400 fewer small ops for a 30-layer model.

    The folded weights are a copy, held only inside the block; the adapters and the base
    are untouched, so training sees exactly the parameters it had. Layers that are
    quantized or stored in 16 bits keep their adapters (folding would round the small
    update away), as does a model in training mode (LoRA dropout).
    """
    lora = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, LoRALinear)
        and not isinstance(m.linear, nn.QuantizedLinear)
        and m.linear.weight.dtype == mx.float32
    ]
    if not lora or model.training:
        yield model
        return
    folded = [(name, m.fuse()) for name, m in lora]
    for _, f in folded:
        f.freeze()
    mx.eval([f.weight for _, f in folded])
    model.update_modules(tree_unflatten(folded))
    try:
        yield model
    finally:
        model.update_modules(tree_unflatten(lora))
