"""Data-parallel GRPO: two ranks on localhost (mlx.launch, ring backend) against one
process, on the tiny model. Each rank runs from its own folder (tests/dist_rank.py), as
if on a machine of its own, so a file written by rank 1 would show up in its folder."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from conftest import assert_f32_close, f32_tolerance, tiny_additions

from mlx_grpo.cli import cmd_train
from mlx_grpo.log import PROCESS_METRICS

TESTS = Path(__file__).parent
TOY = TESTS / "data" / "toy"
LAUNCH = Path(sys.executable).parent / "mlx.launch"
PROCESS = PROCESS_METRICS + ("dist/",)


def _free_port_pair() -> int:
    """A port p with p and p + 1 free (the ring backend listens on one per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def _launch(root: Path, *args: str, ok: bool = True, **env_extra: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), *sys.path])}
    env.update(env_extra)
    cmd = [str(LAUNCH), "--backend", "ring", "-n", "2", "--starting-port"]
    cmd += [str(_free_port_pair()), "--", sys.executable, str(TESTS / "dist_rank.py")]
    done = subprocess.run(
        [*cmd, str(root), "train", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    out = done.stdout + done.stderr
    # mlx.launch exits 0 even when a rank fails: look at what the ranks said.
    if ok:
        assert "exited with code" not in out and "done: adapters" in out, out
    return out


def _run_args(model_dir, *extra) -> list[str]:
    # Four tasks in shuffled epochs, two per step (one group per rank); task 0's
    # rewards all raise (scored 0), so its group has no variance and is left out.
    return [
        "--recipe",
        str(TOY),
        f"--model.path={model_dir}",
        "--recipe.train_size=4",
        '--recipe.params={"explode_every": 4}',
        "--curriculum.strategy=uniform",
        "--optimizer.learning_rate=1e-3",
        "--train.steps=4",
        "--train.seed=5",
        "--train.sample_every=1",
        "--output.save_every=4",
        *extra,
    ]


def _metrics(run: Path) -> list[dict]:
    rows = _jsonl(run / "metrics.jsonl")
    return [{k: v for k, v in r.items() if not k.startswith(PROCESS)} for r in rows]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _adapters(path: Path) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in mx.load(str(path)).items()}


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_two_ranks_match_one_process_and_resume(tiny_model_dir, tmp_path):
    # One process, no launcher.
    single = tmp_path / "single"
    assert cmd_train(_run_args(tiny_model_dir, f"--output.dir={single}", "--output.run=r")) == 0

    # Two ranks; relative output dirs land in each rank's own folder.
    two = tmp_path / "two"
    out = _launch(two, *_run_args(tiny_model_dir, "--output.dir=ckpt", "--output.run=r"))
    assert out.count("step 4/4") == 1  # only rank 0 prints
    run = two / "rank0" / "ckpt" / "r"
    assert list((two / "rank1").iterdir()) == []  # rank 1 writes nothing

    # Both ranks hold the same adapters; one process that ran the same global batch
    # with the same seeds ends within float tolerance of them.
    a0 = _adapters(two / "adapters-rank0.safetensors")
    _same(_adapters(two / "adapters-rank1.safetensors"), a0)
    _same(_adapters(run / "adapters.safetensors"), a0)
    ref = _adapters(single / "r" / "adapters.safetensors")
    assert ref.keys() == a0.keys()
    assert any(np.abs(v).max() > 0 for k, v in ref.items() if k.endswith("lora_b"))
    # Each of the 4 steps sums the same terms in another order (two shares, then the
    # all_sum); AdamW's normalised step carries a gradient's relative error through.
    n = 4 * tiny_additions(json.loads((tiny_model_dir / "config.json").read_text()))
    for k in ref:
        assert_f32_close(a0[k], ref[k], n, k)

    # Same samples, rewards and decisions; losses and norms within float tolerance. Loss
    # and KL are means of O(1) terms (normalised advantages, ratios near 1) that cancel,
    # so their error is relative to 1 where they are smaller than 1.
    m1, m2 = _metrics(single / "r"), _metrics(run)
    for r1, r2 in zip(m1, m2, strict=True):
        assert r1.keys() == r2.keys()
        for k in r1:
            bound = f32_tolerance(n) * max(1.0, abs(r2[k]))
            assert abs(r1[k] - r2[k]) <= bound, (r1["step"], k, r1[k], r2[k])
    samples, alone = _jsonl(run / "samples.jsonl"), _jsonl(single / "r" / "samples.jsonl")
    # Each completion's sampling entropy: its logits, from batches of other sizes.
    entropies = [[r.pop("entropy") for r in rows] for rows in (samples, alone)]
    assert samples == alone
    assert_f32_close(*entropies, n, "entropy")
    # With seed 5, task 0's group is rank 0's only group at step 1 and rank 1's at
    # step 3 (a rank with nothing to train still joins the exchange); at steps 2 and
    # 4 both ranks train (each divides by the whole batch's token count).
    order = [s["task"] for s in samples][::4]  # each group's first sample, by rank
    assert order[0] == order[5] == "train-5-0", order
    assert [r["groups/discarded"] for r in m2] == [1, 0, 1, 0]

    # A 2-rank run stopped after step 1 resumes (rank 1 has no copy of the run folder:
    # rank 0 sends it the checkpoint) and ends exactly where the uninterrupted one did.
    _launch(
        two,
        *_run_args(tiny_model_dir, "--output.dir=ckpt", "--output.run=s", "--train.token_budget=1"),
    )
    assert [r["step"] for r in _metrics(two / "rank0" / "ckpt" / "s")] == [1]
    out = _launch(two, "--resume", "ckpt/s", "--train.token_budget=0")
    assert out.count("resuming from step-000001") == 1
    assert list((two / "rank1").iterdir()) == []
    assert _metrics(two / "rank0" / "ckpt" / "s") == m2
    _same(_adapters(two / "rank0" / "ckpt" / "s" / "adapters.safetensors"), a0)
    _same(_adapters(two / "adapters-rank1.safetensors"), a0)


def test_a_full_disk_on_rank_0_stops_every_rank(tiny_model_dir, tmp_path):
    """Rank 0 alone writes the logs. When its disk fills at step 2's metrics record,
    rank 1 stops with it, told so, rather than in the next exchange (the ring backend
    then fails with a traceback; a backend that does not notice the peer is gone waits
    forever): rank 0 says the one-line error, and the run resumes from its step-1
    checkpoint once there is room."""
    two = tmp_path / "two"
    args = _run_args(tiny_model_dir, "--output.dir=ckpt", "--output.run=r", "--output.save_every=1")
    out = _launch(two, *args, ok=False, DIST_RANK_NO_ROOM="metrics.jsonl:2")
    assert out.count("metrics.jsonl: No space left on device") == 1, out
    assert "Traceback" not in out and "done: adapters" not in out, out
    run = two / "rank0" / "ckpt" / "r"
    assert [r["step"] for r in _metrics(run)] == [1]
    out = _launch(two, "--resume", "ckpt/r")
    assert out.count("resuming from step-000001") == 1
    assert [r["step"] for r in _metrics(run)] == [1, 2, 3, 4]


COLLECTIVES = """
import json, sys
import mlx.core as mx
from mlx_grpo.dist import Dist, RankZeroError

d = Dist()
r = d.rank
tree = {"a": [mx.full((2, 3), r + 1.0)], "b": mx.array([r + 0.5], dtype=mx.bfloat16),
        "n": mx.array([r + 1], dtype=mx.int32)}
s = d.sum_tree(tree)
sent = d.broadcast_arrays(
    {"w": mx.arange(5, dtype=mx.float32) - 2, "step": mx.array([7], dtype=mx.uint64)}
    if r == 0 else None
)
def fail():
    raise ValueError("rank 0 says no")
try:
    d.run_on_main(fail)
    err = None
except (ValueError, RankZeroError) as e:
    err = [type(e).__name__, str(e)]
out = {
    "share": list(d.share(5)),
    "sum": [s["a"][0].tolist(), s["b"].astype(mx.float32).tolist(), s["n"].tolist()],
    "gather": d.gather({"rank": r, "text": "x" * (3 * r + 1)}),
    "broadcast": d.broadcast({"from": r}),
    "arrays": {k: [v.tolist(), str(v.dtype)] for k, v in sent.items()},
    "error": err,
}
print("RESULT", r, json.dumps(out), flush=True)
"""


def test_collectives_over_two_ranks(tmp_path):
    script = tmp_path / "collectives.py"
    script.write_text(COLLECTIVES)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), *sys.path])}
    cmd = [str(LAUNCH), "--backend", "ring", "-n", "2", "--starting-port"]
    cmd += [str(_free_port_pair()), "--", sys.executable, str(script)]
    done = subprocess.run(
        cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=120
    )
    lines = [ln.split(" ", 2) for ln in done.stdout.splitlines() if ln.startswith("RESULT")]
    got = {int(rank): json.loads(body) for _, rank, body in lines}
    assert sorted(got) == [0, 1], done.stdout + done.stderr
    assert got[0]["share"] == [0, 1] and got[1]["share"] == [2, 3, 4]
    for r in (0, 1):
        g = got[r]
        assert g["sum"] == [[[3.0] * 3] * 2, [2.0], [3]]  # 1+2, 0.5+1.5, 1+2
        assert g["gather"] == [{"rank": 0, "text": "x"}, {"rank": 1, "text": "xxxx"}]
        assert g["broadcast"] == {"from": 0}
        assert g["arrays"] == {
            "w": [[-2.0, -1.0, 0.0, 1.0, 2.0], "mlx.core.float32"],
            "step": [[7], "mlx.core.uint64"],
        }
    assert got[0]["error"] == ["ValueError", "rank 0 says no"]
    assert got[1]["error"] == ["RankZeroError", "rank 0 says no"]


