"""Flax integration: NVFP4 dense layers in Flax linen and Flax NNX.

``jax_nvfp4.dot_general`` is the dense-layer drop-in for ``lax.dot_general``;
this module wraps it as a module that draws its stochastic-rounding key from a
Flax RNG stream (default name ``"nvfp4"``), so that a training step is
reproducible from its inputs and each step draws new bits:

- linen: ``LinenDotGeneral``, used as
  ``nn.Dense(features, dot_general_cls=functools.partial(LinenDotGeneral,
  recipe=NVFP4))`` (or ``dot_general=LinenDotGeneral(recipe)``). Each call
  takes ``self.make_rng("nvfp4")``: pass ``rngs={"nvfp4": step_key}`` to
  ``apply`` with a new key each step. Flax folds the module path and a
  per-call counter into it, so every layer and every call gets its own key.
- NNX: ``NNXDotGeneral``, used as ``nnx.Linear(..., dot_general=
  NNXDotGeneral(recipe, rngs=rngs))``. It holds its own ``nnx.RngStream``
  (forked from ``rngs``); each call takes the next key (``fold_in(key,
  count)``) and advances the count, which is module state: it flows through
  ``nnx.jit`` and ``nnx.split``/``nnx.merge`` like any other state, so two
  steps draw different bits and re-running from a saved state reproduces them.
- ``convert(model, policy, rngs)`` sets such a ``dot_general`` on every
  ``nnx.Linear`` of an NNX model that the ``Policy`` puts in NVFP4.

Keys and inference. Only the backward pass uses the key (stochastic rounding
of dY); the forward pass is the same with or without one. So a layer without
its RNG stream — linen ``init`` or ``apply`` without ``rngs={"nvfp4": ...}``,
or an NNX layer built with ``rngs=None`` — still computes the forward pass,
and raises a ``ValueError`` naming the missing stream only if it is
differentiated with a recipe that uses stochastic rounding. Recipes without
stochastic rounding (``NVFP4_NO_SR``) never need a key.

Dtypes: the layers cast inputs, kernel and bias to the layer's ``dtype`` as
usual (``promote_dtype``); keep fp32 master weights (``param_dtype``) and set
``dtype=jnp.bfloat16`` for bf16 compute. K and N must be multiples of 16.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen, nnx

from jax_nvfp4 import projection
from jax_nvfp4.policy import Policy, path_string, warn_unmatched_rules
from jax_nvfp4.recipe import NVFP4, Recipe

__all__ = [
    "DEFAULT_RNG_COLLECTION",
    "LinenDotGeneral",
    "LinenEinsum",
    "NNXDotGeneral",
    "NNXEinsumOp",
    "NVFP4Enabled",
    "convert",
    "nvfp4_layers",
]

DEFAULT_RNG_COLLECTION = "nvfp4"


def _missing_key_message(rng_collection: str) -> str:
    return (
        "this NVFP4 layer was differentiated without a key for stochastic "
        f"rounding: it has no {rng_collection!r} RNG stream. In linen pass "
        f"rngs={{{rng_collection!r}: step_key}} to apply (a new key each "
        "step); in NNX build the layer (or call jax_nvfp4.flax.convert) with "
        f"rngs=nnx.Rngs({rng_collection}=seed). Or use a recipe without "
        "stochastic rounding (jax_nvfp4.NVFP4_NO_SR)."
    )


def _dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    precision,
    preferred_element_type,
    out_sharding,
    *,
    recipe: Recipe,
    key: jax.Array | None,
    rng_collection: str,
) -> jax.Array:
    """``jax_nvfp4.dot_general``; without a key where the recipe needs one, a
    forward-only product whose gradient says how to give the layer a key."""
    if preferred_element_type is not None:
        preferred_element_type = jnp.dtype(preferred_element_type)
    return projection.dot_general(
        lhs,
        rhs,
        dimension_numbers,
        precision,
        preferred_element_type,
        recipe=recipe,
        key=key,
        out_sharding=out_sharding,
        _missing_key_message=_missing_key_message(rng_collection),
    )


def _check_recipe(recipe: Any) -> None:
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"recipe must be a jax_nvfp4.Recipe (e.g. jax_nvfp4.NVFP4), got {recipe!r}"
        )


class LinenDotGeneral(linen.Module):
    """A Flax linen ``dot_general`` running the NVFP4 training recipe.

    Use it in ``nn.Dense``, or in ``nn.DenseGeneral`` without ``batch_dims``
    (several contracted axes fold into one K and several feature axes into one
    N; both must be multiples of 16)::

        dense = nn.Dense(
            1024,
            dtype=jnp.bfloat16,
            dot_general_cls=functools.partial(LinenDotGeneral, recipe=NVFP4),
        )
        y = model.apply(variables, x, rngs={"nvfp4": step_key})

    Each call draws ``self.make_rng(rng_collection)`` when the recipe uses
    stochastic rounding. Without that stream (``init``, or ``apply`` for
    inference) the forward pass still runs; differentiating it raises a
    ``ValueError``. The stream is never replaced by the ``"params"`` stream
    (which would repeat the same bits every step).

    Attributes:
      recipe: the NVFP4 recipe (``jax_nvfp4.NVFP4`` and its variants).
      rng_collection: the name of the RNG stream that supplies the keys.
    """

    recipe: Recipe = NVFP4
    rng_collection: str = DEFAULT_RNG_COLLECTION

    def __call__(
        self,
        lhs: jax.Array,
        rhs: jax.Array,
        dimension_numbers,
        precision=None,
        preferred_element_type=None,
        out_sharding=None,
    ) -> jax.Array:
        """``lax.dot_general``'s signature; see ``jax_nvfp4.dot_general``."""
        _check_recipe(self.recipe)
        key = None
        if self.recipe.needs_key and self.has_rng(self.rng_collection):
            key = self.make_rng(self.rng_collection)
        return _dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision,
            preferred_element_type,
            out_sharding,
            recipe=self.recipe,
            key=key,
            rng_collection=self.rng_collection,
        )


