"""`python -m mlx_grpo.compare`: its statistics against independent computations on fixed
synthetic results, a model against itself, end to end on the tiny model (single- and
multi-turn), and one-line refusals."""

from __future__ import annotations

import itertools
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_grpo import compare as cmp
from mlx_grpo import report as report_mod
from mlx_grpo import sides
from mlx_grpo import stats as stats_mod
from mlx_grpo.cli import cmd_train
from mlx_grpo.evaluate import TaskResult
from mlx_grpo.recipe import Task

DATA = Path(__file__).parent / "data"
TOY, TOY_ENV = DATA / "toy", DATA / "toy_env"

# Two fixed synthetic result sets: per-task success counts out of 4 samples, so every
# per-task mean and difference is a multiple of 1/4 (exact sums for the tests below).
A_SMALL = [0, 1, 2, 0, 3, 1, 0, 2, 4, 1]
B_SMALL = [1, 3, 2, 2, 4, 1, 1, 4, 4, 0]
_rng = np.random.default_rng(123)
A_LARGE = _rng.integers(0, 5, size=40).tolist()
B_LARGE = np.clip(np.array(A_LARGE) + _rng.integers(-1, 3, size=40), 0, 4).tolist()


def _results(counts: list[int], k: int = 4, tag: str = "") -> list[TaskResult]:
    """TaskResults whose samples succeed (`success` = 1) c out of k times."""
    out = []
    for i, c in enumerate(counts):
        s = [1.0] * c + [0.0] * (k - c)
        out.append(
            TaskResult(
                id=f"t{i}",
                level=1 + i % 3,
                rewards=s,
                components={"success": s},
                texts=[f"{tag}{i}"] * k,
                tokens=[3 + i % 5] * k,
            )
        )
    return out


# --------------------------------------------------------- independent computations


def _brute_force_permutation_p(d: list[float]) -> float:
    """All 2^n sign patterns, plain Python, on exact quarters."""
    q = [round(x * 4) for x in d]  # integers: no rounding questions
    obs = abs(sum(q))
    pats = list(itertools.product((1, -1), repeat=len(q)))
    return sum(abs(sum(s * x for s, x in zip(pats_i, q))) >= obs for pats_i in pats) / len(pats)


def _exact_permutation_p_dp(d: list[float]) -> float:
    """The exact sign-flip p-value by dynamic programming over integer sums (n = 40:
    2^40 patterns are too many to list)."""
    q = [round(x * 4) for x in d]
    counts = {0: 1}
    for x in q:
        nxt: dict[int, int] = {}
        for s, c in counts.items():
            for v in (s + x, s - x):
                nxt[v] = nxt.get(v, 0) + c
        counts = nxt
    obs = abs(sum(q))
    return sum(c for s, c in counts.items() if abs(s) >= obs) / 2 ** len(q)


def _sign_test_p(d: list[float]) -> float:
    """Two-sided binomial test: the probability of every outcome no more likely than the
    observed number of positives (ties dropped)."""
    pos, neg = sum(x > 0 for x in d), sum(x < 0 for x in d)
    m = pos + neg
    prob = [math.comb(m, j) / 2**m for j in range(m + 1)]
    return min(1.0, sum(p for p in prob if p <= prob[pos] * (1 + 1e-12)))


