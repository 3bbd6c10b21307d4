"""The vocabulary-wide ops of a step, each alone at the work unit's shapes.

    python -m mlx_grpo.bench.ops [--rows 16] [--vocab 49152] [--reps 20] [--context 1024]
                                 [--skinny-rows 1,4,8,16,32]

Times `mx.exp`, `fastmath.exp` and NumPy's exp, the two categorical samplers and
`mx.logsumexp` over a [rows, vocab] float32 array (16 rows: one decode step of B=2 x
G=8), and the best of `--reps` runs of each, with its ratio to `mx.exp`. It shows what
the elementwise column of `make bench`'s profile is made of on this machine. Then one
layer's causal attention over `--context` tokens (the embedded model's 9 query and 3
key heads of 64), forward and with its gradient: MLX's
`mx.fast.scaled_dot_product_attention` and `fastmath.attention`. Last, the linear layers of
a decode step at `--skinny-rows` rows through the skinny-GEMM front (`mlx_grpo.cpu.skinny`)
and through the BLAS alone, where the front is in use.
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np

from mlx_grpo import fastmath
from mlx_grpo.bench.floor import _best
from mlx_grpo.device import blas_in_use, linux_cpu


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


def attention_times(context: int, reps: int) -> dict[str, float]:
    """Best seconds per call of one causal attention layer, [1, 9, context, 64] queries
    on 3 key heads, forward and forward + gradient, MLX's and fastmath's."""
    q = mx.random.normal((1, 9, context, 64))
    k, v = mx.random.normal((1, 3, context, 64)), mx.random.normal((1, 3, context, 64))
    mx.eval(q, k, v)
    scale = 64**-0.5

    def mlx_sdpa(q, k, v):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")

    def fast(q, k, v):
        return fastmath.attention(q, k, v, scale, "causal")

    out = {}
    for name, fn in (("mx.fast.sdpa", mlx_sdpa), ("fastmath.attention", fast)):
        grad = mx.grad(lambda q, k, v, fn=fn: fn(q, k, v).sum(), argnums=(0, 1, 2))
        out[f"{name} forward"] = _best(lambda fn=fn: mx.eval(fn(q, k, v)), reps)
        out[f"{name} + gradient"] = _best(lambda g=grad: mx.eval(g(q, k, v)), reps)
    return out


# One layer of the embedded model (SmolLM2-135M) as (out, in): q, k, v, o, gate, up, down.
LAYER = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))


def skinny_times(rows: list[int], reps: int, layers: int = 30) -> dict[int, tuple[float, float]]:
    """{rows: (front s, BLAS s)}: the best of `reps` runs of every linear layer's product
    in a decode step of the embedded model (`layers` x LAYER and the [49152, 576] output
    head, each weight its own array, so read from memory as in decode) at each row count,
    through the skinny-GEMM front and with every call sent to the BLAS; {} without a
    front."""
    if not linux_cpu():
        return {}
    from mlx_grpo.cpu.blas import state

    front = state["front"]
    if front is None:
        return {}
    weights = [mx.random.normal(shape) * 0.02 for _ in range(layers) for shape in LAYER]
    weights.append(mx.random.normal((49152, 576)) * 0.02)
    mx.eval(weights)
    out = {}
    for m in rows:
        xs = {k: mx.random.normal((m, k)) for k in (576, 1536)}
        mx.eval(xs)

        def step(xs=xs):
            mx.eval([xs[w.shape[1]] @ w.T for w in weights])

        with front.bypassed():
            blas = _best(step, reps)
        out[m] = (_best(step, reps), blas)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--context", type=int, default=1024, help="attention's tokens (0: skip)")
    p.add_argument("--skinny-rows", default="1,4,8,16,32", help="decode GEMM row counts ('': skip)")
    args = p.parse_args(argv)
    times = op_times(args.rows, args.vocab, args.reps)
    base = times["mx.exp"]
    print(f"[{args.rows}, {args.vocab}] float32 on {mx.default_device()}, best of {args.reps}")
    print(f"{'op':<24}{'ms':>8}{'x mx.exp':>10}")
    for name, t in times.items():
        print(f"{name:<24}{t * 1e3:>8.2f}{t / base:>10.2f}")
    if args.context:
        print(f"causal attention, [1, 9, {args.context}, 64] on 3 key heads, best of 3")
        for name, t in attention_times(args.context, 3).items():
            print(f"{name:<32}{t * 1e3:>8.1f} ms")
    rows = [int(r) for r in args.skinny_rows.split(",") if r.strip()]
    if rows and (times := skinny_times(rows, 5)):
        print(
            f"a decode step's linear layers (embedded model, 211 products), best of 5: "
            f"{blas_in_use()}"
        )
        print(f"{'rows':>6}{'front ms':>10}{'BLAS ms':>10}{'x BLAS':>8}")
        for m, (front, blas) in times.items():
            print(f"{m:>6}{front * 1e3:>10.1f}{blas * 1e3:>10.1f}{front / blas:>8.2f}")


if __name__ == "__main__":
    main()