class LinenEinsum(linen.Einsum):
    """``nn.Einsum`` running the NVFP4 recipe (linen's ``Einsum`` takes no
    ``dot_general``): the same parameters, shapes and bias as ``nn.Einsum``,
    with the einsum's products through ``jax_nvfp4.dot_general``::

        proj = LinenEinsum((512, 8, 64), "BTD,DNH->BTNH", recipe=NVFP4)
        y = proj.apply(variables, x, rngs={"nvfp4": step_key})

    Weight-like equations (no index shared by input, kernel and output) run
    the recipe, with K (the contracted kernel axes) and N (the kept ones)
    multiples of 16; an equation with batch indices runs in the input
    precision. Keys come from the ``rng_collection`` stream as in
    ``LinenDotGeneral``.

    Attributes (besides ``nn.Einsum``'s):
      recipe: the NVFP4 recipe.
      rng_collection: the name of the RNG stream that supplies the keys.
    """

    recipe: Recipe = NVFP4
    rng_collection: str = DEFAULT_RNG_COLLECTION

    @linen.compact
    def __call__(self, inputs: jax.Array, einsum_str: str | None = None) -> jax.Array:
        _check_recipe(self.recipe)
        spec = linen.module.merge_param("einsum_str", self.einsum_str, einsum_str)
        spec = spec.replace(" ", "")
        if "->" not in spec or spec.count(",") != 1:
            raise ValueError(
                f"einsum_str {spec!r} must be explicit ('->') with two operands, "
                "the input and the kernel"
            )
        kernel = self.param("kernel", self.kernel_init, self.shape, self.param_dtype)
        bias, bias_view = None, None
        if self.use_bias:
            bias_shape, bias_view = self._get_bias_shape(spec, inputs, kernel)
            bias = self.param("bias", self.bias_init, bias_shape, self.param_dtype)
        inputs, kernel, bias = self.promote_dtype(
            inputs, kernel, bias, dtype=self.dtype
        )
        key = None
        if self.recipe.needs_key and self.has_rng(self.rng_collection):
            key = self.make_rng(self.rng_collection)
        product = functools.partial(
            _switched_dot_general,
            recipe=self.recipe,
            key=key,
            enabled=None,
            rng_collection=self.rng_collection,
        )
        y = jnp.einsum(
            spec,
            inputs,
            kernel,
            precision=self.precision,
            preferred_element_type=self.preferred_element_type,
            _dot_general=product,
        )
        if bias is not None:
            y += jnp.reshape(bias, bias_view)
        return y


