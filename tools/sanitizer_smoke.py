"""Run every CUDA kernel of jax_nvfp4 once on small, odd shapes, for compute-sanitizer.

    compute-sanitizer --tool memcheck python3 tools/sanitizer_smoke.py
    compute-sanitizer --tool racecheck python3 tools/sanitizer_smoke.py

tools/gpu_check.sh --sanitizer runs both. The shapes are small (the tools
slow kernels down a hundredfold) and odd (partial tiles, k not a multiple of
16, a batch axis), so that every bounds check and every tail path of the
kernels runs: the quantize kernels (row-wise, column-wise, 16x16, RHT,
stochastic rounding, the fused rows + columns with each option set, a NaN
block on the slow path), the amax passes (plain, RHT, per column), dequantize,
the GEMM's call plans (shared and per-item operands, bf16 and float32 out),
the recipe's forward + backward (the fused quantize writing the GEMM's
operands, the decode of FP4 residuals) and ragged_dot's (the grouped GEMM).
Runs anywhere; only on a GPU does it exercise the CUDA handlers.
"""

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


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]),
    )
    parser.parse_args(argv)
    key = jax.random.key(0)
    print("devices:", jax.devices(), "handlers on", sorted(nv.available_platforms()))
    for dtype in (jnp.bfloat16, jnp.float32, jnp.float16):
        x = jax.random.normal(key, (2, 144, 80), dtype)
        outs, amaxes, deq = quantizations(x, key)
        jax.block_until_ready((outs, amaxes, deq))
    jax.block_until_ready(gemms(key))
    jax.block_until_ready(recipe_step(key))
    jax.block_until_ready(ragged_step(key))
    print(
        f"sanitizer smoke: ran {len(outs)} quantizations and 2 amax passes per "
        "dtype, 4 GEMMs, one recipe step and one ragged_dot step"
    )


if __name__ == "__main__":
    main()
