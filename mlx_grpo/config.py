"""Run configuration: typed sections, recipe defaults, command-line overrides.

Precedence, lowest first: the field defaults below, the recipe's `recipe.toml`, an
optional `--config FILE.toml`, then `--section.field=value` flags. Every mistake is
reported as one line naming the field, e.g.
`config: grpo.loss_type: Input should be 'grpo', 'dr_grpo' or 'dapo' (got 'ppo')`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import tomllib
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# Most floats in one logits tensor (engine.logits_chunk): 2^25 is 128 MB in float32.
LOGITS_CHUNK = 1 << 25


class ConfigError(ValueError):
    """A bad config value or file; the message is one line that names the field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """The policy model: which weights, how they are loaded."""

    path: str = Field(
        "default",
        description="'default' (embedded SmolLM2-135M-Instruct), a local MLX model folder, "
        "or a Hugging Face repo id.",
    )
    dequantize: Literal["auto", "yes", "no"] = Field(
        "auto",
        description="Dequantize a quantized model at load: 'auto' on CPU only (quantized matmuls "
        "are slow there), 'yes', 'no'.",
    )
    init_adapter: str | None = Field(
        None,
        description="Start from this LoRA adapter folder (as mlx_lm.lora writes it); its rank, "
        "scale, layers and keys replace the lora section.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Weights dtype. 'auto': float32 on CPU (bf16/fp16 are slow there), the "
        "checkpoint's own dtype on a GPU.",
    )


class LoRAConfig(_Section):
    """The LoRA adapters that train (mlx_lm's)."""

    rank: int = Field(8, ge=1, description="LoRA rank r.")
    scale: float = Field(20.0, gt=0, description="mlx_lm's LoRA scale (PEFT's lora_alpha / r).")
    dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout on the LoRA branch's input while training."
    )
    num_layers: int = Field(
        -1, description="Adapt the last N transformer blocks; -1 adapts all of them."
    )
    keys: list[str] | None = Field(
        None,
        description="Module paths inside a block to adapt (e.g. ['self_attn.q_proj', "
        "'self_attn.v_proj']); None adapts every linear layer.",
    )


class RolloutConfig(_Section):
    """Sampling the completions (and multi-turn episodes)."""

    max_new_tokens: int = Field(64, ge=1, description="Completion length limit.")
    max_prompt_tokens: int = Field(
        1024,
        ge=8,
        description="Longer prompts are cut from the left, keeping the generation prompt.",
    )
    max_turns: int = Field(
        1, ge=1, description="Multi-turn recipes: most model turns in one episode."
    )
    max_episode_tokens: int = Field(
        2048,
        ge=16,
        description="Multi-turn recipes: an episode ends when its context is this long.",
    )
    max_in_flight: int = Field(
        32,
        ge=1,
        description="Most episodes (multi-turn) or completions played at once; a step's further "
        "groups play in later batches of whole groups.",
    )
    stop_at_newline: bool = Field(
        False,
        description="A reply ends at its first line break (one-line actions): decoding "
        "stops after the token that holds it and the reply's text is cut there.",
    )
    end_on_ill_formed: bool = Field(
        False,
        description="Multi-turn training rollouts: end an episode at a reply its environment "
        "marks ill-formed (info['format'] false).",
    )
    temperature: float = Field(0.8, gt=0, description="Sampling temperature (> 0 for RL).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling; 1.0 disables it.")
    top_k: int = Field(0, ge=0, description="Top-k sampling; 0 disables it.")
    min_p: float = Field(0.0, ge=0, lt=1, description="Min-p sampling; 0 disables it.")
    fold_adapters: bool = Field(
        True,
        description="Sample with each float32 LoRA layer folded into its base weight: one "
        "matmul per layer instead of three, for a transient copy of those weights.",
    )
    compile_decode: bool = Field(
        True,
        description="Decode with one compiled graph per token (mlx_grpo/decode.py); false: "
        "mlx_lm's op-by-op batch generator. The same tokens either way.",
    )


