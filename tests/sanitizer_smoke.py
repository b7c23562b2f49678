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
            *nv.quantize_rowwise_and_columnwise(
                x, col_rht=True, col_rounding="stochastic", key=key
            ),
            *nv.quantize_rowwise_and_columnwise(
                x, row_block="16x16", col_block="16x16"
            ),
        ]
        deq = [nv.dequantize(t, jnp.float32) for t in outs]
        deq += [nv.dequantize(outs[0], jnp.bfloat16)]
        jax.block_until_ready((outs, deq))
    print("sanitizer smoke: ran", len(outs), "quantizations per dtype")


if __name__ == "__main__":
    main()
