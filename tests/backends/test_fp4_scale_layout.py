"""The Blackwell scale swizzle: the Python layout against the C++ offsets and
against the layout's definition (byte j*16 + i*4 + c of tile (r/128, c/4) for
row r = 128 t + 32 i + j)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jax_nvfp4.backends.fp4_gemm import swizzle_scales


def _by_definition(rows, cols):
    cols_p = -(-cols // 4) * 4
    offsets = np.empty((rows, cols), np.int64)
    for r in range(rows):
        for c in range(cols):
            tile = (r // 128) * (cols_p // 4) + c // 4
            offsets[r, c] = tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    return offsets


@pytest.mark.parametrize("rows,cols", [(128, 4), (256, 8), (130, 5), (1, 1), (300, 13)])
def test_swizzle_matches_definition_and_cpp(rows, cols):
    rng = np.random.default_rng(rows * 1000 + cols)
    raw = rng.integers(1, 0x7E, size=(rows, cols), dtype=np.uint8)
    scales = jnp.asarray(raw).view(jnp.float8_e4m3fn)
    out = np.asarray(swizzle_scales(scales))
    assert out.size == (-(-rows // 128) * 128) * (-(-cols // 4) * 4)
    offsets = _by_definition(rows, cols)
    np.testing.assert_array_equal(out[offsets], raw)
    pad = np.ones(out.size, bool)
    pad[offsets.reshape(-1)] = False
    assert not out[pad].any()
    testing = pytest.importorskip("jax_nvfp4._ffi_testing")
    np.testing.assert_array_equal(
        np.asarray(testing.swizzled_scale_offsets(rows, cols)).reshape(rows, cols),
        offsets,
    )