class GRPOConfig(_Section):
    """The objective: groups, advantages, clipping, KL, loss normalisation."""

    num_generations: int = Field(
        8, ge=2, description="G: completions per prompt; advantages are relative to the group."
    )
    beta: float = Field(
        0.04,
        ge=0,
        description="KL(policy || reference) coefficient, k3 estimator; 0 skips the "
        "reference forward pass.",
    )
    reference: Literal["base", "start"] = Field(
        "base",
        description="What the KL term holds the policy near: 'base' (adapters off) or 'start' "
        "(the adapters after train.sft_steps or model.init_adapter).",
    )
    epsilon: float = Field(0.2, gt=0, lt=1, description="Lower clip range of the ratio.")
    epsilon_high: float | None = Field(
        None,
        gt=0,
        description="Upper clip range (DAPO's clip-higher); None uses epsilon.",
    )
    num_iterations: int = Field(
        1,
        ge=1,
        description="Updates per rollout batch. 1 is policy gradient with a group baseline "
        "(the ratio is 1); >1 reuses samples and makes the clipping matter.",
    )
    loss_type: Literal["grpo", "dr_grpo", "dapo", "turn", "episode"] = Field(
        "dapo",
        description="Loss normalisation: 'grpo' (sequence mean), 'dr_grpo' (sum / (N * "
        "max_new_tokens)), 'dapo' (batch token mean), 'turn' / 'episode' "
        "(docs/options.md).",
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token",
        description="'token': one importance ratio per token (GRPO); 'sequence': one per "
        "completion, clipped as a whole (GSPO).",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="Divide advantages by the group's reward std ('group', GRPO), the batch's "
        "('batch'), or not at all ('none', Dr. GRPO).",
    )
    mask_truncated_completions: bool = Field(
        False,
        description="Leave completions that hit max_new_tokens out of the loss (DAPO): "
        "their reward judges an unfinished answer.",
    )


class CreditConfig(_Section):
    """Credit assignment: which groups and which replies the update trains (credit.py)."""

    signal_component: str | None = Field(
        None,
        description="A reward component (e.g. 'success') that a group must score above 0 on, in "
        "some sample, to train; None: no such gate.",
    )
    reinforce_ill_formed: bool = Field(
        True,
        description="Multi-turn: whether a reply its environment marks ill-formed is reinforced "
        "with the rest of an episode whose advantage is positive.",
    )
    blame_replies: Literal["all", "compared"] = Field(
        "all",
        description="Multi-turn replies a below-average episode pushes down: 'all', or 'compared' "
        "(those from states a better episode played on from, and ill-formed ones).",
    )
    skip_zero_variance_groups: bool = Field(
        True,
        description="Leave groups whose rewards are all equal out of the update (they add only "
        "the KL term); false trains every group, as TRL does.",
    )


class GuidanceConfig(_Section):
    """Demonstrations inside GRPO's groups (guidance.py); needs the recipe's demonstrate(task)."""

    enabled: bool = Field(
        False,
        description="Off-policy guidance (LUFFY): a group whose every sample scores below the "
        "recipe's demonstration gets it in place of its worst sample.",
    )
    advantage: Literal["group", "demonstration"] = Field(
        "group",
        description="Advantages of a guided group: 'group' (LUFFY: over the group with the "
        "demonstration in) or 'demonstration' (only it moves).",
    )
    demo_starts: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Multi-turn: share of a step's groups that start partway through their task's "
        "demonstration (a reverse curriculum); 0: none.",
    )


class EngineConfig(_Section):
    """How the update is computed: the same result in other memory, streams or graphs."""

    logits_chunk: int = Field(
        LOGITS_CHUNK,
        ge=1 << 16,
        description="Most floats in one logits tensor: log-probs are computed in row chunks of at "
        "most this many (2^25: 128 MB in float32).",
    )
    micro_batch_tokens: int | None = Field(
        4096,
        ge=64,
        description="Run the update in micro-batches of at most this many positions, gradients "
        "summed: the same result in bounded memory. None: the whole batch.",
    )
    update_lanes: int | None = Field(
        None,
        ge=1,
        description="CPU streams each micro-batch is split over, side by side: the same loss and "
        "gradient. None: 2 on a CPU with 2+ BLAS threads, else 1.",
    )
    compile: bool = Field(
        False,
        description="Run the update's loss and gradient under mx.compile (mlx_grpo/compiled.py), "
        "shapes padded to multiples of 32 tokens.",
    )


