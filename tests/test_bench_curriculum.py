"""The curriculum benchmark's report, on synthetic held-out curves."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mlx_grpo.bench.curriculum import Curve, analyse, read_curve


def _curve(tokens, finals_by_eval):
    return Curve(tokens, [{f"t{i}": v for i, v in enumerate(vals)} for vals in finals_by_eval])


def test_report_rows_match_a_direct_computation():
    uniform = {
        0: _curve([0, 100, 200], [[0, 0, 0, 0], [0, 1, 0, 0], [1, 1, 0, 0]]),
        1: _curve([0, 110, 220], [[0, 0, 0, 0], [1, 0, 0, 0], [1, 0, 1, 0]]),
    }
    ued = {
        0: _curve([0, 90, 210], [[0, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0]]),
        1: _curve([0, 100, 200], [[0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]),
    }
    rows = {r["strategy"]: r for r in analyse({"uniform": uniform, "learnability": ued})}
    u, le = rows["uniform"], rows["learnability"]
    assert u["final_success"] == pytest.approx(4 / 8) and le["final_success"] == pytest.approx(
        7 / 8
    )
    assert u["ci"][0] <= 0.5 <= u["ci"][1] and 0 <= u["ci"][0] < u["ci"][1] <= 1
    # paired, task by task within each seed: (0,0,1,0) and (0,1,0,1) -> mean 3/8
    assert le["diff"] == pytest.approx(3 / 8) and le["diff_ci"][0] <= 3 / 8 <= le["diff_ci"][1]
    # uniform's seed-mean curve: 0, 0.25, 0.5 -> target 0.45, reached at its 3rd eval
    assert u["target"] == pytest.approx(0.45)
    assert u["tokens_to_target"] == pytest.approx(210)
    # learnability's curve: 0, 0.625, 0.875 -> reached at the 2nd eval (mean of 90, 100)
    assert le["tokens_to_target"] == pytest.approx(95)
    assert le["per_seed"] == [0.75, 1.0]


def test_equal_differences_give_a_degenerate_interval():
    base = {s: _curve([0, 50], [[0] * 5, [0.4] * 5]) for s in (0, 1, 2)}
    better = {s: _curve([0, 50], [[0] * 5, [1, 1, 1, 1, 1]]) for s in (0, 1, 2)}
    worse = {s: _curve([0, 40], [[0] * 5, [0] * 5]) for s in (0, 1, 2)}
    rows = {r["strategy"]: r for r in analyse({"uniform": base, "a": better, "b": worse})}
    assert rows["a"]["diff_ci"] == [pytest.approx(0.6), pytest.approx(0.6)]
    assert rows["b"]["tokens_to_target"] is None  # never reaches 90% of 0.4


def test_read_curve_scores_the_main_component(tmp_path):
    path = tmp_path / "eval.jsonl"
    recs = [
        {
            "step": 0,
            "rollout_tokens": 0,
            "results": [
                {"id": "a", "rewards": [0.3], "components": {"success": [0.0]}},
                {"id": "b", "rewards": [0.9], "components": {"success": [1.0]}},
            ],
        },
        {
            "step": 4,
            "rollout_tokens": 123,
            "results": [
                {"id": "a", "rewards": [1.3, 0.2], "components": {"success": [1.0, 0.0]}},
                {"id": "b", "rewards": [1.3, 1.3], "components": {"success": [1.0, 1.0]}},
            ],
        },
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    c = read_curve(path)
    assert c.tokens == [0, 123] and np.allclose(c.means, [0.5, 0.75])
    assert read_curve(path, key="missing").per_task[1] == {"a": 0.75, "b": 1.3}


def test_a_run_folder_from_other_settings_is_not_reused(tmp_path):
    from argparse import Namespace

    from mlx_grpo.bench.curriculum import check_run

    run = tmp_path / "runs" / "uniform-s0"
    run.mkdir(parents=True)
    args = Namespace(recipe="miniwob", token_budget=4000, eval_tasks=30, eval_every=4)
    check_run(run, "uniform", 0, args)  # nothing trained yet: fine
    cfg = {
        "recipe": {"name": "web_browsing"},
        "curriculum": {"strategy": "uniform"},
        "train": {"seed": 0, "token_budget": 4000, "eval_tasks": 30, "eval_every": 4},
    }
    (run / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        SystemExit, match=r"uniform-s0 was trained with recipe.name web_browsing \(asked miniwob\)"
    ):
        check_run(run, "uniform", 0, args)
    args.recipe = "web_browsing"
    check_run(run, "uniform", 0, args)  # the same settings: reused
    args.token_budget = 5000
    with pytest.raises(SystemExit, match=r"train.token_budget 4000 \(asked 5000\)"):
        check_run(run, "uniform", 0, args)
    (run / "config.json").write_text("{")
    with pytest.raises(SystemExit, match="config.json: not a run config"):
        check_run(run, "uniform", 0, args)


def test_bad_seeds_are_a_usage_error(capsys):
    from mlx_grpo.bench.curriculum import main

    with pytest.raises(SystemExit) as e:
        main(["--seeds", "0,abc", "--analyse-only"])
    assert e.value.code == 2 and "--seeds: integers separated by commas" in capsys.readouterr().err
