"""The CPU handlers' fast paths: work split over XLA's intra-op threads and
vector kernels compiled for several instruction sets (ffi/cpu/).

- The CPU GEMM's summation order (docs/DESIGN.md section 5): every output
  adds its K exact products in order k = 0, 1, ..., K - 1 in one float32
  accumulator from +0, then multiplies by alpha and rounds once. The handler
  equals that sequential sum (numpy, float32) bit for bit, for tile edges,
  long sums, batches and both output types.
- Quantize and amax: the bytes of the reference on shapes that split into
  several chunks (threads) and partial tiles.
- Dequantize and global_amax (the plain amax has a CPU handler of its own):
  the reference's bits for every code byte and scale byte, non-finite and
  subnormal inputs, chunks that span batch items.
- Every kernel variant (JAX_NVFP4_CPU_KERNELS=base / avx2; the default is the
  best the CPU has) gives the same bytes and sums, checked in subprocesses
  (the variant is chosen once per process).
- Blocks whose scaled values are every boundary of the E2M1 ladder, the
  floats next to them and the grid: the reference's bytes, in every variant.

Everything runs on the CPU device, also on a machine with a GPU.
"""

import functools
import os
import pathlib
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import assert_same_bytes, outlier_data, tensor_bytes

import jax_nvfp4 as nv
from jax_nvfp4 import ops
from jax_nvfp4 import reference as ref

CPU = jax.devices("cpu")[0]
pytestmark = pytest.mark.skipif(
    "cpu" not in nv.available_platforms(), reason="no CPU handlers built"
)

# (M, K, N): single elements, edges of every kernel's tile (4, 6 rows; 8, 16,
# 64 columns) and block of a (60 rows), sums of 2048 products (k in slices),
# b's columns in several blocks.
GEMM_SHAPES = [
    (1, 16, 1),
    (7, 48, 130),
    (67, 96, 70),
    (130, 2048, 65),
    (8, 2048, 1100),
]


def _on_cpu(fn, *args):
    with jax.default_device(CPU):
        return fn(*jax.device_put(args, CPU))


def _operands(m, k, n, seed=0):
    """a [M, K] quantized along K, b from w [K, N] along K (16x16 tiles where
    N allows); outlier data, so the sums round at many places."""
    x = outlier_data(seed, (m, k), jnp.bfloat16)
    w = outlier_data(seed + 1, (k, n), jnp.bfloat16)
    block = "16x16" if n % 16 == 0 else "1x16"
    quantize = jax.jit(lambda x, w: (nv.quantize(x), nv.quantize(w, 0, block=block)))
    return _on_cpu(quantize, x, w)


def _values(codes, scales):
    """e2m1 * s_b as float32 numpy [..., rows, K] (exact products)."""
    codes = np.asarray(codes)
    nibbles = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(
        *codes.shape[:-1], -1
    )
    e2m1 = np.asarray(nv.E2M1_VALUES, np.float32)
    e2m1 = np.concatenate([e2m1, -e2m1])[nibbles]
    scale = np.asarray(scales).astype(np.float32)
    return e2m1 * np.repeat(scale, nv.BLOCK_SIZE, axis=-1)


def sequential_matmul(a_vals, b_vals, alpha, dtype):
    """out[m, n] = alpha * (((0 + p_0) + p_1) + ... + p_{K-1}) in float32,
    p_k = a[m, k] * b[n, k] (exact), rounded once to dtype."""
    acc = np.zeros((a_vals.shape[0], b_vals.shape[0]), np.float32)
    for k in range(a_vals.shape[1]):
        acc = acc + np.outer(a_vals[:, k], b_vals[:, k]).astype(np.float32)
    return (acc * np.float32(alpha)).astype(dtype)


def _alpha(a_amax, b_amax):
    r = np.float32(nv.SCALE_RANGE)
    return (np.float32(a_amax) / r) * (np.float32(b_amax) / r)


@pytest.mark.parametrize("shape", GEMM_SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_matmul_is_the_sequential_float32_sum(shape, dtype):
    m, k, n = shape
    a, b = _operands(m, k, n)
    got = _on_cpu(jax.jit(functools.partial(nv.matmul, out_dtype=dtype)), a, b)
    want = sequential_matmul(
        _values(a.codes[None], a.scales[None])[0],
        _values(b.codes[None], b.scales[None])[0],
        _alpha(a.amax, b.amax),
        dtype,
    )
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))