class OptimizerConfig(_Section):
    """AdamW on the adapters, and its schedule."""

    learning_rate: float = Field(
        1e-5, gt=0, description="AdamW's peak learning rate (after warm-up, before decay)."
    )
    weight_decay: float = Field(
        0.0, ge=0, description="AdamW's decoupled weight decay on the LoRA weights."
    )
    warmup_steps: int = Field(
        0, ge=0, description="Linear warm-up from lr/(warmup_steps+1) up to the learning rate."
    )
    schedule: Literal["cosine", "constant"] = Field(
        "cosine",
        description="After warm-up: cosine decay to min_lr_ratio * lr over the run, or constant.",
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine floor as a share of lr.")
    max_grad_norm: float = Field(1.0, gt=0, description="Global-norm gradient clipping.")


class TrainConfig(_Section):
    """The loop: steps, batch, seed, held-out evaluation, logging."""

    steps: int = Field(100, ge=1, description="Updates (steps of B groups) in the run.")
    batch_size: int = Field(2, ge=1, description="B: prompts per step (B*G completions).")
    seed: int = Field(
        0, description="Seeds the task draw, sampling and LoRA init; a run replays exactly."
    )
    sample_every: int = Field(10, ge=0, description="Write sample completions every N steps.")
    sft_steps: int = Field(
        0,
        ge=0,
        description="Supervised warm-start steps on the recipe's demonstrations "
        "(demonstrate(task)) before the first GRPO step; 0: none.",
    )
    sft_batch_size: int = Field(8, ge=1, description="Demonstrations per warm-start step.")
    sft_learning_rate: float = Field(
        1e-4, gt=0, description="AdamW learning rate of the warm start (constant)."
    )
    max_nonfinite_steps: int = Field(
        5, ge=1, description="Stop after this many non-finite updates in a row."
    )
    zero_signal_warn_steps: int = Field(
        5, ge=1, description="Warn when every group had equal rewards this many steps running."
    )
    token_budget: int = Field(
        0,
        ge=0,
        description="Stop once this many rollout tokens were generated (0: no budget); "
        "for comparing runs at equal sampling cost.",
    )
    eval_every: int = Field(
        0, ge=0, description="Greedy held-out evaluation every N steps (and at the end); 0: off."
    )
    eval_tasks: int = Field(
        48,
        ge=1,
        description="Held-out tasks per evaluation (spread evenly through the eval split).",
    )


class CurriculumConfig(_Section):
    """Which tasks each step trains on (UED)."""

    strategy: Literal["learnability", "uniform", "filter"] = Field(
        "learnability",
        description="'learnability': replay tasks whose rewards vary + a bandit over levels "
        "(UED); 'uniform': tasks in turn; 'filter': DAPO dynamic sampling.",
    )
    levels: list[int] | None = Field(None, description="Train only on these levels.")
    replay_prob: float = Field(
        0.5, ge=0, le=1, description="Share of the batch replayed from the scored-task buffer."
    )
    buffer_size: int = Field(256, ge=1, description="Scored tasks kept for replay.")
    replay_min_score: float = Field(
        1e-4,
        ge=0,
        description="Only tasks scoring above this are replayed: a task whose G rewards "
        "were all equal gave no gradient, and replaying it would give none again.",
    )
    staleness: float = Field(
        0.3, ge=0, le=1, description="Weight of staleness against score in replay priority."
    )
    rank_temperature: float = Field(
        0.3, gt=0, description="Replay priority ~ (1/rank)^(1/T); lower is greedier."
    )
    score_ema: float = Field(
        0.5, gt=0, le=1, description="Weight of a task's newest learnability score."
    )
    bandit_lr: float = Field(
        0.3, gt=0, le=1, description="Step size of the level bandit's value update."
    )
    bandit_temperature: float = Field(
        0.1, gt=0, description="Softmax temperature of the level bandit (values in [0, 1])."
    )
    level_explore: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of the level bandit's draws made uniformly over the open levels, so "
        "that a level without signal yet is still visited.",
    )
    start_levels: int = Field(
        2, ge=1, description="How many of the lowest levels are unlocked at the start."
    )
    window: int = Field(3, ge=1, description="Most levels open for new tasks at once.")
    unlock_at: float = Field(
        0.6,
        gt=0,
        le=1,
        description="The window moves up when the top open level's smoothed mean reward "
        "reaches this share of the best reward.",
    )
    retire_at: float = Field(
        0.95, gt=0, le=1, description="A task whose group scores this share is retired."
    )
    filter_oversample: float = Field(
        2.0, ge=1, description="'filter': groups rolled out per group kept."
    )
    max_waves: int = Field(
        1,
        ge=1,
        description="Waves of groups a step may roll out until train.batch_size have signal "
        "(DAPO's dynamic sampling).",
    )