def _fork_stream(
    rngs: nnx.Rngs | nnx.RngStream | jax.Array | int, rng_collection: str
) -> nnx.RngStream:
    """A new stream forked from ``rngs[rng_collection]`` (or seeded by a key)."""
    if isinstance(rngs, nnx.RngStream):
        return rngs.fork()
    if isinstance(rngs, nnx.Rngs):
        try:
            return rngs[rng_collection].fork()
        except KeyError:
            raise ValueError(
                f"rngs has no {rng_collection!r} stream (and no default "
                f"stream); pass nnx.Rngs({rng_collection}=seed, ...)"
            ) from None
    if isinstance(rngs, (int, jax.Array)) and not isinstance(rngs, bool):
        return nnx.RngStream(rngs, tag=rng_collection)
    raise TypeError(
        "rngs must be an nnx.Rngs, an nnx.RngStream, a jax.random.key or an "
        f"int seed (or None for inference only); got {type(rngs).__name__}"
    )


class NNXDotGeneral(nnx.Module):
    """A Flax NNX ``dot_general`` running the NVFP4 training recipe.

    Use it as ``nnx.Linear(k, n, dot_general=NNXDotGeneral(NVFP4,
    rngs=rngs), rngs=rngs)`` or through ``convert``. The module owns an
    ``nnx.RngStream`` forked from ``rngs[rng_collection]``; each call with a
    recipe that uses stochastic rounding takes its next key, and the stream's
    count is module state (advance it under ``nnx.jit``, or carry it through
    ``nnx.split``/``nnx.merge`` under ``jax.jit``; like any NNX RNG state it
    cannot be advanced inside a plain ``jax.jit`` that closes over the
    module). With ``rngs=None`` the layer is forward-only (inference): its
    gradient raises a ``ValueError``.

    Args:
      recipe: the NVFP4 recipe (``jax_nvfp4.NVFP4`` and its variants).
      rngs: ``nnx.Rngs`` (the stream ``rng_collection``, else ``default``),
        an ``nnx.RngStream``, a key or an int seed; None for inference only.
        Not needed (and not kept) for recipes without stochastic rounding.
      rng_collection: the stream name to fork from ``rngs``.
      enabled: None (always NVFP4), or a bool (array) switch: False runs the
        plain ``lax.dot_general``. ``convert`` sets it per layer of a stack
        whose last layers the policy keeps in bf16.
    """

    def __init__(
        self,
        recipe: Recipe = NVFP4,
        *,
        rngs: nnx.Rngs | nnx.RngStream | jax.Array | int | None = None,
        rng_collection: str = DEFAULT_RNG_COLLECTION,
        enabled: jax.Array | bool | None = None,
    ):
        _check_recipe(recipe)
        self.recipe = recipe
        self.rng_collection = rng_collection
        stream = None
        if rngs is not None and recipe.needs_key:
            stream = _fork_stream(rngs, rng_collection)
        # Mark as data so the attribute holds a stream or None either way.
        self.rngs = _as_data(stream)
        self.enabled = _as_data(None if enabled is None else NVFP4Enabled(enabled))

    def bind(self) -> functools.partial:
        """``lax.dot_general``'s signature as a pure function for one call: the
        key is drawn (the stream advanced) now, so the function can be handed
        to code that traces it again (``jnp.einsum``'s ``_dot_general``)."""
        key = None
        if self.rngs is not None and self.recipe.needs_key:
            key = self.rngs()
        enabled = None if self.enabled is None else self.enabled[...]
        return functools.partial(
            _switched_dot_general,
            recipe=self.recipe,
            key=key,
            enabled=enabled,
            rng_collection=self.rng_collection,
        )

    def __call__(
        self,
        lhs: jax.Array,
        rhs: jax.Array,
        dimension_numbers,
        precision=None,
        preferred_element_type=None,
        out_sharding=None,
    ) -> jax.Array:
        """``lax.dot_general``'s signature; see ``jax_nvfp4.dot_general``."""
        return self.bind()(
            lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding
        )


class NVFP4Enabled(nnx.Variable):
    """The per-layer switch of a stacked layer: True runs the layer's NVFP4
    recipe, False the plain ``lax.dot_general`` (``Policy.stack_recipes``).
    Not a parameter: optimizers built with ``wrt=nnx.Param`` leave it alone."""


