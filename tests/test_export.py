"""Export (mlx_grpo.export): PEFT adapter, merged model, HF base, model card, Hub push.

Parity is checked with the real consumers: PEFT + transformers on PyTorch CPU load the
exports in `.venv-parity` (made by `make parity-env`, a dependency of `make test`; the
product itself never imports torch), mlx_lm loads the MLX one, and each gives the
logits of the MLX model with its adapter on the same tokens within 1e-3 (float32).
The adapters are non-square (rank 4 on 64->32, 64->128 and 128->64 projections) with
a random non-zero lora_b and a scale that is not 1, so a transposed factor, a missing
scale or alpha = scale (not scale * r) fails. Without `.venv-parity` these tests fail
with a hint; MLX_GRPO_SKIP_PARITY=1 skips them instead.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

# isort: off
import mlx_grpo  # noqa: F401  (first: loads OpenBLAS before mlx)

# isort: on
import mlx.core as mx
import numpy as np
import pytest
from conftest import parity_python
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.tuner.lora import LoRALinear

from mlx_grpo import sides
from mlx_grpo.cli import main
from mlx_grpo.config import LoRAConfig, RunConfig
from mlx_grpo.export import (
    ExportError,
    export,
    lora_modules,
    peft_weights,
    push_to_hub,
    read_run,
    target_modules,
)
from mlx_grpo.model_card import model_card
from mlx_grpo.models import adapter_config, adapters_disabled, apply_lora, resolve_model_path

ROOT = Path(__file__).resolve().parents[1]
TOY = Path(__file__).parent / "data" / "toy"
TOL = 1e-3
COMPARE = {
    "model_a": "base",
    "model_b": "trained",
    "rows": [
        {
            "metric": "reward/mean",
            "a": 0.21,
            "b": 0.47,
            "diff": 0.26,
            "ci_low": 0.18,
            "ci_high": 0.34,
            "p_value": 0.0012,
            "n": 96,
        },
        {
            "metric": "reward/correct",
            "a": 0.1,
            "b": 0.35,
            "diff": 0.25,
            "ci_low": 0.15,
            "ci_high": 0.33,
        },
    ],
}

# Runs under .venv-parity: loads each export with transformers (+ peft) on CPU, float32.
CONSUMER = r"""
import json, sys
import numpy as np, torch
from transformers import AutoModelForCausalLM

torch.manual_seed(0)
report = {}
for job in json.load(open(sys.argv[1])):
    if job["kind"] == "peft":
        from peft import AutoPeftModelForCausalLM, PeftModel
        if job.get("base"):
            base = AutoModelForCausalLM.from_pretrained(job["base"], dtype=torch.float32)
            model = PeftModel.from_pretrained(base, job["path"])
        else:
            model = AutoPeftModelForCausalLM.from_pretrained(job["path"], dtype=torch.float32)
        lora = [m for n, m in model.named_modules() if n.endswith("lora_B.default")]
        info = {"lora_modules": len(lora), "nonzero_B": sum(bool(m.weight.abs().sum() > 0) for m in lora)}
    else:
        model = AutoModelForCausalLM.from_pretrained(job["path"], dtype=torch.float32)
        info = {}
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor(job["tokens"])).logits
    np.save(job["out"], logits.float().numpy())
    report[job["name"]] = info
print("REPORT " + json.dumps(report))
"""


def run_consumers(jobs: list[dict], tmp: Path) -> tuple[dict, dict]:
    """Run CONSUMER on `jobs` under .venv-parity; returns ({name: logits}, report)."""
    py = parity_python()
    for job in jobs:
        job["out"] = str(tmp / f"{job['name']}.npy")
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    (tmp / "consumer.py").write_text(CONSUMER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [str(py), str(tmp / "consumer.py"), str(tmp / "jobs.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")][-1]
    return {j["name"]: np.load(j["out"]) for j in jobs}, json.loads(line[len("REPORT ") :])


def logits_of(model, tokens: np.ndarray) -> np.ndarray:
    out = model(mx.array(tokens))
    return np.array(out.astype(mx.float32))


# ------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def quantized_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny llama quantized to 4 bits (group 32), like the embedded default."""
    import shutil

    from mlx_lm.utils import load_config, quantize_model, save_config, save_model

    out = tmp_path_factory.mktemp("tiny-q4")
    model, _ = load(str(tiny_model_dir))
    model, config = quantize_model(model, load_config(tiny_model_dir), 32, 4)
    save_model(out, model)
    save_config(config, out / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tiny_model_dir / name, out / name)
    return out