class RecipeConfig(_Section):
    """The task family: its tasks and its weighted reward."""

    name: str = Field("arithmetic", description="A folder under recipes/, or a path.")
    weights: dict[str, float] = Field(
        default_factory=dict,
        description="Reward component -> weight; the reward is the weighted sum.",
    )
    params: dict[str, Any] = Field(
        default_factory=dict, description="Passed to the recipe's task generator."
    )
    rewards: dict[str, str] = Field(
        default_factory=dict,
        description="Component -> reward function, 'module:function' or 'file.py:function' in the "
        "recipe folder; added to tasks.py's reward if any.",
    )
    tasks: str | None = Field(
        None, description="A JSONL file of tasks in the recipe folder (instead of tasks.py)."
    )
    reward_timeout_s: float = Field(
        120.0,
        gt=0,
        description="Longest a reward call may take; past it those completions score 0 with "
        "fail/timeout and the run goes on.",
    )
    train_size: int = Field(2000, ge=1, description="Tasks generated for the train split.")
    eval_size: int = Field(
        200, ge=1, description="Tasks generated for the held-out split (never trained on)."
    )


class OutputConfig(_Section):
    """Where the run is written, how often it is saved, what is shown."""

    dir: str = Field("checkpoints", description="Runs are written to <dir>/<run>/.")
    run: str | None = Field(None, description="Run name; default <recipe>-<timestamp>.")
    save_every: int = Field(10, ge=1, description="Checkpoint every N steps (and at the end).")
    keep_last: int = Field(
        3, ge=1, description="Step-numbered checkpoints to keep (and step 0, the warm start)."
    )
    live: Literal["auto", "yes", "no"] = Field(
        "auto", description="Rich live display; 'auto' only on a terminal."
    )
    on_full_disk: Literal["stop", "continue"] = Field(
        "stop",
        description="A checkpoint that cannot be written for lack of space: 'stop' ends the run; "
        "'continue' warns and tries again at the next save.",
    )
    report_to: list[Literal["tensorboard", "wandb", "trackio"]] = Field(
        default_factory=list,
        description="Also log to these trackers: tensorboard, wandb, trackio, 'all' or none (e.g. "
        "tensorboard,wandb); pip install 'mlx-grpo[trackers]'.",
    )

    @field_validator("report_to", mode="before")
    @classmethod
    def _tracker_list(cls, v):
        if v is None or v == "none":
            return []
        if v == "all":
            return ["tensorboard", "wandb", "trackio"]
        if isinstance(v, str):
            return [x.strip() for x in v.split(",") if x.strip()]
        return v


def config_help() -> str:
    """Every section of a run config with its fields, defaults and descriptions, as
    `--section.field` options (the train command's --help)."""
    lines = []
    for section, info in RunConfig.model_fields.items():
        cls = info.annotation
        lines.append(f"{section}: {(cls.__doc__ or '').strip()}")
        for name, field in cls.model_fields.items():
            default = field.default_factory() if field.default_factory else field.default
            lines.append(f"  --{section}.{name} ({default!r}): {field.description or ''}")
        lines.append("")
    return "\n".join(lines)


