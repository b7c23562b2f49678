"""Where an Equinox layer's stochastic-rounding key comes from: its
``key=`` argument, else the innermost ``keys(step_key)`` block, else (in
inference mode) a fixed key, else none: the forward pass runs and its
gradient raises (see the package docstring, "Keys")."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp

from jax_nvfp4.equinox.fold import trace_classes
from jax_nvfp4.recipe import Recipe
from jax_nvfp4.recipe.steps import recipe_words, refuse_forward_mode

__all__ = ["keys"]


class _KeySource:
    """One ``keys`` block: its key and how many calls drew from it."""

    def __init__(self, key: jax.Array):
        self.key = key
        self.count = 0

    def draw(self) -> jax.Array:
        if not isinstance(self.key, jax.core.Tracer) and _staging_now():
            raise ValueError(
                "a jax_nvfp4.equinox.Linear drew its key from a keys(...) block "
                "whose key is a constant of the function being traced: every "
                "call of the compiled function would draw the same bits. Enter "
                "the block inside the jitted function, with the key as one of "
                "its arguments (with jax_nvfp4.equinox.keys(step_key): ...)"
            )
        key = jax.random.fold_in(self.key, self.count)
        self.count += 1
        return key


_sources = threading.local()


def _source_stack() -> list[_KeySource]:
    if not hasattr(_sources, "stack"):
        _sources.stack = []
    return _sources.stack


def _staging_now() -> bool:
    """Whether a jaxpr is being traced (jit, scan, make_jaxpr, ...) around the
    current call; False where JAX's trace state cannot be read."""
    found = trace_classes()
    if found is None:  # pragma: no cover - other JAX versions
        return False
    trace, staging, _ = found
    for _ in range(1000):
        if trace is None:
            return False
        if isinstance(trace, staging):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False  # pragma: no cover


@contextlib.contextmanager
def keys(key: jax.Array) -> Iterator[None]:
    """Stochastic-rounding keys for the ``Linear`` calls made without ``key=``.

    Inside the block each such call (of a recipe that needs a key) draws
    ``jax.random.fold_in(key, n)``, n = 0, 1, ... in call order as JAX traces
    them: every layer gets its own key, and a new ``key`` each step gives new
    bits. For models that pass no key to their layers, e.g. ``eqx.nn.MLP``::

        @eqx.filter_jit
        def step(model, x, y, key):
            def loss(model):
                with jax_nvfp4.equinox.keys(key):
                    return jnp.mean((jax.vmap(model)(x) - y) ** 2)
            return eqx.filter_value_and_grad(loss)(model)

    Blocks nest; the innermost wins. A ``lax.scan`` body is traced once, so
    all layers of a scanned stack would draw the same key: give each step its
    own (``jax.random.split(key, L)`` as a scanned input, then ``key=`` or a
    ``keys`` block inside the body). ``key`` must be an argument of the traced
    function (see the module docstring).

    Args:
      key: a ``jax.random.key`` or a uint32[2] PRNG key.
    """
    if not isinstance(key, jax.Array) or not (
        jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
        or (key.shape == (2,) and key.dtype == jnp.uint32)
    ):
        raise TypeError(
            "keys() takes a jax.random.key(...) or a uint32[2] PRNGKey, got "
            f"{getattr(key, 'dtype', type(key).__name__)}"
            f"{list(getattr(key, 'shape', ()))}"
        )
    source = _KeySource(key)
    stack = _source_stack()
    stack.append(source)
    try:
        yield
    finally:
        stack.remove(source)


def _key_words(
    key: jax.Array | None, recipe: Recipe, inference: bool
) -> jax.Array | None:
    """uint32[2] words of ``key`` (typed or raw); a fixed key when unused;
    None when the recipe needs a key and there is none (``forward_only``)."""
    if not recipe.needs_key:
        return jnp.zeros((2,), jnp.uint32)
    if key is None and _source_stack():
        key = _source_stack()[-1].draw()
    if key is None:
        return jnp.zeros((2,), jnp.uint32) if inference else None
    return recipe_words(key, recipe)[0]


def _missing_key_message(layer: str) -> str:
    return (
        f"this jax_nvfp4.equinox.{layer} was differentiated without a key: its "
        "recipe rounds dY stochastically in the backward pass. Call it with "
        "key=... (a new key each step) or inside a `with "
        "jax_nvfp4.equinox.keys(step_key):` block, or convert with a recipe "
        "without stochastic rounding (jax_nvfp4.NVFP4_NO_SR)"
    )


def forward_only(
    product: Callable[..., jax.Array], recipe: Recipe, layer: str
) -> Callable[..., jax.Array]:
    """``product(recipe, *operands)`` for a layer called without a key, as
    ``jax_nvfp4.dot`` runs without one: the forward pass (stochastic
    rounding is for dY only, so the output is the same as with any key), and
    its gradient raises a ValueError saying how to give the layer a key. The
    key operand is unused."""
    no_sr = dataclasses.replace(recipe, stochastic_rounding=False)
    message = _missing_key_message(layer)

    def run(*operands):
        # Forward mode gets the recipe's own error, as with a key, not
        # JAX's about this custom_vjp.
        refuse_forward_mode(*operands)
        return _forward_only(functools.partial(product, no_sr), message, *operands)

    return run


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _forward_only(product, message, *operands):
    return product(*operands)


def _forward_only_fwd(product, message, *operands):
    return product(*operands), None


def _forward_only_bwd(product, message, residuals, cotangent):
    raise ValueError(message)


_forward_only.defvjp(_forward_only_fwd, _forward_only_bwd)