def _brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def _percentile(sorted_vals: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), by hand."""
    pos = q / 100 * (len(sorted_vals) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (pos - lo) * (sorted_vals[hi] - sorted_vals[lo])


def _loop_bootstrap(a, b, resamples, seed):
    """Per-resample means in a Python loop over the same index draws."""
    idx = np.random.default_rng(seed).integers(0, len(a), size=(resamples, len(a)))
    ma, mb, md = [], [], []
    for row in idx.tolist():
        ma.append(sum(a[i] for i in row) / len(row))
        mb.append(sum(b[i] for i in row) / len(row))
        md.append(sum(b[i] - a[i] for i in row) / len(row))
    return [(_percentile(sorted(m), 2.5), _percentile(sorted(m), 97.5)) for m in (ma, mb, md)]


# --------------------------------------------------------------------- statistics


@pytest.mark.parametrize("a_counts,b_counts", [(A_SMALL, B_SMALL), (A_LARGE, B_LARGE)])
def test_rows_match_independent_computations(a_counts, b_counts):
    stats = stats_mod.StatsConfig(resamples=2000, permutations=20_000, seed=7)
    a, b = _results(a_counts), _results(b_counts)
    rule = report_mod.SuccessRule("success", 1.0)
    report = report_mod.compare_results(a, b, rule, ks=[1, 2, 4], stats=stats)
    rows = {r["metric"]: r for r in report.rows}
    assert list(rows) == [
        "eval/reward",
        "eval/success",
        "eval/pass@1",
        "eval/pass@2",
        "eval/pass@4",
        "eval/completion/len_mean",
        "eval/self_bleu",
        "eval/distinct_2",
    ]
    # Every task's samples are one repeated one-word text: Self-BLEU 1, no bigrams.
    assert rows["eval/self_bleu"]["a"] == pytest.approx(1.0)
    assert rows["eval/distinct_2"]["a"] == 0.0
    va = [c / 4 for c in a_counts]
    vb = [c / 4 for c in b_counts]
    d = [y - x for x, y in zip(va, vb)]
    r = rows["eval/reward"]
    assert r["a"] == pytest.approx(sum(va) / len(va)) and r["b"] == pytest.approx(sum(vb) / len(vb))
    assert r["diff"] == pytest.approx(sum(d) / len(d))

    # Bootstrap intervals: the same draws, means and percentiles computed by hand.
    (a_lo, a_hi), (b_lo, b_hi), (lo, hi) = _loop_bootstrap(va, vb, stats.resamples, stats.seed)
    assert (r["a_low"], r["a_high"]) == pytest.approx((a_lo, a_hi), abs=1e-12)
    assert (r["b_low"], r["b_high"]) == pytest.approx((b_lo, b_hi), abs=1e-12)
    assert (r["ci_low"], r["ci_high"]) == pytest.approx((lo, hi), abs=1e-12)
    # ... and close to the normal approximation mean +- 1.96 sd / sqrt(n).
    half = 1.96 * np.std(d, ddof=1) / math.sqrt(len(d))
    assert r["ci_low"] == pytest.approx(r["diff"] - half, abs=0.45 * half)
    assert r["ci_high"] == pytest.approx(r["diff"] + half, abs=0.45 * half)

    # p-values: exact by brute force (n = 10) or dynamic programming (n = 40: the
    # random flips must land within 4 standard errors of the exact value).
    if len(d) <= stats.exact_max:
        assert r["p_value"] == pytest.approx(_brute_force_permutation_p(d), abs=1e-12)
    else:
        exact = _exact_permutation_p_dp(d)
        se = math.sqrt(exact * (1 - exact) / stats.permutations) + 1 / stats.permutations
        assert abs(r["p_value"] - exact) < 4 * se
    assert r["p_sign"] == pytest.approx(_sign_test_p(d), abs=1e-12)

    # pass@k: every k-subset of each task's 4 samples enumerated.
    for k in (1, 2, 4):
        want_a = np.mean([_brute_force_pass_at_k(4, c, k) for c in a_counts])
        want_b = np.mean([_brute_force_pass_at_k(4, c, k) for c in b_counts])
        assert rows[f"eval/pass@{k}"]["a"] == pytest.approx(want_a, abs=1e-12)
        assert rows[f"eval/pass@{k}"]["b"] == pytest.approx(want_b, abs=1e-12)

    wins = report.wins
    assert wins == {
        "b": sum(y > x for x, y in zip(a_counts, b_counts)),
        "tie": sum(y == x for x, y in zip(a_counts, b_counts)),
        "a": sum(y < x for x, y in zip(a_counts, b_counts)),
    }
    # Per level: the same row computed on that level's tasks alone.
    for lv in (1, 2, 3):
        at = [i for i in range(len(a)) if a[i].level == lv]
        row = next(x for x in report.levels if x["metric"] == f"eval/level_{lv}/reward")
        assert row["n"] == len(at)
        assert row["diff"] == pytest.approx(np.mean([d[i] for i in at]))
        (lo, hi) = _loop_bootstrap([va[i] for i in at], [vb[i] for i in at], 2000, 7)[2]
        assert (row["ci_low"], row["ci_high"]) == pytest.approx((lo, hi), abs=1e-12)
    # Shown side by side: the tasks with the largest differences, largest first.
    gaps = [abs(x["b_reward"] - x["a_reward"]) for x in report.differ]
    assert len(gaps) == 3 and gaps == sorted(gaps, reverse=True) and gaps[0] == max(map(abs, d))


def test_small_cases():
    assert stats_mod.permutation_p([0.0] * 30) == 1.0  # the random path, all tied
    assert stats_mod.sign_test_p([0.0, 0.0]) == 1.0
    assert stats_mod.sign_test_p([1, 1, 1, 1, 1, 1, -1]) == pytest.approx(16 / 128)
    assert stats_mod.pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert stats_mod.pass_at_k(5, 5, 3) == 1.0
    with pytest.raises(ValueError):
        stats_mod.pass_at_k(4, 1, 5)


def test_significance_needs_the_test_as_well_as_the_interval():
    """Every task one better on 3 tasks: the bootstrap interval is [1, 1], but only 2 of
    the 8 sign patterns are as extreme (p = 0.25): not significant, not coloured."""
    row = stats_mod.compare_values("m", [0.0] * 3, [1.0] * 3)
    assert (row["ci_low"], row["ci_high"], row["p_value"]) == (1.0, 1.0, 0.25)
    assert row["better"] is None and report_mod._diff_style(row) == ""
    # 4 of 10 tasks won, none lost: p = 2/16 by the exact test, not significant either.
    row = stats_mod.compare_values("m", [0.0] * 10, [1.0] * 4 + [0.0] * 6)
    assert row["ci_low"] > 0 and row["p_value"] == pytest.approx(0.125) and row["better"] is None
    row = stats_mod.compare_values("m", [1.0] * 8, [0.0] * 8)  # p = 2/256
    assert row["better"] == "a" and report_mod._diff_style(row) == "red"
    row = stats_mod.compare_values("m", [0.0] * 20, [1.0] * 12 + [0.0] * 8)  # random flips
    assert row["ci_low"] > 0 and row["p_value"] < 0.05 and row["better"] == "b"
    assert report_mod._p(0.0496) == "0.0496" and report_mod._p(0.0504) == "0.0504"
    with pytest.raises(ValueError, match="m: a task's value is not a finite number"):
        stats_mod.compare_values("m", [0.1, 0.2, 0.3], [0.1, float("nan"), 0.2])


def test_a_sample_whose_reward_raised_counts_0_in_every_component(monkeypatch):
    """A reward that raises gives its sample the weighted components only; the others
    still count it, as 0, in their task's mean (not a mean over the samples that scored)."""
    from types import SimpleNamespace

    from mlx_grpo import evaluate as ev
    from mlx_grpo.config import RolloutConfig
    from mlx_grpo.recipe import Scored

    tasks = [Task("t0", 1, []), Task("t1", 1, [])]
    done = [SimpleNamespace(prompt_index=i // 2, text="x", model_tokens=1) for i in range(4)]
    scored = [
        Scored(0.0, {"success": 0.0}, "ValueError: boom"),  # t0, first sample: raised
        Scored(1.0, {"success": 1.0, "partial": 1.0}),
        Scored(0.5, {"success": 0.0, "partial": 0.5}),
        Scored(0.0, {"success": 0.0}, "ValueError: boom"),  # t1, last sample: raised
    ]
    recipe = SimpleNamespace(score_rollout=lambda tasks, rollout: scored)
    monkeypatch.setattr(ev, "rollout_tasks", lambda *a, **k: SimpleNamespace(completions=done))
    model = SimpleNamespace(eval=lambda: None)
    r0, r1 = ev.evaluate(model, None, recipe, tasks, RolloutConfig(), samples=2)
    assert r0.components == {"success": [0.0, 1.0], "partial": [0.0, 1.0]} and r0.errors == 1
    assert r1.components == {"success": [0.0, 0.0], "partial": [0.5, 0.0]} and r1.errors == 1
    values = report_mod.task_values(
        [r0, r1], ["partial"], report_mod.SuccessRule("success", 1), [1]
    )
    assert values["eval/partial"].tolist() == [0.5, 0.25]


def test_identical_sides_give_zero_difference():
    a = _results(A_LARGE)
    report = report_mod.compare_results(a, a, report_mod.SuccessRule("reward", 1.0), ks=[1])
    for r in report.rows + report.levels:
        assert r["diff"] == 0 and r["ci_low"] == 0 and r["ci_high"] == 0
        assert r["p_value"] == 1 and r["p_sign"] == 1
    assert report.wins == {"b": 0, "tie": 40, "a": 0} and report.differ == []


# ------------------------------------------------------------------ tiny model, CLI


def _compare(capsys, *argv) -> tuple[dict, str]:
    from rich.console import Console

    data = cmp.run_compare([str(x) for x in argv], Console(width=160, force_terminal=False))
    return data, capsys.readouterr().out


def test_model_against_itself(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "self"
    data, printed = _compare(
        capsys, "--a", tiny_model_dir, "--b", tiny_model_dir, "--recipe", TOY,
        "--n-tasks", 4, "--out", out,
    )  # fmt: skip
    print(printed)  # the terminal table, for `pytest -s`
    assert (out / "compare.json").exists() and (out / "compare.png").stat().st_size > 1000
    saved = json.loads((out / "compare.json").read_text())
    assert saved["rows"] == data["rows"] and len(saved["tasks"]) == 4
    for r in saved["rows"]:
        assert {"metric", "a", "b", "diff", "ci_low", "ci_high", "p_value"} <= r.keys()
        assert r["a"] == r["b"] and r["ci_low"] <= 0 <= r["ci_high"] and r["p_value"] == 1
    assert all(t["a"] == t["b"] for t in saved["tasks"])
    assert saved["wins"] == {"b": 0, "tie": 4, "a": 0}
    assert [r["metric"] for r in saved["rows"]][:3] == ["eval/reward", "eval/ascii", "eval/short"]
    assert "B vs A" in printed and "eval/reward" in printed and "tie on 4" in printed


@pytest.fixture(scope="module")
def toy_run(tiny_model_dir, tmp_path_factory) -> Path:
    """Two training steps on the toy recipe, a checkpoint after each."""
    out = tmp_path_factory.mktemp("runs")
    args = ["--recipe", str(TOY), f"--model.path={tiny_model_dir}", f"--output.dir={out}"]
    assert cmd_train([*args, "--output.run=toy", "--train.steps=2", "--output.save_every=1"]) == 0
    return out / "toy"


def test_run_checkpoint_against_its_base(tiny_model_dir, toy_run, capsys):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    run = toy_run
    data, printed = _compare(
        capsys, "--a", tiny_model_dir, "--b", f"{run}@step-000001", "--n-tasks", 4
    )
    # The recipe came from the run; the report went to the run's folder.
    assert data["recipe"]["name"] == str(TOY) and data["eval"]["n_tasks"] == 4
    assert data["sides"]["b"]["step"] == 1 and data["sides"]["b"]["adapter"].endswith("step-000001")
    assert (run / "compare" / "compare.json").exists() and (
        run / "compare" / "compare.png"
    ).exists()
    # The result sits beside the adapters compared: the step's folder, not the run's.
    assert json.loads((run / "step-000001" / "compare.json").read_text())["rows"] == data["rows"]
    assert not (run / "compare.json").exists()
    assert "note:" not in printed
    # A checkpoint against itself leaves the result the model card quotes alone.
    kept = (run / "step-000001" / "compare.json").read_bytes()
    step = f"{run}@step-000001"
    _, printed = _compare(capsys, "--a", step, "--b", step, "--n-tasks", 4, "--out", run / "self")
    assert "note: A and B are the same model and adapters" in printed
    assert (run / "step-000001" / "compare.json").read_bytes() == kept
    # The run folder's adapters are a copy of its last step's: the same side again.
    _, printed = _compare(capsys, "--a", f"{run}@step-000002", "--b", run, "--n-tasks", 4)
    assert "note: A and B are the same model and adapters" in printed
    assert not (run / "compare.json").exists()

    # The same checkpoint named three ways; the run folder itself means its latest.
    for spec in (f"{run}@1", str(run / "step-000001")):
        side = sides.resolve_side("b", spec)
        assert (side.adapter, side.run_dir, side.step) == (run / "step-000001", run, 1)
    assert sides.resolve_side("b", str(run)).step == 2

    # B is the base with that step's adapters in place, as mlx_lm.load(adapter_path=) does.
    model, _ = sides.load_side(sides.resolve_side("b", f"{run}@step-000001"))
    saved = mx.load(str(run / "step-000001" / "adapters.safetensors"))
    params = dict(tree_flatten(model.parameters()))
    assert saved and all(mx.array_equal(params[k], v).item() for k, v in saved.items())
    assert any(k.endswith("lora_b") and mx.abs(v).max().item() > 0 for k, v in saved.items())


def test_multi_turn_recipe_sampled(tiny_model_dir, toy_run, tmp_path, capsys):
    out = tmp_path / "env"
    data, printed = _compare(
        capsys, "--a", tiny_model_dir, "--b", toy_run, "--recipe", TOY_ENV,
        "--samples", 2, "--temperature", 1.0, "--n-tasks", 3, "--out", out,
    )  # fmt: skip
    print(printed)
    assert "note: B was trained on recipe" in printed and "up to 3 turns" in printed
    assert (out / "compare.json").exists() and (out / "compare.png").exists()
    assert data["sides"]["b"]["step"] == 2 and data["rollout"]["max_turns"] == 3
    metrics = [r["metric"] for r in data["rows"]]
    assert {"eval/finished", "eval/short", "eval/pass@1", "eval/pass@2"} <= set(metrics)
    assert all(len(t["a"]["rewards"]) == 2 == len(t["b"]["rewards"]) for t in data["tasks"])
    assert [t["level"] for t in data["tasks"]] == [1, 2, 3]
    assert [x["level"] for x in data["levels"][::2]] == [1, 2, 3]


def test_the_tokenizer_check_closes_every_environment_it_opens(tiny_model_dir):
    """Each task's first prompt comes from a reset environment; a MiniWoB one holds a
    browser window, and the check once kept one per task and side (600 at 300 tasks)."""
    from types import SimpleNamespace

    from mlx_lm.utils import load_tokenizer

    from mlx_grpo.recipe import Recipe

    opened, closed = [], []

    class Env:
        def reset(self):
            opened.append(self)
            return "the page"

        def close(self):
            closed.append(self)

    recipe = SimpleNamespace(multi_turn=True, make_env=lambda task: Env())
    recipe.first_messages = lambda task, env: Recipe.first_messages(recipe, task, env)
    tasks = [SimpleNamespace(messages=[{"role": "user", "content": f"task {i}"}]) for i in range(5)]
    ids = sides.prompt_tokens(load_tokenizer(tiny_model_dir), recipe, tasks, 10**6)
    assert len(ids) == 5 and len(set(map(tuple, ids))) == 5
    assert len(opened) == 5 and closed == opened


def test_cli_module_end_to_end(tiny_model_dir, tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_grpo.compare", "--a", str(tiny_model_dir), "--b",
         str(tiny_model_dir), "--recipe", str(TOY), "--n-tasks", "2", "--out", str(out),
         "--rollout.max_new_tokens=4"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (out / "compare.json").exists() and (out / "compare.png").exists()
    assert json.loads((out / "compare.json").read_text())["rollout"]["max_new_tokens"] == 4
    # Once more, in a new process: both sides are read from the evaluation cache.
    again = subprocess.run(proc.args, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "evaluating" not in again.stdout
    assert json.loads((out / "compare.json").read_text())["eval"]["cached"].keys() == {"a", "b"}


def _fake_run(folder: Path, recipe: Path) -> Path:
    from mlx_grpo.config import build_config
    from mlx_grpo.recipe import recipe_defaults

    folder.mkdir(parents=True)
    cfg = build_config(recipe_defaults(str(recipe)))
    (folder / "config.json").write_text(cfg.model_dump_json())
    mx.save_safetensors(str(folder / "adapters.safetensors"), {"a": mx.zeros(1)})
    (folder / "adapter_config.json").write_text("{}")
    return folder


def _refused(cases: dict[str, list[str]], capsys) -> None:
    """Each argv of `cases` exits with status 2 and one line on stderr holding its key."""
    for want, argv in cases.items():
        with pytest.raises(SystemExit) as e:
            cmp.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2, (want, err)
        assert err.startswith("error: ") and err.count("\n") == 1 and want in err, (want, err)


def test_a_task_the_browser_failed_on_is_left_out_and_time_limits_are_named(
    tiny_model_dir, tmp_path, capsys, monkeypatch
):
    """A crashed browser scores 0 for the side it happened to: its task leaves the rows on
    both sides, named in the header and in compare.json; a time limit stays in (it can be
    the program's own doing) with a note; repeated task ids cannot be paired."""

    ids = []

    def evaluate_side(side, recipe, tasks, *a):
        ids[:] = [t.id for t in tasks]
        out = []
        for i, t in enumerate(tasks):
            won = float(side.flag == "b")
            failures = {"browser": 1} if (i, side.flag) == (0, "b") else {}
            failures = {"timeout": 1} if (i, side.flag) == (1, "a") else failures
            out.append(
                TaskResult(t.id, t.level, [won], {"success": [won]}, ["x"], [1], 0, failures)
            )
        return out, 0.0

    monkeypatch.setattr(cmp, "evaluate_side", evaluate_side)
    m, argv = str(tiny_model_dir), ["--recipe", TOY, "--n-tasks", 5, "--no-cache"]
    data, printed = _compare(capsys, "--a", m, "--b", m, *argv, "--out", tmp_path / "c")
    first = ids[0]
    assert data["eval"]["left_out"] == [first] and [t["id"] for t in data["tasks"]] == ids[1:]
    assert data["eval"]["failures"] == {"a": {"timeout": 1}, "b": {"browser": 1}}
    reward = data["rows"][0]
    assert reward["metric"] == "eval/reward" and (reward["n"], reward["a"], reward["b"]) == (
        4,
        0,
        1,
    )
    assert "warning: 1 of 5 tasks left out of the comparison: browser failed" in printed
    assert "note: 1 samples of A ended by timeout" in printed
    assert json.loads((tmp_path / "c" / "compare.json").read_text())["eval"]["left_out"] == [first]

    def every_one_broken(side, recipe, tasks, *a):
        bad = {"browser": 1}
        return [TaskResult(t.id, t.level, [0.0], {}, ["x"], [1], 0, bad) for t in tasks], 0.0

    monkeypatch.setattr(cmp, "evaluate_side", every_one_broken)
    with pytest.raises(cmp.CompareError, match="browser failed on every one of the 5 tasks"):
        _compare(capsys, "--a", m, "--b", m, *argv, "--out", tmp_path / "d")
    twice = lambda self, split, n, seed: [Task("same", 1, [{"role": "user", "content": "x"}])] * 2  # noqa: E731
    monkeypatch.setattr(cmp.Recipe, "tasks", twice)
    with pytest.raises(cmp.CompareError, match="two eval tasks have the id 'same'"):
        _compare(capsys, "--a", m, "--b", m, *argv, "--out", tmp_path / "e")


def test_refusals_are_one_line(tiny_model_dir, tmp_path, capsys, monkeypatch):
    from conftest import make_tiny_model

    other = make_tiny_model(tmp_path / "other")
    tok_cfg = other / "tokenizer_config.json"
    tok_cfg.write_text(tok_cfg.read_text().replace("<|im_start|>{{ message", "### {{ message"))
    m = str(tiny_model_dir)
    cases = {
        "no such run or model folder": ["--a", m, "--b", str(tmp_path / "nope" / "run")],
        "the eval set is empty": ["--a", m, "--b", m, "--recipe", str(TOY), "--n-tasks", "0"],
        "greedy samples are identical": ["--a", m, "--b", m, "--recipe", str(TOY), "--samples", "4"],
        "tokenize the prompts differently": ["--a", m, "--b", str(other), "--recipe", str(TOY)],
        "different recipe": [
            "--a", str(_fake_run(tmp_path / "r1", TOY)), "--b", str(_fake_run(tmp_path / "r2", TOY_ENV)),
        ],
        "--recipe NAME is needed": ["--a", m, "--b", m],
        "no checkpoint 'step-000009'": ["--a", m, "--b", f"{tmp_path / 'r1'}@step-000009"],
        "the following arguments are required: --b": ["--a", m],
        "compare takes only": ["--a", m, "--b", m, "--recipe", str(TOY), "--train.steps=3"],
        "no component 'nope'": ["--a", m, "--b", m, "--recipe", str(TOY), "--n-tasks", "1",
                                "--success-key", "nope", "--out", str(tmp_path / "x")],
    }  # fmt: skip
    _refused(cases, capsys)

    # Refused before side A is evaluated: an --out where nothing can be written, a torn
    # adapters file.
    (tmp_path / "file").write_text("")
    torn = _fake_run(tmp_path / "torn", TOY) / "adapters.safetensors"
    torn.write_bytes(torn.read_bytes()[:20])

    def evaluate_side(*a, **k):
        raise AssertionError("evaluated")

    monkeypatch.setattr(cmp, "evaluate_side", evaluate_side)
    bad_config = _fake_run(tmp_path / "badcfg", TOY)
    (bad_config / "adapter_config.json").write_text("[1,")
    cases = {
        f"{bad_config / 'adapter_config.json'} is unreadable": ["--a", str(bad_config), "--b", m],
        "--temperature nan: must be a number >= 0": ["--a", m, "--b", m, "--temperature", "nan"],
        "--show -1: must be >= 0": ["--a", m, "--b", m, "--show", "-1"],
        f"--out: cannot write in {tmp_path / 'file' / 'x'}": [
            "--a", m, "--b", m, "--recipe", str(TOY), "--no-cache",
            "--out", str(tmp_path / "file" / "x")],
        f"--b {torn.parent}: {torn} is unreadable": ["--a", m, "--b", str(torn.parent)],
    }  # fmt: skip
    _refused(cases, capsys)

    # And through `python -m`: one line on stderr, exit status 2.
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_grpo.compare", "--a", "default", "--b", "/nonexistent/run"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: --b /nonexistent/run: no such run or model folder")


def test_a_run_still_training_is_compared_as_it_was_when_the_command_started(
    toy_run, tiny_model_dir, tmp_path
):
    """`--b RUN` while RUN trains on: side A's evaluation takes minutes, in which the run
    saves new steps, replaces its own copy of the adapters and prunes the step that was
    its latest. B is still that step: its label, its cache key and its weights."""
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_grpo import evalcache
    from mlx_grpo.checkpoint import publish, remove_step

    run = tmp_path / "live"
    shutil.copytree(toy_run, run)
    side = sides.resolve_side("b", str(run))
    key = evalcache.side_key(side, {"settings": 1})
    assert side.step == 2 and side.adapter == run and key is not None
    later = run / "step-000003"  # the training goes on
    shutil.copytree(run / "step-000002", later)
    moved = {k: v + 1 for k, v in mx.load(str(later / "adapters.safetensors")).items()}
    mx.save_safetensors(str(later / "adapters.safetensors"), moved)
    (later / "state.json").write_text(json.dumps({"step": 3, "counters": {}, "curriculum": {}}))
    publish(later)
    remove_step(run / "step-000002")
    assert evalcache.side_key(side, {"settings": 1}) == key
    assert side.describe().startswith(f"run {run}, step 2 ")
    model, _ = sides.load_side(side)
    saved = mx.load(str(toy_run / "step-000002" / "adapters.safetensors"))
    params = dict(tree_flatten(model.parameters()))
    assert all(mx.array_equal(params[k], v).item() for k, v in saved.items())
    # A run named again now is the run as it is now.
    assert sides.resolve_side("b", str(run)).step == 3
    # An adapter folder (--b-adapter) is taken as it is when the command starts too.
    side = sides.resolve_side("b", str(tiny_model_dir), str(run))
    key = evalcache.side_key(side, {"settings": 1})
    mx.save_safetensors(str(run / "adapters.safetensors"), saved)
    assert evalcache.side_key(side, {"settings": 1}) == key
    params = dict(tree_flatten(sides.load_side(side)[0].parameters()))
    assert all(mx.array_equal(params[k], v + 1).item() for k, v in saved.items())


def test_a_side_named_dot_is_copied_into_a_folder_of_its_own(toy_run, tmp_path, monkeypatch):
    """`--a-adapter .` from inside a step folder: the copy is named after the folder, and
    what is removed at exit is the copy's own temporary folder, never TMPDIR."""
    removed = []
    monkeypatch.setattr(sides.atexit, "register", lambda fn, path, **k: removed.append(path))
    monkeypatch.chdir(toy_run / "step-000001")
    copy = sides._freeze(Path("."), "--a-adapter", run=False)
    assert copy.name == "step-000001" and removed == [copy.parent]
    assert copy.parent.name.startswith("mlx-grpo-side-") and (copy / "state.json").exists()
    # A run's step folder without its state.json was being pruned: said so.
    pruning = tmp_path / "pruning" / "step-000001"
    pruning.mkdir(parents=True)
    for name in ("adapters.safetensors", "adapter_config.json"):
        shutil.copy(toy_run / "step-000001" / name, pruning)
    with pytest.raises(cmp.CompareError, match="was removed while being read"):
        sides._freeze(pruning, "--b x")


def test_the_same_weights_at_another_scale_are_another_model(toy_run, tiny_model_dir, tmp_path):
    import shutil

    other = tmp_path / "scaled"
    shutil.copytree(toy_run / "step-000002", other)
    cfg = json.loads((other / "adapter_config.json").read_text())
    cfg["lora_parameters"]["scale"] *= 2
    (other / "adapter_config.json").write_text(json.dumps(cfg))
    a = sides.resolve_side("a", str(tiny_model_dir), str(toy_run / "step-000002"))
    b = sides.resolve_side("b", str(tiny_model_dir), str(other))
    same = sides.resolve_side("b", str(toy_run))  # the run's copy of step 2
    assert cmp._adapter_bytes(a) != cmp._adapter_bytes(b)
    assert cmp._adapter_bytes(a) == cmp._adapter_bytes(same)


def test_a_side_evaluated_before_is_kept_until_anything_that_decides_it_changes(
    tiny_model_dir, toy_run, tmp_path, capsys, monkeypatch
):
    """The second identical compare evaluates nothing and reports what the first did;
    new adapters, an edited recipe and --no-cache each make a side play again; a side
    on which a reward raised is not kept."""
    import shutil

    from mlx_grpo import evalcache

    monkeypatch.setenv("MLX_GRPO_CACHE", str(tmp_path / "cache"))
    played = []
    real = cmp.evaluate_side

    def spy(side, *args, **kw):
        played.append(side.flag)
        return real(side, *args, **kw)

    monkeypatch.setattr(cmp, "evaluate_side", spy)
    # Freed memory is kept (device.prepare_training) before each side that plays, not a kept one.
    kept = []
    monkeypatch.setattr(cmp, "keep_freed_memory", lambda: kept.append(len(played)))
    recipe = tmp_path / "toy"
    shutil.copytree(TOY, recipe)
    adapters = tmp_path / "adapters"
    shutil.copytree(toy_run / "step-000001", adapters)
    argv = ["--a", tiny_model_dir, "--b", tiny_model_dir, "--b-adapter", adapters]
    argv += ["--recipe", recipe, "--n-tasks", 3, "--out", tmp_path / "out"]

    first, _ = _compare(capsys, *argv)
    assert played == ["a", "b"] and first["eval"]["cached"] == {} and kept == [0, 1]
    second, printed = _compare(capsys, *argv)
    assert played == ["a", "b"] and kept == [0, 1]  # nothing played again
    assert set(second["eval"]["cached"]) == {"a", "b"} and "kept from" in printed
    assert second["tasks"] == first["tasks"] and second["rows"] == first["rows"]

    # Other adapter weights (step 2's, under the same folder name): B plays again.
    shutil.copy(toy_run / "step-000002" / "adapters.safetensors", adapters)
    third, _ = _compare(capsys, *argv)
    assert played == ["a", "b", "b"] and set(third["eval"]["cached"]) == {"a"}
    # An edited reward: both play again, and score with the new code.
    tasks_py = recipe / "tasks.py"
    tasks_py.write_text(tasks_py.read_text() + "\n# edited\n")
    _compare(capsys, *argv)
    assert played == ["a", "b", "b", "a", "b"]
    _compare(capsys, *argv, "--no-cache")
    assert played == ["a", "b", "b", "a", "b", "a", "b"]

    # A run folder as B: the compare it writes into the run does not change B's key.
    run_argv = ["--a", tiny_model_dir, "--b", toy_run, "--recipe", recipe, "--n-tasks", 3]
    _compare(capsys, *run_argv)
    again, _ = _compare(capsys, *run_argv)
    assert set(again["eval"]["cached"]) == {"a", "b"}
    # A Hub id is never kept: the same name can load another snapshot.
    hub = sides.Side("b", "org/model", sides.ModelConfig(path="org/model"))
    assert evalcache.side_key(hub, {}) is None

    # Not kept: a reward that raised, a failure of the moment (a time limit); kept: an
    # ordinary failure (a wrong answer), read back only for the same tasks.
    raised = TaskResult("t", 1, [0.0], {}, ["x"], [1], errors=1)
    timed_out = TaskResult("t", 1, [0.0], {}, ["x"], [1], failures={"timeout": 1})
    wrong = TaskResult("t", 1, [0.5], {}, ["x"], [1], failures={"wrong_answer": 1})
    for r in (raised, timed_out):
        assert not evalcache.store("k", [r], 1.0) and evalcache.load("k", ["t"]) is None
    assert evalcache.store("k", [wrong], 1.0)
    assert evalcache.load("k", ["t"])[0] == [wrong] and evalcache.load("k", ["u"]) is None


def test_a_cache_that_cannot_be_written_keeps_nothing_and_the_compare_goes_on(
    tmp_path, monkeypatch
):
    from mlx_grpo import evalcache

    (tmp_path / "file").write_text("")  # the cache root is a file: no folder under it
    monkeypatch.setenv("MLX_GRPO_CACHE", str(tmp_path / "file"))
    assert evalcache.store("k", _results([1, 2]), 1.0) is False
    assert evalcache.load("k", [r.id for r in _results([1, 2])]) is None


def test_a_full_disk_at_the_end_is_one_line_and_the_evaluations_are_kept(
    tiny_model_dir, tmp_path, capsys, monkeypatch
):
    def full(*a, **k):
        raise OSError(28, "No space left on device")

    argv = ["--a", tiny_model_dir, "--b", tiny_model_dir, "--recipe", TOY, "--n-tasks", 2]
    write_outputs = cmp.write_outputs
    monkeypatch.setattr(cmp, "write_outputs", full)
    with pytest.raises(cmp.CompareError) as e:
        _compare(capsys, *argv, "--no-cache", "--out", tmp_path / "out")
    assert str(e.value) == (
        f"--out: writing in {tmp_path / 'out'} failed (No space left on device); the "
        "evaluations are kept, so the same command without --no-cache only writes"
    )
    monkeypatch.setattr(cmp, "write_outputs", write_outputs)
    capsys.readouterr()  # (the first run's lines)
    _, printed = _compare(capsys, *argv, "--out", tmp_path / "out")
    assert "evaluating" not in printed and (tmp_path / "out" / "compare.json").exists()


def test_the_machine_in_a_key_names_the_chip_not_its_free_memory(monkeypatch):
    """CUDA's device_info reports free_memory, which moves between any two calls: the
    machine part of a key leaves it out, and keeps what names the device."""
    import itertools

    import mlx.core as mx

    from mlx_grpo import evalcache

    free = itertools.count(80 << 30, -(1 << 20))
    chip = {"device_name": "NVIDIA H200", "architecture": "sm_90",
            "compute_capability_major": 9, "compute_capability_minor": 0}  # fmt: skip
    monkeypatch.setattr(mx, "device_info", lambda *a: {**chip, "free_memory": next(free),
                                                       "total_memory": 150 << 30})  # fmt: skip
    first, second = evalcache._machine(), evalcache._machine()
    assert first == second and first["device_info"] == chip
    chip["device_name"] = "NVIDIA H100"
    assert evalcache._machine()["device_info"] != first["device_info"]


def test_a_run_trained_with_the_episode_cut_is_evaluated_to_each_episodes_end(tiny_model_dir):
    """rollout.end_on_ill_formed is a training rule: the settings a compare takes from
    a run leave it out, as evaluation does."""
    from mlx_grpo.compare import resolve_eval_config
    from mlx_grpo.config import build_config
    from mlx_grpo.models import ModelConfig
    from mlx_grpo.recipe import recipe_defaults
    from mlx_grpo.sides import Side

    trained = build_config(
        recipe_defaults(str(TOY_ENV)), overrides={"rollout": {"end_on_ill_formed": True}}
    )
    side = Side("b", "run", ModelConfig(path=str(tiny_model_dir)), run_config=trained)
    cfg = resolve_eval_config(None, {}, [side])
    assert trained.rollout.end_on_ill_formed and not cfg.rollout.end_on_ill_formed
    assert cfg.rollout.max_turns == trained.rollout.max_turns == 3