class RunConfig(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    credit: CreditConfig = Field(default_factory=CreditConfig)
    guidance: GuidanceConfig = Field(default_factory=GuidanceConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig)
    recipe: RecipeConfig = Field(default_factory=RecipeConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)

    @property
    def reference_is_start(self) -> bool:
        """Whether the KL term holds the policy near the adapters its GRPO steps start
        from (grpo.reference=start, a KL term, and a warm start or an initial adapter to
        start from); otherwise its reference is the base, with the adapters off."""
        has_start = bool(self.train.sft_steps or self.model.init_adapter)
        return self.grpo.reference == "start" and self.grpo.beta > 0 and has_start

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        if self.grpo.epsilon_high is not None and self.grpo.epsilon_high < self.grpo.epsilon:
            raise ValueError("grpo.epsilon_high must be >= grpo.epsilon (it widens the upper clip)")
        comp = self.credit.signal_component
        if comp is not None and self.recipe.weights and comp not in self.recipe.weights:
            raise ValueError(
                f"credit.signal_component: '{comp}' is not one of the recipe's reward "
                f"components ({', '.join(self.recipe.weights)})"
            )
        return self


def _format_error(err: ValidationError, source: str) -> str:
    e = err.errors()[0]
    field = ".".join(str(p) for p in e["loc"])
    if e["type"] == "extra_forbidden" and field in MOVED:
        msg = f"'{field}' is now '{MOVED[field]}'"
    elif e["type"] == "extra_forbidden":
        section, _, name = field.rpartition(".")
        known = _known_fields(section)
        msg = f"unknown field '{field}'" + (f" (known: {', '.join(known)})" if known else "")
    elif field:
        msg = f"{field}: {e['msg']} (got {e.get('input')!r})"
    else:
        msg = e["msg"].removeprefix("Value error, ")
    more = f" [+{len(err.errors()) - 1} more]" if len(err.errors()) > 1 else ""
    return f"{source}: {msg}{more}"


def _known_fields(section: str) -> list[str]:
    model: type[BaseModel] = RunConfig
    for part in filter(None, section.split(".")):
        ann = model.model_fields.get(part)
        if ann is None or not isinstance(ann.annotation, type):
            return []
        model = ann.annotation
    return list(model.model_fields)


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if (
            isinstance(v, dict)
            and isinstance(out.get(k), dict)
            and k not in ("weights", "params", "rewards")
        ):
            out[k] = _merge(out[k], v)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = {**out[k], **v}
        else:
            out[k] = v
    return out


def _parse_value(text: str) -> Any:
    """`16` -> 16, `0.5` -> 0.5, `true` -> True, `[1,2]` -> [1, 2], `none` -> None, else str."""
    low = text.strip().lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        if text.lstrip().startswith(("{", "[")):  # meant as JSON: say where it breaks
            raise
        return text


def parse_overrides(args: list[str]) -> dict:
    """`['--grpo.beta=0', '--train.steps', '30']` -> {'grpo': {'beta': 0}, 'train': {...}}."""
    out: dict = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=")[0]:
            raise ConfigError(f"command line: expected --section.field=value, got '{arg}'")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"command line: --{key} needs a value")
            i += 1
            value = args[i]
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        try:
            node[leaf] = _parse_value(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--{key}: not valid JSON ({e.msg} at column {e.colno})") from None
        i += 1
    return out


def read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def build_config(
    recipe_defaults: dict | None = None,
    config_file: Path | None = None,
    overrides: dict | None = None,
    *,
    source: str = "config",
    defaults_file: Path | str | None = None,
) -> RunConfig:
    """Merge the layers and validate once; raises ConfigError with a one-line message
    that starts with the file the faulty value came from (`defaults_file` names the
    first layer's: the recipe's recipe.toml, or a resumed run's config.json), else
    with `source`."""
    first = migrate(recipe_defaults) if recipe_defaults else None
    layers = (
        (defaults_file, first and without_removed(first, str(defaults_file or source), True)),
        (config_file, read_toml(config_file) if config_file else None),
        (None, overrides),
    )
    for name, layer in layers[1:]:
        without_removed(layer or {}, str(name or source))
    data: dict = {}
    for _, layer in layers:
        if layer:
            data = _merge(data, layer)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        loc = e.errors()[0]["loc"]
        where = next((name for name, layer in reversed(layers) if _holds(layer, loc)), None)
        raise ConfigError(_format_error(e, str(where or source))) from None


# Fields that left the grpo section for their own (old name -> new name).
MOVED = {
    **{f"grpo.{k}": f"credit.{k}" for k in CreditConfig.model_fields},
    "grpo.guidance": "guidance.enabled",
    "grpo.guidance_advantage": "guidance.advantage",
    "grpo.demo_starts": "guidance.demo_starts",
    **{f"grpo.{k}": f"engine.{k}" for k in EngineConfig.model_fields},
}


def migrate(data: dict) -> dict:
    """`data` with the fields of MOVED under their new names: a run folder's config.json
    (or a recipe.toml) written before they moved reads as it was meant. Flags and
    --config files name the new fields (an old name there is a one-line error).

    >>> migrate({"grpo": {"beta": 0.1, "guidance": True}})
    {'grpo': {'beta': 0.1}, 'guidance': {'enabled': True}}
    """
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for old, new in MOVED.items():
        section, name = old.split(".")
        if isinstance(out.get(section), dict) and name in out[section]:
            value = out[section].pop(name)
            to, field = new.split(".")
            out.setdefault(to, {})[field] = value
    return out


_ENTROPY_BONUS = (
    "an entropy bonus held toward a target did worse on web_browsing than none "
    "(docs/recipes/web_browsing-experiments.md), and no recipe used one"
)
_ADAPTIVE_KL = (
    "no recipe used the adaptive KL weight and no measurement supported it; grpo.beta is fixed"
)
# Fields taken out (name -> (the value that did nothing, why it went)), under their old
# grpo names too. A saved run's config.json (or a recipe.toml) that holds one at that
# value reads without it; at another value, or on the command line or in a --config
# file, it is a one-line error that names it (`without_removed`).
REMOVED = {
    "grpo.entropy_coef": (0.0, _ENTROPY_BONUS),
    "grpo.kl_loss": ("k3", "the KL term is TRL's k3; 'k2' was never measured"),
    **{
        f"{section}.{name}": (value, why)
        for section in ("controllers", "grpo")
        for name, value, why in (
            ("entropy_target", None, _ENTROPY_BONUS),
            ("entropy_coef_rate", 0.01, _ENTROPY_BONUS),
            ("entropy_coef_max", 0.05, _ENTROPY_BONUS),
            ("kl_target", None, _ADAPTIVE_KL),
            ("kl_rate", 0.5, _ADAPTIVE_KL),
        )
    },
}


def without_removed(data: dict, where: str, saved: bool = False) -> dict:
    """`data` without the REMOVED fields that a saved run or recipe (`saved`) holds at
    the value that did nothing (and without the `controllers` section they leave
    empty); any other REMOVED field is a ConfigError that names it.

    >>> without_removed({"grpo": {"beta": 0.1, "kl_loss": "k3"}, "controllers": {}}, "x", True)
    {'grpo': {'beta': 0.1}}
    """
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for field, (idle, why) in REMOVED.items():
        section, name = field.split(".")
        if not isinstance(out.get(section), dict) or name not in out[section]:
            continue
        value = out[section].pop(name)
        if not saved:
            raise ConfigError(f"{where}: '{field}' was removed: {why}")
        if value != idle:
            raise ConfigError(
                f"{where}: '{field}' is {value!r} here, but it was removed: {why} (a run "
                "that set it resumes only under the mlx-grpo that started it)"
            )
    if out.get("controllers") == {}:
        del out["controllers"]
    return out


def _holds(layer: Any, loc: tuple) -> bool:
    """Whether a config layer sets the value at `loc` (a pydantic error's location)."""
    if not loc or not layer:
        return False
    for part in loc:
        try:
            layer = layer[part]
        except (KeyError, IndexError, TypeError):
            return False
    return True
