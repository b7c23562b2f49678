"""Time a mixture-of-experts MLP, forward + backward: NVFP4 against bf16.

    python benchmarks/moe_bench.py                    # 8 experts, d 2048, 32k tokens
    python benchmarks/moe_bench.py --tokens 8192 --rounds 5

The expert MLP of an MoE block: 8 SwiGLU experts (d -> ffn -> d), each token
routed to 2 of them, the rows sorted by expert and unbalanced 2:1 (even
experts get twice the rows of odd ones). One step is y = down(silu(gate(r)) *
up(r)) over the sorted rows r and its vjp with a random cotangent. Rows:
  bf16 ragged_dot      the three projections by jax.lax.ragged_dot, bf16
  nvfp4 ragged_dot     the same by jax_nvfp4.ragged_dot (the full recipe:
                       RHT, stochastic rounding, 16x16 weight tiles), its
                       grouped GEMM as the dispatcher picks it (on Hopper,
                       the wgmma engine)
  nvfp4 NO_SR          the same without stochastic rounding (NVFP4_NO_SR)
  nvfp4, mma grouped   the full recipe with JAX_NVFP4_GEMM_ENGINE=0: the
                       mma.sync handler
  nvfp4, XLA grouped   the same with JAX_NVFP4_GROUPED_GEMM=0: XLA's
                       ragged_dot_general on the decoded operands
  bf16 tokamax mosaic  the bf16 step by tokamax's ragged_dot (Google's
  bf16 tokamax triton  Pallas kernels, what MaxText's MoE layer calls), with
                       implementation="mosaic" (Mosaic GPU, Hopper) and
                       "triton" (needs jax-triton); a row whose kernel does
                       not import or compile says why and is left out
  bf16 dense batched   the same FLOPs as a dense batched GEMM (every expert
                       with the mean row count, jnp.einsum): how fast the
                       bf16 ragged_dot is, so that a slow baseline cannot
                       flatter the ratio
Each row is a jitted step; the rows take turns over --rounds rounds (each
settles --settle seconds, then --reps steps are timed back to back), and the
ratio to bf16 ragged_dot is taken within each round. TFLOP/s count the
useful FLOPs (2 x rows x d x ffn per GEMM, 9 GEMMs).

--kernels also times each grouped GEMM form of the first projection alone
(the rows form, x [rows, d] by w [G, ffn, d]; the tokens form, the WGRAD of
the same, by the engine with and without regrouping its operands into lines
and by the mma.sync handler; tokamax's Mosaic forward where it imports)
against XLA's dense batched GEMM of the same FLOPs. The last lines compare
the NVFP4 steps with the fastest bf16 grouped step of the run.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
from common import argument_parser, header, tokamax_ragged_dot, write_json

import jax_nvfp4 as nv
from jax_nvfp4.backends import bf16_grouped_gemm
from jax_nvfp4.ops import token_buffer


def group_sizes(rows: int, experts: int) -> jax.Array:
    """rows split 2:1 between even and odd experts (the remainder to the
    last)."""
    weights = [2 if g % 2 == 0 else 1 for g in range(experts)]
    sizes = [rows * w // sum(weights) for w in weights]
    sizes[-1] += rows - sum(sizes)
    return jnp.array(sizes, jnp.int32)


def swiglu(product):
    def mlp(rows, wg, wu, wd):
        h = jax.nn.silu(product(rows, wg, "gate")) * product(rows, wu, "up")
        return product(h, wd, "down")

    def step(rows, wg, wu, wd, dy):
        y, vjp = jax.vjp(mlp, rows, wg, wu, wd)
        return (y, *vjp(dy))

    return step


def kernel_operands(rows, wg, sizes):
    """Decoded-operand stand-ins of the first projection's GEMMs: bf16 rows
    [R, d] (R the token buffer's rows, groups padded to 16), w [G, ffn, d]; the WGRAD
    operands as items of 16 tokens [R / 16, d or ffn, 16], and those in the
    engine's lines of 64 tokens."""
    count, d, ffn = wg.shape
    padded = (sizes + 15) // 16 * 16
    buffer_rows = token_buffer.buffer_rows(rows.shape[0], count)
    a = jnp.zeros((buffer_rows, d), jnp.bfloat16).at[: rows.shape[0]].set(rows)
    b = jnp.swapaxes(wg, 1, 2)
    items = buffer_rows // 16
    ta = a.reshape(items, 16, d).swapaxes(1, 2)
    tb = jnp.ones((items, ffn, 16), jnp.bfloat16)
    la = bf16_grouped_gemm.token_lines(ta, padded)
    lb = bf16_grouped_gemm.token_lines(tb, padded)
    return a, b, padded, jnp.ones(count, jnp.float32), ta, tb, la, lb


def kernel_steps(rows, wg, sizes, dense_product, tokamax_dot=None):
    """The grouped GEMM forms alone (jitted), tokamax's forward ragged_dot
    (its rows form) where it imports, and a dense batched GEMM of the same
    FLOPs."""

    def rows_form(kernel):
        def form(a, b, s, alpha, ta, tb, la, lb):
            return bf16_grouped_gemm.rows(a, b, s, alpha, jnp.bfloat16, kernel=kernel)

        return jax.jit(form)

    def tokens_form(kernel):
        def form(a, b, s, alpha, ta, tb, la, lb):
            return bf16_grouped_gemm.tokens(
                ta, tb, s, alpha, jnp.float32, kernel=kernel
            )

        return jax.jit(form)

    def lines_form(a, b, s, alpha, ta, tb, la, lb):
        return bf16_grouped_gemm.tokens_on_lines(la, lb, s, alpha, jnp.float32)

    def dense_form(a, b, s, alpha, ta, tb, la, lb):
        return dense_product(a[: rows.shape[0]], jnp.swapaxes(b, 1, 2), None)

    steps = {}
    count, _, ffn = wg.shape
    if bf16_grouped_gemm.engine_supported(groups=count, n=ffn):
        steps["rows form (engine)"] = rows_form("engine")
        steps["tokens form (engine)"] = tokens_form("engine")
        steps["tokens form (engine, lines)"] = jax.jit(lines_form)
    if bf16_grouped_gemm.handler_supported():
        steps["rows form (mma)"] = rows_form("mma")
        steps["tokens form (mma)"] = tokens_form("mma")
    steps["dense form (XLA)"] = jax.jit(dense_form)
    if tokamax_dot is not None:

        def tokamax_rows(a, b, s, alpha, ta, tb, la, lb):
            return tokamax_dot(rows, wg, sizes, implementation="mosaic")

        steps["rows form (tokamax mosaic)"] = jax.jit(tokamax_rows)
    return steps


def main(argv=None):
    parser = argument_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--d", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--settle", type=float, default=1.0, help="seconds")
    parser.add_argument("--kernels", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    print(header())
    rows_n, d, ffn, e = args.tokens * args.top_k, args.d, args.ffn, args.experts
    if rows_n % e:
        raise SystemExit("tokens x top-k must be a multiple of the expert count")
    sizes = group_sizes(rows_n, e)
    keys = jax.random.split(jax.random.key(0), 5)
    rows = jax.random.normal(keys[0], (rows_n, d), jnp.bfloat16)
    wg = jax.random.normal(keys[1], (e, d, ffn), jnp.bfloat16) * 0.02
    wu = jax.random.normal(keys[2], (e, d, ffn), jnp.bfloat16) * 0.02
    wd = jax.random.normal(keys[3], (e, ffn, d), jnp.bfloat16) * 0.02
    dy = jax.random.normal(keys[4], (rows_n, d), jnp.bfloat16)
    step_key = jax.random.key(7)
    print(
        f"{e} experts, d {d}, SwiGLU {ffn}, {args.tokens} tokens x top-{args.top_k}"
        f" = {rows_n} rows, group sizes {sizes.tolist()}"
    )

    def bf16_product(x, w, _):
        return jax.lax.ragged_dot(x, w, sizes)

    def nvfp4_product(x, w, name, recipe=nv.NVFP4):
        key = jax.random.fold_in(step_key, ("gate", "up", "down").index(name))
        return nv.ragged_dot(x, w, sizes, key=key, recipe=recipe)

    def nvfp4_no_sr_product(x, w, name):
        return nvfp4_product(x, w, name, nv.NVFP4_NO_SR)

    per = rows_n // e  # the dense baseline: every expert the mean row count

    def dense_product(x, w, _):
        return jnp.einsum("gtk,gkn->gtn", x.reshape(e, per, -1), w).reshape(rows_n, -1)

    operands = (rows, wg, wu, wd, dy)
    steps = {
        "bf16 ragged_dot": jax.jit(swiglu(bf16_product)),
        "nvfp4 ragged_dot": jax.jit(swiglu(nvfp4_product)),
        "nvfp4 NO_SR": jax.jit(swiglu(nvfp4_no_sr_product)),
        "nvfp4, mma grouped": jax.jit(swiglu(nvfp4_product)),
        "nvfp4, XLA grouped": jax.jit(swiglu(nvfp4_product)),
    }
    settings = {
        "nvfp4, mma grouped": {"gemm_engine": False},
        "nvfp4, XLA grouped": {"grouped_gemm": False},
    }
    tokamax_dot, why = tokamax_ragged_dot()
    if tokamax_dot is None:
        print(f"tokamax rows left out: {why}")
    else:
        for impl in ("mosaic", "triton"):

            def tokamax_product(x, w, _, impl=impl):
                return tokamax_dot(x, w, sizes, implementation=impl)

            steps[f"bf16 tokamax {impl}"] = jax.jit(swiglu(tokamax_product))
    steps["bf16 dense batched"] = jax.jit(swiglu(dense_product))
    if not bf16_grouped_gemm.handler_supported():
        del steps["nvfp4, XLA grouped"]  # the same as "nvfp4 ragged_dot"
    if not bf16_grouped_gemm.engine_supported(groups=e, n=ffn):
        del steps["nvfp4, mma grouped"]  # the same as "nvfp4 ragged_dot"
    for name, fn in list(steps.items()):
        with nv.config.override(**settings.get(name, {})):
            try:
                steps[name] = fn.lower(*operands).compile()
            except Exception as err:  # noqa: BLE001 - a baseline that cannot run
                if "tokamax" not in name:
                    raise
                print(f"{name} left out: {type(err).__name__}: {str(err)[:300]}")
                del steps[name]
    operands_of = {}
    if args.kernels:
        steps.update(kernel_steps(rows, wg, sizes, dense_product, tokamax_dot))
        kernel_args = kernel_operands(rows, wg, sizes)
        operands_of = {n: kernel_args for n in steps if "form" in n}
    times = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, fn in steps.items():
            ops = operands_of[name] if "form" in name else operands
            start = time.perf_counter()
            while time.perf_counter() - start < args.settle:
                jax.block_until_ready(fn(*ops))
            start = time.perf_counter()
            out = [fn(*ops) for _ in range(args.reps)]
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / args.reps * 1e3)
    base = times["bf16 ragged_dot"]
    print(f"{'step (fwd + bwd)':24s} {'ms':>9s} {'vs bf16 ragged_dot':>20s} TFLOP/s")
    step_flops = 9 * 2 * rows_n * d * ffn  # 3 projections x (fwd, dgrad, wgrad)
    for name, values in times.items():
        ratios = [t / b for t, b in zip(values, base, strict=True)]
        ms = statistics.median(values)
        flops = 2 * rows_n * d * ffn if "form" in name else step_flops
        print(
            f"{name:24s} {ms:9.2f} {statistics.median(ratios):9.3f}x "
            f"({min(ratios):.3f}..{max(ratios):.3f}) {flops / ms / 1e9:8.0f}"
        )
    grouped = [n for n in times if n.startswith("bf16") and "dense" not in n]
    fastest = min(grouped, key=lambda n: statistics.median(times[n]))
    for name in ("nvfp4 ragged_dot", "nvfp4 NO_SR"):
        ratios = [t / f for t, f in zip(times[name], times[fastest], strict=True)]
        print(
            f"{name} vs the fastest bf16 grouped step ({fastest}): "
            f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}..{max(ratios):.3f})"
        )
    if args.out:
        write_json(args.out, {"args": vars(args), "ms": times})


if __name__ == "__main__":
    main()