def make_run(
    folder: Path, base: Path | str, lora: LoRAConfig, seed: int, compare: dict | None = None
) -> Path:
    """A run folder as the trainer leaves it, with a random non-zero lora_b."""
    folder.mkdir(parents=True)
    model, _ = load(resolve_model_path(str(base)))
    apply_lora(model, lora, seed=seed)
    mx.random.seed(seed + 1)
    for _, m in model.named_modules():
        if isinstance(m, LoRALinear):
            m.lora_b = mx.random.normal(m.lora_b.shape) * 0.2
    mx.eval(model.parameters())
    adapters = dict(tree_flatten(model.trainable_parameters()))
    mx.save_safetensors(str(folder / "adapters.safetensors"), adapters)
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config(lora, model, str(base))))
    cfg = RunConfig.model_validate(
        {"model": {"path": str(base)}, "lora": lora.model_dump(), "recipe": {"name": "toy"}}
    )
    (folder / "config.json").write_text(cfg.model_dump_json(indent=2))
    (folder / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "reward/mean": 0.1 * s}) + "\n" for s in (1, 2, 3))
    )
    if compare is not None:
        (folder / "compare.json").write_text(json.dumps(compare))
    return folder


def mlx_logits(base: Path, run: Path, tokens: np.ndarray) -> np.ndarray:
    """The reference: mlx_lm's own model with the run's adapter (quantized if the base is)."""
    model, _ = load(str(base), adapter_path=str(run))
    return logits_of(model, tokens)


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(3, 259, size=(2, 16))


@pytest.fixture(scope="module")
def exported(tiny_model_dir, quantized_model_dir, tmp_path_factory, tokens):
    """Three runs, their exports, and the MLX logits with and without each adapter.

    full    float base, every linear of every layer (r=4, scale 2.5): peft through the CLI
    subset  quantized base, last layer's q_proj and down_proj (r=4, scale 3): peft
    merged  quantized base, every linear (r=4, scale 2): merged hf/ + mlx/
    """
    tmp = tmp_path_factory.mktemp("export-parity")
    runs = {
        "full": make_run(
            tmp / "run-full", tiny_model_dir, LoRAConfig(rank=4, scale=2.5), seed=1, compare=COMPARE
        ),
        "subset": make_run(
            tmp / "run-subset",
            quantized_model_dir,
            LoRAConfig(rank=4, scale=3.0, num_layers=1, keys=["self_attn.q_proj", "mlp.down_proj"]),
            seed=2,
        ),
        "merged": make_run(
            tmp / "run-merged", quantized_model_dir, LoRAConfig(rank=4, scale=2.0), seed=3
        ),
    }
    bases = {"full": tiny_model_dir, "subset": quantized_model_dir, "merged": quantized_model_dir}
    outs = {k: tmp / f"out-{k}" for k in runs}
    with pytest.raises(SystemExit) as done:
        main(["export", str(runs["full"]), "--format", "peft", "--out", str(outs["full"])])
    assert done.value.code == 0
    export(runs["subset"], "peft", outs["subset"])
    export(runs["merged"], "merged", outs["merged"])
    return {
        "tmp": tmp,
        "runs": runs,
        "outs": outs,
        "mlx": {k: mlx_logits(bases[k], runs[k], tokens) for k in runs},
        "no_adapter": {k: logits_of(load(str(bases[k]))[0], tokens) for k in runs},
    }


@pytest.fixture(scope="module")
def parity(exported, tokens):
    """`exported`, plus what transformers / peft compute on the exports."""
    outs = exported["outs"]
    jobs = [
        {"name": "full", "kind": "peft", "path": str(outs["full"]), "tokens": tokens.tolist()},
        {"name": "subset", "kind": "peft", "path": str(outs["subset"]), "tokens": tokens.tolist()},
        {
            "name": "merged",
            "kind": "hf",
            "path": str(outs["merged"] / "hf"),
            "tokens": tokens.tolist(),
        },
    ]
    torch_logits, report = run_consumers(jobs, exported["tmp"])
    return {**exported, "torch": torch_logits, "report": report}


def _check(exported, name: str, got: np.ndarray) -> float:
    ref = exported["mlx"][name]
    assert got.shape == ref.shape
    # The adapter must matter far more than the tolerance, or the test proves nothing.
    assert np.abs(ref - exported["no_adapter"][name]).max() > 100 * TOL
    diff = float(np.abs(got - ref).max())
    print(f"{name}: max |logit diff| = {diff:.2e}")
    assert diff < TOL, f"{name}: max |logit diff| {diff:.2e} >= {TOL}"
    return diff


# -------------------------------------------------------------------------- parity


