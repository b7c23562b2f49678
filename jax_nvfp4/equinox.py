"""Equinox integration: an NVFP4 stand-in for ``eqx.nn.Linear`` and ``convert``.

``Linear`` holds the same ``weight`` (out, in) and ``bias`` (out,) as
``eqx.nn.Linear`` and computes ``y = x @ weight.T + bias`` with
``jax_nvfp4.dot`` (the FPROP / DGRAD / WGRAD recipe). ``convert(model,
policy)`` swaps every ``eqx.nn.Linear`` that the policy puts in NVFP4 for a
``Linear`` holding the same arrays, with ``eqx.tree_at``; the other layers are
left untouched (bit-identical to the original model).

Batching: what folds where. Equinox layers are written per example and run
under ``jax.vmap``. Run literally, that would quantize and multiply each
example on its own: one sequence (or one token) padded to a block of 16 for
the token-axis quantization, a per-example amax, and a per-example weight
gradient [batch, in, out] that is then summed. ``Linear`` instead folds the
enclosing ``vmap``s into the token axis: it binds a primitive whose batching
rule reshapes x [batch, ..., in] to [batch * ..., in] and calls the layer's
product again, so nested maps (batch x sequence positions) fold into one
``dot`` over all tokens -- three GEMMs in all, with the weight gradient
reduced inside WGRAD -- exactly the computation of ``dot`` on the folded
tokens, forward and backward. The fold reaches through the bodies that JAX
traces into a jaxpr and that a ``vmap`` then batches as a whole: a
``lax.scan`` over stacked layers, ``jax.checkpoint`` (with or without a
policy such as ``save_fp4_residuals``), ``jit``, ``lax.cond``. So
``jax.vmap(model)`` of a model that scans its blocks runs one GEMM per layer
over all of the batch's tokens (batch 3 x 40 positions: one GEMM of 120
tokens, not three of 40 padded to 48), under ``grad`` too.

The primitive is bound only where the innermost transformation is a
``vmap``, or a chain of such traced bodies whose first enclosing
transformation is a ``vmap`` (read from JAX's trace state; where the names
it reads are missing, the layer never folds). Its batching rule folds; if it
is differentiated before any ``vmap`` batched it -- the ``vmap`` mapped none
of the scan's operands and handed the scan on unbatched -- its derivative is
that of the plain ``dot``, and evaluated or compiled unbatched it is the plain
``dot``. Where the innermost transformation is ``grad`` or ``jit`` -- in
particular ``jax.vmap(jax.grad(loss))`` for per-example gradients, or a scan
inside ``grad`` inside ``vmap`` -- the layer calls ``dot`` directly and JAX
batches it per example: correct (a per-example amax and weight gradient, as
such a computation asks for), without the fold. A weight mapped by the
``vmap`` (an ensemble) is not folded either. Explicitly sharded operands
(``jax.sharding.AxisType.Explicit``) are not folded.

Stacked layers. ``eqx.filter_vmap(make_block)(keys)`` builds blocks whose
arrays have a leading layer axis, run by ``lax.scan``; an ``eqx.nn.Linear``
in there has weight [L, out, in]. ``convert`` makes it one stacked
``Linear`` (weight [L, out, in]) so each scan step sees an ordinary
``Linear``. The policy decides per layer with ``Policy.stack_recipes``: the
rules see the stack's path (no block index, e.g. ``"layers.mlp.up_proj"``),
and ``keep_last`` puts the last blocks of a stack of ``num_layers`` blocks
in bf16. Such a mixed stack holds a per-layer switch ``nvfp4`` (bool [L],
sliced by the scan like the weight); each step then picks the NVFP4 product
or the bf16 one (``eqx.nn.Linear``'s own computation) with ``lax.cond``.
Under ``grad`` a ``cond`` keeps the residuals of both branches, so a mixed
stack saves x in bf16 as well as its FP4 copy (``jax.checkpoint`` with
``save_fp4_residuals`` around the scan body keeps only the FP4 ones); to
avoid the cond, keep the last blocks out of the stack.

Keys. Stochastic rounding of the backward pass needs a key, a new one each
step, when the recipe uses it (``Recipe.needs_key``). A layer takes it from,
in this order: ``layer(x, key=key)``; else the innermost active
``with jax_nvfp4.equinox.keys(step_key):``, from which each call draws
``fold_in(step_key, n)`` with n counting the calls made in that block while
JAX traces it (for models such as ``eqx.nn.MLP`` that pass no key to their
layers); else, in inference mode (``eqx.nn.inference_mode(model)``, where no
gradient is expected), a fixed key; else it raises. The count runs at trace
time: a ``lax.scan`` body is traced once, so every layer of a scanned stack
draws the same key from an enclosing ``keys`` block -- pass per-layer keys
through the scan instead (``key=`` or a ``keys(layer_key)`` block inside the
body). Enter ``keys`` inside the jitted step with the step's key as an
argument: a key captured from outside a traced function would be a constant
of the compiled step (the same bits every step), which raises. Under
``vmap`` pass one key for the whole batch (``in_axes=None``, as usual for a
model's key) or a key per example: the fold makes one ``dot`` over the
whole batch, so a batch of keys is reduced to the first one. Either way every
element of the folded tensor draws its own random bits (they are indexed by
the element's position in the folded tensor).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from jax_nvfp4.fold import folded_dot, trace_classes
from jax_nvfp4.policy import Policy, path_string, warn_unmatched_rules
from jax_nvfp4.recipe import NVFP4, Recipe

__all__ = ["Linear", "convert", "keys", "linear_paths", "plan"]


# --------------------------------------------------------------------- keys


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


def _key_words(key: jax.Array | None, recipe: Recipe, inference: bool) -> jax.Array:
    """uint32[2] words of ``key`` (typed or raw); a fixed key when unused."""
    if not recipe.needs_key:
        return jnp.zeros((2,), jnp.uint32)
    if key is None and _source_stack():
        key = _source_stack()[-1].draw()
    if key is None:
        if inference:
            return jnp.zeros((2,), jnp.uint32)
        raise ValueError(
            "this jax_nvfp4.equinox.Linear's recipe uses stochastic rounding in "
            "the backward pass: call it with key=... (a new key each step) or "
            "inside a `with jax_nvfp4.equinox.keys(step_key):` block, put the "
            "model in inference mode (eqx.nn.inference_mode(model)) when no "
            "gradient is taken, or convert with a recipe without stochastic "
            "rounding (jax_nvfp4.NVFP4_NO_SR)"
        )
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        data = jax.random.key_data(key)
        if data.shape[-1:] == (2,) and data.dtype == jnp.uint32:
            return data
        return jax.random.bits(key, (2,), jnp.uint32)
    if key.shape[-1:] != (2,) or key.dtype != jnp.uint32:
        raise ValueError(
            "key must be a jax.random.key(...) or a uint32[2] PRNGKey, got "
            f"{key.dtype}{list(key.shape)}"
        )
    return key


# ------------------------------------------------------------------- module


class Linear(eqx.Module):
    """A stand-in for ``eqx.nn.Linear`` that runs the NVFP4 training recipe.

    ``y = x @ weight.T + bias`` through ``jax_nvfp4.dot`` (x quantized along
    ``in``, the weight in 16x16 blocks, the backward GEMMs as the recipe says).
    The weight is cast to x's dtype first, so fp32 master weights work with
    bf16 activations; the output has x's dtype.

    A stack of layers (``eqx.filter_vmap``-built, run by ``lax.scan``) is one
    ``Linear`` whose arrays have leading layer axes: weight [L, out, in]. It
    is called per layer (each scan step, or after indexing its arrays).

    Attributes:
      weight: (out_features, in_features), as in ``eqx.nn.Linear``; a stack
        has leading layer axes.
      bias: (out_features,) or None (a stack: with the same leading axes).
      in_features, out_features: multiples of 16 (NVFP4 blocks).
      use_bias: whether ``bias`` is used.
      recipe: the ``jax_nvfp4.Recipe`` of the three GEMMs.
      inference: when True and no key is given, stochastic rounding uses a
        fixed key (set by ``eqx.nn.inference_mode``; for evaluation only).
      nvfp4: None (every layer runs ``recipe``), or a bool array with the
        weight's leading axes: per layer of a stack, True runs ``recipe`` and
        False the bf16 product of ``eqx.nn.Linear`` (see the module docstring).
    """

    weight: jax.Array
    bias: jax.Array | None
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    recipe: Recipe = eqx.field(static=True)
    inference: bool = False
    nvfp4: jax.Array | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        use_bias: bool = True,
        dtype: Any = None,
        *,
        recipe: Recipe = NVFP4,
        inference: bool = False,
        key: jax.Array,
    ):
        """Initialises like ``eqx.nn.Linear`` (uniform in +-1/sqrt(in))."""
        for name, n in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(n, int) or isinstance(n, bool):
                raise TypeError(
                    f"{name} must be an int (the 'scalar' features of "
                    f"eqx.nn.Linear are not supported), got {n!r}"
                )
        _check_shape(in_features, out_features, recipe, "Linear")
        linear = eqx.nn.Linear(
            in_features, out_features, use_bias=use_bias, dtype=dtype, key=key
        )
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.recipe = recipe
        self.inference = inference
        self.nvfp4 = None

    @classmethod
    def from_linear(
        cls,
        linear: eqx.nn.Linear | Linear,
        recipe: Recipe = NVFP4,
        *,
        path: str = "",
        nvfp4: Any = None,
    ) -> Linear:
        """A ``Linear`` holding ``linear``'s own weight and bias arrays.

        ``linear`` may be a stack (weight [L, out, in]); ``nvfp4`` is then
        None or a bool per layer (see the class docstring). A ``Linear``
        given here keeps its ``inference`` flag and gets the new recipe.
        """
        if not isinstance(linear.in_features, int) or not isinstance(
            linear.out_features, int
        ):
            raise TypeError(
                f"{path or 'the layer'}: eqx.nn.Linear with 'scalar' features "
                "cannot run in NVFP4; keep it in bf16 with a policy rule "
                f"({path!r}, None)"
            )
        _check_shape(linear.in_features, linear.out_features, recipe, path)
        lead = linear.weight.shape[:-2]
        if nvfp4 is not None:
            nvfp4 = jnp.asarray(nvfp4, bool)
            if nvfp4.shape != lead:
                raise ValueError(
                    f"{path or 'Linear'}: nvfp4 has shape {nvfp4.shape}; the "
                    f"stack's layer axes are {lead}"
                )
        # Build the module abstractly (no random initialisation), then put the
        # layer's own arrays in.
        template = eqx.filter_eval_shape(
            cls,
            linear.in_features,
            linear.out_features,
            linear.use_bias,
            linear.weight.dtype,
            recipe=recipe,
            inference=bool(getattr(linear, "inference", False)),
            key=jax.random.key(0),
        )
        return _fill(template, linear.weight, linear.bias, nvfp4)

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        """x [..., in_features] -> [..., out_features] (x's dtype).

        Args:
          x: one example's features (the usual Equinox call under ``vmap``) or
            any leading dimensions of tokens.
          key: PRNG key for stochastic rounding in the backward pass (see the
            module docstring); unused when the recipe has no stochastic
            rounding.
        """
        if self.weight.ndim != 2:
            raise ValueError(
                f"this Linear is a stack of layers (weight {self.weight.shape}): "
                "call it per layer, inside a lax.scan over its arrays or after "
                "indexing them"
            )
        if x.shape[-1:] != (self.in_features,):
            raise ValueError(
                f"x has shape {x.shape}; this Linear takes [..., {self.in_features}]"
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"x must be floating point, got {x.dtype}")
        kd = _key_words(key, self.recipe, self.inference)
        nvfp4 = functools.partial(_nvfp4_product, self.recipe)
        operands = (x, self.weight, self.bias, kd)
        flag = self.nvfp4
        if flag is None:
            return nvfp4(*operands)
        if not isinstance(flag, jax.core.Tracer):  # known now: no cond
            return nvfp4(*operands) if bool(flag) else _bf16_product(*operands)
        return jax.lax.cond(flag, nvfp4, _bf16_product, *operands)


def _nvfp4_product(recipe: Recipe, x, weight, bias, kd):
    y = folded_dot(recipe, x, weight.astype(x.dtype), kd)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y


def _bf16_product(x, weight, bias, kd):
    """``eqx.nn.Linear``'s computation, in x's dtype like ``_nvfp4_product``."""
    del kd  # no stochastic rounding
    y = weight @ x if x.ndim == 1 else x @ weight.T
    if bias is not None:
        y = y + bias
    return y.astype(x.dtype)


def _fill(template, weight, bias, nvfp4=None):
    """``template`` (a Linear or an eqx.nn.Linear) holding these arrays."""
    module = eqx.tree_at(lambda m: m.weight, template, weight)
    if bias is not None:
        module = eqx.tree_at(lambda m: m.bias, module, bias)
    if nvfp4 is not None:
        module = eqx.tree_at(
            lambda m: m.nvfp4, module, nvfp4, is_leaf=lambda n: n is None
        )
    return module


def _to_eqx_linear(layer: Linear) -> eqx.nn.Linear:
    """The ``eqx.nn.Linear`` holding a ``Linear``'s arrays (bf16 again)."""
    template = eqx.filter_eval_shape(
        eqx.nn.Linear,
        layer.in_features,
        layer.out_features,
        layer.use_bias,
        layer.weight.dtype,
        key=jax.random.key(0),
    )
    return _fill(template, layer.weight, layer.bias)


def _check_shape(k: int, n: int, recipe: Recipe, path: str) -> None:
    if (recipe.fprop or recipe.dgrad or recipe.wgrad) and (k % 16 or n % 16):
        raise ValueError(
            f"{path or 'Linear'}: in_features={k}, out_features={n}; NVFP4 "
            "needs multiples of 16 -- keep this layer in bf16 (a policy rule "
            f"({path!r}, None)) or pad it"
        )


# ---------------------------------------------------------------- converter


def _is_linear(node: Any) -> bool:
    return isinstance(node, (eqx.nn.Linear, Linear))


def _stack_size(layer: eqx.nn.Linear | Linear) -> int | None:
    """L for a stack (weight [L, ..., out, in]); None for one layer."""
    return layer.weight.shape[0] if layer.weight.ndim > 2 else None


def linear_paths(model: Any) -> dict[str, eqx.nn.Linear | Linear]:
    """``{path: layer}`` for every ``eqx.nn.Linear`` and ``Linear`` in ``model``.

    Paths are ``policy.path_string`` of the pytree path: field names and list
    indices joined by "." (e.g. ``"layers.3.mlp.up_proj"``). A stack of layers
    (weight [L, out, in]) is one entry, at the stack's path.
    """
    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_linear)[0]
    return {path_string(p): leaf for p, leaf in leaves if _is_linear(leaf)}


