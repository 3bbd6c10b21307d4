"""Shared fixtures: a tiny random llama with a byte-level tokenizer, saved as a normal
MLX model folder so that every code path (mlx_lm.load, adapters, checkpoints) is the
real one, offline and in milliseconds."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

# The suite's converted models and BLAS verdicts go to a cache of its own, never the
# user's (~/.cache/mlx-grpo); subprocesses inherit it.
os.environ["MLX_GRPO_CACHE"] = _CACHE = tempfile.mkdtemp(prefix="mlx-grpo-test-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
# The tolerances are float32 rounding. MLX's CUDA build multiplies float32 matrices in
# TF32 by default (10-bit mantissa: errors near 1e-3, not 1e-7), so the suite turns that
# off; CPU and Metal ignore the variable. Subprocesses inherit it.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

# isort: off
import mlx_grpo  # noqa: F401  (first: loads OpenBLAS before mlx)

# isort: on
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

PARITY_PY = Path(__file__).resolve().parents[1] / ".venv-parity" / "bin" / "python"


def parity_python() -> Path:
    """The torch + transformers + peft + trl interpreter of the parity tests."""
    if PARITY_PY.exists():
        return PARITY_PY
    if os.environ.get("MLX_GRPO_SKIP_PARITY") == "1":
        pytest.skip("MLX_GRPO_SKIP_PARITY=1: parity with transformers/peft/trl skipped")
    pytest.fail(
        f"{PARITY_PY} not found: the parity tests need the torch + transformers + peft + "
        "trl environment; run `make parity-env` (`make test` does it), or set "
        "MLX_GRPO_SKIP_PARITY=1 to skip them"
    )


CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_byte_tokenizer(folder: Path) -> int:
    """A byte-level BPE tokenizer with no merges (one token per byte) plus chat
    specials; returns the vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": "<|endoftext|>",
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": 2048,
            }
        )
    )
    return len(vocab)


# Unit roundoff of float32: every float32 operation is exact to within a factor (1 + d),
# |d| <= U32.
U32 = 2.0**-24


# What a run's config.json held of the removed fields, at their defaults, as the version
# before their removal wrote it (commit 403785f's config.py); with the sections before
# `controllers`, the controllers' fields were in `grpo`.
REMOVED_AT_DEFAULTS = {
    "grpo": {"entropy_coef": 0.0, "kl_loss": "k3"},
    "controllers": {
        "entropy_target": None,
        "entropy_coef_rate": 0.01,
        "entropy_coef_max": 0.05,
        "kl_target": None,
        "kl_rate": 0.5,
    },
}


def recipe_folder(parent: Path, name: str, tasks_py: str, **files: str) -> Path:
    """A recipe folder `parent/name` with an empty `[recipe]` recipe.toml, `tasks_py` as
    its tasks.py, and `files` (file name -> text) beside them."""
    folder = parent / name
    folder.mkdir()
    (folder / "recipe.toml").write_text("[recipe]\n")
    (folder / "tasks.py").write_text(tasks_py)
    for file, text in files.items():
        (folder / file).write_text(text)
    return folder


def cut_back(run: Path, copy: Path, step: int) -> Path:
    """`copy`: the run folder `run` as a kill right after step `step`'s checkpoint
    leaves it (later step folders gone, `latest` at step `step`); the logs stay whole,
    as a resume must cut them back."""
    from mlx_grpo.runfolder import RunFolder, step_name, step_of

    shutil.copytree(run, copy)
    for folder in RunFolder(copy).step_dirs(complete=False):
        if step_of(folder.name) > step:
            shutil.rmtree(folder)
    latest = {"step_dir": step_name(step), "step": step}
    (copy / "latest").write_text(json.dumps(latest))
    return copy


def f32_tolerance(additions: int) -> float:
    """Relative tolerance between two float32 computations of one quantity that add the
    same terms in different orders (chunks, buckets, rank shares, another BLAS's kernels):
    each is within gamma_n = n U / (1 - n U) of the exact sum of n terms, relative to the
    sum of their magnitudes (Higham, Accuracy and Stability, 3.1), so the two differ by at
    most 2 gamma_n. `additions` is n: the additions on the longest path to the result."""
    gamma = additions * U32 / (1 - additions * U32)
    return 2 * gamma


def assert_f32_close(actual, desired, additions: int, what: str = "") -> None:
    """actual == desired up to float32 reordering error, measured on the whole tensor
    (2-norm): elements that cancel to nearly zero carry an error relative to the terms
    they were summed from, not to their own size, which a per-element rtol gets wrong."""
    a = np.asarray(actual, dtype=np.float64)
    d = np.asarray(desired, dtype=np.float64)
    assert a.shape == d.shape, (what, a.shape, d.shape)
    err, scale = np.linalg.norm(a - d), max(np.linalg.norm(a), np.linalg.norm(d))
    tol = f32_tolerance(additions)
    assert err <= tol * scale, f"{what}: |a - b| = {err:.3g} > {tol:.2g} * |b| = {tol * scale:.3g}"


def tiny_additions(config: dict) -> int:
    """A bound on the float32 additions on the longest path through a tiny llama's loss
    and gradients (config: its config.json): the widest reduction (MLP, vocabulary,
    hidden) once per layer, the head and the log-softmax, forward and backward."""
    width = max(config["intermediate_size"], config["vocab_size"], config["hidden_size"])
    return 2 * (config["num_hidden_layers"] + 2) * width


def make_tiny_model(folder: Path, seed: int = 0, hidden: int = 64, layers: int = 2) -> Path:
    from mlx_lm.models.llama import Model, ModelArgs

    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_byte_tokenizer(folder)
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "eos_token_id": 2,
        "bos_token_id": 1,
    }
    mx.random.seed(seed)
    model = Model(ModelArgs.from_dict(config))
    # Logits with std ~1.5: varied samples, yet far from uniform noise.
    model.update({"model": {"embed_tokens": {"weight": mx.random.normal((vocab, hidden)) * 0.2}}})
    mx.eval(model.parameters())
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def tiny(tiny_model_dir):
    """(model, tokenizer) of the tiny llama, freshly loaded."""
    from mlx_lm import load

    return load(str(tiny_model_dir))