def test_peft_export_loaded_by_peft_matches_mlx(parity):
    _check(parity, "full", parity["torch"]["full"])
    out = parity["outs"]["full"]
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 10  # scale 2.5 * r 4
    assert cfg["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert cfg["layers_to_transform"] is None
    # A local base is shipped dequantized in base/, and named by its path.
    assert cfg["base_model_name_or_path"] == str((out / "base").resolve())
    assert parity["report"]["full"] == {"lora_modules": 14, "nonzero_B": 14}


def test_peft_export_of_some_layers_on_a_quantized_base_matches_mlx(parity):
    _check(parity, "subset", parity["torch"]["subset"])
    cfg = json.loads((parity["outs"]["subset"] / "adapter_config.json").read_text())
    assert cfg["target_modules"] == ["down_proj", "q_proj"]
    assert cfg["layers_to_transform"] == [1] and cfg["layers_pattern"] == "layers"
    assert cfg["lora_alpha"] == 12
    assert parity["report"]["subset"] == {"lora_modules": 2, "nonzero_B": 2}
    card = (parity["outs"]["subset"] / "README.md").read_text()
    assert "Quantized base" in card and 'subfolder="base"' in card


def test_merged_export_loaded_by_transformers_matches_mlx(parity):
    hf = parity["outs"]["merged"] / "hf"
    config = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization" not in config and "quantization_config" not in config
    assert {"model.safetensors", "tokenizer.json", "README.md"} <= {p.name for p in hf.iterdir()}
    _check(parity, "merged", parity["torch"]["merged"])


def test_merged_mlx_export_loaded_by_mlx_lm_matches(exported, tokens):
    model, tokenizer = load(str(exported["outs"]["merged"] / "mlx"))
    assert not any(isinstance(m, LoRALinear) for _, m in model.named_modules())
    assert tokenizer.encode("hi") == load(str(exported["outs"]["merged"] / "hf"))[1].encode("hi")
    _check(exported, "merged", logits_of(model, tokens))


def test_embedded_default_run_exports_to_peft_with_its_dequantized_base(tmp_path):
    """A run on the embedded Q4_1 default: the PEFT export ships the dequantized base in
    base/; transformers on base/ gives the training-time MLX base's logits, and PEFT on
    the export those of the MLX model with the adapter (last 2 of 30 layers)."""
    from mlx_lm.tuner.utils import load_adapters

    from mlx_grpo.config import ModelConfig
    from mlx_grpo.models import load_model

    parity_python()
    lora = LoRAConfig(rank=4, scale=2.0, num_layers=2, keys=["self_attn.q_proj", "mlp.down_proj"])
    run = make_run(tmp_path / "run", "default", lora, seed=5)
    out = export(run, "peft", tmp_path / "out").out
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str((out / "base").resolve())
    assert cfg["layers_to_transform"] == [28, 29] and cfg["target_modules"] == [
        "down_proj",
        "q_proj",
    ]
    card = (out / "README.md").read_text()
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card
    assert "Q4_1" in card and "Quantized base" in card
    assert "SmolLM2-135M-Instruct (Q4_1, dequantized)" in (out / "base" / "README.md").read_text()

    # The reference is the model as training sees it on a CPU: dequantized, float32.
    model, tokenizer = load_model(ModelConfig(path="default", dequantize="yes", dtype="float32"))
    load_adapters(model, str(run))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
    )
    toks = np.array([prompt])
    with_adapter = logits_of(model, toks)
    with adapters_disabled(model):
        base = logits_of(model, toks)
    assert np.abs(with_adapter - base).max() > 100 * TOL
    jobs = [
        {"name": "base", "kind": "hf", "path": str(out / "base"), "tokens": toks.tolist()},
        {"name": "peft", "kind": "peft", "path": str(out), "tokens": toks.tolist()},
    ]
    got, report = run_consumers(jobs, tmp_path)
    assert report["peft"] == {"lora_modules": 4, "nonzero_B": 4}
    for name, ref in (("base", base), ("peft", with_adapter)):
        diff = float(np.abs(got[name] - ref).max())
        print(f"default {name}: max |logit diff| = {diff:.2e}")
        assert diff < TOL, f"default {name}: max |logit diff| {diff:.2e}"


