"""Config layering and one-line errors that name the field."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import REMOVED_AT_DEFAULTS

from mlx_grpo.config import ConfigError, build_config, parse_overrides
from mlx_grpo.recipe import recipe_defaults, recipe_dir


def test_overrides_parse_types_and_nesting():
    got = parse_overrides(
        [
            "--grpo.num_generations=16",
            "--grpo.beta",
            "0",
            '--lora.keys=["self_attn.q_proj"]',
            "--model.path=some/folder",
            "--grpo.epsilon_high=none",
            "--output.live=no",
        ]
    )
    assert got == {
        "grpo": {"num_generations": 16, "beta": 0, "epsilon_high": None},
        "lora": {"keys": ["self_attn.q_proj"]},
        "model": {"path": "some/folder"},
        "output": {"live": "no"},
    }


def test_layers_apply_in_order(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text("[train]\nsteps = 7\nbatch_size = 3\n")
    cfg = build_config(recipe_defaults("arithmetic"), f, parse_overrides(["--train.steps=9"]))
    assert cfg.train.steps == 9 and cfg.train.batch_size == 3
    assert cfg.recipe.weights == {"correct": 1.0, "format": 0.5}  # from recipe.toml
    assert cfg.grpo.loss_type == "dapo"  # field default


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["--grpo.loss_type=ppo"],
            "grpo.loss_type: Input should be 'grpo', 'dr_grpo', 'dapo', 'turn' or 'episode'",
        ),
        (["--grpo.num_generations=1"], "grpo.num_generations"),
        (["--train.steps=many"], "train.steps"),
        (["--grpo.bogus=1"], "unknown field 'grpo.bogus' (known: num_generations"),
        (["--nosuch.field=1"], "unknown field 'nosuch'"),
        (["--grpo.scale_rewards=std"], "grpo.scale_rewards"),
        (["--grpo.epsilon=0.3", "--grpo.epsilon_high=0.1"], "grpo.epsilon_high"),
        (['--recipe.params={"levels": [1, 2}'], "--recipe.params: not valid JSON (Expecting"),
        (
            [
                '--recipe.weights={"success": 1.0, "format": 0.2}',
                "--credit.signal_component=sucess",
            ],
            "credit.signal_component: 'sucess' is not one of the recipe's reward components "
            "(success, format)",
        ),
    ],
)
def test_bad_values_are_one_line_naming_the_field(args, needle):
    with pytest.raises(ConfigError) as e:
        build_config(None, None, parse_overrides(args))
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


def test_fields_that_moved_section_read_from_old_files_and_name_their_place_on_flags(tmp_path):
    """A run folder's config.json from before the sections (the first layer) reads as it
    was meant; a flag or a --config file with an old name is one line naming the new."""
    old = {"grpo": {"beta": 0.1, "guidance": True, "guidance_advantage": "demonstration"}}
    old["grpo"] |= {"logits_chunk": 1 << 20, "signal_component": None}
    cfg = build_config(old)
    assert cfg.grpo.beta == 0.1 and cfg.guidance.enabled and cfg.credit.signal_component is None
    assert cfg.guidance.advantage == "demonstration" and cfg.engine.logits_chunk == 1 << 20
    with pytest.raises(ConfigError, match=r"^config: 'grpo.compile' is now 'engine.compile'$"):
        build_config(None, None, parse_overrides(["--grpo.compile=true"]))
    f = tmp_path / "run.toml"
    f.write_text("[grpo]\nblame_replies = 'compared'\n")
    with pytest.raises(ConfigError, match="'grpo.blame_replies' is now 'credit.blame_replies'"):
        build_config(None, f, None)


def _old_config(controllers_in_grpo: bool = False) -> dict:
    """Today's defaults as a run's config.json, plus the removed fields at theirs."""
    from mlx_grpo.config import RunConfig

    old = RunConfig().model_dump(mode="json")
    old["grpo"] |= REMOVED_AT_DEFAULTS["grpo"]
    if controllers_in_grpo:
        old["grpo"] |= REMOVED_AT_DEFAULTS["controllers"]
    else:
        old["controllers"] = dict(REMOVED_AT_DEFAULTS["controllers"])
    return old


ENTROPY, KL = "did worse on web_browsing than none", "grpo.beta is fixed"


@pytest.mark.parametrize(
    "flag, why",
    [
        ("--grpo.entropy_coef=0.01", ENTROPY),
        ("--grpo.kl_loss=k2", "'k2' was never measured"),
        ("--grpo.kl_loss=k3", "'k2' was never measured"),
        ("--controllers.entropy_target=0.8", ENTROPY),
        ("--controllers.entropy_coef_rate=0.01", ENTROPY),
        ("--controllers.entropy_coef_max=0.1", ENTROPY),
        ("--controllers.kl_target=0.1", KL),
        ("--controllers.kl_rate=0.5", KL),
        ("--grpo.kl_target=0.1", KL),  # its name before the controllers section
        ("--grpo.entropy_target=0.8", ENTROPY),
    ],
)
def test_a_removed_field_on_the_command_line_or_in_a_config_file_is_one_line(flag, why, tmp_path):
    """Given at all (at its old default too), a removed field is one line that names it
    and says why it went."""
    field = flag[2:].split("=")[0]
    with pytest.raises(ConfigError) as e:
        build_config(recipe_defaults("arithmetic"), None, parse_overrides([flag]))
    msg = str(e.value)
    assert msg.startswith(f"config: '{field}' was removed: ") and "\n" not in msg, msg
    assert why in msg, msg
    f = tmp_path / "run.toml"
    section, name = field.split(".")
    f.write_text(f"[{section}]\n{name} = {json.dumps(parse_overrides([flag])[section][name])}\n")
    with pytest.raises(
        ConfigError, match=f"^{re.escape(str(f))}: '{re.escape(field)}' was removed"
    ):
        build_config(None, f, None)


@pytest.mark.parametrize("controllers_in_grpo", [False, True])
def test_a_saved_config_with_the_removed_fields_at_their_defaults_reads_as_todays(
    controllers_in_grpo,
):
    """An old run's config.json (the first layer) holds every removed field at the value
    that did nothing: it reads as today's defaults, the emptied `controllers` section
    gone too."""
    from mlx_grpo.config import RunConfig

    old = _old_config(controllers_in_grpo)
    assert build_config(old).model_dump() == RunConfig().model_dump()


@pytest.mark.parametrize(
    "section, name, value",
    [
        ("grpo", "entropy_coef", 0.01),
        ("grpo", "kl_loss", "k2"),
        ("controllers", "entropy_target", 0.8),
        ("controllers", "entropy_coef_max", 0.1),
        ("controllers", "kl_target", 0.1),
        ("controllers", "kl_rate", 1.0),
        ("grpo", "kl_target", 0.2),  # a config.json from before the controllers section
    ],
)
def test_a_saved_config_that_set_a_removed_field_is_refused_naming_it(section, name, value):
    """A run (or a recipe) that set a removed field cannot be run as it was: one line
    that names the field, its value and the file."""
    old = _old_config()
    old[section][name] = value
    with pytest.raises(ConfigError) as e:
        build_config(old, defaults_file="runs/x/config.json")
    msg = str(e.value)
    want = f"runs/x/config.json: '{section}.{name}' is {value!r} here, but it was removed: "
    assert msg.startswith(want) and "\n" not in msg, msg


def test_bad_command_line_and_files(tmp_path):
    with pytest.raises(ConfigError, match="expected --section.field=value"):
        parse_overrides(["steps=3"])
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3")
    with pytest.raises(ConfigError, match="bad.toml: invalid TOML"):
        build_config(None, bad, None)
    with pytest.raises(
        ConfigError, match="recipe: 'nope' not found \\(built-in recipes: arithmetic"
    ):
        recipe_defaults("nope")


def test_a_bad_value_names_the_file_it_came_from(tmp_path):
    """A faulty value is blamed on the last layer that set it: the recipe's recipe.toml,
    a --config file, a resumed run's config.json, or the command line ("config")."""
    from mlx_grpo.cli import resolve_config

    recipe = tmp_path / "toy"
    shutil.copytree(recipe_dir("arithmetic"), recipe)
    toml = recipe / "recipe.toml"
    toml.write_text(toml.read_text().replace("[optimizer]", '[optimizer]\nweight_decay = "two"'))
    run = ["--recipe", str(recipe), f"--output.dir={tmp_path}", "--output.run=r"]
    said = f"{toml}: optimizer.weight_decay: Input should be a valid number"
    with pytest.raises(ConfigError, match="^" + re.escape(said)):
        resolve_config(run)
    layer = tmp_path / "run.toml"
    layer.write_text("[optimizer]\nweight_decay = -1\n")
    with pytest.raises(ConfigError, match="^" + re.escape(f"{layer}: optimizer.weight_decay")):
        resolve_config([*run, "--config", str(layer)])
    with pytest.raises(ConfigError, match=r"^config: optimizer.weight_decay: .* \(got 'x'\)"):
        resolve_config([*run, "--config", str(layer), "--optimizer.weight_decay=x"])
    cfg, _, _ = resolve_config([*run, "--optimizer.weight_decay=0.1"])  # the last layer wins
    assert cfg.optimizer.weight_decay == 0.1

    saved = tmp_path / "r" / "config.json"
    saved.parent.mkdir()
    saved.write_text(json.dumps({**cfg.model_dump(mode="json"), "train": {"steps": 0}}))
    with pytest.raises(ConfigError, match="^" + re.escape(f"{saved}: train.steps")):
        resolve_config(["--resume", str(saved.parent)])