def test_two_ranks_guide_the_groups_one_process_guides(tiny_model_dir, tmp_path):
    """guidance.enabled under two ranks: each rank plays the demonstrations of its own
    groups and reports their rows in the whole batch, so the update is one process's."""
    args = ["--recipe", str(TESTS / "data" / "toy_guided"), f"--model.path={tiny_model_dir}"]
    args += ["--guidance.enabled=true", "--train.steps=2", "--curriculum.strategy=uniform"]
    single = tmp_path / "single"
    assert cmd_train([*args, f"--output.dir={single}", "--output.run=r"]) == 0
    two = tmp_path / "two"
    _launch(two, *args, "--output.dir=ckpt", "--output.run=r")
    m1, m2 = _metrics(single / "r"), _metrics(two / "rank0" / "ckpt" / "r")
    assert [r["guidance/groups"] for r in m1] == [r["guidance/groups"] for r in m2] == [2, 2]
    assert [r["groups/trained"] for r in m2] == [2, 2]
    a0, ref = (
        _adapters(two / "adapters-rank0.safetensors"),
        _adapters(single / "r" / "adapters.safetensors"),
    )
    n = 2 * tiny_additions(json.loads((tiny_model_dir / "config.json").read_text()))
    for k in ref:
        assert_f32_close(a0[k], ref[k], n, k)


