"""`python -m mlx_grpo.bench --smoke`: one real step of mlx-grpo on the tiny model, its
profile and floor, the JSON record and the table; and the work unit's pieces."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_grpo.bench import work_unit as wu
from mlx_grpo.bench.floor import floor_seconds, step_work

ROOT = Path(__file__).resolve().parent.parent


def test_smoke_runs_one_step_and_writes_results(tiny_model_dir, tmp_path):
    out = tmp_path / "results"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_grpo.bench",
            "--smoke",
            "--model",
            str(tiny_model_dir),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "mlx-grpo" in r.stdout and "Floor" in r.stdout
    (path,) = out.glob("*.json")
    report = json.loads(path.read_text())
    assert list(report["systems"]) == ["mlx-grpo"]
    res = report["systems"]["mlx-grpo"]
    assert len(res["steps"]) == 1
    step = res["steps"][0]
    assert 0 < step["rollout_s"] < step["step_s"]
    assert step["gen_tokens"] > 0 and step["work"]["completion_tokens"] == step["gen_tokens"]
    assert res["time_to_first_step_s"] >= step["step_s"] and res["peak_rss_mb"] > 0
    phases = res["profile"]["phases_s"]
    assert set(phases) == {"prefill", "decode", "ref_forward", "policy_fwd_bwd", "optimizer"}
    assert all(v >= 0 for v in phases.values()) and phases["policy_fwd_bwd"] > 0
    floor = report["floor"]
    assert floor["rates"]["gemm_gflops"] > 0 and floor["rates"]["bandwidth_gbs"] > 0
    assert floor["step_over_floor"] > 0
    assert (path.with_suffix(".md")).read_text().count("| mlx-grpo |") == 1


def test_step_work_counts_flops_by_hand():
    """One layer, d=2, inter=4, 1 head of 2, vocab 3, rank 1: FLOPs written out."""

    class Args:
        hidden_size, num_hidden_layers, intermediate_size = 2, 1, 4
        num_attention_heads, num_key_value_heads, head_dim, vocab_size = 1, 1, 2, 3

    class Model:
        args = Args()

    from mlx_grpo.bench.floor import Shapes

    s = Shapes(Model(), lora_rank=1)
    assert s.block_params == 4 * 4 + 3 * 8  # q, k, v, o (2x2) + gate, up, down (2x4)
    assert s.weight_bytes == 4 * (40 + 6)
    w = step_work(s, prompt_lens=[3], comp_lens=[2, 1], group=2)
    assert w["decode_steps"] == 2 and w["completion_tokens"] == 3
    assert w["decode_weight_bytes"] == 2 * s.weight_bytes
    lin, lora, head = 2 * 40, 2 * (4 * 4 + 3 * 6), 2 * 2 * 3  # per token
    attn = lambda q, c: 4 * q * c * 2  # noqa: E731
    assert w["prefill_flops"] == 2 * (lin + lora) + attn(2, 1)
    fwd_attn = attn(3, 1.5) + attn(2, 4) + attn(1, 3.5)
    assert w["ref_forward_flops"] == 6 * lin + 3 * head + fwd_attn
    assert w["policy_fwd_bwd_flops"] == (6 * (lin + lora) + 3 * head + fwd_attn) + (
        6 * lin + 3 * head + 2 * 6 * lora + 2 * fwd_attn
    )
    f = floor_seconds(w, {"gemm_gflops": 1e-9, "bandwidth_gbs": 1e-9})  # 1 FLOP/s, 1 B/s
    assert f["decode"] == 2 * max(s.weight_bytes, w["decode_flops"] / 2)
    assert f["total"] == f["prefill"] + f["decode"] + f["ref_forward"] + f["policy_fwd_bwd"]


def test_work_unit_tasks_and_reward():
    tasks = wu.tasks()
    assert len(tasks) == 16 and tasks == wu.tasks()  # seeded
    for t in tasks:
        a, b = (int(x) for x in t["prompt"].removeprefix("What is ").split("?")[0].split(" + "))
        assert 10 <= a <= 99 and 10 <= b <= 99 and t["answer"] == a + b
    assert [t["prompt"] for t in wu.step_tasks(1)] == [t["prompt"] for t in tasks[:2]]
    assert wu.step_tasks(9) == wu.step_tasks(1)
    assert wu.reward("The answer is 90.", 90) == 1.0
    assert wu.reward("It is 190 or 901", 90) == 0.0
    assert wu.reward("-90, 90.5", 90) == 0.0


def test_each_finished_step_is_written_to_stderr_as_it_ends(capsys):
    clock = wu.StepClock(0.0)
    clock.record(step_s=1.5, rollout_s=0.5)
    clock.record(step_s=2.0, rollout_s=0.75)
    lines = capsys.readouterr().err.splitlines()
    assert [json.loads(x.removeprefix(wu.STEP_TAG)) for x in lines] == clock.steps
    assert all(x.startswith(wu.STEP_TAG) for x in lines)


def test_a_runner_cut_off_by_its_limit_reports_its_finished_steps(tmp_path, monkeypatch):
    """A runner stopped at its time limit (a cold GPU compiling its kernels, say) names
    the steps it finished in the error, and its log keeps what it printed."""
    from mlx_grpo.bench import speed

    steps = [{"step_s": 56.8, "rollout_s": 3.4}, {"step_s": 6.4, "rollout_s": 3.0}]
    (tmp_path / "cut_runner.py").write_text(
        "import json, sys, time\n"
        f"for s in {steps!r}:\n"
        f"    sys.stderr.write({wu.STEP_TAG!r} + json.dumps(s) + '\\n')\n"
        "sys.stderr.flush()\n"
        "print('still going', flush=True)\n"
        "time.sleep(600)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    log = tmp_path / "logs" / "cut.log"
    with pytest.raises(speed.BenchError) as e:
        speed.run_runner(sys.executable, "cut_runner", [], timeout=10, log=log)
    assert str(e.value) == (
        f"cut_runner ran past 10 s after 2 finished step(s) (56.8, 6.4 s) (log: {log})"
    )
    text = log.read_text()
    assert "still going" in text and text.count(wu.STEP_TAG) == 2


def test_the_peers_run_on_the_same_blas_without_the_front_unless_asked(tmp_path, monkeypatch):
    """mlx-lm-lora's products go to the BLAS mlx-grpo chose, not through mlx-grpo's own
    skinny-GEMM front, unless --peer-front; the report names each system's BLAS."""
    from mlx_grpo.bench import speed
    from mlx_grpo.device import blas_in_use

    (tmp_path / "blas_runner.py").write_text(
        "import json\n"
        "from mlx_grpo.bench import work_unit as wu\n"
        "import mlx.core as mx\n"
        "from mlx_grpo.device import blas_in_use\n"
        "print(wu.RESULT_TAG + json.dumps({'blas': blas_in_use()}), flush=True)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.delenv("MLX_GRPO_SKINNY", raising=False)
    ours = blas_in_use()
    runs = {
        front: speed.run_runner(
            sys.executable, "blas_runner", [], 120, tmp_path / f"{front}.log", front=front
        )
        for front in (False, True)
    }
    # The same library (a child names it "custom": it gets the path, not the search)...
    library = ours.split(" (")[0]
    assert runs[True]["blas"].startswith(library) and runs[False]["blas"].startswith(library)
    # ... with the front where this process has it, and never with front=False.
    front = " + skinny-GEMM front"
    assert (front in runs[True]["blas"]) == (front in ours)
    assert front not in runs[False]["blas"]
    report = {"systems": {"mlx-grpo": {"blas": ours}, "trl": {}, "mlx-lm-lora": runs[False]}}
    assert speed.blas_line(report) == f"mlx-grpo: {ours}; mlx-lm-lora: {runs[False]['blas']}"


def test_the_ratio_column_is_mlx_grpo_step_over_each_system_and_empty_when_it_failed():
    from mlx_grpo.bench.speed import tables

    def summary(step_s):
        keys = ("rollout_s", "rollout_tok_s", "update_s", "time_to_first_step_s", "peak_rss_gb")
        return {"step_s": step_s, "reward_mean": 0.5, **dict.fromkeys(keys, 1.0)}

    def ratios(systems):
        (_, header, rows), *_ = tables({"steps": 4, "systems": systems})
        assert header[-1] == "mlx-grpo / system"
        return {row[0]: row[-1] for row in rows}

    peer = {"summary": summary(8.0)}
    assert ratios({"mlx-grpo": {"summary": summary(2.0)}, "trl": peer}) == {
        "mlx-grpo": "1.00",
        "trl": "0.25",
    }
    assert ratios({"mlx-grpo": {"error": "ran past 140 s"}, "trl": peer})["trl"] == "-"
