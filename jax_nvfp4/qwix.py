"""Qwix integration: jax_nvfp4's NVFP4 training recipe as a qwix provider.

`Qwix <https://github.com/google/qwix>`_ quantizes a Flax model without
editing it: ``qwix.quantize_model(model, provider)`` intercepts the
``jax.lax.dot_general`` and ``jnp.einsum`` calls made inside the model's
modules, and the provider decides, by rules matched against the module path,
how each one runs. ``NvFp4Provider`` runs the matched ones with
``jax_nvfp4.dot_general`` and a ``Recipe`` (FPROP, DGRAD and WGRAD in NVFP4,
stochastic rounding of dY, RHT on WGRAD's inputs)::

    import qwix
    from jax_nvfp4.qwix import NvFp4Provider, NvFp4Rule

    provider = NvFp4Provider([
        qwix.QtRule(module_path=r".*/lm_head"),        # no qtype: stays bf16
        NvFp4Rule(module_path=r"decoder/.*layers.*"),  # NVFP4 (jax_nvfp4.NVFP4)
    ])
    qmodel = qwix.quantize_model(model, provider)           # linen
    qmodel = qwix.quantize_model(model, provider, x)        # NNX (runs x once)

Rules are qwix's, first match wins. ``NvFp4Rule`` is a ``qwix.QtRule`` with
``weight_qtype="nvfp4"`` and a ``recipe`` (None: the provider's). A plain
``qwix.QtRule(weight_qtype="nvfp4")`` selects the provider's recipe too; a
rule without ``weight_qtype`` leaves what it matches unquantized. The
recipe fixes how activations and gradients are quantized, so ``act_qtype``
and ``bwd_qtype`` may only be None or ``"nvfp4"``, and QtRule's other
numerics settings (tiles, calibration, qwix's own stochastic rounding) must
keep their defaults.

What runs in NVFP4. In a matched module, a product of a weight (one of the
module's params, as qwix finds it) with an activation, without batch
dimensions: ``nn.Dense``/``nn.DenseGeneral``/``nnx.Linear``/
``nnx.LinearGeneral`` and einsum projections such as ``"BTD,DNH->BTNH"`` and
``"BTNH,NHD->BTD"`` (the weight may come first in the einsum). The weight's
contracting dims fold into K and its free dims into N (both multiples of 16).
And ``jax.lax.ragged_dot`` of rows sorted by group with weights [G, K, N]
(mixture-of-experts projections, as MaxText's MoE runs them): through
``jax_nvfp4.ragged_dot``. Everything else — activation x activation products
such as attention scores, products with batch dimensions, a ragged_dot with
a ``group_offset``, modules no rule matches, and convolutions (not
intercepted) — runs exactly as without the provider, bit for bit.

Stochastic-rounding keys (only the backward pass uses them; the forward pass
is the same with or without a key):

- linen: each NVFP4 product draws ``module.make_rng("nvfp4")`` in the module
  that calls it. Pass ``rngs={"nvfp4": step_key}`` to ``apply`` with a new key
  each step; Flax folds in the module path and a per-call count. Under
  ``nn.scan`` split the stream like any other (``split_rngs={"nvfp4": True}``).
- NNX: each NVFP4 product draws ``rngs.nvfp4()`` from the ``nnx.Rngs`` that
  qwix looks for on every module as ``qwix_rngs`` (qwix's own way to hand
  keys to NNX modules; ``quantize_model`` leaves it None). After
  ``quantize_model`` call ``set_rngs(qmodel, nnx.Rngs(nvfp4=seed))``: the
  stream's count is model state, so under ``nnx.jit`` each step draws new
  keys (in call order) and re-running from a saved state reproduces them.

Without a key (no stream), the forward pass runs and differentiating it
raises a ``ValueError`` that says how to pass one. Recipes without stochastic
rounding (``jax_nvfp4.NVFP4_NO_SR``) never need a key.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import opt_einsum
import qwix
from flax import linen, nnx
from qwix._src.utils import flax_util

from jax_nvfp4.dot import product_general
from jax_nvfp4.ragged_dot import ragged_dot
from jax_nvfp4.recipe import NVFP4, Recipe
from jax_nvfp4.recipe.steps import recipe_words

__all__ = [
    "DEFAULT_RNG_COLLECTION",
    "QTYPE",
    "NvFp4Provider",
    "NvFp4Rule",
    "set_rngs",
]

DEFAULT_RNG_COLLECTION = "nvfp4"
# The qtype that selects jax_nvfp4's recipe in a rule.
QTYPE = "nvfp4"

# QtRule fields a rule for NvFp4Provider sets; the others must keep their
# defaults (the recipe decides the numerics).
_RULE_KEYS = ("module_path", "op_names", "weight_qtype", "act_qtype", "bwd_qtype")


@dataclasses.dataclass(frozen=True, kw_only=True)
class NvFp4Rule(qwix.QtRule):
    """A ``qwix.QtRule`` that runs the matched products by an NVFP4 recipe.

    Attributes:
      module_path: regex matched (``re.fullmatch``) against the module path,
        names joined by ``"/"`` (linen ``module.path``; NNX attribute names
        and indices from the root, e.g. ``"layers/0/mlp/wi_0"``).
      op_names: the ops it applies to, ``"dot_general"`` and/or ``"einsum"``
        (empty: both).
      weight_qtype: ``"nvfp4"``; None leaves the matched ops unquantized.
      recipe: the ``jax_nvfp4.Recipe``; None takes the provider's.
    """

    weight_qtype: jax.typing.DTypeLike | None = QTYPE
    recipe: Recipe | None = None


def _is_nvfp4(qtype) -> bool:
    return isinstance(qtype, str) and qtype == QTYPE


class NvFp4Provider(qwix.QtProvider):
    """A qwix provider running matched dot_general/einsum products by jax_nvfp4.

    Args:
      rules: ``NvFp4Rule`` or ``qwix.QtRule`` (``weight_qtype`` ``"nvfp4"``,
        or None for unquantized), first match wins.
      recipe: the recipe of rules that name none (default ``jax_nvfp4.NVFP4``).
      rng_collection: the RNG stream the stochastic-rounding keys come from
        (linen ``make_rng`` stream; NNX ``qwix_rngs`` stream).
      strict: a matched weight whose K or N is not a multiple of 16 raises a
        ``ValueError`` naming the module (default); False runs that product
        unquantized with a ``UserWarning``.
      disable_jit: passed to qwix (run the intercepted methods without jit).
    """

    def __init__(
        self,
        rules: Sequence[qwix.QuantizationRule],
        *,
        recipe: Recipe = NVFP4,
        rng_collection: str = DEFAULT_RNG_COLLECTION,
        strict: bool = True,
        disable_jit: bool = False,
    ):
        _check_recipe(recipe, "recipe")
        if not isinstance(rng_collection, str) or not rng_collection:
            raise TypeError(
                f"rng_collection must be a stream name, got {rng_collection!r}"
            )
        # Set before qwix's __init__, which calls _init_rule on every rule.
        self.recipe = recipe
        self.rng_collection = rng_collection
        self.strict = strict
        super().__init__(rules, disable_jit=disable_jit)

    @property
    def rules(self) -> tuple[qwix.QuantizationRule, ...]:
        """The rules as the provider uses them (NVFP4 ones as ``NvFp4Rule``
        with their recipe)."""
        return tuple(self._rules)

    def _init_rule(self, rule: qwix.QuantizationRule) -> qwix.QtRule:
        if not isinstance(rule, qwix.QuantizationRule):
            raise TypeError(
                f"rules must be qwix.QtRule or NvFp4Rule, got {type(rule).__name__}"
            )
        rule = super()._init_rule(rule)
        if rule.weight_qtype is None:
            return rule  # matched ops stay unquantized
        where = f"rule module_path={rule.module_path!r}"
        if not _is_nvfp4(rule.weight_qtype):
            raise ValueError(
                f"NvFp4Provider runs jax_nvfp4's NVFP4 recipe: {where} has "
                f"weight_qtype={rule.weight_qtype!r}; use {QTYPE!r} (or "
                "NvFp4Rule), or None to leave the matched ops unquantized"
            )
        for name in ("act_qtype", "bwd_qtype"):
            value = getattr(rule, name)
            if value is not None and not _is_nvfp4(value):
                raise ValueError(
                    f"{where} has {name}={value!r}: the NVFP4 recipe quantizes "
                    f"activations and gradients itself; leave {name} None or "
                    f"{QTYPE!r} and choose the recipe (NvFp4Rule(recipe=...))"
                )
        default = super()._init_rule(qwix.QtRule())
        changed = [
            field.name
            for field in dataclasses.fields(qwix.QtRule)
            if field.name not in _RULE_KEYS
            and getattr(rule, field.name) != getattr(default, field.name)
        ]
        if changed:
            raise ValueError(
                f"{where} sets {', '.join(changed)}, which qwix's own "
                "quantization reads; the NVFP4 recipe fixes those numerics "
                "(choose its switches with NvFp4Rule(recipe=jax_nvfp4.Recipe("
                "...)))"
            )
        rule_recipe = getattr(rule, "recipe", None) or self.recipe
        _check_recipe(rule_recipe, f"{where}: recipe")
        values = {f.name: getattr(rule, f.name) for f in dataclasses.fields(rule)}
        values["recipe"] = rule_recipe
        return NvFp4Rule(**values)

    def get_intercept_map(self):
        """dot_general, einsum and ragged_dot (expert projections):
        convolutions are left alone (no NVFP4 form)."""
        return qwix.QuantizationProvider.get_intercept_map(self) | {
            "jax.lax.dot_general": self.dot_general,
            "jax.numpy.einsum": self.einsum,
            "jax.lax.ragged_dot": self.ragged_dot,
        }

    def ragged_dot(
        self,
        lhs: jax.Array,
        rhs: jax.Array,
        group_sizes: jax.Array,
        precision=None,
        preferred_element_type=None,
        group_offset=None,
    ) -> jax.Array:
        """``jax.lax.ragged_dot`` inside the quantized model: in a matched
        module, rows sorted by group times one weight [G, K, N] per group
        (expert projections) run ``jax_nvfp4.ragged_dot``; a ``group_offset``
        (a shard of the groups) runs as called."""
        rule, op_id = self._get_current_rule_and_op_id("ragged_dot")

        def unquantized():
            return jax.lax.ragged_dot(
                lhs,
                rhs,
                group_sizes,
                precision=precision,
                preferred_element_type=preferred_element_type,
                group_offset=group_offset,
            )

        if rule is None or rule.weight_qtype is None or group_offset is not None:
            return unquantized()
        # ragged_dot's [G, K, N] operand is one weight per group by the op's
        # definition, so it is not looked up among the module's params (which
        # fails inside a shard_map, where MaxText runs its experts, and for
        # weights of one shape such as wi_0 and wi_1).
        if (
            jnp.ndim(lhs) != 2
            or jnp.ndim(rhs) != 3
            or not self._fits(op_id, rhs, (1,), batch=1)
        ):
            return unquantized()
        recipe = rule.recipe
        key = self._key() if recipe.needs_key else None
        if preferred_element_type is not None:
            preferred_element_type = jnp.dtype(preferred_element_type)
        dtype = jnp.result_type(lhs, rhs)
        return ragged_dot(
            lhs.astype(dtype),
            rhs.astype(dtype),
            group_sizes,
            key=key,
            recipe=recipe,
            preferred_element_type=preferred_element_type,
        )

    def dot_general(
        self,
        lhs: jax.Array,
        rhs: jax.Array,
        dimension_numbers,
        precision=None,
        preferred_element_type=None,
        *,
        out_sharding=None,
    ) -> jax.Array:
        """``jax.lax.dot_general`` inside the quantized model."""
        rule, op_id = self._get_current_rule_and_op_id("dot_general")

        def unquantized():
            return jax.lax.dot_general(
                lhs,
                rhs,
                dimension_numbers,
                precision=precision,
                preferred_element_type=preferred_element_type,
                out_sharding=out_sharding,
            )

        if rule is None or rule.weight_qtype is None:
            return unquantized()
        (lc, rc), (lb, rb) = dimension_numbers
        if tuple(lb) or tuple(rb):
            return unquantized()
        lc = tuple(d % lhs.ndim for d in lc)
        rc = tuple(d % rhs.ndim for d in rc)
        if _is_param(rhs):
            out = self._nvfp4(rule, op_id, lhs, rhs, lc, rc, preferred_element_type)
        elif _is_param(lhs):
            out = self._nvfp4(rule, op_id, rhs, lhs, rc, lc, preferred_element_type)
            if out is not None:  # [rhs free, lhs free] -> lax's [lhs free, rhs free]
                rhs_free = rhs.ndim - len(rc)
                out = jnp.transpose(out, (*range(rhs_free, out.ndim), *range(rhs_free)))
        else:
            out = None
        if out is None:
            return unquantized()
        return _constrain(out, out_sharding)

    def einsum(
        self,
        subscripts,
        *operands,
        precision=None,
        preferred_element_type=None,
        _dot_general: Callable[..., jax.Array] = jax.lax.dot_general,
        out_sharding=None,
        **kwargs,
    ) -> jax.Array:
        """``jnp.einsum`` inside the quantized model. A matched two-operand
        einsum of a weight and an activation without batch indices runs as
        one NVFP4 product and a transpose; any other runs as called."""
        rule, op_id = self._get_current_rule_and_op_id("einsum")

        def unquantized():
            return jnp.einsum(
                subscripts,
                *operands,
                precision=precision,
                preferred_element_type=preferred_element_type,
                _dot_general=_dot_general,
                out_sharding=out_sharding,
                **kwargs,
            )

        if rule is None or rule.weight_qtype is None:
            return unquantized()
        plan = _einsum_plan(subscripts, operands)
        if plan is None:
            return unquantized()
        x, w, xc, wc, perm = plan
        dtype = jnp.result_type(x, w)
        x, w = x.astype(dtype), w.astype(dtype)
        out = self._nvfp4(rule, op_id, x, w, xc, wc, preferred_element_type)
        if out is None:
            return unquantized()
        if perm != tuple(range(out.ndim)):
            out = jnp.transpose(out, perm)
        return _constrain(out, out_sharding)

    def _nvfp4(
        self, rule: NvFp4Rule, op_id: str, x, w, xc, wc, preferred_element_type
    ) -> jax.Array | None:
        """x . w contracting x's dims xc with w's wc (no batch dims) by the
        rule's recipe: [x free, w free]. None where the shape has no NVFP4
        form and ``strict`` is off (the caller runs it unquantized)."""
        if not self._fits(op_id, w, wc):
            return None
        recipe = rule.recipe
        key = self._key() if recipe.needs_key else None
        if preferred_element_type is not None:
            preferred_element_type = jnp.dtype(preferred_element_type)
        return product_general(
            x,
            w,
            ((tuple(xc), tuple(wc)), ((), ())),
            None,
            preferred_element_type,
            recipe=recipe,
            words=recipe_words(key, recipe),
            missing_key_message=self._missing_key_message(),
        )

    def _fits(self, op_id: str, w, wc, batch: int = 0) -> bool:
        """Whether the weight w, contracted over its dims wc (after ``batch``
        leading group dims), has an NVFP4 form: K and N multiples of 16.
        Where not, raises (``strict``) or warns that it stays unquantized."""
        free = [d for d in range(batch, w.ndim) if d not in wc]
        k = math.prod(w.shape[d] for d in wc)
        n = math.prod(w.shape[d] for d in free)
        if k % 16 == 0 and n % 16 == 0:
            return True
        message = (
            f"{_module_path()} ({op_id}): NVFP4 needs the weight's "
            f"contracted size K and free size N to be multiples of 16; its "
            f"shape {tuple(w.shape)} contracts dims {tuple(wc)} (K={k}, N={n})"
        )
        if self.strict:
            raise ValueError(
                f"{message}. Exclude it with a rule qwix.QtRule("
                "module_path=...) before the NVFP4 rule, or pass "
                "strict=False to leave such products unquantized"
            )
        warnings.warn(f"{message}: it stays unquantized", UserWarning, stacklevel=4)
        return False

    def _key(self) -> jax.Array | None:
        """The next stochastic-rounding key of the current module, or None."""
        module = flax_util.get_current_module()
        stream = self.rng_collection
        if isinstance(module, linen.Module):
            return module.make_rng(stream) if module.has_rng(stream) else None
        rngs = getattr(module, "qwix_rngs", None)
        if isinstance(rngs, nnx.Rngs):
            try:
                return rngs[stream]()
            except KeyError:
                return None
        return None

    def _missing_key_message(self) -> str:
        stream = self.rng_collection
        return (
            "this NVFP4 product (qwix NvFp4Provider) was differentiated "
            f"without a key for stochastic rounding: no {stream!r} RNG stream. "
            f"In linen pass rngs={{{stream!r}: step_key}} to apply (a new key "
            "each step); in NNX set the stream on the quantized model with "
            f"jax_nvfp4.qwix.set_rngs(model, nnx.Rngs({stream}=seed)). Or use "
            "a recipe without stochastic rounding (jax_nvfp4.NVFP4_NO_SR)."
        )


def set_rngs(
    model: nnx.Module,
    rngs: nnx.Rngs | jax.Array | int,
    *,
    rng_collection: str = DEFAULT_RNG_COLLECTION,
) -> nnx.Module:
    """Gives a quantized NNX model the stream its NVFP4 products draw from.

    Sets ``qwix_rngs`` — where qwix's NNX modules look for keys — on every
    module of ``model`` to one shared ``nnx.Rngs`` (marked as data, so its
    count is model state). Each NVFP4 product then draws the stream's next
    key: call it once after ``qwix.quantize_model`` (which leaves
    ``qwix_rngs`` None) and let the count advance under ``nnx.jit``, or call
    it again to re-seed.

    Args:
      model: the NNX model returned by ``qwix.quantize_model``.
      rngs: an ``nnx.Rngs`` with a ``rng_collection`` (or ``default``)
        stream, or a key or int seed for one.
      rng_collection: the provider's stream name.

    Returns:
      ``model`` (changed in place).
    """
    if not isinstance(rngs, nnx.Rngs):
        rngs = nnx.Rngs(**{rng_collection: rngs})
    if rng_collection not in rngs and "default" not in rngs:
        raise ValueError(
            f"rngs has no {rng_collection!r} stream (and no default stream); "
            f"pass nnx.Rngs({rng_collection}=seed)"
        )
    iter_modules = getattr(nnx, "iter_modules", None)  # Flax >= 0.12
    modules = iter_modules(model) if iter_modules else model.iter_modules()
    for _, module in modules:
        module.qwix_rngs = nnx.data(rngs)
    return model


def _check_recipe(recipe, what: str) -> None:
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"{what} must be a jax_nvfp4.Recipe (e.g. jax_nvfp4.NVFP4), got {recipe!r}"
        )


def _is_param(x) -> bool:
    """Whether x is (derived by unary ops from) a param of the current
    module, as qwix decides which operand is the weight."""
    try:
        return flax_util.find_param(x) is not None
    except ValueError:  # several same-shaped params: not decidable
        return False


def _constrain(out: jax.Array, out_sharding) -> jax.Array:
    if out_sharding is None:
        return out
    return jax.lax.with_sharding_constraint(out, out_sharding)


def _einsum_plan(subscripts, operands):
    """(x, w, x's contracted dims, w's, output permutation) if the einsum is
    a weight (a param of the current module; the second operand first) times
    an activation with no batch, summed-only or repeated indices; else None."""
    if not isinstance(subscripts, str) or len(operands) != 2:
        return None
    shapes = [
        jax.ShapeDtypeStruct(jnp.shape(op), jnp.result_type(op)) for op in operands
    ]
    try:
        inputs, output, _ = opt_einsum.parser.parse_einsum_input((subscripts, *shapes))
    except (ValueError, TypeError):
        return None  # jnp.einsum says what is wrong
    specs = inputs.split(",")
    if len(specs) != 2 or any(len(set(s)) != len(s) for s in (*specs, output)):
        return None
    a, b = specs
    if any(
        c not in output and c not in other for s, other in ((a, b), (b, a)) for c in s
    ):
        return None  # an index summed over one operand alone
    if any(c in a and c in b for c in output):
        return None  # a batch index
    if _is_param(operands[1]):
        wi = 1
    elif _is_param(operands[0]):
        wi = 0
    else:
        return None
    x, w = operands[1 - wi], operands[wi]
    xs, ws = specs[1 - wi], specs[wi]
    contracted = [c for c in ws if c in xs]
    if not contracted:
        return None
    xc = tuple(xs.index(c) for c in contracted)
    wc = tuple(ws.index(c) for c in contracted)
    free = [c for c in xs if c not in contracted] + [
        c for c in ws if c not in contracted
    ]
    return x, w, xc, wc, tuple(free.index(c) for c in output)


def _module_path() -> str:
    return "/".join(map(str, flax_util.get_current_module_path())) or "<root>"