def test_batched_matmul_sums_each_item_in_order():
    """A per-item b (one GEMM per batch item) and a shared b (the batch folded
    into M): each output is its item's sequential sum."""
    x = outlier_data(4, (3, 20, 64), jnp.bfloat16)
    w = outlier_data(5, (3, 64, 40), jnp.bfloat16)

    def per_item(x, w):
        a = jax.vmap(nv.quantize)(x)
        b = jax.vmap(functools.partial(nv.quantize, axis=0))(w)
        return a, b, nv.matmul(a, b, out_dtype=jnp.float32)

    a, b, got = _on_cpu(jax.jit(per_item), x, w)
    for i in range(3):
        want = sequential_matmul(
            _values(a.codes[i : i + 1], a.scales[i : i + 1])[0],
            _values(b.codes[i : i + 1], b.scales[i : i + 1])[0],
            _alpha(a.amax[i], b.amax[i]),
            np.float32,
        )
        np.testing.assert_array_equal(np.asarray(got[i]), want)

    a, b = _on_cpu(jax.jit(lambda x, w: (nv.quantize(x), nv.quantize(w[0], 0))), x, w)
    matmul = jax.jit(functools.partial(nv.matmul, out_dtype=jnp.float32))
    shared = _on_cpu(matmul, a, b)
    want = sequential_matmul(
        _values(a.codes.reshape(1, 60, 32), a.scales.reshape(1, 60, 4))[0],
        _values(b.codes[None], b.scales[None])[0],
        _alpha(a.amax, b.amax),
        np.float32,
    )
    np.testing.assert_array_equal(np.asarray(shared).reshape(60, 40), want)


# --- quantize and amax: the reference's bytes on multi-chunk shapes ------------

KEY = jax.random.key(11)
# name: (shape, dtype, quantize's keyword arguments, or with "fused" those of
# quantize_rowwise_and_columnwise). Shapes of several chunks and partial
# tiles.
QUANTIZE_CASES = {
    "rows_partial_tiles": ((1037, 96), jnp.bfloat16, dict(axis=-1)),
    "cols_partial_tiles": ((96, 1000), jnp.float32, dict(axis=0, rht=True)),
    "f16_rows_rht_sr": (
        (128, 256),
        jnp.float16,
        dict(rht=True, rounding="stochastic", key=KEY),
    ),
    "ladder_rows": (None, jnp.float32, dict(axis=-1)),
    "ladder_cols": (None, jnp.float32, dict(axis=0)),
    "ladder_rows_sr": (None, jnp.float32, dict(rounding="stochastic", key=KEY)),
    "ladder_cols_sr": (
        None,
        jnp.float32,
        dict(axis=0, rounding="stochastic", key=KEY),
    ),
    "x_fused": ((1024, 512), jnp.bfloat16, dict(fused=True, col_rht=True)),
    "dy_fused": (
        (512, 256),
        jnp.bfloat16,
        dict(
            fused=True,
            row_rounding="stochastic",
            col_rounding="stochastic",
            col_rht=True,
            key=KEY,
        ),
    ),
    "w_tiles": (
        (256, 512),
        jnp.bfloat16,
        dict(fused=True, row_block="16x16", col_block="16x16"),
    ),
}


def ladder_data(transposed: bool) -> np.ndarray:
    """float32 blocks of 16 whose elements reach the E2M1 rounding exactly:
    the tensor's amax is 2688 (so S_enc = 1) and each block holds a 6 (so
    s_b = 1 and enc_b = 1): the other 15 values are the scaled values
    themselves. They are every boundary of the ladder (docs/DESIGN.md 2.2),
    the floats next to them, the grid points and zeros, with both signs.
    Blocks run along the last axis, or along the first one (``transposed``),
    in whole 16 x 16 tiles."""
    points = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1, 1.5, 2, 3, 4, 6]
    values = [0.0, 1e-30]
    for p in np.float32(points):
        values += [p, np.nextafter(p, np.float32(0)), np.nextafter(p, np.inf)]
    values = np.array(values + [-v for v in values], np.float32)
    values = np.concatenate([values, np.zeros(-len(values) % 15, np.float32)])
    blocks = values.reshape(-1, 15)
    blocks = np.concatenate([np.full((len(blocks), 1), 6, np.float32), blocks], 1)
    amax_block = np.zeros((1, 16), np.float32)
    amax_block[0, 3] = 2688
    blocks = np.concatenate([blocks, amax_block])
    blocks = np.concatenate([blocks, np.zeros((-len(blocks) % 8, 16), np.float32)])
    x = np.tile(blocks.reshape(-1, 64), (16, 1))  # 4 blocks a row
    return x.T.copy() if transposed else x