def _switched_dot_general(
    lhs,
    rhs,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    out_sharding=None,
    *,
    recipe: Recipe,
    key: jax.Array | None,
    enabled: jax.Array | None,
    rng_collection: str,
) -> jax.Array:
    """The NVFP4 product, or, where a stacked layer's switch is off, the plain
    one: inside a scan the switch is a traced per-layer bool, so the choice is
    a ``lax.cond`` (one branch runs; gradients follow the branch taken)."""
    if preferred_element_type is not None:
        preferred_element_type = jnp.dtype(preferred_element_type)

    def nvfp4(lhs, rhs):
        return _dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision,
            preferred_element_type,
            None,
            recipe=recipe,
            key=key,
            rng_collection=rng_collection,
        )

    def plain(lhs, rhs):
        return jax.lax.dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision,
            preferred_element_type=preferred_element_type,
        )

    out = (
        nvfp4(lhs, rhs)
        if enabled is None
        else jax.lax.cond(enabled, nvfp4, plain, lhs, rhs)
    )
    if out_sharding is not None:
        out = jax.lax.with_sharding_constraint(out, out_sharding)
    return out


class NNXEinsumOp(nnx.Module):
    """``nnx.Einsum``'s ``einsum_op`` running the NVFP4 recipe: ``jnp.einsum``
    with ``_dot_general`` = this layer's ``NNXDotGeneral`` (one key per call).

    Weight-like einsums (no index shared by input, kernel and output) run the
    recipe; an einsum with such batch indices runs in the input precision,
    as ``jax_nvfp4.dot_general`` does.
    """

    def __init__(self, dot_general: NNXDotGeneral):
        self.dot_general = dot_general

    @property
    def recipe(self) -> Recipe:
        return self.dot_general.recipe

    def __call__(self, spec, *operands, precision=None, **kwargs) -> jax.Array:
        return jnp.einsum(
            spec,
            *operands,
            precision=precision,
            _dot_general=self.dot_general.bind(),
            **kwargs,
        )


def _as_data(value: Any) -> Any:
    """``nnx.data(value)`` where Flax has it (>= 0.12), else the value."""
    data = getattr(nnx, "data", None)
    return value if data is None else data(value)


def _iter_graph(node: Any):
    iter_graph = getattr(nnx, "iter_graph", None) or nnx.graph.iter_graph
    return iter_graph(node)


_LAYER_TYPES = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)


def _kernel_shape(layer: nnx.Module) -> tuple[int, ...]:
    kernel = layer.kernel
    value = kernel.get_value() if hasattr(kernel, "get_value") else kernel.value
    return tuple(value.shape)


def _einsum_form(spec: str, kernel_shape: tuple[int, ...]):
    """(K, N, why-not) of an einsum ``input,kernel->output`` over ``kernel_shape``."""
    try:
        inputs, out = spec.split("->")
        lhs, rhs = inputs.split(",")
    except ValueError:
        return None, None, f"einsum {spec!r} is not 'input,kernel->output'"
    if "." in rhs or len(rhs) != len(kernel_shape):
        return None, None, f"einsum {spec!r} does not name each kernel axis"
    batch = [c for c in rhs if c in lhs and c in out]
    if batch:
        return (
            None,
            None,
            (
                f"einsum {spec!r} has batch indices {batch} (a batched product, "
                "not a weight-like projection)"
            ),
        )
    size = dict(zip(rhs, kernel_shape, strict=True))
    k = math.prod(size[c] for c in rhs if c in lhs)
    n = math.prod(size[c] for c in rhs if c not in lhs)
    return k, n, None


def _layer_form(layer: nnx.Module):
    """(per-layer kernel shape, K, N, why it cannot run NVFP4 or None).

    K and N are None where the layer decides them at call time (an
    ``nnx.Einsum`` whose equation is passed to ``__call__``)."""
    if isinstance(layer, nnx.Einsum):
        shape = tuple(layer.kernel_shape)
        if layer.einsum_op is not jnp.einsum and not isinstance(
            layer.einsum_op, NNXEinsumOp
        ):
            return shape, None, None, f"it has a custom einsum_op ({layer.einsum_op!r})"
        if layer.einsum_str is None:
            return shape, None, None, None
        k, n, why = _einsum_form(layer.einsum_str, shape)
        return shape, k, n, why
    if isinstance(layer, nnx.LinearGeneral):
        shape = (
            tuple(layer.batch_axis.values())
            + tuple(layer.in_features)
            + tuple(layer.out_features)
        )
        k, n = math.prod(layer.in_features), math.prod(layer.out_features)
        if layer.batch_axis:
            return shape, k, n, "it has batch_axis (a batched product)"
        if layer.dot_general_cls is not None:
            return shape, k, n, "it has a dot_general_cls"
        current = layer.dot_general
        if current is not None and current is not jax.lax.dot_general:
            if not isinstance(current, NNXDotGeneral):
                return shape, k, n, f"it has a custom dot_general ({current!r})"
        return shape, k, n, None
    shape = (layer.in_features, layer.out_features)
    current = layer.dot_general
    if current is not jax.lax.dot_general and not isinstance(current, NNXDotGeneral):
        return shape, *shape, f"it has a custom dot_general ({current!r})"
    return shape, *shape, None


