"""Run every CUDA kernel of jax_nvfp4 once on small, odd shapes, for compute-sanitizer.

    compute-sanitizer --tool memcheck python3 tools/sanitizer_smoke.py
    compute-sanitizer --tool racecheck python3 tools/sanitizer_smoke.py

tools/gpu_check.sh --sanitizer runs both, each part (--parts) in a process
of its own and XLA compiling on one thread (tools/sanitizer_repro.py: the
sanitizer itself crashes with XLA's parallel compilation). The shapes are
small (the tools slow kernels down a hundredfold) and odd (partial tiles, k
not a multiple of 16, a batch axis), so that every bounds check and every
tail path of the kernels runs: the quantize kernels (row-wise, column-wise,
16x16, RHT, stochastic rounding, the fused rows + columns with each option
set, a NaN block on the slow path), the amax passes (plain, RHT, per
column), dequantize, the GEMM's call plans (shared and per-item operands,
bf16 and float32 out), the recipe's forward + backward (the fused quantize
writing the GEMM's operands, the decode of FP4 residuals) and ragged_dot's
(the grouped GEMM). Runs anywhere; only on a GPU does it exercise the CUDA
handlers."""

import argparse

import jax
import jax.numpy as jnp

import jax_nvfp4 as nv


def quantizations(x, key):
    """Every quantize / dequantize configuration of one input."""
    outs = [
        nv.quantize(x),
        nv.quantize(x, axis=1, block="16x16", rht=True),
        nv.quantize(x, axis=-2, rounding="stochastic", key=key),
        nv.quantize(x[:, :, :7], axis=1),  # column-wise with k = 7
        # A NaN: its blocks take the numerics header's slow path.
        *nv.quantize_rowwise_and_columnwise(x.at[0, 3, 5].set(jnp.nan)),
        *nv.quantize_rowwise_and_columnwise(
            x, col_rht=True, col_rounding="stochastic", key=key
        ),
        *nv.quantize_rowwise_and_columnwise(x, row_block="16x16", col_block="16x16"),
        # dY's options: stochastic rounding both ways.
        *nv.quantize_rowwise_and_columnwise(
            x,
            row_rounding="stochastic",
            col_rht=True,
            col_rounding="stochastic",
            key=key,
        ),
    ]
    amaxes = [nv.global_amax(x), nv.global_amax(x, axis=-2, rht=True)]
    deq = [nv.dequantize(t, jnp.float32) for t in outs]
    deq.append(nv.dequantize(outs[0], jnp.bfloat16))
    return outs, amaxes, deq


def gemms(key):
    """Shared b, per-item b, per-item amaxes (vmap), both output dtypes."""
    a = nv.quantize(jax.random.normal(key, (3, 40, 96), jnp.bfloat16))
    b = nv.quantize(jax.random.normal(key, (48, 96), jnp.bfloat16))
    bb = nv.quantize(jax.random.normal(key, (3, 48, 96), jnp.bfloat16))
    per_item = jax.vmap(nv.matmul)(
        jax.vmap(nv.quantize)(jax.random.normal(key, (3, 40, 96))),
        jax.vmap(nv.quantize)(jax.random.normal(key, (3, 48, 96))),
    )
    return [
        nv.matmul(a, b),
        nv.matmul(a, b, out_dtype=jnp.float32),
        nv.matmul(a, bb),
        per_item,
    ]


def recipe_step(key):
    """jax_nvfp4.dot forward + both gradients (FPROP, DGRAD, WGRAD)."""
    kx, kw, kg = jax.random.split(key, 3)
    x = jax.random.normal(kx, (48, 80), jnp.bfloat16)
    w = jax.random.normal(kw, (80, 64), jnp.bfloat16) * 0.1
    g = jax.random.normal(kg, (48, 64), jnp.float32)

    def loss(x, w):
        return jnp.sum(nv.dot(x, w, key=key).astype(jnp.float32) * g)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)


def ragged_step(key):
    """jax_nvfp4.ragged_dot forward + both gradients: the grouped GEMM's rows
    and tokens forms, with an empty group, groups off 16 and off the 128-row
    tile, and rows past the groups."""
    kx, kw, kg = jax.random.split(key, 3)
    sizes = jnp.array([19, 0, 150, 33], jnp.int32)
    x = jax.random.normal(kx, (210, 80), jnp.bfloat16)
    w = jax.random.normal(kw, (4, 80, 48), jnp.bfloat16) * 0.1
    g = jax.random.normal(kg, (210, 48), jnp.float32)

    def loss(x, w):
        y = nv.ragged_dot(x, w, sizes, key=key)
        return jnp.sum(y.astype(jnp.float32) * g)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)