def _quantize_case(name, implementation):
    shape, dtype, kwargs = QUANTIZE_CASES[name]
    if name.startswith("ladder"):
        x = jnp.asarray(ladder_data(kwargs.get("axis", -1) == 0))
    else:
        x = outlier_data(sorted(QUANTIZE_CASES).index(name), shape, dtype)
    kwargs = dict(kwargs, implementation=implementation)
    if kwargs.pop("fused", False):
        fn = functools.partial(nv.quantize_rowwise_and_columnwise, **kwargs)
        return _on_cpu(jax.jit(fn), x)
    return (_on_cpu(jax.jit(functools.partial(nv.quantize, **kwargs)), x),)


def _amax_case(cols):
    x = outlier_data(9, (2, 272, 208), jnp.bfloat16)
    return (
        _on_cpu(jax.jit(functools.partial(ops.amax, cols=cols)), x),
        _on_cpu(jax.jit(functools.partial(ref.amax, cols=cols)), x),
    )


@pytest.mark.parametrize("name", sorted(QUANTIZE_CASES))
def test_quantize_bytes_on_multi_chunk_shapes(name):
    for got, want in zip(
        _quantize_case(name, "ffi"), _quantize_case(name, "reference"), strict=True
    ):
        assert_same_bytes(got, want)


@pytest.mark.parametrize("cols", [False, True])
def test_amax_bits(cols):
    got, want = _amax_case(cols)
    np.testing.assert_array_equal(
        np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32)
    )


# --- dequantize and the plain amax ---------------------------------------------