def test_one_command_lists_every_option_of_every_section(capsys):
    """`mlx-grpo train --help` names every field of every config section with its
    description; compare and bench answer --help through the same command."""
    from mlx_grpo.cli import main
    from mlx_grpo.config import RunConfig

    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for section, info in RunConfig.model_fields.items():
        assert f"\n{section}: " in text
        for name, field in info.annotation.model_fields.items():
            line = next(x for x in text.splitlines() if x.startswith(f"  --{section}.{name} ("))
            assert field.description and field.description in line
    for cmd in ("compare", "bench"):
        with pytest.raises(SystemExit) as exit_:
            main([cmd, "--help"])
        assert exit_.value.code == 0 and "usage:" in capsys.readouterr().out


DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize(
    "recipe, file, source, where, said",
    [
        ("toy", "tasks.py", "def make_tasks(split, n, seed:\n", "tasks.py:1", "SyntaxError"),
        ("toy", "tasks.py", "x = 1\nraise RuntimeError('boom')\n", "tasks.py:2", "boom"),
        ("capitals", "rewards.py", "import no_such_module_here\n", "rewards.py:1", "no_such"),
    ],
)
def test_a_recipe_file_that_does_not_import_is_one_line_naming_it(
    tmp_path, recipe, file, source, where, said
):
    from mlx_grpo.recipe import Recipe

    folder = tmp_path / recipe
    shutil.copytree(DATA / recipe, folder)
    (folder / file).write_text(source)
    cfg = build_config(recipe_defaults(str(folder)))
    with pytest.raises(ConfigError) as e:
        Recipe.from_config(cfg.recipe)
    msg = str(e.value)
    assert f"{folder / where}:" in msg and said in msg and "\n" not in msg, msg


