"""The layout of a run folder, in one place (no MLX: compare, export and plot read runs
without loading a model).

    checkpoints/<run>/
      config.json                 the run's full config
      adapters.safetensors        latest adapters  } mlx_lm.load(model, adapter_path=<run>)
      adapter_config.json                          }
      latest                      {"step_dir", "step"} of the newest complete step folder
      step-000020/                adapters, adapter_config.json, optimizer.safetensors,
                                  state.json (step, counters, curriculum)
      .tmp-step-000020/           a step folder being written (renamed when complete)
      metrics.jsonl, samples.jsonl, eval.jsonl
      trackers.json               output.report_to: the tracker run id and where its logs are
      tensorboard/, wandb/        those trackers' own files (trackio keeps a store of its own)
      compare.json                the last `python -m mlx_grpo.compare` with this run as B
                                  (a step folder holds its own: B named as RUN@step)
      export-<format>/            `python -m mlx_grpo export` output
      .lock                       flock'ed by the process training the run (its pid)

A checkpoint is named on the command line as the run folder (its latest step), one of
its step folders, or `RUN@step-000020` / `RUN@20`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

STEP_PREFIX = "step-"

# Run locks this process holds (`RunFolder.hold`). A child it forks without exec (a
# reward's multiprocessing pool) closes its copies at once, so workers that outlive a
# killed run do not keep the run "being trained".
_held: set[int] = set()


def _drop_held_in_child() -> None:
    while _held:
        os.close(_held.pop())  # not LOCK_UN: that would release the parent's lock too


os.register_at_fork(after_in_child=_drop_held_in_child)


def step_name(step: int) -> str:
    """20 -> 'step-000020'."""
    return f"{STEP_PREFIX}{step:06d}"


def step_of(name: str) -> int | None:
    """'step-000020' -> 20; None for any other name. Read from the name alone, so that
    ranks without a copy of the folder agree on it."""
    tail = name[len(STEP_PREFIX) :] if name.startswith(STEP_PREFIX) else ""
    return int(tail) if tail.isascii() and tail.isdigit() else None


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` is still the file open as `fd`."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino)


class RunBusy(RuntimeError):
    """Another process is training the run; one line."""


@dataclass(frozen=True)
class RunFolder:
    """A run folder <output.dir>/<run>/. Constructing one touches no file."""

    path: Path

    CONFIG = "config.json"
    ADAPTERS = "adapters.safetensors"
    ADAPTER_CONFIG = "adapter_config.json"
    OPTIMIZER = "optimizer.safetensors"
    STATE = "state.json"
    LATEST = "latest"
    METRICS = "metrics.jsonl"
    SAMPLES = "samples.jsonl"
    EVAL = "eval.jsonl"
    COMPARE = "compare.json"
    WARMSTART = "warmstart.json"
    REFERENCE = "reference.safetensors"
    START = "start.partial"  # the start of a run before its first checkpoint
    LOCK = ".lock"

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))

    def __str__(self) -> str:
        return str(self.path)

    @property
    def name(self) -> str:
        return self.path.name

    def hold(self, warn=print) -> int:
        """Claim the run for this process: an exclusive flock on its `.lock` (made with
        the folder), released when the returned descriptor is closed or the process
        ends, however it ends. RunBusy when another process holds it; OSError when the
        folder cannot be written. A filesystem without flock (NFS without its lock
        daemon, some FUSE mounts) trains unlocked, with a `warn`ing."""
        import errno
        import fcntl

        lock = self.path / self.LOCK
        for _ in range(8):
            self.path.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
            except FileNotFoundError:  # `release` removed the folder after the mkdir
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
                    raise RunBusy(
                        f"output.run: {self.path} is being trained by another process (pid "
                        f"{holder}); wait for it to end, or stop it, before training it again"
                    ) from None
                except OSError as e:
                    if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                        raise
                    warn(
                        f"warning: {lock} cannot be locked here ({e.strerror}): "
                        "make sure no other process trains this run meanwhile"
                    )
                if not _same_file(fd, lock):  # `release` removed it between open and flock
                    os.close(fd)
                    continue
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
            except BaseException:
                os.close(fd)
                raise
            _held.add(fd)
            return fd
        raise RunBusy(f"output.run: {lock} was removed again and again while this process took it")

    def release(self, fd: int) -> None:
        """Close `hold`'s descriptor (the flock goes with it); a folder that holds nothing
        but the lock, a start that failed before it wrote anything, is removed first,
        while the lock is still held (a `hold` that opened the file meanwhile sees it
        gone and takes a new one)."""
        import contextlib

        if fd not in _held:  # a forked child's: the hook closed it already
            return
        _held.remove(fd)
        try:
            with contextlib.suppress(OSError):
                if os.listdir(self.path) == [self.LOCK]:
                    (self.path / self.LOCK).unlink()
                    self.path.rmdir()
        finally:
            os.close(fd)

    @property
    def config_file(self) -> Path:
        return self.path / self.CONFIG

    @property
    def adapters_file(self) -> Path:
        return self.path / self.ADAPTERS

    @property
    def latest_file(self) -> Path:
        return self.path / self.LATEST

    @property
    def metrics_file(self) -> Path:
        return self.path / self.METRICS

    @property
    def samples_file(self) -> Path:
        return self.path / self.SAMPLES

    @property
    def eval_file(self) -> Path:
        return self.path / self.EVAL

    @property
    def compare_file(self) -> Path:
        return self.path / self.COMPARE

    @property
    def warmstart_file(self) -> Path:
        return self.path / self.WARMSTART

    @property
    def reference_file(self) -> Path:
        return self.path / self.REFERENCE

    @property
    def start_dir(self) -> Path:
        return self.path / self.START

    @property
    def logs(self) -> tuple[Path, Path, Path]:
        """The per-step logs a resumed run cuts back to its checkpoint's step."""
        return self.metrics_file, self.samples_file, self.eval_file

    def export_dir(self, fmt: str) -> Path:
        return self.path / f"export-{fmt}"

    def step_dir(self, step: int) -> Path:
        return self.path / step_name(step)

    def tmp_step_dir(self, step: int) -> Path:
        return self.path / f".tmp-{step_name(step)}"

    def step_dirs(self, complete: bool = True) -> list[Path]:
        """Step folders by step; `complete`: only those holding their state.json."""
        dirs = (p for p in self.path.glob(f"{STEP_PREFIX}*") if p.is_dir())
        dirs = (p for p in dirs if step_of(p.name) is not None)
        return sorted(
            (p for p in dirs if not complete or (p / self.STATE).exists()),
            key=lambda p: step_of(p.name),
        )

    def latest_named(self) -> str | None:
        """The step folder `latest` names, or None when it cannot be read."""
        try:
            name = json.loads(self.latest_file.read_text())["step_dir"]
            return name if isinstance(name, str) else None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def latest_step_dir(self) -> Path | None:
        """The newest complete step folder, or None. `latest` names it, unless a kill
        came between its rename into place and `latest` (a resume mends that)."""
        dirs = self.step_dirs()
        return dirs[-1] if dirs else None

    def adapters_dir(self) -> Path:
        """Where the run's latest adapters are: the newest step folder where the run's
        own copy is missing, or a kill came before `latest` and that copy were updated
        to it; else the copy (also before any checkpoint, with no readable `latest`, or
        where `latest`'s step folder was removed since)."""
        files = (self.ADAPTERS, self.ADAPTER_CONFIG)
        own = all((self.path / f).is_file() for f in files)
        newest = self.latest_step_dir()
        named = step_of(self.latest_named() or "")
        if newest is None or (own and (named is None or named > step_of(newest.name))):
            return self.path
        try:
            same = own and named == step_of(newest.name)
            same = same and all(
                (self.path / f).read_bytes() == (newest / f).read_bytes() for f in files
            )
        except OSError:  # (pruned meanwhile by a run that goes on)
            return self.path
        return self.path if same else newest

    def find_step(self, ref: str) -> Path | None:
        """The step folder `ref` names ('20' or 'step-000020'), if it exists."""
        name = step_name(int(ref)) if ref.isdigit() else ref
        folder = self.path / name
        return folder if step_of(name) is not None and folder.is_dir() else None

    def write_config(self, cfg) -> None:
        """config.json from a pydantic RunConfig."""
        from mlx_grpo.durable import write_atomic

        self.path.mkdir(parents=True, exist_ok=True)
        write_atomic(self.config_file, cfg.model_dump_json(indent=2) + "\n")

    @classmethod
    def is_run(cls, path: Path) -> bool:
        """A run folder's config.json is a whole run config (a model's is not)."""
        try:
            config = json.loads((Path(path) / cls.CONFIG).read_text())
            return isinstance(config, dict) and isinstance(config.get("model"), dict)
        except (OSError, ValueError):
            return False

    @classmethod
    def holding(cls, path: Path) -> tuple[RunFolder, Path] | None:
        """(the run, the folder with the adapters) for a run folder or one of its step
        folders; None for anything else."""
        path = Path(path)
        if step_of(path.name) is not None and cls.is_run(path.parent):
            return cls(path.parent), path
        if cls.is_run(path):
            return cls(path), path
        return None

    @classmethod
    def saved_step(cls, folder: Path) -> int | None:
        """The step a step folder (its state.json) or a run folder (its `latest`)
        holds, or None when there is none to read."""
        name = cls.STATE if Path(folder).name.startswith(STEP_PREFIX) else cls.LATEST
        try:
            return int(json.loads((Path(folder) / name).read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
