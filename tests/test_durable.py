"""Run-folder writes against real failures: a full filesystem (a small tmpfs, as root),
/dev/full, a stale step folder left by a kill, and a lock removed while being taken."""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from rich.console import Console

from mlx_grpo.checkpoint import TrainState, load_arrays, save_arrays, save_checkpoint
from mlx_grpo.durable import append_record, write_atomic
from mlx_grpo.runfolder import RunBusy, RunFolder

DEV_FULL = Path("/dev/full")


@pytest.fixture
def full_fs(tmp_path):
    """A 1 MiB tmpfs whose every byte is then taken by a ballast file: `fill()` takes
    what is left. Needs root (mount); skipped elsewhere."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)])
    if made.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")

    def fill():
        fd = os.open(mnt / "ballast", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            while True:
                os.write(fd, b"\0" * 512)
        except OSError as e:
            assert e.errno == errno.ENOSPC
        finally:
            os.close(fd)

    try:
        yield mnt, fill
    finally:
        gone = subprocess.run(["umount", "-l", str(mnt)], capture_output=True, text=True)
        assert gone.returncode == 0, f"umount {mnt}: {gone.stderr.strip()}"


def test_a_full_filesystem_keeps_the_old_file_whole_and_no_partial_copy(full_fs):
    mnt, fill = full_fs
    target = mnt / "metrics.jsonl"
    target.write_text('{"step": 1}\n')
    fill()
    with pytest.raises(OSError) as e:
        write_atomic(target, b"x" * 100_000)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(target)
    assert target.read_text() == '{"step": 1}\n'
    assert sorted(p.name for p in mnt.iterdir()) == ["ballast", "metrics.jsonl"]
    with pytest.raises(OSError) as e:
        save_arrays(mnt / "reference.safetensors", {"w": mx.zeros((10_000,))})
    assert e.value.errno == errno.ENOSPC
    assert sorted(p.name for p in mnt.iterdir()) == ["ballast", "metrics.jsonl"]


def test_a_full_filesystem_keeps_the_runs_earlier_compare_json(full_fs, tmp_path, monkeypatch):
    """compare writes compare.json beside B's adapters too; with no room there, the
    earlier one stays whole (an export's model card quotes it) and one line says so."""
    import mlx_grpo.report as report

    mnt, fill = full_fs
    run = mnt / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    earlier = json.dumps({"model_a": "default", "rows": [1, 2, 3]})
    (run / "compare.json").write_text(earlier)
    fill()
    monkeypatch.setattr(report, "plot_levels", lambda *a: None)
    said = io.StringIO()
    data = {"model_a": "default", "model_b": str(run), "rows": list(range(20_000))}
    written = report.write_outputs(
        data, None, tmp_path / "out", run, Console(file=said, width=1000)
    )
    assert written == [tmp_path / "out" / "compare.json"]
    assert json.loads(written[0].read_text()) == data
    assert (run / "compare.json").read_text() == earlier
    assert f"{run / 'compare.json'} not written (No space left on device)" in said.getvalue()
    assert sorted(p.name for p in run.iterdir()) == ["compare.json", "config.json"]


@pytest.mark.skipif(not DEV_FULL.exists(), reason="no /dev/full")
def test_writes_that_find_no_room_are_oserrors_naming_their_file():
    """MLX's own file writer says only '[write] Unable to write N bytes', which neither
    output.on_full_disk=continue nor the one-line full-disk error could recognise."""
    from mlx_grpo.checkpoint import _save_safetensors

    for write in (
        lambda: _save_safetensors(DEV_FULL, {"w": mx.ones((1000,))}),
        lambda: append_record(DEV_FULL, {"step": 1}),
    ):
        with pytest.raises(OSError) as e:
            write()
        assert e.value.errno == errno.ENOSPC and e.value.filename == str(DEV_FULL)
    assert not Path("/dev/full.safetensors").exists()


def test_arrays_written_through_python_read_back_as_mlx_wrote_them(tmp_path):
    arrays = {"a": mx.arange(12, dtype=mx.float32).reshape(3, 4), "b": mx.array([1, 2], mx.int32)}
    save_arrays(tmp_path / "x.safetensors", arrays)
    mx.save_safetensors(str(tmp_path / "y.safetensors"), arrays)
    assert (tmp_path / "x.safetensors").read_bytes() == (tmp_path / "y.safetensors").read_bytes()
    back = load_arrays(tmp_path / "x.safetensors")
    assert back.keys() == arrays.keys()
    assert all(mx.array_equal(back[k], arrays[k]).item() for k in arrays)


def _fake_step(run: Path, step: int, whole: bool = True) -> Path:
    folder = RunFolder(run).step_dir(step)
    folder.mkdir(parents=True)
    if whole:
        (folder / "state.json").write_text(json.dumps({"step": step}))
    return folder


def test_saving_prunes_older_steps_only_with_what_a_kill_left(tmp_path):
    """A save prunes only the steps before its own: never itself, whatever lies beyond
    it (step 40 here; by name it sorted after step 27, and a save there with keep_last=1
    removed the step just written). What a kill left goes: a step folder whose removal
    was cut short (no state.json), a temporary one."""
    run = tmp_path / "run"
    for step in (10, 20, 40):
        _fake_step(run, step)
    _fake_step(run, 15, whole=False)
    (run / ".tmp-step-000030").mkdir()
    model, opt = nn.Linear(3, 2), optim.Adam(1e-3)
    opt.init(model.trainable_parameters())

    def save(step, keep_last):
        state = TrainState(step, {}, {})
        return save_checkpoint(run, step, model, opt, {"rank": 1}, state, keep_last)

    assert save(27, keep_last=2) == run / "step-000027"
    assert sorted(p.name for p in run.glob("*step-*")) == [
        "step-000020",
        "step-000027",
        "step-000040",
    ]
    assert json.loads((run / "latest").read_text()) == {"step_dir": "step-000027", "step": 27}
    save(28, keep_last=1)
    assert sorted(p.name for p in run.glob("*step-*")) == ["step-000028", "step-000040"]
    for step in (29, 30, 31):
        save(step, keep_last=5)  # fewer older steps than it keeps: all stay
    assert [p.name for p in RunFolder(run).step_dirs()] == [
        "step-000028",
        "step-000029",
        "step-000030",
        "step-000031",
        "step-000040",
    ]
    save(32, keep_last=3)
    assert [p.name for p in RunFolder(run).step_dirs()] == [
        "step-000030",
        "step-000031",
        "step-000032",
        "step-000040",
    ]


def test_step_0_the_warm_start_outlives_every_prune_unless_a_kill_tore_it(tmp_path):
    """Step 0 holds the warm start's adapters, the baseline of `compare --a <run>@0`:
    saves with keep_last=1 keep it besides their own step; a step 0 that a kill left
    without its state.json is pruned like any other."""
    model, opt = nn.Linear(3, 2), optim.Adam(1e-3)
    opt.init(model.trainable_parameters())

    def save(run, step):
        return save_checkpoint(run, step, model, opt, {"rank": 1}, TrainState(step, {}, {}), 1)

    run = tmp_path / "run"
    for step in (0, 10, 20, 30):
        save(run, step)
    assert [p.name for p in RunFolder(run).step_dirs()] == ["step-000000", "step-000030"]
    torn = tmp_path / "torn"
    _fake_step(torn, 0, whole=False)
    save(torn, 10)
    assert sorted(p.name for p in torn.glob("*step-*")) == ["step-000010"]


def test_a_step_saved_whose_latest_cannot_be_written_is_said_to_be_saved(tmp_path, monkeypatch):
    """The step folder is in place; only `latest` found no room. The error says so (not
    that the step before is the one intact), a resume takes the step, and under
    output.on_full_disk=continue the run goes on without claiming to have lost it."""
    import mlx_grpo.checkpoint as ckpt
    from mlx_grpo.checkpoint import CheckpointError
    from mlx_grpo.runstate import unless_full_disk

    run = tmp_path / "run"
    model, opt = nn.Linear(3, 2), optim.Adam(1e-3)
    opt.init(model.trainable_parameters())

    def save(step):
        return save_checkpoint(run, step, model, opt, {}, TrainState(step, {}, {}), 3)

    save(1)
    write_json = ckpt._write_json

    def no_room_for_latest(path, data):
        if path.name == "latest":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        write_json(path, data)

    monkeypatch.setattr(ckpt, "_write_json", no_room_for_latest)
    with pytest.raises(CheckpointError) as e:
        save(2)
    assert str(e.value) == (
        f"checkpoint: {run / 'step-000002'} is saved, but `latest` or the run's copy of its "
        "adapters could not be updated: No space left on device (a resume mends them)"
    )
    assert RunFolder(run).latest_step_dir() == run / "step-000002"
    said = []
    assert unless_full_disk(lambda: save(3), True, said.append, "this checkpoint") is None
    assert said == [
        f"checkpoint: {run / 'step-000003'} is saved, but `latest` or the run's copy of its "
        "adapters could not be updated: No space left on device (a resume mends them); "
        "going on (output.on_full_disk=continue)"
    ]


def test_the_newest_complete_step_folder_is_the_latest_whatever_latest_says(tmp_path):
    run = tmp_path / "run"
    for step in (999_999, 1_000_000):
        _fake_step(run, step)
    _fake_step(run, 1_000_001, whole=False)
    (run / "latest").write_text(json.dumps({"step_dir": "step-999999", "step": 999_999}))
    folder = RunFolder(run)
    assert folder.latest_step_dir() == run / "step-1000000"
    assert [p.name for p in folder.step_dirs()] == ["step-999999", "step-1000000"]


def test_the_adapters_of_a_run_are_its_newest_steps_until_they_are_published(tmp_path):
    """A kill after step 2's folder, before `latest` and the run's copy of its adapters
    moved: export and compare read step 2's adapters from its folder, not the run's copy
    of step 1's under step 2's name."""
    from mlx_grpo.checkpoint import publish

    run = tmp_path / "run"
    for step in (1, 2):
        folder = _fake_step(run, step)
        (folder / "adapters.safetensors").write_bytes(b"step %d" % step)
        (folder / "adapter_config.json").write_text("{}")
    publish(run / "step-000001")
    assert RunFolder(run).adapters_dir() == run / "step-000002"
    assert RunFolder.saved_step(RunFolder(run).adapters_dir()) == 2
    publish(run / "step-000002")
    assert RunFolder(run).adapters_dir() == run
    assert (run / "adapters.safetensors").read_bytes() == b"step 2"
    assert RunFolder.saved_step(run) == 2


def test_a_lock_released_while_another_process_takes_it_is_not_taken_alone(tmp_path, monkeypatch):
    """A start that failed early removes the run's empty folder and its `.lock`; a
    second start that had already opened that `.lock` must not end up holding a lock
    on a file nobody else can see, which a third start would then take too."""
    import fcntl

    folder = RunFolder(tmp_path / "run")
    first = folder.hold()
    flock = fcntl.flock
    calls = []

    def released_meanwhile(fd, op):
        calls.append(fd)
        if len(calls) == 1:
            folder.release(first)  # between the second start's open and its flock
        flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", released_meanwhile)
    second = folder.hold()
    monkeypatch.setattr(fcntl, "flock", flock)
    assert len(calls) == 2  # it took the lock again, on the new file
    lock = os.stat(folder.path / RunFolder.LOCK)
    assert (os.fstat(second).st_ino, os.fstat(second).st_dev) == (lock.st_ino, lock.st_dev)
    with pytest.raises(RunBusy, match="being trained by another process"):
        folder.hold()
    folder.release(second)
    assert not folder.path.exists()
