"""What `make install` checks first, with the Python that will make the venv: the
Python version, and on Linux the C library MLX's wheels are built for (manylinux 2.35:
glibc 2.35 or newer). Each problem is one line; exit status 1 when there is one. Runs
before anything is installed: the standard library only."""

from __future__ import annotations

import os
import sys

GLIBC = (2, 35)  # mlx-cpu's wheels: manylinux_2_35 (x86_64 and aarch64)


def problems(version=sys.version_info, platform=sys.platform, libc=None) -> list[str]:
    """What stops the install on this machine (`libc`: os.confstr's answer, for tests).

    >>> problems((3, 9, 18), "linux", "glibc 2.36")[0][:40]
    'Python 3.9 is too old: mlx-grpo needs 3.'
    >>> problems((3, 11, 7), "linux", "glibc 2.31")[0][:48]
    "MLX's Linux wheels need glibc 2.35 or newer; thi"
    >>> problems((3, 12, 1), "linux", "glibc 2.36"), problems((3, 12, 1), "darwin", None)
    ([], [])
    """
    out = []
    if tuple(version[:2]) < (3, 10):
        out.append(
            f"Python {version[0]}.{version[1]} is too old: mlx-grpo needs 3.10 or newer "
            "(make install PYTHON=python3.11, say)"
        )
    if platform.startswith("linux"):
        if libc is None:
            try:
                libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
            except (ValueError, OSError):  # not glibc: musl (Alpine), say
                libc = ""
        parts = libc.split()
        try:
            have = tuple(int(x) for x in parts[1].split(".")[:2]) if parts[0] == "glibc" else None
        except (IndexError, ValueError):
            have = None
        if have is None or have < GLIBC:
            which = f"this system has {libc}" if have else "this system's C library is not glibc"
            out.append(
                f"MLX's Linux wheels need glibc {GLIBC[0]}.{GLIBC[1]} or newer; {which} "
                "(Ubuntu 22.04, Debian 12, Fedora 36 and later have it)"
            )
    return out


if __name__ == "__main__":
    found = problems()
    for line in found:
        print(f"mlx-grpo: {line}", file=sys.stderr)
    sys.exit(1 if found else 0)
