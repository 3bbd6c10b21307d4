"""`python -m mlx_grpo train ...`: set a run up from its config and hand it to the loop.

python -m mlx_grpo train --recipe arithmetic --train.steps=30 --model.path=default
python -m mlx_grpo train --resume checkpoints/arithmetic-20261122-1130
mlx.launch --hostfile hosts.json python -m mlx_grpo train ...   (data-parallel, see README)
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

from mlx_grpo.checkpoint import CheckpointError, publish
from mlx_grpo.config import ConfigError, RunConfig, build_config, config_help, parse_overrides
from mlx_grpo.durable import FULL_DISK
from mlx_grpo.recipe import recipe_defaults, recipe_dir
from mlx_grpo.runfolder import RunBusy, RunFolder, step_of

USAGE = """\
mlx-grpo train [--recipe NAME|PATH] [--config FILE.toml] [--resume [RUN_DIR]]
               [--init-adapter DIR] [--section.field=value ...]
  (or python -m mlx_grpo train ...). Examples:
  --train.steps=30 --grpo.num_generations=16 --model.path=path/to/mlx-model
"""
COMMANDS = """\
usage: mlx-grpo COMMAND ...   (or python -m mlx_grpo COMMAND ...)

  train     GRPO on a recipe (train --help: every option)
  compare   A/B two models on a recipe's held-out tasks (python -m mlx_grpo.compare)
  export    adapters to PEFT / a fused Hugging Face model / the base, push to the Hub
  plot      a run's curves as a PNG
  bench     speed against TRL and mlx-lm-lora (make bench; python -m mlx_grpo.bench)
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, like every other error here
        print(f"error: {self.prog}: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = _Parser(
        prog="mlx-grpo train",
        usage=USAGE,
        epilog="options of the run config, by section:\n\n" + config_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--recipe", default=None)
    p.add_argument("--config", type=Path, default=None)
    p.add_argument("--resume", nargs="?", const="", default=None)
    p.add_argument("--init-adapter", default=None, help="start from this mlx_lm LoRA adapter")
    return p.parse_known_args(argv)


def resolve_config(argv: list[str]) -> tuple[RunConfig, Path, Path | None]:
    """(config, run dir, checkpoint step folder to resume from or None)."""
    args, rest = _parse(argv)
    overrides = parse_overrides(rest)
    if args.resume is not None:
        run_dir = Path(args.resume) if args.resume else None
        if run_dir is None:
            out = overrides.get("output", {})
            if not out.get("run"):
                raise ConfigError("--resume: give the run folder, or --output.run=NAME")
            run_dir = Path(out.get("dir", "checkpoints")) / out["run"]
        folder = RunFolder(run_dir)
        saved = folder.config_file
        if not saved.exists():
            raise ConfigError(f"--resume: {saved} not found (not a run folder)")
        step_dir = folder.latest_step_dir()
        named = folder.latest_named()
        if step_dir is None:
            print(f"--resume: {run_dir} has no checkpoint yet; starting it again", file=sys.stderr)
        elif named != step_dir.name:
            print(
                f"--resume: {folder.latest_file} names {named or 'nothing readable'}; the "
                f"newest complete checkpoint is {step_dir.name}: resuming from it",
                file=sys.stderr,
            )
        try:
            base = json.loads(saved.read_text())
        except ValueError as e:
            raise ConfigError(f"--resume: {saved} is not valid JSON ({e})") from None
        cfg = build_config(base, args.config, overrides, source="config", defaults_file=saved)
        return cfg, run_dir, step_dir

    name = args.recipe or overrides.get("recipe", {}).get("name") or "arithmetic"
    if args.init_adapter:
        overrides.setdefault("model", {})["init_adapter"] = args.init_adapter
    init = overrides.get("model", {}).get("init_adapter")
    if init:
        from mlx_grpo.models import lora_from_adapter

        # The adapter's shape decides the lora section (it must fit its weights).
        overrides["lora"] = {**overrides.get("lora", {}), **lora_from_adapter(init)}
    cfg = build_config(
        recipe_defaults(name),
        args.config,
        overrides,
        source="config",
        defaults_file=recipe_dir(name) / "recipe.toml",
    )
    run = cfg.output.run or f"{Path(cfg.recipe.name).name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if Path(run).is_absolute() or {".", ".."} & set(run.split("/")):
        raise ConfigError(
            f"output.run: '{run}' must name a folder under output.dir (no '.', '..' or leading /)"
        )
    cfg.output.run = run
    run_dir = Path(cfg.output.dir) / run
    if RunFolder(run_dir).latest_step_dir() is not None:
        raise ConfigError(
            f"output.run: {run_dir} already holds a run; add --resume to continue it "
            "or choose another --output.run"
        )
    return cfg, run_dir, None


def spread(tasks: list, n: int) -> list:
    """n tasks covering every level alike: the first task of each level, then the second
    of each, and so on (taking every k-th task of a split that cycles through its levels
    could land on a few levels only)."""
    if n >= len(tasks):
        return tasks
    by_level: dict[int, list] = {}
    for t in tasks:
        by_level.setdefault(t.level, []).append(t)
    rounds = itertools.zip_longest(*(by_level[lv] for lv in sorted(by_level)))
    return [t for row in rounds for t in row if t is not None][:n]


def cmd_train(argv: list[str]) -> int:
    from mlx_grpo.dist import Dist
    from mlx_grpo.trackers import require as require_trackers

    dist = Dist()
    cfg, run_dir, resume_from = _shared_config(dist, argv)
    done = step_of(resume_from.name) if resume_from else 0
    if done > cfg.train.steps:
        raise ConfigError(
            f"train.steps: {cfg.train.steps} is below step {done}, where {run_dir} stands "
            "(a resume continues up to train.steps)"
        )
    folder, held = RunFolder(run_dir), []

    def claim() -> None:  # before the model loads (config.json comes once it starts)
        require_trackers(cfg.output.report_to)
        try:
            held.append(folder.hold(warn=lambda line: print(line, file=sys.stderr)))
        except OSError as e:
            raise ConfigError(f"output.dir: cannot write in {run_dir} ({e.strerror})") from None
        except RunBusy as e:
            raise ConfigError(str(e)) from None
        if folder.latest_step_dir() != resume_from:  # another process ended in between
            raise ConfigError(
                f"output.run: {run_dir} was trained by another process while this one "
                "started; run the command again"
            )

    try:
        dist.run_on_main(claim)
        if done and done == cfg.train.steps:
            # (what a resume redoes in any case: a kill may have come between the last
            # step folder and `latest` or the run folder's copy of its adapters)
            dist.run_on_main(lambda: publish(resume_from))
            print(
                f"{run_dir} has all its {done} steps; nothing to train (raise "
                "--train.steps to continue it)",
                file=sys.stderr,
            )
            return 0
        return _train(dist, cfg, run_dir, resume_from, done)
    finally:
        for fd in held:
            folder.release(fd)


def _train(dist, cfg: RunConfig, run_dir: Path, resume_from: Path | None, done: int) -> int:
    """`cmd_train` once the run is claimed: load, set up and train."""
    import mlx.core as mx

    from mlx_grpo.curriculum import make_curriculum
    from mlx_grpo.device import blas_in_use
    from mlx_grpo.evaluate import make_eval_fn
    from mlx_grpo.log import Display
    from mlx_grpo.models import (
        adapter_config,
        apply_lora,
        load_init_adapter,
        load_model,
        trainable_count,
    )
    from mlx_grpo.recipe import Recipe
    from mlx_grpo.trainer import Interrupted, build_optimizer, train

    mx.random.seed(cfg.train.seed)
    recipe = Recipe.from_config(cfg.recipe)
    train_tasks = recipe.tasks("train", cfg.recipe.train_size, cfg.train.seed)
    curriculum = make_curriculum(cfg.curriculum, train_tasks, cfg.train.seed, recipe.max_reward)
    distinct = len(getattr(curriculum, "by_id", ()))  # (the uniform draws repeat tasks)
    if distinct and distinct < cfg.train.batch_size:
        raise ConfigError(
            f"train.batch_size: {cfg.train.batch_size} distinct tasks a step, but "
            f"{distinct} train tasks at the curriculum's levels (recipe.train_size "
            f"{cfg.recipe.train_size})"
        )

    model, tokenizer = load_model(cfg.model)
    apply_lora(model, cfg.lora, seed=cfg.train.seed)
    if cfg.model.init_adapter and resume_from is None:
        load_init_adapter(model, cfg.model.init_adapter)
    optimizer = build_optimizer(cfg.optimizer, cfg.train.steps * cfg.grpo.num_iterations)

    adapter_cfg = adapter_config(cfg.lora, model, cfg.model.path)
    _check_ranks_agree(dist, len(train_tasks), trainable_count(model))

    eval_fn = None
    if cfg.train.eval_every:  # (every rank: a recipe without them stops them all alike)
        eval_tasks = spread(
            recipe.tasks("eval", cfg.recipe.eval_size, cfg.train.seed), cfg.train.eval_tasks
        )
    if cfg.train.eval_every and dist.is_main:
        eval_fn = make_eval_fn(
            model, tokenizer, recipe, eval_tasks, cfg.rollout, RunFolder(run_dir).eval_file
        )

    live = cfg.output.live if dist.is_main else "no"
    display = Display(cfg.train.steps, done, live, f"{cfg.recipe.name} -> {run_dir}")
    device = "gpu" if mx.default_device() == mx.gpu else f"cpu ({blas_in_use()})"
    ranks = f"; {dist.size} ranks (data-parallel)" if dist.size > 1 else ""
    if dist.is_main:
        display.info(
            f"model {cfg.model.path} on {device}; LoRA r={cfg.lora.rank} "
            f"({trainable_count(model) / 1e6:.2f}M trainable); {len(train_tasks)} train tasks; "
            f"B={cfg.train.batch_size} x G={cfg.grpo.num_generations}{ranks}; run dir {run_dir}"
            + (f"; resuming from {resume_from.name}" if resume_from else "")
            + (f"; adapters start from {cfg.model.init_adapter}" if cfg.model.init_adapter else "")
        )
    with display:
        try:
            train(
                model,
                tokenizer,
                optimizer,
                recipe,
                curriculum,
                cfg,
                run_dir,
                adapter_cfg,
                resume_from=resume_from,
                callback=display.step if dist.is_main else None,
                say=display.warn,
                evaluate_fn=eval_fn,
                info=display.info,
                dist=dist,
            )
        except Interrupted as e:
            display.info(
                f"stopped after step {e.step}, saved; continue with: "
                f"python -m mlx_grpo train --resume {run_dir}"
            )
            return 130
        except KeyboardInterrupt:
            if dist.is_main:
                saved = RunFolder(run_dir).latest_step_dir()
                where = f"from {saved.name}" if saved else "from the start"
                display.info(
                    f"interrupted; continue ({where}) with: "
                    f"python -m mlx_grpo train --resume {run_dir}"
                )
            return 130
    if dist.is_main:
        display.info(f"done: adapters in {run_dir} (mlx_lm.load(..., adapter_path='{run_dir}'))")
    return 0


def _shared_config(dist, argv: list[str]) -> tuple[RunConfig, Path, Path | None]:
    """`resolve_config` on rank 0 (the one that holds the run folder), sent to all
    ranks, so that they agree on the run name and the checkpoint to resume."""
    if dist.size == 1:
        return resolve_config(argv)

    def resolve() -> dict:
        cfg, run_dir, resume_from = resolve_config(argv)
        resume = str(resume_from) if resume_from else None
        return {"config": cfg.model_dump(mode="json"), "run_dir": str(run_dir), "resume": resume}

    got = dist.run_on_main(resolve)
    cfg = RunConfig.model_validate(got["config"])
    return cfg, Path(got["run_dir"]), Path(got["resume"]) if got["resume"] else None


def _check_ranks_agree(dist, n_tasks: int, n_trainable: int) -> None:
    """Ranks on different machines must build the same tasks and the same LoRA tree
    (same mlx-grpo, recipe and model on each); say which differs, on every rank."""
    if dist.size == 1:
        return
    seen = dist.gather({"train tasks": n_tasks, "trainable parameters": n_trainable})
    for key in seen[0]:
        values = [s[key] for s in seen]
        if len(set(values)) > 1:
            raise ConfigError(
                f"ranks disagree on {key} ({values}, by rank): install the same "
                "mlx-grpo, recipe and model on every machine"
            )


def cmd_plot(argv: list[str]) -> int:
    from mlx_grpo.plot import PlotError, plot_run

    p = _Parser(prog="python -m mlx_grpo plot")
    p.add_argument("run_dir", type=Path, help="a run folder, e.g. checkpoints/<run>")
    p.add_argument("--out", type=Path, default=None, help="PNG path (default <run>/metrics.png)")
    p.add_argument("--smooth", type=int, default=5, help="moving-mean width in steps")
    args = p.parse_args(argv)
    if args.smooth < 1:
        p.error(f"--smooth {args.smooth}: must be >= 1 (1: no smoothing)")
    try:
        print(plot_run(args.run_dir, args.out, args.smooth))
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_export(argv: list[str]) -> int:
    from mlx_grpo.export import (
        DTYPES,
        FORMATS,
        ExportError,
        base_repo,
        check_hub,
        export,
        push_to_hub,
    )

    p = _Parser(
        prog="python -m mlx_grpo export",
        description="Export a run's LoRA adapter for PEFT, the model with the adapter "
        "fused in (transformers + MLX), or the dequantized base; optionally push it to "
        "the Hugging Face Hub. See mlx_grpo/export.py.",
    )
    p.add_argument(
        "source",
        help="a run folder (checkpoints/<run>, or one of its step-NNNNNN folders); "
        "for --format base also 'default', a model folder or a Hub id",
    )
    p.add_argument("--format", required=True, help=f"one of: {', '.join(FORMATS)}")
    p.add_argument(
        "--out", type=Path, default=None, help="output folder (default <run>/export-<format>)"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help=f"auto (float32; PEFT: the adapter's own) or {', '.join(DTYPES)}",
    )
    p.add_argument(
        "--base-model",
        default=None,
        help="peft: the base_model_name_or_path to write "
        "(then no base/ is shipped); default: the run's model, or base/ when it is "
        "quantized, local or the embedded default",
    )
    p.add_argument("--push-to-hub", metavar="REPO", default=None, help="upload to this Hub repo")
    p.add_argument(
        "--private",
        action="store_true",
        help="create the Hub repo private (and refuse to upload into one that is public)",
    )
    p.add_argument("--force", action="store_true", help="replace a non-empty --out folder")
    args = p.parse_args(argv)
    try:
        if args.push_to_hub:  # before the export, which can take minutes
            check_hub(args.push_to_hub)
        done = export(
            args.source,
            args.format,
            args.out,
            dtype=args.dtype,
            base_model=args.base_model,
            repo_id=args.push_to_hub,
            force=args.force,
        )
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.format} to {done.out}: {', '.join(done.files)}")
    if args.push_to_hub:
        print(f"uploading {done.upload} to {args.push_to_hub} ...")
        try:
            urls = push_to_hub(done.upload, args.push_to_hub, private=args.private)
        except ExportError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except Exception as e:  # network, auth, hub errors: one line, the export stays
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            said = getattr(e, "server_message", None)  # the Hub's own reason
            said = f" ({said.strip().splitlines()[0]})" if said and said.strip() else ""
            if (done.upload / "base").is_dir():  # adapter_config.json names the base's repo
                said += (
                    f"; the export's adapter_config.json names {base_repo(args.push_to_hub)}, "
                    "which this push was to fill: push again, or load base/ from the folder"
                )
            print(f"error: --push-to-hub {args.push_to_hub}: {first}{said}", file=sys.stderr)
            return 2
        print(f"pushed: {', '.join(urls)}")
    return 0


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(COMMANDS)
        sys.exit(0)
    cmd, rest = argv[0], argv[1:]
    if cmd == "compare":
        from mlx_grpo.compare import main as compare_main

        compare_main(rest)
        sys.exit(0)
    if cmd == "bench":
        from mlx_grpo.bench.speed import main as bench_main

        sys.exit(bench_main(rest))
    if cmd == "plot":
        sys.exit(cmd_plot(rest))
    if cmd == "export":
        sys.exit(cmd_export(rest))
    if cmd != "train":
        print(
            f"error: unknown command '{cmd}' (commands: train, compare, export, plot, bench)",
            file=sys.stderr,
        )
        sys.exit(2)
    from mlx_grpo.dist import DistError, RankZeroError
    from mlx_grpo.env import EnvError
    from mlx_grpo.models import ModelLoadError
    from mlx_grpo.trackers import TrackerError
    from mlx_grpo.trainer import TrainingError

    try:
        sys.exit(cmd_train(rest))
    except RankZeroError:  # rank 0 prints it
        sys.exit(2)
    except (
        ConfigError,
        CheckpointError,
        ModelLoadError,
        TrainingError,
        DistError,
        TrackerError,
    ) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except EnvError as e:  # the step cannot be played; the steps saved are kept
        print(f"error: {e}; continue from the last checkpoint with --resume", file=sys.stderr)
        sys.exit(2)
    except OSError as e:
        if e.errno not in FULL_DISK:
            raise
        print(
            f"error: {e.filename or 'a run file'}: {e.strerror}; the last checkpoint is "
            "intact: free some space and continue with --resume",
            file=sys.stderr,
        )
        sys.exit(2)