def grouped_gemms(key):
    """The grouped GEMM handlers alone (the Hopper engine where it runs, the
    mma.sync kernel), both forms (no XLA computation around them but the
    call and the engine's token lines)."""
    from jax_nvfp4.backends import bf16_grouped_gemm

    sizes = jnp.array([32, 0, 160, 48], jnp.int32)
    a = jax.random.normal(key, (256, 80), jnp.bfloat16)
    b = jax.random.normal(key, (4, 48, 80), jnp.bfloat16)
    ta = jax.random.normal(key, (16, 80, 16), jnp.bfloat16)
    tb = jax.random.normal(key, (16, 48, 16), jnp.bfloat16)
    alpha = jnp.ones(4, jnp.float32)
    kernels = [
        kernel
        for kernel, here in (
            ("engine", bf16_grouped_gemm.engine_supported(groups=4, n=48)),
            ("mma", bf16_grouped_gemm.handler_supported()),
        )
        if here
    ] or ["xla"]
    outs = []
    for kernel in kernels:
        outs.append(
            bf16_grouped_gemm.rows(a, b, sizes, alpha, jnp.bfloat16, kernel=kernel)
        )
        outs.append(
            bf16_grouped_gemm.tokens(ta, tb, sizes, alpha, jnp.float32, kernel=kernel)
        )
    return outs


def w4a16_gemms(key):
    """The weight-only GEMM handler at every row-tile height, partial tiles
    in M and N, K in one slice and in slices of which the last is short;
    on an H100/H200 also the engine's at each of its tile heights, K split
    over a cluster and not, and its grouped form (ragged_dot by NVFP4
    experts)."""
    from jax_nvfp4 import ops
    from jax_nvfp4.backends import w4a16_gemm

    outs = []
    for k in (512, 2176):
        w = nv.quantize(jax.random.normal(key, (k, 130)), axis=0)
        paths = ["handler" if w4a16_gemm.handler_supported(k, 130) else "xla"]
        if w4a16_gemm.engine_supported(k):
            paths.append("engine")
        weight = (
            w.codes.reshape(1, 130, k // 2),
            w.scales.reshape(1, 130, k // 16),
            w.amax.reshape(1),
        )
        for m in (1, 17, 40, 100):
            x = jax.random.normal(key, (1, m, k), jnp.bfloat16)
            for dtype in (jnp.bfloat16, jnp.float32):
                for path in paths:
                    outs.append(ops.w4a16_matmul(x, *weight, dtype=dtype, path=path))
    if w4a16_gemm.engine_supported(512, grouped=True):
        # The grouped form: empty groups, groups off 16, rows past the
        # groups; 16-token and 128-token tiles, K split and not.
        for k, n in ((512, 130), (4096, 64)):
            experts = jax.vmap(lambda e: nv.quantize(e, axis=0))(
                jax.random.normal(key, (4, k, n))
            )
            for sizes, rows in (([3, 0, 17, 9], 40), ([200, 0, 90, 7], 300)):
                x = jax.random.normal(key, (rows, k), jnp.bfloat16)
                sizes = jnp.asarray(sizes, jnp.int32)
                for dtype in (jnp.bfloat16, jnp.float32):
                    outs.append(
                        nv.ragged_dot(x, experts, sizes, preferred_element_type=dtype)
                    )
    return outs


PARTS = {
    "quantize": "quantizations and amax passes in three dtypes",
    "gemm": "4 GEMMs",
    "recipe": "one dot step",
    "grouped": "the grouped GEMM's two forms",
    "w4a16": "the weight-only GEMMs at four row counts and two K, and grouped",
    "ragged": "one ragged_dot step",
}


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]),
    )
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"comma-separated, of {', '.join(PARTS)} (default: all)",
    )
    parser.add_argument(
        "--list", action="store_true", help="print the parts' names and exit"
    )
    args = parser.parse_args(argv)
    if args.list:
        print(" ".join(PARTS))
        return
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(unknown)}; known: {', '.join(PARTS)}")
    key = jax.random.key(0)
    print("devices:", jax.devices(), "handlers on", sorted(nv.available_platforms()))
    if "quantize" in parts:
        for dtype in (jnp.bfloat16, jnp.float32, jnp.float16):
            x = jax.random.normal(key, (2, 144, 80), dtype)
            jax.block_until_ready(quantizations(x, key))
    if "gemm" in parts:
        jax.block_until_ready(gemms(key))
    if "recipe" in parts:
        jax.block_until_ready(recipe_step(key))
    if "grouped" in parts:
        jax.block_until_ready(grouped_gemms(key))
    if "w4a16" in parts:
        jax.block_until_ready(w4a16_gemms(key))
    if "ragged" in parts:
        jax.block_until_ready(ragged_step(key))
    print("sanitizer smoke: ran " + "; ".join(PARTS[p] for p in parts))


if __name__ == "__main__":
    main()
