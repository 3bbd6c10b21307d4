"""`python -m mlx_grpo export`: hand a run to people who use PyTorch, PEFT and the Hub.

    python -m mlx_grpo export checkpoints/<run> --format peft   --out exports/<run>-peft
    python -m mlx_grpo export checkpoints/<run> --format merged --out exports/<run>-merged
    python -m mlx_grpo export default           --format base   --out exports/smollm2-base
        ... [--push-to-hub USER/REPO [--private]]

A run's export goes to <run>/export-<format> unless --out says otherwise.

What each format writes under --out:

    peft     adapter_config.json + adapter_model.safetensors as PEFT saves them, and a
             README.md model card. When no Hub id names the very weights the adapter was
             trained on (the embedded default, a quantized base, a local folder), the
             dequantized base is written to base/ and `base_model_name_or_path` points
             at it; `--base-model NAME` names one instead and ships none.
    merged   hf/   the base with the adapter fused in, dequantized: HF safetensors,
                   config.json, tokenizer, card (transformers and mlx_lm load it)
             mlx/  the same weights written by mlx_lm's `save_model` / `save_config`
    base     the run's base (or 'default', a model folder, a Hub id), dequantized, as an
             HF model: the base a PEFT adapter trained on a quantized model loads onto.

MLX -> PEFT. mlx_lm's LoRALinear computes `W x + scale * (x @ lora_a) @ lora_b` with
lora_a (in, r) and lora_b (r, out); PEFT computes `W x + (lora_alpha / r) * B(A(x))`
with A = lora_A.weight (r, in) and B = lora_B.weight (out, r). So lora_A = lora_a.T,
lora_B = lora_b.T, lora_alpha = scale * r. For the model types in HF_ARCHITECTURES
mlx_lm's parameter names are transformers' own (`model.layers.0.self_attn.q_proj`);
PEFT prefixes them with `base_model.model.`.

Model weights are written in float32 unless --dtype says otherwise: a dequantized
4-bit base plus a LoRA delta is not exactly representable in 16 bits, and float32
reproduces the MLX model's logits to float rounding.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from mlx_grpo.checkpoint import CheckpointError, load_arrays
from mlx_grpo.config import ConfigError, RunConfig, build_config
from mlx_grpo.durable import write_failed
from mlx_grpo.model_card import Compare, hub_id, model_card
from mlx_grpo.runfolder import RunFolder, step_of

FORMATS = ("peft", "merged", "base")
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
# mlx_lm model types whose parameter names and layouts are transformers' own.
HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_LAYER_MODULE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class ExportError(RuntimeError):
    """A run or model that cannot be exported as asked; the message is one line."""


@dataclass
class Run:
    """What an export reads from a run folder (or one of its step-NNNNNN folders)."""

    name: str
    run_dir: Path
    path: Path  # the folder holding the adapters: run_dir or one of its step folders
    config: RunConfig
    adapter_config: dict
    adapters: dict[str, mx.array]
    step: int | None  # training steps behind the adapters, when known
    compare: Compare | None  # the run's compare.json, if it has one

    @property
    def lora(self) -> dict:
        return self.adapter_config["lora_parameters"]


@dataclass
class Base:
    """A base model, dequantized and in float32."""

    model: nn.Module
    tokenizer: object
    config: dict
    source: Path  # the local folder it was loaded from
    name: str  # as the run (or the user) named it: 'default', a folder or a Hub id
    quantized: bool


@dataclass
class Exported:
    out: Path
    upload: Path  # the folder a Hub push uploads
    files: list[str]


# ---------------------------------------------------------------------------- reading


def _read_json(path: Path, obj: bool = True):
    """A JSON file's content, an object unless `obj` is false; else ExportError."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ExportError(f"{path}: not found") from None
    except json.JSONDecodeError as e:
        raise ExportError(f"{path}: invalid JSON ({e.msg}, line {e.lineno})") from None
    if obj and not isinstance(data, dict):
        raise ExportError(f"{path}: not a JSON object")
    return data


