"""The embedded default model: GGUF conversion, q/k un-permutation, and real learning."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.llama import Model, ModelArgs

from mlx_grpo.gguf import ensure_default_model, permute_rows, unpermute_rows


def _tiny_llama(traditional: bool) -> Model:
    args = ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=100,
        rope_traditional=traditional,
        tie_word_embeddings=True,
    )
    return Model(args)


def test_unpermute_inverts_llama_cpp_rotary_layout():
    """llama.cpp's row layout + interleaved RoPE == HF layout + half-split RoPE."""
    mx.random.seed(0)
    hf = _tiny_llama(traditional=False)
    mx.eval(hf.parameters())
    weights = dict(tree_flatten(hf.parameters()))
    gguf_style = {
        k: permute_rows(v, 4 if "q_proj" in k else 2) if ("q_proj" in k or "k_proj" in k) else v
        for k, v in weights.items()
    }
    x = mx.array([[1, 5, 9, 13, 17, 21, 25, 29]])
    want = hf(x)

    interleaved = _tiny_llama(traditional=True)
    interleaved.update(tree_unflatten(list(gguf_style.items())))
    assert mx.allclose(interleaved(x), want, atol=1e-4).item()

    wrong = _tiny_llama(traditional=False)  # permuted rows with the standard RoPE
    wrong.update(tree_unflatten(list(gguf_style.items())))
    assert not mx.allclose(wrong(x), want, atol=1e-2).item()

    for k in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        n = 4 if "q_proj" in k else 2
        assert mx.array_equal(unpermute_rows(permute_rows(weights[k], n), n), weights[k]).item()


@pytest.fixture(scope="module")
def default_dir(tmp_path_factory, monkeypatch_module) -> Path:
    monkeypatch_module.setenv("MLX_GRPO_CACHE", str(tmp_path_factory.mktemp("cache")))
    return ensure_default_model()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_conversion_writes_a_normal_mlx_model_folder(default_dir):
    cfg = json.loads((default_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 30
    assert (
        cfg["quantization"]["bits"] == 4 and cfg["quantization"]["model.embed_tokens"]["bits"] == 8
    )
    assert ensure_default_model() == default_dir  # converted once, then reused

    from mlx_lm import load

    _, tok = load(str(default_dir))
    ids = tok.encode("What is 123 + 45?")
    assert tok.decode(ids) == "What is 123 + 45?"
    assert [tok.decode([i]) for i in ids if tok.decode([i]).strip().isdigit()] == list("12345")
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"


def test_default_model_answers_a_factual_question(default_dir):
    from mlx_lm import generate

    from mlx_grpo.config import ModelConfig
    from mlx_grpo.models import load_model, on_gpu

    model, tok = load_model(ModelConfig())  # the CLI path
    if on_gpu():  # the checkpoint's own format: the Q4_1 blocks stay quantized
        assert any(isinstance(m, nn.QuantizedLinear) for m in model.modules())
    else:  # dequantized to float32
        dtypes = {str(v.dtype) for _, v in tree_flatten(model.parameters())}
        assert dtypes == {"mlx.core.float32"}
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert "Paris" in generate(model, tok, prompt, max_tokens=20)


GSPO = [  # GSPO's paper's setup: sequence ratios, tight clip, rollouts reused
    "--grpo.importance_sampling_level=sequence",
    "--grpo.loss_type=grpo",
    "--grpo.num_iterations=2",
    "--grpo.epsilon=3e-4",
    "--grpo.epsilon_high=4e-4",
]


@pytest.mark.parametrize("objective", [[], GSPO], ids=["grpo", "gspo"])
def test_grpo_learns_the_answer_format_on_the_embedded_model(default_dir, tmp_path, objective):
    """A real run: the reward over the last steps beats the first steps."""
    from mlx_grpo.cli import cmd_train

    args = objective + [
        "--recipe",
        "arithmetic",
        f"--output.dir={tmp_path}",
        "--output.run=learn",
        "--train.steps=8",
        "--rollout.max_new_tokens=24",
        '--recipe.params={"levels": [1, 2]}',
        "--output.live=no",
        "--output.save_every=8",
    ]
    assert cmd_train(args) == 0
    rows = [json.loads(x) for x in (tmp_path / "learn" / "metrics.jsonl").read_text().splitlines()]
    first = rows[0]["reward/format"]  # sampled before any update
    last = np.mean([r["reward/format"] for r in rows[-3:]])
    assert last >= first + 0.2 and last >= 0.9, (first, last)
    assert np.mean([r["reward/mean"] for r in rows[-3:]]) > rows[0]["reward/mean"]
    if objective:  # the second pass over each rollout moved some sequence ratios past 4e-4
        assert max(r.get("clip/frac", 0.0) for r in rows) > 0