def test_two_ranks_warm_start_as_one_process(tiny_model_dir, tmp_path):
    """train.sft_steps under two ranks: each takes half of a step's demonstrations over
    the whole step's token count, so the NLL and the adapters are one process's."""
    args = ["--recipe", str(TESTS / "data" / "toy_env"), f"--model.path={tiny_model_dir}"]
    args += ["--train.sft_steps=2", "--train.sft_batch_size=4", "--train.steps=1"]
    args += ["--curriculum.strategy=uniform", "--train.eval_every=0"]
    single = tmp_path / "single"
    assert cmd_train([*args, f"--output.dir={single}", "--output.run=r"]) == 0
    two = tmp_path / "two"
    _launch(two, *args, "--output.dir=ckpt", "--output.run=r")
    w1 = json.loads((single / "r" / "warmstart.json").read_text())
    w2 = json.loads((two / "rank0" / "ckpt" / "r" / "warmstart.json").read_text())
    n = 2 * tiny_additions(json.loads((tiny_model_dir / "config.json").read_text()))
    assert w1["levels"] == w2["levels"]
    assert_f32_close(w2["nll"], w1["nll"], n, "nll")
    a0, ref = (
        _adapters(two / "adapters-rank0.safetensors"),
        _adapters(single / "r" / "adapters.safetensors"),
    )
    for k in ref:
        assert_f32_close(a0[k], ref[k], n, k)