def _last_step(run_dir: Path, folder: Path) -> int | None:
    """Steps behind the adapters in `folder`: a step folder's state.json, else the run's
    `latest` pointer, else the last record of metrics.jsonl."""
    run = RunFolder(run_dir)
    if folder != run_dir or run.latest_file.exists():
        return RunFolder.saved_step(folder)
    try:
        lines = run.metrics_file.read_text().split("\n")
        return int(json.loads([x for x in lines if x.strip()][-1])["step"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def read_compare(path: Path) -> Compare | None:
    """A compare result: a list of rows {metric, a, b, diff, ci_low, ci_high}, at the
    top level or under "rows" (then "model_a" / "model_b" name the models); None when
    there is no such file."""
    if not path.exists():
        return None
    data = _read_json(path, obj=False)
    rows = data.get("rows") if isinstance(data, dict) else data
    if not isinstance(rows, list) or not all(
        isinstance(r, dict) and {"metric", "a", "b"} <= r.keys() for r in rows
    ):
        raise ExportError(
            f"{path}: expected a list of rows {{metric, a, b, diff, ci_low, ci_high}}"
        )
    if isinstance(data, dict):
        b = (data.get("sides") or {}).get("b") or {}
        step = b.get("step") if isinstance(b, dict) else None
        step = step if isinstance(step, int) and not isinstance(step, bool) else None
        return Compare(rows, data.get("model_a"), data.get("model_b"), step)
    return Compare(rows)


def read_run(path: Path, adapters: bool = True) -> Run:
    """Read a run folder (checkpoints/<run>) or one of its step-NNNNNN folders.

    With `adapters=False` only the run's config is needed (a base export)."""
    path = Path(path)
    if not path.is_dir():
        raise ExportError(f"{path}: no such run folder")
    run_dir = path.parent if step_of(path.name) is not None else path
    cfg_path = RunFolder(run_dir).config_file
    if not cfg_path.exists():
        raise ExportError(f"{cfg_path}: not found ({run_dir} is not a run folder)")
    try:
        config = build_config(_read_json(cfg_path), source=str(cfg_path))
    except ConfigError as e:
        raise ExportError(str(e)) from None
    weights, adapter_cfg = {}, {}
    if adapters:
        if path == run_dir:
            path = RunFolder(run_dir).adapters_dir()
        file = path / RunFolder.ADAPTERS
        if not file.exists():
            raise ExportError(f"{file}: not found (the run has saved no adapters yet)")
        adapter_cfg = _read_json(path / RunFolder.ADAPTER_CONFIG)
        kind = adapter_cfg.get("fine_tune_type", "lora")
        if kind != "lora":
            raise ExportError(
                f"{path / 'adapter_config.json'}: fine_tune_type '{kind}' cannot be exported "
                "(only lora)"
            )
        lora = adapter_cfg.get("lora_parameters", {})
        if not isinstance(lora, dict) or not {"rank", "scale"} <= lora.keys():
            raise ExportError(
                f"{path / 'adapter_config.json'}: lora_parameters needs rank and scale"
            )
        layers = adapter_cfg.get("num_layers")
        if not isinstance(layers, int) or isinstance(layers, bool):
            raise ExportError(f"{path / 'adapter_config.json'}: num_layers must be an integer")
        try:
            weights = load_arrays(file)
        except CheckpointError as e:
            raise ExportError(str(e).removeprefix("checkpoint: ")) from None
    return Run(
        name=run_dir.name,
        run_dir=run_dir,
        path=path,
        config=config,
        adapter_config=adapter_cfg,
        adapters=weights,
        step=_last_step(run_dir, path),
        compare=read_compare(RunFolder(path).compare_file),  # the exported step's
    )


def _is_run_dir(path: Path) -> bool:
    """A run (or step) folder, or a folder of adapters, as opposed to a model folder."""
    return RunFolder.holding(path) is not None or (path / RunFolder.ADAPTERS).exists()


def _cast(model: nn.Module, dtype: mx.Dtype) -> None:
    model.update(
        tree_map(
            lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p,
            model.parameters(),
        )
    )
    mx.eval(model.parameters())


def load_base(name: str) -> Base:
    """Load a model with mlx_lm, dequantize it exactly and cast it to float32.

    `name` is 'default' (the embedded model), a local model folder or a Hub repo id.
    """
    from mlx_lm.utils import dequantize_model, hf_repo_to_path, load, load_config

    from mlx_grpo.models import resolve_model_path

    try:
        path = resolve_model_path(name)
    except FileNotFoundError as e:  # the embedded model's package is not installed
        raise ExportError(f"model.path: {e}") from None
    local = Path(path).expanduser()
    if hub_id(path) is None and not (local / "config.json").exists():
        raise ExportError(f"model.path: {path} has no config.json (not a model folder)")
    try:
        model, tokenizer = load(str(local) if local.exists() else path)
        source = local if local.exists() else hf_repo_to_path(path)
    except Exception as e:  # mlx_lm/hub raise many types; keep the user's line short
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExportError(f"model.path: cannot load '{name}': {first}") from None
    config = load_config(source)
    if config.get("model_type") not in HF_ARCHITECTURES:
        raise ExportError(
            f"model.path: model_type '{config.get('model_type')}' has no checked "
            f"transformers layout (supported: {', '.join(HF_ARCHITECTURES)})"
        )
    quantized = "quantization" in config or "quantization_config" in config
    model = dequantize_model(model)
    _cast(model, mx.float32)
    return Base(model, tokenizer, config, source, name, quantized)


LICENSE_FILES = ("LICENSE", "LICENSE.txt", "LICENSE.md", "LICENCE", "USE_POLICY.md")


@dataclass
class License:
    """The base model's license: its id (a Hub card's `license:`, a GGUF's
    `general.license`) and the files that state it, which an export passes on."""

    id: str | None = None
    files: tuple[Path, ...] = ()

    def copy_to(self, folder: Path) -> None:
        for f in self.files:
            shutil.copyfile(f, folder / f.name)


def base_license(name: str) -> License:
    """What this machine knows of model `name`'s license: 'default' (the GGUF's
    metadata), a local folder or a Hub repo in the local cache (its README.md front
    matter and license files); an empty License when nothing says."""
    from mlx_grpo.models import resolve_model_path

    try:
        if name == "default":
            from mlx_grpo.gguf import find_default_gguf

            _, md = mx.load(str(find_default_gguf()), return_metadata=True)
            said = md.get("general.license")
            return License(said if isinstance(said, str) and said else None)
        folder = Path(resolve_model_path(name)).expanduser()
        if not folder.is_dir() and hub_id(name):
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(name, local_files_only=True))
    except Exception:  # not on this machine, no package: nothing known
        return License()
    said = None
    card = folder / "README.md"
    if card.is_file():
        head = card.read_text(errors="replace").split("\n---", 1)[0]
        if head.startswith("---"):
            said = next((m.group(1) for m in _LICENSE_LINE.finditer(head)), None)
    return License(said, tuple(folder / n for n in LICENSE_FILES if (folder / n).is_file()))


_LICENSE_LINE = re.compile(r"^license:\s*['\"]?([^'\"\s]+)", re.MULTILINE)


def fuse(base: Base, run: Run) -> Base:
    """Fuse the run's adapters into the (float32, dequantized) base with mlx_lm's
    `load_adapters` and `LoRALinear.fuse`; the base is modified in place."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    # The adapters read_run read (the files of a run that trains on can change since).
    linear_to_lora_layers(base.model, run.adapter_config["num_layers"], run.lora)
    params = dict(tree_flatten(base.model.parameters()))
    bad = [k for k, v in run.adapters.items() if k not in params or params[k].shape != v.shape]
    if bad:
        raise ExportError(
            f"{run.path / 'adapters.safetensors'}: {len(bad)} tensors do not fit "
            f"{base.name} (first: {bad[0]})"
        )
    base.model.load_weights(list(run.adapters.items()), strict=False)
    fused = [
        (n, m.fuse(dequantize=True)) for n, m in base.model.named_modules() if hasattr(m, "fuse")
    ]
    base.model.update_modules(tree_unflatten(fused))
    mx.eval(base.model.parameters())
    return base


# ------------------------------------------------------------------------------- PEFT


def lora_modules(adapters: dict[str, mx.array]) -> dict[str, tuple[mx.array, mx.array]]:
    """{module path: (lora_a (in, r), lora_b (r, out))} from mlx_lm adapter weights."""
    pairs: dict[str, dict[str, mx.array]] = {}
    for key, value in adapters.items():
        module, _, leaf = key.rpartition(".")
        if leaf not in ("lora_a", "lora_b") or value.ndim != 2:
            raise ExportError(
                f"adapters.safetensors: {key} {tuple(value.shape)} is not a LoRALinear "
                "factor (only linear LoRA layers can be exported)"
            )
        if module.rpartition(".")[2] == "embed_tokens":  # PEFT's is another layout
            raise ExportError(
                f"adapters.safetensors: {key}: LoRA on the embeddings cannot be exported "
                "(only linear LoRA layers can; mlx_lm's also changes a tied output head)"
            )
        pairs.setdefault(module, {})[leaf] = value
    out = {}
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"lora_a", "lora_b"}:
            raise ExportError(f"adapters.safetensors: {module} lacks lora_a or lora_b")
        if pair["lora_a"].shape[1] != pair["lora_b"].shape[0]:
            raise ExportError(f"adapters.safetensors: {module}: lora_a and lora_b ranks differ")
        out[module] = (pair["lora_a"], pair["lora_b"])
    return out


def peft_weights(adapters: dict[str, mx.array]) -> dict[str, mx.array]:
    """mlx_lm adapter weights -> the tensors of PEFT's adapter_model.safetensors."""
    out = {}
    for module, (a, b) in lora_modules(adapters).items():
        out[f"base_model.model.{module}.lora_A.weight"] = a.T  # (r, in)
        out[f"base_model.model.{module}.lora_B.weight"] = b.T  # (out, r)
    return out


def target_modules(modules: list[str], num_layers: int | None) -> tuple[list[str], list | None]:
    """PEFT's (target_modules, layers_to_transform) selecting exactly `modules`.

    The usual short form (["q_proj", "v_proj"], plus the layer indices when not every
    layer is adapted) where it is exact; else the full paths, which PEFT matches as is.
    """
    parsed = [_LAYER_MODULE.match(m) for m in modules]
    if parsed and all(parsed):
        layers = sorted({int(p.group(1)) for p in parsed})
        inner = {p.group(2) for p in parsed}
        leaves = sorted({s.rpartition(".")[2] for s in inner})
        if len(modules) == len(layers) * len(inner) and len(leaves) == len(inner):
            every = num_layers is not None and layers == list(range(num_layers))
            return leaves, None if every else layers
    return sorted(modules), None


def peft_config(run: Run, base_name: str, num_layers: int | None) -> dict:
    """adapter_config.json as PEFT's LoraConfig saves it."""
    mods = lora_modules(run.adapters)
    where = run.path / "adapter_config.json"
    if not mods:
        raise ExportError(f"{run.path / 'adapters.safetensors'}: holds no LoRA weights")
    rank = run.lora["rank"]
    if {a.shape[1] for a, _ in mods.values()} != {rank}:
        raise ExportError(f"{where}: lora_parameters.rank {rank} differs from the weights' rank")
    alpha = run.lora["scale"] * rank  # PEFT scales by lora_alpha / r
    targets, layers = target_modules(list(mods), num_layers)
    return {
        "alpha_pattern": {},
        "auto_mapping": None,
        "base_model_name_or_path": base_name,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_pattern": None if layers is None else "layers",
        "layers_to_transform": layers,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": run.lora.get("dropout", 0.0),
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": rank,
        "rank_pattern": {},
        "revision": None,
        "target_modules": targets,
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }


def ships_base(name: str, quantized: bool) -> bool:
    """Whether a PEFT export must carry its base: only an unquantized Hub model can be
    named by its id (the embedded default, quantized and local bases cannot)."""
    return name == "default" or quantized or hub_id(name) is None


# ------------------------------------------------------------------------ HF / MLX save


def hf_config(config: dict, dtype: str, tied: bool) -> dict:
    """The model's config.json as transformers reads it, without MLX-only fields.
    `tied`: the weights have no lm_head (mlx_lm ties by default, transformers does not:
    a config that does not say so would get a random output head there)."""
    drop = ("quantization", "quantization_config", "rope_traditional", "_name_or_path")
    if config.get("rope_traditional"):
        raise ExportError("config.json: rope_traditional=true has no transformers equivalent")
    cfg = {k: v for k, v in config.items() if k not in drop}
    cfg["architectures"] = [HF_ARCHITECTURES[cfg["model_type"]]]
    cfg["tie_word_embeddings"] = tied
    cfg["torch_dtype"] = dtype  # transformers < 4.56 reads this name
    cfg["dtype"] = dtype
    return dict(sorted(cfg.items()))


def _side_files(base: Base, out: Path) -> None:
    base.tokenizer.save_pretrained(str(out))
    if (base.source / "generation_config.json").exists():
        shutil.copyfile(base.source / "generation_config.json", out / "generation_config.json")


def save_hf(base: Base, out: Path, dtype: str) -> None:
    """Write `base.model` as a transformers model folder: safetensors (in shards past
    mlx_lm's 5 GB, with the usual index), config.json, generation_config, tokenizer."""
    from mlx_lm.utils import make_shards

    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(DTYPES[dtype]) for k, v in tree_flatten(base.model.parameters())}
    shards = make_shards(weights)
    n = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        mx.save_safetensors(str(out / name), shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    if n > 1:
        index = {
            "metadata": {"total_size": sum(v.nbytes for v in weights.values())},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(
        json.dumps(hf_config(base.config, dtype, "lm_head.weight" not in weights), indent=2) + "\n"
    )
    _side_files(base, out)


def save_mlx(base: Base, out: Path, dtype: str) -> None:
    """Write `base.model` with mlx_lm's save_model / save_config; mlx_lm.load reads it.
    Casts the model to `dtype` in place."""
    from mlx_lm.utils import save_config, save_model

    _cast(base.model, DTYPES[dtype])
    save_model(out, base.model, donate_model=False)
    drop = ("quantization", "quantization_config")
    save_config({k: v for k, v in base.config.items() if k not in drop}, out / "config.json")
    _side_files(base, out)


# ----------------------------------------------------------------------------- export


def _model_config(name: str) -> dict | None:
    """A model's config.json without loading its weights: the embedded default's, a
    local folder's, or a Hub repo's from the local cache (training downloaded it);
    None when it is not on this machine."""
    from mlx_grpo.models import resolve_model_path

    try:
        path = Path(resolve_model_path(name)).expanduser() / "config.json"
        if not path.exists() and hub_id(name):
            from huggingface_hub import hf_hub_download

            path = Path(hf_hub_download(name, "config.json", local_files_only=True))
        return _read_json(path) if path.exists() else None
    except Exception:  # no package, not cached: the caller does without
        return None


def _write_peft(
    run: Run, tmp: Path, out: Path, base_model: str | None, dtype: str, repo_id, lic: License
):
    """The PEFT export into `tmp`, which becomes `out` (base/ is named by its final path)."""
    name = run.config.model.path
    cfg = _model_config(name)
    if cfg is None and base_model is None:  # quantized or not decides what is shipped
        raise ExportError(
            f"model.path: {name}'s config.json is not on this machine (a Hub model is "
            "read from the local cache): give --base-model to name the base"
        )
    cfg = cfg or {}
    quantized = "quantization" in cfg or "quantization_config" in cfg
    base = load_base(name) if base_model is None and ships_base(name, quantized) else None
    num_layers = base.config["num_hidden_layers"] if base else cfg.get("num_hidden_layers")
    if base is None:
        base_ref = base_model or name
    else:  # base/ here; pushed, it goes to a repo of its own that PEFT can name
        base_ref = base_repo(repo_id) if repo_id else str((out / "base").resolve())
    weights = peft_weights(run.adapters)
    if dtype != "auto":  # auto: the adapter's own dtype
        weights = {k: v.astype(DTYPES[dtype]) for k, v in weights.items()}
    tmp.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(tmp / "adapter_model.safetensors"), weights, metadata={"format": "pt"})
    peft_cfg = peft_config(run, base_ref, num_layers)
    (tmp / "adapter_config.json").write_text(json.dumps(peft_cfg, indent=2) + "\n")
    files = ["adapter_config.json", "adapter_model.safetensors", "README.md"]
    if base is not None:
        base_dtype = "float32" if dtype == "auto" else dtype
        save_hf(base, tmp / "base", base_dtype)
        card = model_card("base", name, base.quantized, dtype=base_dtype, license=lic.id)
        (tmp / "base" / "README.md").write_text(card)
        lic.copy_to(tmp / "base")
        files.append("base/")
    card_base = None if base and not repo_id else base_ref  # None: base/ beside it
    card = model_card(
        "peft", name, quantized, run, repo_id=repo_id, base_ref=card_base, license=lic.id
    )
    (tmp / "README.md").write_text(card)
    lic.copy_to(tmp)
    return files + [f.name for f in lic.files]


def export(
    source: str | Path,
    fmt: str,
    out: Path | None = None,
    *,
    dtype: str = "auto",
    base_model: str | None = None,
    repo_id: str | None = None,
    force: bool = False,
) -> Exported:
    """Export a run (for fmt='base' also a model name) into `out`; see the module doc.

    `dtype` 'auto' is float32 for model weights and the adapter's own dtype for PEFT.
    `repo_id` goes into the cards' usage lines, and a PEFT export's shipped base is
    then named by its Hub repo (`base_repo`) rather than its local path. The folder is
    built under a
    temporary name beside `out` and renamed into place when complete.
    """
    if fmt not in FORMATS:
        raise ExportError(f"--format: unknown format '{fmt}' (choose {', '.join(FORMATS)})")
    if dtype != "auto" and dtype not in DTYPES:
        raise ExportError(f"--dtype: unknown dtype '{dtype}' (choose auto, {', '.join(DTYPES)})")
    source = str(source)
    src = Path(source)
    if base_model is not None and not base_model.strip():
        raise ExportError("--base-model: empty (give a Hub id or a folder, or leave it out)")
    if fmt == "base" and not (src.is_dir() and _is_run_dir(src)):
        run, name = None, source  # a model: 'default', a folder or a Hub id
    else:
        run = read_run(src, adapters=fmt != "base")
        name = run.config.model.path
    if out is None and run is None:
        raise ExportError("--out: give the folder to export the model to")
    out = Path(out) if out else RunFolder(run.run_dir).export_dir(fmt)
    if run is not None:  # the run, and each of its checkpoints, stay whatever --force says
        kept = [run.run_dir, *RunFolder(run.run_dir).step_dirs(complete=False)]
        if held := [p for p in kept if p.resolve().is_relative_to(out.resolve())]:
            raise ExportError(f"--out: {out} is or holds {held[0]}, which it would replace")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ExportError(f"--out: {out} exists and is not empty (add --force to replace it)")
    model_dtype = "float32" if dtype == "auto" else dtype
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-tmp-{os.getpid()}-", dir=out.parent))
    except OSError as e:
        raise ExportError(f"--out: cannot write in {out.parent} ({e.strerror})") from None
    try:
        lic = base_license(name)
        if fmt == "peft":
            files, upload = _write_peft(run, tmp, out, base_model, dtype, repo_id, lic), out
        elif fmt == "merged":
            base = fuse(load_base(name), run)
            save_hf(base, tmp / "hf", model_dtype)
            card = model_card(
                "merged", name, base.quantized, run, repo_id=repo_id, dtype=model_dtype,
                license=lic.id,
            )  # fmt: skip
            (tmp / "hf" / "README.md").write_text(card)
            save_mlx(base, tmp / "mlx", model_dtype)
            card = model_card("mlx", name, base.quantized, run, dtype=model_dtype, license=lic.id)
            (tmp / "mlx" / "README.md").write_text(card)
            for folder in (tmp / "hf", tmp / "mlx"):
                lic.copy_to(folder)
            files, upload = ["hf/", "mlx/"], out / "hf"
        else:
            base = load_base(name)
            save_hf(base, tmp, model_dtype)
            card = model_card(
                "base", name, base.quantized, repo_id=repo_id, dtype=model_dtype, license=lic.id
            )
            (tmp / "README.md").write_text(card)
            lic.copy_to(tmp)
            files, upload = sorted(p.name for p in tmp.iterdir()), out
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        _replace(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if write_failed(e):  # a full disk, a failing drive
            why = e.strerror if isinstance(e, OSError) and e.strerror else f"{e}".strip()
            raise ExportError(
                f"--out: writing {out} failed ({why}); nothing was left there"
            ) from None
        raise
    return Exported(out=out, upload=upload, files=files)


def _remove_leftovers(out: Path) -> None:
    """What a killed export of `out` left beside it: its unfinished folder (named with
    its pid, gone now; a whole base model in float32 can be gigabytes), and an old
    export moved aside once `out` holds the new one."""
    ours = re.compile(rf"\.{re.escape(out.name)}-tmp-(\d+)-[A-Za-z0-9_]+")
    for folder in out.parent.glob(f".{glob.escape(out.name)}-tmp-*-*"):
        if (m := ours.fullmatch(folder.name)) and not _alive(int(m.group(1))):
            shutil.rmtree(folder, ignore_errors=True)
    if out.exists():
        for folder in out.parent.glob(f".{glob.escape(out.name)}-old-*"):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's
        return True
    return True


def _replace(new: Path, out: Path) -> None:
    """Put the finished folder `new` at `out`. An old export there is renamed aside
    first and removed after, so that no kill leaves a part of either at `out`: it holds
    the old export or the new one, whole, or (a SIGKILL between the two renames)
    nothing, the old one then whole in `.{name}-old-*/` beside it; a failure or Ctrl-C
    there puts the old one back. Deleting it in place could leave a folder that looks
    complete with files missing."""
    if not out.exists() and not out.is_symlink():
        os.rename(new, out)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}-old-", dir=out.parent)) / out.name
    os.rename(out, aside)
    try:
        os.rename(new, out)
    except BaseException:  # (a Ctrl-C too): the old one back in place
        os.rename(aside, out)
        aside.parent.rmdir()
        raise
    shutil.rmtree(aside.parent, ignore_errors=True)


# -------------------------------------------------------------------------------- Hub


def base_repo(repo_id: str) -> str:
    """The Hub repo a PEFT export's shipped base goes to: the adapter's repo cannot hold
    it where `base_model_name_or_path` (AutoPeftModel) would find it."""
    return f"{repo_id}-base"


def check_hub(repo_id: str, token: str | None = None) -> None:
    """Refuse, before any export, a repo id the Hub would refuse or a missing token."""
    from huggingface_hub import get_token
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
        validate_repo_id(base_repo(repo_id))
    except HFValidationError as e:
        raise ExportError(f"--push-to-hub {repo_id}: {str(e).splitlines()[0]}") from None
    if (token or get_token()) is None:
        raise ExportError(
            f"--push-to-hub {repo_id}: no Hugging Face token (set HF_TOKEN or run `hf auth login`)"
        )


def push_to_hub(
    folder: Path, repo_id: str, private: bool = False, token: str | None = None
) -> list[str]:
    """Upload `folder` to the model repo `repo_id` (created if needed), and a PEFT
    export's shipped `base/` to its own repo (`base_repo`); returns the repos' URLs.

    Each repo ends holding exactly the files uploaded (older ones are deleted, so that a
    second push does not mix two exports). `private` creates the repos private and
    refuses, before anything is uploaded, a repo that exists and is public; without it a
    new repo gets the account's default. The token is `token`, else huggingface_hub's
    usual places (HF_TOKEN, `hf auth login`).
    """
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    repos = [(folder, repo_id)]
    if (folder / "base").is_dir():
        repos.insert(0, (folder / "base", base_repo(repo_id)))
    urls = []
    for _, rid in repos:
        urls.append(
            str(
                api.create_repo(
                    repo_id=rid, repo_type="model", private=private or None, exist_ok=True
                )
            )
        )
        if private and not api.repo_info(repo_id=rid, repo_type="model").private:
            raise ExportError(
                f"--push-to-hub {repo_id}: {rid} exists and is public; --private uploads "
                "nothing into it"
            )
    for path, rid in repos:
        api.upload_folder(
            folder_path=str(path),
            repo_id=rid,
            repo_type="model",
            commit_message="Upload an mlx-grpo export",
            ignore_patterns=["base/*"] if path == folder else None,
            delete_patterns="*",
        )
    return urls