def _dequantize_case(batch, rows, length, n_amax, dtype, seed=0):
    """The handler's and the twin's values (their bits, numpy) of random codes
    and scale bytes, every byte value of each among them."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (batch, rows, length // 2), dtype=np.uint8)
    scales = rng.integers(0, 256, (batch, rows, length // 16), dtype=np.uint8)
    codes.reshape(-1)[: min(256, codes.size)] = np.arange(256)[: codes.size]
    scales.reshape(-1)[: min(256, scales.size)] = np.arange(256)[: scales.size]
    scales = jax.lax.bitcast_convert_type(jnp.asarray(scales), jnp.float8_e4m3fn)
    amax = jnp.asarray(rng.uniform(1e-3, 1e30, n_amax).astype(np.float32))
    args = (jnp.asarray(codes), scales, amax)
    bits = np.uint32 if dtype == jnp.float32 else np.uint16
    return tuple(
        np.asarray(_on_cpu(jax.jit(functools.partial(fn, dtype=dtype)), *args)).view(
            bits
        )
        for fn in (ops.dequantize, ref.dequantize)
    )


# (batch, rows, length, amaxes): one block; rows in chunks that span batch
# items with an amax each; long rows.
DEQUANTIZE_SHAPES = [(1, 1, 16, 1), (3, 700, 64, 3), (4, 9, 48, 2), (1, 40, 4096, 1)]


@pytest.mark.parametrize("shape", DEQUANTIZE_SHAPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dequantize_bits(shape, dtype):
    got, want = _dequantize_case(*shape, dtype)
    if dtype == jnp.bfloat16:
        # A NaN rounds to the bfloat16 NaN 0x7FC0 (FloatToBfloat16Bits), where
        # XLA's convert keeps the sign of the float32 NaN that a scale byte 0xFF
        # (never written by a quantize) gives.
        nan = (want & 0x7FFF) > 0x7F80
        np.testing.assert_array_equal((got & 0x7FFF) > 0x7F80, nan)
        got, want = got[~nan], want[~nan]
    np.testing.assert_array_equal(got, want)


def _abs_max_inputs():
    """name -> x (numpy): non-finite values, subnormals, rows of any length,
    several chunks (threads), no finite value at all."""
    rng = np.random.default_rng(3)
    bf16, f16, f32 = ml_dtypes.bfloat16, np.float16, np.float32
    wide = np.array(outlier_data(4, (3, 70001), jnp.float32))
    special = np.array(outlier_data(5, (257, 33), jnp.float32))
    for value in (np.nan, np.inf, -np.inf):
        special.reshape(-1)[rng.choice(special.size, 40, replace=False)] = value
    tiny = np.finfo(f32).tiny
    subnormal = np.full((64, 16), tiny / 4, f32)
    inputs = {"wide": wide, "wide_bf16": wide.astype(bf16)}
    for dtype in (f32, bf16, f16):
        name = np.dtype(dtype).name
        inputs[f"special_{name}"] = special.astype(dtype)
        inputs[f"no_finite_{name}"] = np.array([[np.nan, np.inf, -np.inf]], dtype)
    inputs["subnormal_f32"] = subnormal
    inputs["subnormal_f32_and_normal"] = subnormal.copy()
    inputs["subnormal_f32_and_normal"][3, 3] = -tiny
    inputs["subnormal_bf16"] = subnormal.astype(bf16)
    inputs["subnormal_f16"] = np.full((8, 5), 2.0**-20, f16)
    inputs["one"] = np.array([-3.5], f32)
    inputs["empty"] = np.zeros((4, 0), bf16)
    return inputs


ABS_MAX_INPUTS = _abs_max_inputs()


@pytest.mark.parametrize("name", sorted(ABS_MAX_INPUTS))
def test_global_amax_bits(name):
    x = ABS_MAX_INPUTS[name]
    got, want = (
        _on_cpu(jax.jit(functools.partial(nv.global_amax, implementation=i)), x)
        for i in ("ffi", "reference")
    )
    np.testing.assert_array_equal(
        np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32)
    )


def test_global_amax_under_vmap():
    x = ABS_MAX_INPUTS["special_float32"][:256].reshape(4, 64, 33)
    got = _on_cpu(jax.jit(jax.vmap(nv.global_amax)), x)
    want = _on_cpu(jax.jit(jax.vmap(ref.abs_max)), x)
    np.testing.assert_array_equal(
        np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32)
    )


# --- kernel variants ------------------------------------------------------------


# What the variants compute: the cases that reach every path of the kernels
# (both directions, partial tiles, RHT, stochastic rounding, 16x16 tiles,
# float16, tile edges and k slices of the GEMM); the shapes of several
# chunks only matter for the threads, tested above.
VARIANT_QUANTIZE_CASES = [
    "cols_partial_tiles",
    "dy_fused",
    "f16_rows_rht_sr",
    "ladder_cols",
    "ladder_rows_sr",
    "rows_partial_tiles",
    "w_tiles",
]
VARIANT_GEMM_SHAPES = [(7, 48, 130), (67, 96, 70), (130, 2048, 65)]
VARIANTS = ["base", "avx2"]


def cpu_outputs() -> dict:
    """Everything the variant check compares, as numpy arrays."""
    out = {}
    for name in VARIANT_QUANTIZE_CASES:
        for i, t in enumerate(_quantize_case(name, "ffi")):
            parts = zip(("codes", "scales", "amax"), tensor_bytes(t), strict=True)
            for part, array in parts:
                out[f"{name}/{i}/{part}"] = array
    for cols in (False, True):
        out[f"amax/{cols}"] = np.asarray(_amax_case(cols)[0])
    for shape in DEQUANTIZE_SHAPES[:3]:
        for dtype in (jnp.float32, jnp.bfloat16):
            got = _dequantize_case(*shape, dtype)[0]
            out[f"dequantize/{shape}/{np.dtype(dtype).name}"] = got
    for name, x in ABS_MAX_INPUTS.items():
        out[f"global_amax/{name}"] = np.asarray(_on_cpu(jax.jit(nv.global_amax), x))
    for m, k, n in VARIANT_GEMM_SHAPES:
        a, b = _operands(m, k, n)
        for dtype in (jnp.float32, jnp.bfloat16):
            matmul = jax.jit(functools.partial(nv.matmul, out_dtype=dtype))
            got = _on_cpu(matmul, a, b)
            out[f"matmul/{m}x{k}x{n}/{np.dtype(dtype).name}"] = np.asarray(got).view(
                np.uint8
            )
    return out


def test_kernel_variants_agree():
    """Each lower variant in a subprocess of its own (JAX_NVFP4_CPU_KERNELS is
    read once per process; they run side by side) against this process's
    (the best the CPU has)."""
    package_root = pathlib.Path(nv.__file__).resolve().parent.parent
    code = (
        "import sys, numpy as np, test_cpu_handlers as t; "
        "np.savez(sys.argv[1], **t.cpu_outputs())"
    )
    with tempfile.TemporaryDirectory() as directory:
        runs = {}
        for variant in VARIANTS:
            env = dict(
                os.environ,
                JAX_NVFP4_CPU_KERNELS=variant,
                JAX_PLATFORMS="cpu",
                PYTHONPATH=os.pathsep.join(
                    [
                        str(package_root),
                        str(pathlib.Path(__file__).parent),
                        str(pathlib.Path(__file__).parents[1]),  # shared helpers
                    ]
                    + [p for p in [os.environ.get("PYTHONPATH")] if p]
                ),
            )
            path = os.path.join(directory, f"{variant}.npz")
            process = subprocess.Popen(
                [sys.executable, "-c", code, path],
                cwd=directory,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            runs[variant] = (process, path)
        ours = cpu_outputs()
        for variant, (process, path) in runs.items():
            _, stderr = process.communicate(timeout=600)
            assert process.returncode == 0, (variant, stderr[-4000:])
            theirs = dict(np.load(path))
            assert sorted(theirs) == sorted(ours), variant
            for name, array in ours.items():
                np.testing.assert_array_equal(
                    theirs[name], array, err_msg=f"{variant}: {name}"
                )
