"""Writes that survive a kill -9 or a power cut at any instant.

Every file of a run folder is written in one of two ways:
- whole files (config, checkpoints, `latest`): `write_atomic` writes a temporary file
  beside the target, fsyncs it, renames it over the target and fsyncs the folder, so a
  reader sees the old file or the new one, never a mix;
- logs (`*.jsonl`): `append_record` adds one line with a single `write` on a file opened
  for appending, then fsyncs. A crash can still leave a torn last line; `read_jsonl`
  skips it and `cut_jsonl` (on resume) drops it, saying so in one line, and rewrites
  the log atomically, never in place.

`MLX_GRPO_CRASH_AT=N` (fault-injection tests only) ends the process with `os._exit(137)`
at the N-th write point counted from 1: each write above has three (before it starts,
halfway through its data, after it is complete); a checkpoint's safetensors files have
two (halfway, after) and the rename of its folder into place one.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path

# The errnos of a write that found no room: a full disk, or a quota reached.
FULL_DISK = (errno.ENOSPC, errno.EDQUOT)

_points = 0


def crash_point() -> None:
    """A place where the fault-injection tests may end the process (see the module)."""
    global _points
    at = os.environ.get("MLX_GRPO_CRASH_AT")
    if not at:
        return
    _points += 1
    if _points == int(at):
        os._exit(137)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable (no-op where folders cannot be
    opened, e.g. Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    half = len(view) // 2
    written = 0
    while written < len(view):
        end = len(view) if written >= half else half
        written += os.write(fd, view[written:end])
        if written == half:
            crash_point()  # inside the write: half of the data is in the file


def _write_synced(path: Path, data: bytes, flags: int) -> None:
    """Open `path` with `flags`, write `data` (a crash point halfway), fsync, close. An
    OSError names `path` (os.write's own names no file)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise


def write_new(path: Path, data: bytes) -> None:
    """`path` created or truncated, then `data` written and fsynced (a crash point
    halfway): for files that become visible only when their folder is renamed or they
    are (`write_atomic`)."""
    _write_synced(path, data, os.O_TRUNC)


def write_failed(e: BaseException) -> bool:
    """A failed write, as a full disk gives: Python's OSError, or MLX's RuntimeError
    ('[write] Unable to write 3835 bytes to file.')."""
    if isinstance(e, OSError):
        return True
    return type(e) is RuntimeError and str(e).startswith("[write]")


def check_writable(folder: Path) -> None:
    """OSError unless a file can be made in `folder` (created with its parents for the
    trial, and removed again if it was made for it)."""
    folder = Path(folder)
    made = [p for p in (folder, *folder.parents) if not p.exists()]  # innermost first
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    finally:
        for p in made:
            if p.is_dir() and not any(p.iterdir()):
                p.rmdir()


def write_atomic(path: Path, data: bytes | str) -> None:
    """Replace `path` with `data`: the old contents or the new, whatever happens."""
    path = Path(path)
    data = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.tmp")
    crash_point()
    try:
        _write_synced(tmp, data, os.O_TRUNC)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)  # (a partial copy would hold space a full disk lacks)
        if isinstance(e, OSError) and e.filename == str(tmp):
            raise OSError(e.errno, e.strerror, str(path)) from None  # the file meant
        raise
    fsync_dir(path.parent)
    crash_point()


def append_record(path: Path, record: dict) -> None:
    """Append `record` as one JSON line (one write call), then fsync."""
    crash_point()
    _write_synced(path, (json.dumps(record) + "\n").encode(), os.O_APPEND)
    crash_point()


def read_jsonl(path: Path) -> tuple[list[dict], int]:
    """(the records of a JSONL log, how many lines were unreadable and skipped): a
    torn last line from a crash, or a line that is not a JSON object."""
    records, bad = [], 0
    try:
        text = Path(path).read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(rec, dict):
            records.append(rec)
        else:
            bad += 1
    return records, bad


def cut_jsonl(path: Path, max_step: int) -> str | None:
    """Keep the records of steps up to `max_step` (a resumed run's checkpoint) and drop
    unreadable lines; rewrite the log atomically when that changes it. Returns a
    one-line note when lines were dropped as unreadable, else None."""
    path = Path(path)
    if not path.exists():
        return None
    raw = path.read_bytes()
    records, bad = read_jsonl(path)
    keep = [r for r in records if r.get("step", 0) <= max_step]
    data = "".join(json.dumps(r) + "\n" for r in keep).encode()
    if data != raw:
        write_atomic(path, data)
    if bad:
        return f"{path}: dropped {bad} unreadable line(s) (a record torn by a crash)"
    return None