def test_base_export_of_a_model_folder(tiny_model_dir, quantized_model_dir, tmp_path):
    """`export MODEL --format base` (here the tiny quantized llama): dequantized, HF."""
    done = export(quantized_model_dir, "base", tmp_path / "base", dtype="bfloat16")
    weights = mx.load(str(done.out / "model.safetensors"))
    assert {v.dtype for v in weights.values()} == {mx.bfloat16}
    assert not any(k.endswith((".scales", ".biases")) for k in weights)
    config = json.loads((done.out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    # said whatever the base's config says: transformers does not tie by default
    assert config["tie_word_embeddings"] == ("lm_head.weight" not in weights)
    card = (done.out / "README.md").read_text()
    assert "Quantized base" in card and "dequantized and rounded to bfloat16" in card
    assert "exactly" not in card
    run = make_run(tmp_path / "run", tiny_model_dir, LoRAConfig(rank=4), 0)
    from_run = export(run, "base", tmp_path / "from-run")  # a run's base
    assert "Quantized base" not in (from_run.out / "README.md").read_text()
    assert mx.load(str(from_run.out / "model.safetensors")).keys() == weights.keys()


def test_the_base_models_license_goes_with_its_weights(tiny_model_dir, tmp_path):
    """An export redistributes the base's weights (or an adapter for them): its card
    names the base's license and its license files are copied along."""
    from mlx_grpo.export import License, base_license

    base = tmp_path / "licensed"
    shutil.copytree(tiny_model_dir, base)
    (base / "README.md").write_text("---\nlicense: llama3.2\ntags:\n- x\n---\n# A model\n")
    (base / "LICENSE").write_text("the terms")
    (base / "USE_POLICY.md").write_text("the policy")
    done = export(base, "base", tmp_path / "base-out")
    assert "\nlicense: llama3.2\n" in (done.out / "README.md").read_text()
    assert (done.out / "LICENSE").read_text() == "the terms" and (
        done.out / "USE_POLICY.md"
    ).exists()
    run = make_run(tmp_path / "run", base, LoRAConfig(rank=4), 0)
    done = export(run, "merged", tmp_path / "merged")
    for part in ("hf", "mlx"):
        assert (done.out / part / "LICENSE").exists()
        assert "\nlicense: llama3.2\n" in (done.out / part / "README.md").read_text()
    done = export(run, "peft", tmp_path / "peft")  # a local base: shipped in base/
    assert {"LICENSE", "USE_POLICY.md"} <= set(done.files)
    assert (done.out / "LICENSE").exists() and (done.out / "base" / "LICENSE").exists()
    # Nothing known, nothing claimed.
    assert base_license(str(tiny_model_dir)) == base_license("someone/not-cached") == License()
    assert (
        "license:"
        not in (export(tiny_model_dir, "base", tmp_path / "b2").out / "README.md").read_text()
    )
    assert base_license("default").id == "apache-2.0"  # the GGUF's general.license


# -------------------------------------------------------------------- formats, card


def test_peft_weights_are_transposed_factors():
    a = mx.arange(12, dtype=mx.float32).reshape(6, 2)  # (in, r)
    b = mx.arange(10, dtype=mx.float32).reshape(2, 5)  # (r, out)
    w = peft_weights(
        {"model.layers.0.mlp.up_proj.lora_a": a, "model.layers.0.mlp.up_proj.lora_b": b}
    )
    key = "base_model.model.model.layers.0.mlp.up_proj"
    assert w[f"{key}.lora_A.weight"].shape == (2, 6) and w[f"{key}.lora_B.weight"].shape == (5, 2)
    assert mx.array_equal(w[f"{key}.lora_A.weight"], a.T)


def test_lora_on_the_embeddings_is_refused():
    """mlx_lm's LoRAEmbedding has (vocab, r) and (r, dims) factors, which PEFT keeps as
    lora_embedding_A/B; written as a linear layer's, PEFT would drop them with a warning."""
    a, b = mx.zeros((40, 4)), mx.zeros((4, 16))
    with pytest.raises(ExportError, match="model.embed_tokens.lora_a: LoRA on the embeddings"):
        peft_weights({"model.embed_tokens.lora_a": a, "model.embed_tokens.lora_b": b})


def test_target_modules_fall_back_to_full_paths_when_the_short_form_is_not_exact():
    mods = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj"]
    assert target_modules(mods, 2) == (sorted(mods), None)
    full = [f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "v_proj")]
    assert target_modules(full, 2) == (["q_proj", "v_proj"], None)
    assert target_modules(full, 4) == (["q_proj", "v_proj"], [0, 1])


def test_card_has_recipe_steps_settings_and_the_compare_table(tiny_model_dir, tmp_path):
    run = read_run(
        make_run(tmp_path / "run", tiny_model_dir, LoRAConfig(rank=4, scale=2.5), 0, COMPARE)
    )
    assert run.step == 3
    card = model_card("peft", str(tiny_model_dir), False, run, repo_id="me/toy-grpo")
    assert card.startswith("---\nlibrary_name: peft\n")
    assert "`toy` recipe for 3 steps" in card
    assert "| LoRA rank r | 4 |" in card and "| LoRA scale (PEFT lora_alpha / r) | 2.5 |" in card
    assert "| reward/mean | 0.21 | 0.47 | 0.26 | [0.18, 0.34] | 0.0012 | 96 |" in card
    assert "| reward/correct | 0.1 | 0.35 | 0.25 | [0.15, 0.33] | - | - |" in card
    assert "were not compared" not in card
    assert "## Before / after" in card and "A is `base`, B is `trained`" in card
    assert 'PeftModel.from_pretrained(base, "me/toy-grpo")' in card
    assert "Quantized base" not in card
    assert (
        "| supervised warm start | none |" in card and "| KL coefficient beta (k3) | 0.04 |" in card
    )
    assert "| KL reference | the base model (adapters off) |" in card
    # A compare of an earlier step of the run (it trained on after the compare) says so.
    stale = {**COMPARE, "sides": {"b": {"step": 1}}}
    (tmp_path / "run" / "compare.json").write_text(json.dumps(stale))
    card = model_card("peft", str(tiny_model_dir), False, read_run(tmp_path / "run"))
    assert "B's adapters were those of step 1; these are from step 3 and were not compared" in card
    # A run with a warm start and the KL to it says so.
    cfg_file = tmp_path / "run" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["train"]["sft_steps"] = 8
    cfg["grpo"]["reference"] = "start"
    cfg_file.write_text(json.dumps(cfg))
    card = model_card("peft", str(tiny_model_dir), False, read_run(tmp_path / "run"))
    assert (
        "| supervised warm start | 8 steps of 8 of the recipe's demonstrations, lr 0.0001 |" in card
    )
    assert "| KL coefficient beta (k3) | 0.04 |" in card
    assert "| KL reference | the adapters the GRPO steps started from (after the warm start" in card


def test_a_step_folder_exports_into_its_run_folder(tiny_model_dir, tmp_path):
    run = make_run(tmp_path / "run", tiny_model_dir, LoRAConfig(rank=4, scale=1.5), 0, COMPARE)
    step = run / "step-000002"
    step.mkdir()
    for name in ("adapters.safetensors", "adapter_config.json"):
        (step / name).write_bytes((run / name).read_bytes())
    (step / "state.json").write_text(json.dumps({"step": 2, "counters": {}, "curriculum": {}}))
    assert read_run(step).step == 2 and read_run(run).step == 3
    done = export(step, "peft", base_model="me/base")
    assert done.out == run / "export-peft"
    card = (done.out / "README.md").read_text()
    assert "for 2 steps" in card
    assert json.loads((done.out / "adapter_config.json").read_text())["lora_alpha"] == 6
    # The run's compare.json is about its latest adapters, not step 2's: a step's card
    # shows the compare of that step (`compare --b RUN@step-000002`) or none.
    assert read_run(run).compare is not None and "## Before / after" not in card
    (step / "compare.json").write_text(json.dumps(COMPARE))
    assert read_run(step).compare is not None


def test_a_malformed_compare_json_is_named(tiny_model_dir, tmp_path):
    run = make_run(tmp_path / "run", tiny_model_dir, LoRAConfig(rank=4), 0, {"rows": [{"x": 1}]})
    with pytest.raises(ExportError, match=r"compare\.json: expected a list of rows"):
        read_run(run)


def test_peft_with_a_named_base_ships_no_base(tiny_model_dir, tmp_path):
    run = make_run(
        tmp_path / "run", tiny_model_dir, LoRAConfig(rank=4, keys=["self_attn.v_proj"]), 0
    )
    done = export(run, "peft", tmp_path / "out", base_model="someone/tiny-llama", dtype="bfloat16")
    cfg = json.loads((done.out / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == "someone/tiny-llama"
    assert cfg["target_modules"] == ["v_proj"] and cfg["lora_dropout"] == 0.0
    assert not (done.out / "base").exists()
    w = mx.load(str(done.out / "adapter_model.safetensors"))
    assert {v.dtype for v in w.values()} == {mx.bfloat16} and len(w) == 4


def test_a_named_base_keeps_the_quantized_caveat(quantized_model_dir, tmp_path):
    run = make_run(tmp_path / "run", quantized_model_dir, LoRAConfig(rank=4), 0)
    done = export(run, "peft", tmp_path / "out", base_model="me/tiny-dequantized")
    card = (done.out / "README.md").read_text()
    assert "Quantized base" in card and 'from_pretrained("me/tiny-dequantized")' in card
    assert not (done.out / "base").exists()


# ------------------------------------------------------------------------ errors, CLI


@pytest.mark.parametrize(
    "setup, args, message",
    [
        ("nothing", ["--format", "peft"], "no such run folder"),
        ("no_adapters", ["--format", "peft"], "adapters.safetensors: not found"),
        ("no_config", ["--format", "merged"], "config.json: not found"),
        (
            "run",
            ["--format", "gguf"],
            "--format: unknown format 'gguf' (choose peft, merged, base)",
        ),
        ("run", ["--format", "peft", "--dtype", "int8"], "--dtype: unknown dtype 'int8'"),
    ],
)
def test_export_errors_are_one_line(tiny_model_dir, tmp_path, capsys, setup, args, message):
    run = tmp_path / "run"
    if setup == "run":
        make_run(run, tiny_model_dir, LoRAConfig(rank=4), 0)
    elif setup == "no_adapters":
        make_run(run, tiny_model_dir, LoRAConfig(rank=4), 0)
        (run / "adapters.safetensors").unlink()
    elif setup == "no_config":
        make_run(run, tiny_model_dir, LoRAConfig(rank=4), 0)
        (run / "config.json").unlink()
    with pytest.raises(SystemExit) as done:
        main(["export", str(run), "--out", str(tmp_path / "out"), *args])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_torn_adapter_or_an_out_that_cannot_be_made_is_one_line(tiny_model_dir, tmp_path, capsys):
    run = make_run(tmp_path / "run", tiny_model_dir, LoRAConfig(rank=4), 0)
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "out"
    with pytest.raises(SystemExit) as done:
        main(["export", str(run), "--format", "peft", "--out", str(out)])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: --out: cannot write in {tmp_path / 'file'}")
    adapters = run / "adapters.safetensors"
    adapters.write_bytes(adapters.read_bytes()[:100])
    with pytest.raises(SystemExit) as done:
        main(["export", str(run), "--format", "peft", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {adapters} is unreadable")
    assert not (tmp_path / "out").exists()


def test_an_out_holding_the_run_is_refused_even_with_force(tiny_model_dir, tmp_path):
    run = make_run(tmp_path / "runs" / "run", tiny_model_dir, LoRAConfig(rank=4), 0)
    step = run / "step-000002"
    shutil.copytree(run, step)
    files = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for source, out, held in [(run, run, run), (run, run.parent, run), (run, tmp_path, run),
                              (run, step, step), (step, step, step)]:  # fmt: skip
        with pytest.raises(ExportError, match=re.escape(f"--out: {out} is or holds {held},")):
            export(source, "peft", out, base_model="x/y", force=True)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == files


def test_bad_adapter_configs_and_an_empty_base_name_are_one_line(tiny_model_dir, tmp_path):
    run = make_run(tmp_path / "run", tiny_model_dir, LoRAConfig(rank=4), 0)
    with pytest.raises(ExportError, match="--base-model: empty"):
        export(run, "peft", tmp_path / "out", base_model=" ")
    config = run / "adapter_config.json"
    for text, said in [
        ("[1, 2]", "not a JSON object"),
        ('{"lora_parameters": 4}', "lora_parameters needs rank"),
        ('{"lora_parameters": {"rank": 4, "scale": 1}}', "num_layers must be an integer"),
    ]:
        config.write_text(text)
        with pytest.raises(ExportError, match=re.escape(f"{config}: ") + said):
            export(run, "peft", tmp_path / "out", base_model="x/y")


def test_a_run_whose_top_adapters_are_missing_exports_its_latest_step(tiny_model_dir, tmp_path):
    """What a kill between a checkpoint and the copy of its adapters leaves."""
    from mlx_grpo.cli import cmd_train

    args = ["--recipe", str(TOY), f"--model.path={tiny_model_dir}", f"--output.dir={tmp_path}"]
    assert cmd_train([*args, "--output.run=r", "--train.steps=2", "--output.save_every=1"]) == 0
    run = tmp_path / "r"
    (run / "adapters.safetensors").unlink()

    def exported(step):
        done = export(run / step, "peft", tmp_path / f"out{step}", base_model="x/y")
        return dict(mx.load(str(done.out / "adapter_model.safetensors")))

    got, last, first = (exported(s) for s in ("", "step-000002", "step-000001"))
    assert got.keys() == last.keys() and all(mx.array_equal(got[k], last[k]) for k in got)
    assert not all(mx.array_equal(got[k], first[k]) for k in got)
    assert sides.resolve_side("b", str(run)).adapter == run / "step-000002"
    # Killed between the two files of the copy: the weights there, their config not.
    shutil.copy(run / "step-000001" / "adapters.safetensors", run / "adapters.safetensors")
    (run / "adapter_config.json").unlink()
    assert sides.resolve_side("b", str(run)).adapter == run / "step-000002"
    got = dict(mx.load(str(export(run, "peft", tmp_path / "again", base_model="x/y").out
                          / "adapter_model.safetensors")))  # fmt: skip
    assert all(mx.array_equal(got[k], last[k]) for k in got)


@pytest.mark.parametrize(
    "failure",
    [RuntimeError("[write] Unable to write 3835 bytes to file."), OSError(28, "No space left")],
)
def test_a_full_disk_is_one_line_and_leaves_nothing(tiny_model_dir, tmp_path, monkeypatch, failure):
    run = make_run(tmp_path / "run", tiny_model_dir, LoRAConfig(rank=4), 0)

    def full(*a, **k):
        raise failure

    monkeypatch.setattr(mx, "save_safetensors", full)
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(ExportError, match=re.escape(f"--out: writing {tmp_path / 'out'} failed (")):
        export(run, "peft", tmp_path / "out", base_model="x/y")
    assert sorted(tmp_path.rglob("*")) == before
    (tmp_path / "storywriter").mkdir()  # an error of its own is not taken for a full disk
    with pytest.raises(ExportError, match="^model.path: .*storywriter has no config.json"):
        export(tmp_path / "storywriter", "base", tmp_path / "out")


def test_the_merge_uses_the_adapters_read_once(tiny_model_dir, tmp_path):
    """A run that trains on can replace its adapters between the read and the merge:
    the merge fuses the weights read (those the card's step and the checks are of)."""
    from mlx_grpo.export import fuse, load_base, read_run

    run_dir = make_run(tmp_path / "run", tiny_model_dir, LoRAConfig(rank=4), 0)
    run = read_run(run_dir)
    (run_dir / "adapters.safetensors").unlink()
    fused = dict(tree_flatten(fuse(load_base(str(tiny_model_dir)), run).model.parameters()))
    plain = dict(tree_flatten(load_base(str(tiny_model_dir)).model.parameters()))
    assert fused.keys() == plain.keys()  # the LoRA layers fused away
    module, (a, b) = next(iter(lora_modules(run.adapters).items()))
    scale, key = run.lora["scale"], f"{module}.weight"
    expect = np.array(plain[key]) + scale * (np.array(a) @ np.array(b)).T
    assert np.abs(np.array(fused[key]) - expect).max() < 1e-5


def test_a_base_whose_config_is_not_here_needs_a_named_base(tiny_model_dir, tmp_path):
    run = make_run(tmp_path / "run", tiny_model_dir, LoRAConfig(rank=4), 0)
    cfg = json.loads((run / "config.json").read_text())
    cfg["model"]["path"] = "someone/not-in-the-cache"
    (run / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match="someone/not-in-the-cache's config.json is not on"):
        export(run, "peft", tmp_path / "out")
    assert export(run, "peft", tmp_path / "out", base_model="someone/base").out.exists()


def test_a_replaced_export_is_never_partly_at_out(tiny_model_dir, tmp_path, monkeypatch):
    """--force: the old export goes aside whole before the new one comes in; a failure
    between the two renames puts it back, whole, rather than half deleted."""
    import os

    run = make_run(tmp_path / "run", tiny_model_dir, LoRAConfig(rank=4), 0)
    out = export(run, "peft", tmp_path / "out", base_model="x/y").out
    (out / "mine.txt").write_text("old")
    renames = []

    def second_fails(src, dst):
        renames.append(dst)
        if len(renames) == 2:
            raise OSError(5, "Input/output error")
        real_rename(src, dst)

    real_rename = os.rename
    monkeypatch.setattr(os, "rename", second_fails)
    with pytest.raises(ExportError, match="Input/output error"):
        export(run, "peft", out, base_model="x/y", force=True)
    monkeypatch.undo()  # the old one is back, whole, and nothing is left beside it
    assert (out / "mine.txt").read_text() == "old" and (out / "adapter_model.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out-")]
    export(run, "peft", out, base_model="x/y", force=True)
    assert not (out / "mine.txt").exists() and (out / "adapter_model.safetensors").exists()


def test_what_a_killed_export_left_is_removed_by_the_next(tiny_model_dir, tmp_path):
    import subprocess

    run = make_run(tmp_path / "run", tiny_model_dir, LoRAConfig(rank=4), 0)
    export(run, "peft", tmp_path / "out", base_model="x/y")
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that was an export's and is no process now
    dead = tmp_path / f".out-tmp-{gone.pid}-abc"
    live = tmp_path / f".out-tmp-{os.getpid()}-def"  # an export running in this process
    other = tmp_path / f".outer-tmp-{gone.pid}-ghi"  # another --out's
    for folder in (dead, live, other):
        (folder / "base").mkdir(parents=True)
    (tmp_path / ".out-old-xyz" / "out").mkdir(parents=True)  # a replaced export, aside
    export(run, "peft", tmp_path / "out", base_model="x/y", force=True)
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))
    assert left == sorted([live.name, other.name])


def test_out_folder_is_not_overwritten_without_force(tiny_model_dir, tmp_path):
    run = make_run(tmp_path / "run", tiny_model_dir, LoRAConfig(rank=4), 0)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="exists and is not empty"):
        export(run, "peft", tmp_path / "out", base_model="x/y")
    export(run, "peft", tmp_path / "out", base_model="x/y", force=True)
    assert not (tmp_path / "out" / "keep.txt").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out-tmp-")]


class FakeHub:
    """HfApi's create_repo / repo_info / upload_folder, recorded; `public` repos exist."""

    def __init__(self, monkeypatch, public=()):
        from huggingface_hub import HfApi

        self.calls, self.public = [], set(public)
        hub = self

        def create_repo(self, **kw):
            hub.calls.append(("create_repo", kw))
            return f"https://huggingface.co/{kw['repo_id']}"

        def repo_info(self, repo_id, repo_type):
            return SimpleNamespace(private=repo_id not in hub.public)

        def upload_folder(self, **kw):
            files = sorted(p.name for p in Path(kw["folder_path"]).iterdir())
            hub.calls.append(("upload_folder", kw, files))

        monkeypatch.setattr(HfApi, "create_repo", create_repo)
        monkeypatch.setattr(HfApi, "repo_info", repo_info)
        monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
        monkeypatch.setenv("HF_TOKEN", "hf_test")


def test_push_to_hub_uploads_the_export(tiny_model_dir, tmp_path, monkeypatch, capsys):
    hub = FakeHub(monkeypatch)
    run = make_run(tmp_path / "run", tiny_model_dir, LoRAConfig(rank=4), 0)
    out = tmp_path / "out"
    argv = ["export", str(run), "--format", "peft", "--out", str(out), "--base-model", "me/base"]
    with pytest.raises(SystemExit) as done:
        main([*argv, "--push-to-hub", "me/toy-adapter", "--private"])
    assert done.value.code == 0, capsys.readouterr().err
    assert hub.calls[0] == (
        "create_repo",
        {"repo_id": "me/toy-adapter", "repo_type": "model", "private": True, "exist_ok": True},
    )
    name, kw, files = hub.calls[1]
    assert name == "upload_folder" and kw["repo_id"] == "me/toy-adapter"
    assert kw["folder_path"] == str(out) and kw["repo_type"] == "model"
    assert kw["delete_patterns"] == "*"  # the repo ends holding this export only
    assert files == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    assert 'PeftModel.from_pretrained(base, "me/toy-adapter")' in (out / "README.md").read_text()
    assert "pushed: https://huggingface.co/me/toy-adapter" in capsys.readouterr().out

    # Without --private a new repo gets the account's default (an organisation's may be
    # private): private=None, not False, which the Hub reads as "public".
    hub.calls.clear()
    with pytest.raises(SystemExit) as done:
        main([*argv, "--push-to-hub", "me/toy-adapter", "--force"])
    assert done.value.code == 0 and hub.calls[0][1]["private"] is None
    # --private into a repo that exists and is public: refused before any upload.
    hub.calls.clear()
    hub.public.add("me/open")
    with pytest.raises(SystemExit) as done:
        main([*argv, "--push-to-hub", "me/open", "--private", "--force"])
    assert done.value.code == 2 and [c[0] for c in hub.calls] == ["create_repo"]
    err = capsys.readouterr().err
    assert (
        err
        == "error: --push-to-hub me/open: me/open exists and is public; --private uploads nothing into it\n"
    )


def test_a_pushed_peft_export_names_its_shipped_base_by_its_hub_repo(
    quantized_model_dir, tmp_path, monkeypatch, capsys
):
    """A quantized base is shipped dequantized in base/; pushed, base/ goes to a repo of
    its own, which adapter_config.json names (AutoPeftModel loads the base from there),
    not the exporting machine's path."""
    hub = FakeHub(monkeypatch)
    run = make_run(tmp_path / "run", quantized_model_dir, LoRAConfig(rank=4), 0)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as done:
        main(["export", str(run), "--format", "peft", "--out", str(out), "--push-to-hub", "me/a"])
    assert done.value.code == 0, capsys.readouterr().err
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == "me/a-base"
    assert 'AutoModelForCausalLM.from_pretrained("me/a-base")' in (out / "README.md").read_text()
    uploads = {c[1]["repo_id"]: c for c in hub.calls if c[0] == "upload_folder"}
    assert [c[1]["repo_id"] for c in hub.calls if c[0] == "create_repo"] == ["me/a-base", "me/a"]
    assert uploads["me/a-base"][1]["folder_path"] == str(out / "base")
    assert "config.json" in uploads["me/a-base"][2] and "README.md" in uploads["me/a-base"][2]
    assert uploads["me/a"][1]["ignore_patterns"] == ["base/*"]
    assert "pushed: https://huggingface.co/me/a-base, https://huggingface.co/me/a" in (
        capsys.readouterr().out
    )


def test_hub_problems_are_found_before_the_export(tiny_model_dir, tmp_path, monkeypatch, capsys):
    run = make_run(tmp_path / "run", tiny_model_dir, LoRAConfig(rank=4), 0)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    out = tmp_path / "out"
    argv = ["export", str(run), "--format", "peft", "--out", str(out), "--base-model", "me/b"]
    for repo, said in [
        ("me/x", "no Hugging Face token (set HF_TOKEN or run `hf auth login`)"),
        ("me/x y", "Repo id must"),
    ]:
        with pytest.raises(SystemExit) as done:
            main([*argv, "--push-to-hub", repo])
        err = capsys.readouterr().err
        assert done.value.code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"error: --push-to-hub {repo}: ") and said in err, err
        assert not out.exists()


def test_push_failure_is_one_line(tmp_path, monkeypatch, capsys, tiny_model_dir):
    from huggingface_hub import HfApi

    def create_repo(self, **kw):
        raise OSError("401 Client Error: Unauthorized\nmore lines")

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    with pytest.raises(OSError, match="401"):
        push_to_hub(tmp_path, "me/x")
    run = make_run(tmp_path / "run", tiny_model_dir, LoRAConfig(rank=4), 0)
    argv = [
        "export",
        str(run),
        "--format",
        "peft",
        "--out",
        str(tmp_path / "o"),
        "--base-model",
        "b",
    ]
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    with pytest.raises(SystemExit) as done:
        main([*argv, "--push-to-hub", "me/x"])
    assert done.value.code == 2
    assert capsys.readouterr().err == "error: --push-to-hub me/x: 401 Client Error: Unauthorized\n"
    assert (tmp_path / "o" / "adapter_model.safetensors").exists()
