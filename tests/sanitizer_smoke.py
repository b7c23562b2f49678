"""Runs every CUDA handler once on small, odd shapes, for compute-sanitizer:

compute-sanitizer --tool memcheck python tests/sanitizer_smoke.py
"""

import jax
import jax.numpy as jnp

import jax_nvfp4 as nv


def main():
    key = jax.random.key(0)
    for dtype in (jnp.bfloat16, jnp.float32, jnp.float16):
        x = jax.random.normal(key, (2, 144, 80), dtype)
        outs = [
            nv.quantize(x),
            nv.quantize(x, axis=1, block="16x16", rht=True),
            nv.quantize(x, axis=-2, rounding="stochastic", key=key),
            nv.quantize(x[:, :, :7], axis=1),  # column-wise with k = 7
            # A NaN: its blocks take the header's slow path.
            *nv.quantize_rowwise_and_columnwise(x.at[0, 3, 5].set(jnp.nan)),
            *nv.quantize_rowwise_and_columnwise(
                x, col_rht=True, col_rounding="stochastic", key=key
            ),
            *nv.quantize_rowwise_and_columnwise(
                x, row_block="16x16", col_block="16x16"
            ),
            # dY's options: stochastic rounding both ways.
            *nv.quantize_rowwise_and_columnwise(
                x,
                row_rounding="stochastic",
                col_rht=True,
                col_rounding="stochastic",
                key=key,
            ),
        ]
        deq = [nv.dequantize(t, jnp.float32) for t in outs]
        deq += [nv.dequantize(outs[0], jnp.bfloat16)]
        jax.block_until_ready((outs, deq))
    # The GEMM: shared b, per-item b and per-item amaxes (vmap), both outputs.
    a = nv.quantize(jax.random.normal(key, (3, 40, 96), jnp.bfloat16))
    b = nv.quantize(jax.random.normal(key, (48, 96), jnp.bfloat16))
    bb = nv.quantize(jax.random.normal(key, (3, 48, 96), jnp.bfloat16))
    per_item = jax.vmap(nv.matmul)(
        jax.vmap(nv.quantize)(jax.random.normal(key, (3, 40, 96))),
        jax.vmap(nv.quantize)(jax.random.normal(key, (3, 48, 96))),
    )
    gemms = [
        nv.matmul(a, b),
        nv.matmul(a, b, out_dtype=jnp.float32),
        nv.matmul(a, bb),
        per_item,
    ]
    jax.block_until_ready(gemms)
    print("sanitizer smoke: ran", len(outs), "quantizations per dtype and 4 GEMMs")


if __name__ == "__main__":
    main()
