"""The vocabulary-wide ops of a step, each alone at the work unit's shapes.

    python -m mlx_grpo.bench.ops [--rows 16] [--vocab 49152] [--reps 20]

Times `mx.exp`, `fastmath.exp` and NumPy's exp, the two categorical samplers and
`mx.logsumexp` over a [rows, vocab] float32 array (16 rows: one decode step of B=2 x
G=8), and the best of `--reps` runs of each, with its ratio to `mx.exp`. It shows what
the elementwise column of `make bench`'s profile is made of on this machine.
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np

from mlx_grpo import fastmath
from mlx_grpo.bench.floor import _best


def op_times(rows: int, vocab: int, reps: int) -> dict[str, float]:
    """Best seconds per call of each op over `reps` runs."""
    x = mx.random.normal((rows, vocab)) * 4.0
    mx.eval(x)
    xn = np.array(x)
    key = mx.random.key(0)
    ops = {
        "mx.exp": lambda: mx.eval(mx.exp(x)),
        "fastmath.exp": lambda: mx.eval(fastmath.exp(x)),
        "numpy exp": lambda: np.exp(xn),
        "mx.random.categorical": lambda: mx.eval(mx.random.categorical(x, key=key)),
        "fastmath.categorical": lambda: mx.eval(fastmath.categorical(x, key)),
        "mx.logsumexp": lambda: mx.eval(mx.logsumexp(x, axis=-1)),
    }
    return {name: _best(fn, reps) for name, fn in ops.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    times = op_times(args.rows, args.vocab, args.reps)
    base = times["mx.exp"]
    print(f"[{args.rows}, {args.vocab}] float32 on {mx.default_device()}, best of {args.reps}")
    print(f"{'op':<24}{'ms':>8}{'x mx.exp':>10}")
    for name, t in times.items():
        print(f"{name:<24}{t * 1e3:>8.2f}{t / base:>10.2f}")


if __name__ == "__main__":
    main()
