"""The GEMMs of a model step, jax_nvfp4's Hopper GEMM against XLA's bf16 dot.

    python benchmarks/gemm_shapes.py                     # the d2048 MLP at 32k tokens
    python benchmarks/gemm_shapes.py --tokens 8192 --d 4096 --ffn 14336

For each GEMM the recipe runs in an SwiGLU MLP (FPROP, DGRAD and WGRAD of the
gate/up and down projections, as ``recipe._dot2`` calls ``matmul``: both
operands K-contiguous, [M, K] and [N, K], bf16 out), three timings on the
same bf16 operands:
  nvfp4     the cuBLASLt handler behind ``jax_nvfp4.matmul`` on Hopper
            (``backends.bf16_gemm``), operands already decoded, alpha from the
            amaxes;
  xla TN    ``lax.dot_general`` of the same [M, K] and [N, K] operands (XLA's
            cuBLASLt call, autotuned, alpha = 1);
  xla       the product in the layout a bf16 model has (x [M, K] . w [K, N]
            for FPROP, dy [T, N] . w^T for DGRAD, x^T . dy for WGRAD);
  engine    the Hopper engine's grouped rows form with one group (the same
            TN product, bf16 out), where it runs (compute capability 9.0):
            whether the engine would beat cuBLASLt on the dense path.
Each is timed as --repeat products on their own operands in one jitted call
(per product, median over --reps calls), the three taking turns. A GEMM only
on a CUDA GPU with the handler built; elsewhere the script says so and stops.
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
from common import argument_parser, header, median_seconds, write_json

from jax_nvfp4.backends import bf16_gemm, bf16_grouped_gemm


def shapes(tokens: int, d: int, ffn: int):
    """(name, M, N, K, the bf16 model's dimension numbers): the recipe's
    operands are a [M, K] and b [N, K]."""
    return [
        ("gate/up FPROP", tokens, ffn, d, "mk,kn"),
        ("gate/up DGRAD", tokens, d, ffn, "mn,kn->mk"),
        ("gate/up WGRAD", d, ffn, tokens, "tk,tn->kn"),
        ("down FPROP", tokens, d, ffn, "mk,kn"),
        ("down DGRAD", tokens, ffn, d, "mn,kn->mk"),
        ("down WGRAD", ffn, d, tokens, "tk,tn->kn"),
    ]


def _operands(m, n, k, repeat):
    keys = jax.random.split(jax.random.key(0), 2 * repeat)
    return [
        (
            jax.random.normal(keys[2 * i], (m, k), jnp.bfloat16),
            jax.random.normal(keys[2 * i + 1], (n, k), jnp.bfloat16),
        )
        for i in range(repeat)
    ]


def main(argv=None):
    parser = argument_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--d", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    print(header())
    if not bf16_gemm.cublaslt_gemm_supported():
        print("the cuBLASLt bf16 GEMM handler is not available here: nothing to time")
        return
    amax = jnp.ones((1,), jnp.float32) * 2688.0  # alpha = 1

    def nvfp4(pairs):
        return [
            bf16_gemm.matmul_values(a[None], b[None], amax, amax, jnp.bfloat16)
            for a, b in pairs
        ]

    def engine(pairs):
        one, unit = jnp.ones((1,), jnp.float32), jnp.ones((1,), jnp.int32)
        return [
            bf16_grouped_gemm.rows(
                a, b[None], unit * a.shape[0], one, jnp.bfloat16, kernel="engine"
            )
            for a, b in pairs
        ]

    with_engine = bf16_grouped_gemm.engine_supported(groups=1, n=2)

    def xla_tn(pairs):
        dims = (((1,), (1,)), ((), ()))
        return [jax.lax.dot_general(a, b, dims) for a, b in pairs]

    rows = {}
    print(
        f"{'GEMM':16s} {'M':>6s} {'N':>6s} {'K':>6s} {'nvfp4 µs':>10s} "
        f"{'xla TN µs':>10s} {'xla µs':>10s} {'nvfp4/xla':>10s}"
        + (f" {'engine µs':>10s} {'engine/nvfp4':>12s}" if with_engine else "")
    )
    for name, m, n, k, form in shapes(args.tokens, args.d, args.ffn):
        pairs = _operands(m, n, k, args.repeat)
        # The model's own layouts: FPROP w is [K, N], DGRAD w is [K, N] too
        # (contracted over N), WGRAD contracts tokens, the leading axis of x
        # and dy; materialized so that XLA sees those layouts as inputs.
        if form == "tk,tn->kn":
            model_pairs = [(a.T.copy(), b.T.copy()) for a, b in pairs]  # [T, .]

            def model(ps):
                dims = (((0,), (0,)), ((), ()))
                return [jax.lax.dot_general(a, b, dims) for a, b in ps]
        else:
            model_pairs = [(a, b.T.copy()) for a, b in pairs]  # w as [K, N]

            def model(ps):
                return [a @ b for a, b in ps]

        fns = {
            "nvfp4": (jax.jit(nvfp4), pairs),
            "xla TN": (jax.jit(xla_tn), pairs),
            "xla": (jax.jit(model), model_pairs),
        }
        if with_engine:
            fns["engine"] = (jax.jit(engine), pairs)
        times = {key: [] for key in fns}
        for _ in range(args.rounds):
            for key, (fn, ops) in fns.items():
                seconds = median_seconds(fn, ops, reps=args.reps)
                times[key].append(seconds / args.repeat * 1e6)
        med = {key: statistics.median(v) for key, v in times.items()}
        rows[name] = {"m": m, "n": n, "k": k, **med}
        print(
            f"{name:16s} {m:6d} {n:6d} {k:6d} {med['nvfp4']:10.0f} "
            f"{med['xla TN']:10.0f} {med['xla']:10.0f} "
            f"{med['nvfp4'] / med['xla']:9.3f}x"
            + (
                f" {med['engine']:10.0f} {med['engine'] / med['nvfp4']:11.3f}x"
                if with_engine
                else ""
            )
        )
    total = {key: sum(r[key] for r in rows.values()) for key in times}
    print(
        f"{'all six':16s} {'':6s} {'':6s} {'':6s} {total['nvfp4']:10.0f} "
        f"{total['xla TN']:10.0f} {total['xla']:10.0f} "
        f"{total['nvfp4'] / total['xla']:9.3f}x"
        + (
            f" {total['engine']:10.0f} {total['engine'] / total['nvfp4']:11.3f}x"
            if with_engine
            else ""
        )
    )
    if args.out:
        write_json(args.out, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
