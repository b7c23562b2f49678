"""jax_nvfp4.dot_general on every weight-like projection: the forward pass and
both gradients are bit-identical to the 2-D recipe (jax_nvfp4.dot) on the
flattened problem, in the caller's shapes; einsum takes it as _dot_general;
batch dims run lax.dot_general; bad dimension_numbers say what is wrong."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as nv

B, S, E, H, D = 2, 24, 64, 4, 16  # 48 tokens: not a multiple of the tile
KEY = jax.random.key(3)


def _normal(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.bfloat16)


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint16) if a.dtype == jnp.bfloat16 else a


def _value_and_grads(f, *args):
    def loss(*a):
        return jnp.sum(f(*a).astype(jnp.float32) * 0.01)

    out = jax.jit(lambda *a: f(*a))(*args)
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)
    return out, grads


def _assert_same(got, want):
    out, grads = got
    want_out, want_grads = want
    assert out.shape == want_out.shape
    np.testing.assert_array_equal(_bits(out), _bits(want_out))
    for g, w in zip(grads, want_grads, strict=True):
        assert g.shape == w.shape
        np.testing.assert_array_equal(_bits(g), _bits(w))


# (name, lhs shape, rhs shape, dimension_numbers, the same product by dot on
# 2-D operands: (lhs, rhs) -> (x2, w2, output shape)).
FORMS = [
    (
        "BTD,DNH->BTNH (two free rhs dims)",
        (B, S, E),
        (E, H, D),
        (((2,), (0,)), ((), ())),
        lambda x, w: (x.reshape(-1, E), w.reshape(E, H * D), (B, S, H, D)),
    ),
    (
        "BTNH,NHD->BTD (two contracting dims)",
        (B, S, H, D),
        (H, D, E),
        (((2, 3), (0, 1)), ((), ())),
        lambda x, w: (x.reshape(-1, H * D), w.reshape(H * D, E), (B, S, E)),
    ),
    (
        "weight [N, K] (PyTorch / Equinox)",
        (B, S, E),
        (32, E),
        (((2,), (1,)), ((), ())),
        lambda x, w: (x.reshape(-1, E), w.T, (B, S, 32)),
    ),
    (
        "weight [N, H, D] contracted on its last dims",
        (B, S, H, D),
        (32, H, D),
        (((2, 3), (1, 2)), ((), ())),
        lambda x, w: (x.reshape(-1, H * D), w.reshape(32, H * D).T, (B, S, 32)),
    ),
    (
        "contracting dims listed out of order",
        (S, H, D),
        (D, H, 48),
        (((2, 1), (0, 1)), ((), ())),
        lambda x, w: (
            x.transpose(0, 2, 1).reshape(S, D * H),
            w.reshape(D * H, 48),
            (S, 48),
        ),
    ),
    (
        "lhs contracted on its first dim",
        (E, S),
        (E, 32),
        (((0,), (0,)), ((), ())),
        lambda x, w: (x.T, w, (S, 32)),
    ),
]


@pytest.mark.parametrize("recipe", [nv.NVFP4, nv.Recipe(dgrad=False), nv.BF16])
@pytest.mark.parametrize("form", FORMS, ids=[f[0] for f in FORMS])
def test_dot_general_equals_the_2d_recipe(form, recipe):
    _, lhs_shape, rhs_shape, dims, flat = form
    lhs, rhs = _normal(0, lhs_shape), _normal(1, rhs_shape)
    dg = functools.partial(nv.dot_general, key=KEY, recipe=recipe)

    def two_d(lhs, rhs):
        x2, w2, shape = flat(lhs, rhs)
        return nv.dot(x2, w2, key=KEY, recipe=recipe).reshape(shape)

    _assert_same(
        _value_and_grads(lambda a, b: dg(a, b, dims), lhs, rhs),
        _value_and_grads(two_d, lhs, rhs),
    )


@pytest.mark.parametrize(
    "spec, lhs_shape, rhs_shape",
    [
        ("bsd,dnh->bsnh", (B, S, E), (E, H, D)),
        ("bsnh,nhd->bsd", (B, S, H, D), (H, D, E)),
        ("bsd,nd->bsn", (B, S, E), (32, E)),
    ],
)
def test_einsum_takes_it_as_dot_general(spec, lhs_shape, rhs_shape):
    lhs, rhs = _normal(2, lhs_shape), _normal(3, rhs_shape)
    dg = functools.partial(nv.dot_general, key=KEY)
    lhs_spec, rhs_spec = spec.split("->")[0].split(",")
    contracted = [c for c in lhs_spec if c in rhs_spec]
    dims = (
        (
            tuple(lhs_spec.index(c) for c in contracted),
            tuple(rhs_spec.index(c) for c in contracted),
        ),
        ((), ()),
    )
    _assert_same(
        _value_and_grads(
            lambda a, b: jnp.einsum(spec, a, b, _dot_general=dg), lhs, rhs
        ),
        _value_and_grads(lambda a, b: dg(a, b, dims), lhs, rhs),
    )


def test_batch_dims_run_lax_dot_general():
    q, k = _normal(4, (B, H, S, D)), _normal(5, (B, H, S, D))
    dims = (((3,), (3,)), ((0, 1), (0, 1)))
    np.testing.assert_array_equal(
        _bits(nv.dot_general(q, k, dims, key=KEY)),
        _bits(jax.lax.dot_general(q, k, dims)),
    )


def test_no_transpose_for_either_weight_orientation():
    """[K, N] and [N, K] weights are quantized as stored: the jitted step has
    no transpose of the weight (the quantize primitives read it)."""
    x = _normal(6, (S, E))
    for w, dims in (
        (_normal(7, (E, 32)), (((1,), (0,)), ((), ()))),
        (_normal(7, (32, E)), (((1,), (1,)), ((), ()))),
    ):
        jaxpr = jax.make_jaxpr(
            jax.grad(
                lambda w, dims=dims: jnp.sum(
                    nv.dot_general(x, w, dims, key=KEY).astype(jnp.float32)
                )
            )
        )(w)
        assert "transpose[" not in str(jaxpr), jaxpr


def test_forward_without_a_key_runs_and_its_gradient_raises():
    x, w = _normal(8, (S, E)), _normal(9, (E, 32))
    y = nv.dot(x, w)  # the forward pass never reads the key
    np.testing.assert_array_equal(_bits(y), _bits(nv.dot(x, w, key=KEY)))
    with pytest.raises(ValueError, match="differentiated without a key"):
        jax.grad(lambda w: jnp.sum(nv.dot(x, w).astype(jnp.float32)))(w)


@pytest.mark.parametrize(
    "dims, error, message",
    [
        ((((1,),), ((), ())), ValueError, "dimension_numbers must be"),
        ((((2,), (0,)), ((), ())), ValueError, "out of range"),
        ((((1, 1), (0, 0)), ((), ())), ValueError, "repeats a dimension"),
        ((((1,), (0, 1)), ((), ())), ValueError, "as many contracting dims"),
        ((((0,), (0,)), ((), ())), ValueError, "differ in size"),
        ((((1,), ("a",)), ((), ())), TypeError, "sequence of ints"),
        ((((1,), (0, 1)), ((), ())), ValueError, "as many"),
    ],
)
def test_bad_dimension_numbers_say_what_is_wrong(dims, error, message):
    x, w = _normal(10, (S, E)), _normal(11, (E, 32))
    with pytest.raises(error, match=message):
        nv.dot_general(x, w, dims, key=KEY)


def test_a_rhs_without_free_dims_says_keep_it_in_bf16():
    x, w = _normal(12, (S, E)), _normal(13, (E,))
    with pytest.raises(ValueError, match="free dim on rhs"):
        nv.dot_general(x, w, (((1,), (0,)), ((), ())), key=KEY)
