"""Quantize a bf16 matrix to NVFP4 and back; print what happened.

python examples/quickstart.py
"""

import jax
import jax.numpy as jnp

import jax_nvfp4 as nv


def main():
    x = jax.random.normal(jax.random.key(0), (256, 1024), jnp.bfloat16)

    # Row-wise 1x16 blocks, round-to-nearest: what FPROP's activations use.
    t = jax.jit(nv.quantize)(x)
    y = nv.dequantize(t, jnp.float32)
    err = jnp.linalg.norm(y - x.astype(jnp.float32)) / jnp.linalg.norm(
        x.astype(jnp.float32)
    )
    print(
        f"{t}: codes {t.codes.dtype}{list(t.codes.shape)}, "
        f"scales {t.scales.dtype}{list(t.scales.shape)}, amax {float(t.amax):.3f}"
    )
    print(f"relative error after the round trip: {float(err):.4f}")

    # One pass for the training recipe: row-wise, plus the column-wise copy
    # (transposed, Random Hadamard Transform, stochastic rounding) for WGRAD.
    rows, cols = jax.jit(
        nv.quantize_rowwise_and_columnwise, static_argnames=("col_rht", "col_rounding")
    )(x, col_rht=True, col_rounding="stochastic", key=jax.random.key(1))
    print(
        f"row-wise codes {list(rows.codes.shape)}, column-wise codes "
        f"{list(cols.codes.shape)}"
    )
    print(
        "FFI handlers on:",
        sorted(nv.available_platforms()),
        "| default backend:",
        jax.default_backend(),
    )


if __name__ == "__main__":
    main()
