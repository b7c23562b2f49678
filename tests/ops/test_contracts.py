"""Every primitive family against the contract of tests/ops/contract.py:
each implementation named explicitly equals the twin on the CPU, the eager
call equals the jitted one, vmap equals a loop."""

import functools

import jax.numpy as jnp
import numpy as np
from contract import PrimitiveContract, generate_contract_tests
from gemm_cases import CASES, random_operands
from grouped_cases import ROWS, TOKENS, rows_operands, tokens_operands

from jax_nvfp4 import ops, reference
from jax_nvfp4.ops import grouped_matmul

pytest_generate_tests = generate_contract_tests


def _x(seed, shape, dtype=jnp.float32):
    values = np.random.default_rng(seed).standard_normal(shape) * 3
    return jnp.asarray(values, dtype)


def _path(form, path):
    """A grouped GEMM path's lowering body, called with the primitive's
    operands (the whole buffer: origin 0)."""
    body = grouped_matmul.lowering_body(form, path)

    def run(*operands, dtype):
        return body(*operands, jnp.zeros((1,), jnp.int32), dtype=dtype)

    return run


def _codes(seed, rows, k):
    """codes [1, rows, k/2], scales [1, rows, k/16], amax [1]."""
    a = random_operands(seed, 1, rows, 1, k, 1, False, False)
    return a[0], a[1], a[2]


class TestQuantizeRows(PrimitiveContract):
    primitive = staticmethod(ops.quantize_rows)
    twin = staticmethod(reference.quantize_rows)

    def cases(self):
        words = jnp.asarray([[7, 11]], jnp.uint32)
        x = _x(0, (2, 48, 64), jnp.bfloat16)
        amax = jnp.asarray([np.abs(np.asarray(x, np.float32)).max()], jnp.float32)
        return {
            "nearest": ((x, amax, words), dict(rows=ops.QuantizeSpec())),
            "stochastic_16x16_rht": (
                (x, amax, words),
                dict(rows=ops.QuantizeSpec(block_rows=16, stochastic=True, rht=True)),
            ),
        }


class TestDequantize(PrimitiveContract):
    primitive = staticmethod(ops.dequantize)
    twin = staticmethod(reference.dequantize)

    def cases(self):
        codes, scales, amax = _codes(1, 40, 64)
        return {
            dtype.__name__: ((codes, scales, amax), dict(dtype=np.dtype(dtype)))
            for dtype in (jnp.float32, jnp.bfloat16)
        }


class TestDecode(PrimitiveContract):
    primitive = staticmethod(ops.decode_bf16)
    twin = staticmethod(reference.decode_bf16)

    def cases(self):
        codes, scales, _ = _codes(2, 24, 96)
        return {"rows": ((codes, scales), {})}


class TestMatmul(PrimitiveContract):
    """The CPU handler sums in k order, the twin's XLA dot in its own."""

    primitive = staticmethod(ops.matmul)
    twin = staticmethod(reference.matmul)
    exact = False
    tolerance = 1e-6

    def cases(self):
        return {
            f"case{i}_{dtype.__name__}": (
                random_operands(10 + i, *CASES[i]),
                dict(dtype=np.dtype(dtype)),
            )
            for i in (0, 1, 4)
            for dtype in (jnp.float32, jnp.bfloat16)
        }


class TestW4A16Matmul(PrimitiveContract):
    """On the CPU the primitive is its twin, XLA's dot, whose float32 order
    depends on the rows a vmap folds together."""

    primitive = staticmethod(ops.w4a16_matmul)
    twin = staticmethod(reference.w4a16_matmul)
    vmap_exact = False
    tolerance = 1e-6

    def implementations(self):
        return {
            **super().implementations(),
            # The CUDA choice names a path; on the CPU every path is the twin.
            "path_xla": functools.partial(ops.w4a16_matmul, path="xla"),
        }

    def cases(self):
        codes, scales, amax = _codes(3, 48, 256)
        out = {}
        for rows in (1, 17):
            x = _x(rows, (1, rows, 256), jnp.bfloat16)
            for dtype in (jnp.float32, jnp.bfloat16):
                out[f"m{rows}_{dtype.__name__}"] = (
                    (x, codes, scales, amax),
                    dict(dtype=np.dtype(dtype)),
                )
        return out


class TestGroupedMatmulRows(PrimitiveContract):
    primitive = staticmethod(ops.grouped_matmul_rows)
    twin = staticmethod(reference.grouped_matmul_rows)

    def implementations(self):
        return {
            **super().implementations(),
            "path_per_group": _path("rows", "per_group"),
        }

    def cases(self):
        return {
            f"{name}_{dtype.__name__}": (
                rows_operands(ROWS[name], seed=4),
                dict(dtype=np.dtype(dtype)),
            )
            for name in ("unaligned", "one_group")
            for dtype in (jnp.float32, jnp.bfloat16)
        }


class TestGroupedMatmulTokens(PrimitiveContract):
    primitive = staticmethod(ops.grouped_matmul_tokens)
    twin = staticmethod(reference.grouped_matmul_tokens)

    def implementations(self):
        return {
            **super().implementations(),
            "path_per_group": _path("tokens", "per_group"),
        }

    def cases(self):
        return {
            f"{name}_{dtype.__name__}": (
                tokens_operands(TOKENS[name], seed=5),
                dict(dtype=np.dtype(dtype)),
            )
            for name in ("unbalanced", "one_group")
            for dtype in (jnp.float32, jnp.bfloat16)
        }