def _decide(policy: Policy, path: str, layer) -> Recipe | None | tuple:
    """The policy's recipe for a layer, or a stack's tuple of them."""
    size = _stack_size(layer)
    if size is None:
        return policy.recipe_for(path)
    return policy.stack_recipes(path, size)


def plan(model: Any, policy: Policy) -> dict[str, Recipe | None | tuple]:
    """What ``convert`` would do: ``{path: recipe or None}`` for every linear
    layer of ``model`` (None: bf16, an ``eqx.nn.Linear``), and for a stack a
    tuple with each layer's."""
    return {path: _decide(policy, path, layer) for path, layer in _linears(model)}


def _linears(model: Any) -> list[tuple[str, eqx.nn.Linear | Linear]]:
    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_linear)[0]
    return [(path_string(p), leaf) for p, leaf in leaves if _is_linear(leaf)]


def _reject_flax(model: Any) -> None:
    """Flax modules (linen or NNX) belong to jax_nvfp4.flax; told apart by
    their classes' module names, so flax need not be installed."""
    for cls in type(model).__mro__:
        module = getattr(cls, "__module__", "") or ""
        if module == "flax" or module.startswith("flax."):
            raise TypeError(
                f"{type(model).__name__} is a Flax module ({cls.__module__}."
                f"{cls.__qualname__}); convert Flax NNX models with "
                "jax_nvfp4.flax.convert (linen: give nn.Dense "
                "dot_general_cls=jax_nvfp4.flax.LinenDotGeneral). "
                "jax_nvfp4.equinox.convert takes Equinox models"
            )


