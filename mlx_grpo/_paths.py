"""Where mlx-grpo keeps what it makes once per machine (converted models, BLAS verdicts)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_root() -> Path:
    """`$MLX_GRPO_CACHE`, or ~/.cache/mlx-grpo; where there is no home to write in (HOME
    unset for a uid with no passwd entry, HOME=/ for a container's random uid), a folder
    of this user's own in the temporary directory."""
    if os.environ.get("MLX_GRPO_CACHE"):
        return Path(os.environ["MLX_GRPO_CACHE"])
    try:
        home = Path.home()
    except (RuntimeError, KeyError):
        home = None
    if home is not None and _writable_under(home):
        return home / ".cache" / "mlx-grpo"
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"mlx-grpo-{uid}"


def _writable_under(home: Path) -> bool:
    """Whether the cache can be made under `home`: its deepest existing part of
    .cache/mlx-grpo is a folder this process may write in."""
    path = home / ".cache" / "mlx-grpo"
    while not path.exists():
        if path == path.parent:
            return False
        path = path.parent
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)