def _new_dot_general(recipes, rngs, rng_collection: str) -> NNXDotGeneral:
    """The ``NNXDotGeneral`` of a layer, or of a stack of layers whose
    ``recipes`` are one recipe or None (bf16) per layer: its RNG state (and,
    if some layers stay in bf16, its switch) gets the stack's leading axis, so
    that a scan over the stack hands each layer its own keys."""
    recipe = next(r for r in recipes if r is not None)
    if len(recipes) == 1 and not isinstance(recipes, list):
        return NNXDotGeneral(recipe, rngs=rngs, rng_collection=rng_collection)
    switch = None
    if any(r is None for r in recipes):
        switch = jnp.array([r is not None for r in recipes])
    keys = None
    if rngs is not None and recipe.needs_key:
        keys = jax.random.split(_fork_stream(rngs, rng_collection)(), len(recipes))
    if keys is None and switch is None:
        return NNXDotGeneral(recipe, rngs=None, rng_collection=rng_collection)

    def make(keys, switch):
        return NNXDotGeneral(
            recipe, rngs=keys, rng_collection=rng_collection, enabled=switch
        )

    in_axes = (None if keys is None else 0, None if switch is None else 0)
    return nnx.vmap(make, in_axes=in_axes, out_axes=0, axis_size=len(recipes))(
        keys, switch
    )