@pytest.mark.parametrize(
    "recipe, file, source, field",
    [
        ("capitals", "rewards.py", "def correct(completions, **kw): ...\ndef brevity(x): ...\n",
         "recipe.rewards.brevity: rewards.py:brevity takes (x)"),
        ("toy", "tasks.py", "def make_tasks(split, n, seed): ...\ndef reward(task): ...\n",
         "tasks.py: reward takes (task)"),
    ],
)  # fmt: skip
def test_a_reward_that_cannot_take_its_arguments_is_refused_at_load(
    tmp_path, recipe, file, source, field
):
    from mlx_grpo.recipe import Recipe

    folder = tmp_path / recipe
    shutil.copytree(DATA / recipe, folder)
    cfg = build_config(recipe_defaults(str(folder)))
    Recipe.from_config(cfg.recipe)  # the recipe as it is loads
    (folder / file).write_text(source)
    with pytest.raises(ConfigError, match=re.escape(field) + ".*a reward takes"):
        Recipe.from_config(cfg.recipe)


def test_rewards_of_every_documented_shape_load(tmp_path):
    """TRL's signature in tasks.py, a decorator that supplies an argument, a partial,
    a callable object, defaults and *args all pass the check at load."""
    from mlx_grpo.recipe import Recipe

    folder = tmp_path / "capitals"
    shutil.copytree(DATA / "capitals", folder)
    (folder / "rewards.py").write_text(
        "import functools\n"
        "def judged(f):\n"
        "    @functools.wraps(f)\n"
        "    def w(task, completion):\n"
        "        return f(task, completion, 'judge')\n"
        "    return w\n"
        "@judged\n"
        "def correct(task, completion, judge): return 1.0\n"
        "class Brevity:\n"
        "    def __call__(self, task, completion, scale=1.0): return scale\n"
        "brevity = Brevity()\n"
        "def many(*args): return 0.0\n"
        "partial = functools.partial(lambda task, completion, k: 0.0, k=1)\n"
    )
    rewards = {k: f"rewards.py:{k}" for k in ("correct", "brevity", "many", "partial")}
    cfg = build_config(recipe_defaults(str(folder)), None, {"recipe": {"rewards": rewards}})
    assert set(Recipe.from_config(cfg.recipe).reward_fns) == set(rewards)
    toy = tmp_path / "toy"
    shutil.copytree(DATA / "toy", toy)
    with open(toy / "tasks.py", "a") as f:
        f.write("\ndef reward(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    assert Recipe.from_config(build_config(recipe_defaults(str(toy))).recipe).own_reward


def test_a_folder_that_is_not_a_recipe_and_tasks_that_are_not_tasks_are_one_line(tmp_path):
    from mlx_grpo.recipe import Recipe

    with pytest.raises(ConfigError, match=re.escape(f"recipe: {tmp_path} has no recipe.toml")):
        recipe_defaults(str(tmp_path))
    toy = tmp_path / "toy"
    shutil.copytree(DATA / "toy", toy)
    recipe = Recipe.from_config(build_config(recipe_defaults(str(toy))).recipe)
    assert recipe.tasks("train", 4, 0)
    for made, said in [("[{'id': 'x'}]", "a list of dict"), ("'abc'", "str")]:
        (toy / "tasks.py").write_text(
            f"def make_tasks(split, n, seed): return {made}\ndef reward(task, completion): ...\n"
        )
        recipe = Recipe.from_config(build_config(recipe_defaults(str(toy))).recipe)
        with pytest.raises(ConfigError, match=re.escape(f"make_tasks returned {said}, not a list")):
            recipe.tasks("train", 4, 0)


def test_a_reward_that_returns_none_is_a_failed_sample_not_a_stopped_run(tmp_path):
    """TRL's None ("not applicable") belongs to its batch signature; from reward(task,
    completion) it is an error of that sample, scored 0 and counted."""
    from mlx_grpo.recipe import Recipe

    toy = tmp_path / "toy"
    shutil.copytree(DATA / "toy", toy)
    with open(toy / "tasks.py", "a") as f:
        f.write(
            "\ndef reward(task, completion):\n"
            "    return None if 'x' in completion else {'ascii': 1.0, 'short': 0.0}\n"
        )
    recipe = Recipe.from_config(build_config(recipe_defaults(str(toy))).recipe)
    task = recipe.tasks("train", 1, 0)[0]
    bad, good = recipe.score_groups([task], [["x", "y"]])[0]
    assert bad.reward == 0.0 and "returned None" in bad.error
    assert good.error is None and good.reward == 1.0


def test_every_field_has_a_one_line_description():
    """`--help` shows each field's description on one line: what it controls and its
    values; the why and the measurements live in docs/options.md."""
    from mlx_grpo.config import RunConfig

    long = []
    for section, info in RunConfig.model_fields.items():
        for name, field in info.annotation.model_fields.items():
            text = field.description or ""
            if not text.strip() or "\n" in text or len(text) > 160:
                long.append(f"{section}.{name} ({len(text)} chars)")
    assert not long, "descriptions not one line of 1-160 chars: " + ", ".join(long)