def _replacement(layer, decided, path: str):
    """The layer ``convert`` puts at ``path``."""
    if isinstance(decided, tuple):  # a stack
        recipes = {r for r in decided if r is not None}
        if len(recipes) > 1:  # pragma: no cover - Policy gives one per stack
            raise ValueError(f"{path}: one recipe per stack, got {recipes}")
        if not recipes:
            decided = None
        else:
            (recipe,) = recipes
            if all(r is not None for r in decided):
                return Linear.from_linear(layer, recipe, path=path)
            per_layer = jnp.asarray([r is not None for r in decided], bool)
            lead = layer.weight.shape[:-2]
            per_layer = jnp.broadcast_to(
                per_layer.reshape(-1, *(1,) * (len(lead) - 1)), lead
            )
            return Linear.from_linear(layer, recipe, path=path, nvfp4=per_layer)
    if decided is None:
        return layer if isinstance(layer, eqx.nn.Linear) else _to_eqx_linear(layer)
    return Linear.from_linear(layer, decided, path=path)


def convert(model: Any, policy: Policy) -> Any:
    """Puts the linear layers of ``model`` that ``policy`` selects in NVFP4.

    Every ``eqx.nn.Linear`` (and every ``Linear``, so that converting again
    applies the new policy) at path ``p`` (see ``linear_paths``) becomes:

    - ``policy.recipe_for(p)`` is a Recipe: a ``Linear`` with that recipe,
      holding the same weight and bias arrays;
    - None: an ``eqx.nn.Linear`` (the same layer if it was one).

    A stack of layers (weight [L, out, in], built by ``eqx.filter_vmap`` and
    run by ``lax.scan``) is decided per layer by ``policy.stack_recipes(p,
    L)``: all in NVFP4, all in bf16, or -- where ``keep_last`` keeps its last
    layers in bf16 -- a stacked ``Linear`` with a per-layer ``nvfp4`` switch
    (see the module docstring).

    Args:
      model: an Equinox model (a pytree of modules).
      policy: a ``jax_nvfp4.policy.Policy``. A rule whose glob matches no
        linear layer gets a ``UserWarning`` listing the paths found.

    Returns:
      A new model (built with ``eqx.tree_at``): everything but the converted
      layers is unchanged and holds the same arrays. The model's code passes
      ``key=`` to the layers, or runs inside ``keys(step_key)``, when their
      recipe uses stochastic rounding.
    """
    _reject_flax(model)
    if not isinstance(policy, Policy):
        raise TypeError(
            f"policy must be a jax_nvfp4.policy.Policy, got {type(policy).__name__}"
        )
    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_linear)[0]
    found = [(kp, leaf) for kp, leaf in leaves if _is_linear(leaf)]
    warn_unmatched_rules(policy, [path_string(kp) for kp, _ in found], stacklevel=3)
    wheres, replacements = [], []
    for key_path, leaf in found:
        path = path_string(key_path)
        new = _replacement(leaf, _decide(policy, path, leaf), path)
        if new is not leaf:
            wheres.append(key_path)
            replacements.append(new)
    if not wheres:
        return model

    def where(m):
        return [_get(m, key_path) for key_path in wheres]

    return eqx.tree_at(where, model, replace=replacements, is_leaf=_is_linear)


def _get(node: Any, key_path) -> Any:
    """The node at a ``jax.tree_util`` key path (attribute, index or dict key)."""
    for entry in key_path:
        if isinstance(entry, jax.tree_util.GetAttrKey):
            node = getattr(node, entry.name)
        elif isinstance(entry, jax.tree_util.SequenceKey):
            node = node[entry.idx]
        elif isinstance(entry, jax.tree_util.DictKey):
            node = node[entry.key]
        else:
            raise TypeError(
                f"cannot follow the tree path entry {entry!r} "
                f"({type(entry).__name__}) to a layer; convert supports modules, "
                "lists, tuples and dicts"
            )
    return node