def convert(
    model: nnx.Module,
    policy: Policy,
    rngs: nnx.Rngs | nnx.RngStream | jax.Array | int | None = None,
    *,
    rng_collection: str = DEFAULT_RNG_COLLECTION,
    strict: bool = True,
) -> nnx.Module:
    """Puts the dense layers of an NNX model that ``policy`` selects in NVFP4,
    in place.

    Layers: ``nnx.Linear``, ``nnx.LinearGeneral`` (several input or feature
    axes fold into one K and one N) and ``nnx.Einsum`` whose equation is
    weight-like (no index shared by input, kernel and output: e.g.
    ``"BTD,DNH->BTNH"``, ``"BTNH,NHD->BTD"``). For each one reached from
    ``model`` (``nnx.iter_graph`` order, a shared layer once), ``path`` is its
    normalised path (``policy.path_string``, e.g. ``"layers.3.mlp.up_proj"``)
    and the policy decides:

    - ``None``: the layer is left untouched (bit-identical to the original).
    - a ``Recipe``: the layer's ``dot_general`` (an Einsum's ``einsum_op``)
      runs the recipe through ``NNXDotGeneral``, with its own RNG stream
      forked from ``rngs[rng_collection]`` (so keys do not depend on call
      order). A layer converted before gets the new recipe and a new stream.

    Stacked layers: a layer whose kernel has one more leading axis than its
    features say (``nnx.vmap``-built blocks run by ``nnx.scan``) is a stack.
    Its RNG state gets the same leading axis, so each layer of the stack and
    each step draws its own stochastic-rounding bits (scan the stack with
    ``in_axes=0`` for all its state, as usual). The policy decides per layer
    with ``Policy.stack_recipes``: where it keeps the last blocks in bf16, a
    per-layer switch (``NVFP4Enabled``, stacked likewise) selects the bf16
    product for them inside the scan (``lax.cond``). Under ``jax.grad`` a
    ``cond`` keeps the residuals of both branches, so such a stack saves the
    bf16 operands as well as the FP4 ones: to save memory, split the stack
    (the last blocks outside it, with an index in their path).

    Layers the policy selects but that cannot run NVFP4 -- K or N (the
    flattened contracted and free kernel dims) not multiples of 16, an einsum
    with batch indices, ``batch_axis``, another custom ``dot_general`` --
    raise a ``ValueError`` naming each of them before anything is changed;
    ``strict=False`` leaves them as they are with a ``UserWarning``. A rule of
    the policy that matches no layer gets a ``UserWarning`` listing the paths
    found (most often a typo in a glob).

    NNX modules are mutable, so the model is modified in place, like other
    NNX surgery; it is also returned for chaining. Parameters are unchanged
    (an optimizer state built before stays valid); each converted layer adds
    RNG state (``nnx.RngKey``/``nnx.RngCount``) to the model's state.

    Args:
      model: an NNX module. (linen modules are immutable: give ``nn.Dense``
        and ``nn.DenseGeneral`` ``LinenDotGeneral``, and use ``LinenEinsum``
        for ``nn.Einsum``; Equinox models: ``jax_nvfp4.equinox.convert``.)
      policy: which layers run in NVFP4 (``jax_nvfp4.policy``).
      rngs: ``nnx.Rngs`` with a ``rng_collection`` (or default) stream, an
        ``nnx.RngStream``, a key or an int seed; None converts for inference
        only (the forward pass works, gradients raise).
      rng_collection: the stream name.
      strict: raise on selected layers that cannot run NVFP4 (default);
        False leaves them as they are, with a warning.

    Returns:
      ``model``.
    """
    if not isinstance(model, nnx.Module):
        hint = "jax_nvfp4.flax.convert takes a Flax NNX module"
        if type(model).__module__.split(".")[0] == "equinox" or _is_equinox(model):
            hint += "; for an Equinox model use jax_nvfp4.equinox.convert"
        elif isinstance(model, linen.Module):
            hint += (
                "; linen modules are immutable: pass dot_general_cls="
                "functools.partial(jax_nvfp4.flax.LinenDotGeneral, recipe=...) "
                "to nn.Dense / nn.DenseGeneral and use jax_nvfp4.flax.LinenEinsum"
            )
        raise TypeError(f"{hint}; got {type(model).__name__}")
    if not isinstance(policy, Policy):
        raise TypeError(
            f"policy must be a jax_nvfp4.policy.Policy, got {type(policy).__name__}"
        )
    if isinstance(rngs, (int, jax.Array)) and not isinstance(rngs, bool):
        rngs = nnx.Rngs(**{rng_collection: rngs})
    paths, selected, problems = [], [], []
    for parts, layer in list(_iter_graph(model)):
        if not isinstance(layer, _LAYER_TYPES):
            continue
        path = path_string(parts)
        paths.append(path)
        shape, k, n, why = _layer_form(layer)
        full = _kernel_shape(layer)
        stack = full[: len(full) - len(shape)]
        if full[len(stack) :] != shape or len(stack) > 1:
            why = why or (
                f"its kernel {list(full)} is not [{', '.join(map(str, shape))}] "
                "or a stack of it along one leading axis"
            )
            recipes = (policy.recipe_for(path),)
        elif stack:
            recipes = policy.stack_recipes(path, stack[0])
        else:
            recipes = (policy.recipe_for(path),)
        if all(r is None for r in recipes):
            continue
        if why is None and k is not None and (k % 16 or n % 16):
            why = f"K={k}, N={n} are not multiples of 16 (NVFP4 blocks)"
        if why is not None:
            problems.append(f"{path} ({type(layer).__name__}: {why})")
            continue
        selected.append((layer, list(recipes) if stack else recipes))
    warn_unmatched_rules(policy, paths)
    if problems:
        message = "the policy selects layers that cannot run NVFP4: " + "; ".join(
            problems
        )
        if strict:
            raise ValueError(
                f"{message}. Exclude them with policy rules (path, None), change "
                "them, or pass strict=False to leave them as they are"
            )
        warnings.warn(f"{message}: they stay as they are", UserWarning, stacklevel=2)
    # Only now change the model: an error above leaves it as it was.
    for layer, recipes in selected:
        dot_general = _new_dot_general(recipes, rngs, rng_collection)
        if isinstance(layer, nnx.Einsum):
            layer.einsum_op = _as_data(NNXEinsumOp(dot_general))
        else:
            layer.dot_general = _as_data(dot_general)
    return model


def _is_equinox(model: Any) -> bool:
    return any(c.__module__.split(".")[0] == "equinox" for c in type(model).__mro__)


def nvfp4_layers(model: nnx.Module) -> dict[str, Recipe]:
    """``{path: recipe}`` of the dense layers of ``model`` in NVFP4 (a stack
    whose last layers stay in bf16 is listed with its recipe)."""
    found = {}
    for parts, node in _iter_graph(model):
        op = None
        if isinstance(node, (nnx.Linear, nnx.LinearGeneral)):
            op = node.dot_general
        elif isinstance(node, nnx.Einsum):
            op = node.einsum_op
        if isinstance(op, (NNXDotGeneral, NNXEinsumOp)):
            found[path_string(parts)] = op.recipe
    return found
