"""What NVFP4 quantization loses on a tensor: for finding which tensor of a
model, or which GEMM operand, a 4-bit format hurts.

``quantization_stats(x)`` quantizes x as the recipe would (round to nearest),
decodes it and measures the loss: how much of x falls to zero, how many blocks
lose their scale, and the relative error. Underflow is the usual failure of a
block-scaled format: a block scale is chosen for the block's largest element,
so elements below a quarter of the block's spacing round to zero, and a block
far below the tensor's amax gets a subnormal or zero E4M3 scale.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4.format import BLOCK_SIZE, Block
from jax_nvfp4.quantize import Implementation, dequantize, quantize
from jax_nvfp4.reference.numerics import random_hadamard16

__all__ = ["STATISTICS", "operand_stats", "quantization_stats"]

# The keys of quantization_stats' result.
STATISTICS = (
    "amax",
    "nonfinite",
    "underflow",
    "relative_error",
    "zero_scale_blocks",
    "subnormal_scale_blocks",
)

# E4M3's smallest normal value: scales below it keep fewer than 4 bits.
_E4M3_MIN_NORMAL = 2.0**-6


def _fraction(count, total):
    return count.astype(jnp.float32) / jnp.maximum(total, 1).astype(jnp.float32)


def _counts(x, axis, block, rht, amax, implementation):
    """The sums behind the statistics, so that several tensors' add up."""
    t = quantize(
        x, axis, block=block, rht=rht, amax=amax, implementation=implementation
    )
    decoded = dequantize(t, jnp.float32, implementation=implementation)
    # The quantized axis last, as the codes and scales are stored.
    values = jnp.moveaxis(jnp.asarray(x, jnp.float32), t.axis, -1)
    if rht:
        values = random_hadamard16(values)
    decoded = jnp.moveaxis(decoded, t.axis, -1)
    # A non-finite element makes its block's decoded values NaN: the rest is
    # measured over the other blocks.
    blocked = (*values.shape[:-1], -1, BLOCK_SIZE)
    clean = jnp.all(jnp.isfinite(values.reshape(blocked)), axis=-1)
    if block == "16x16":  # a tile's one scale spans 16 rows of blocks
        rows, blocks = clean.shape[-2:]
        tiles = clean.reshape(*clean.shape[:-2], rows // BLOCK_SIZE, BLOCK_SIZE, blocks)
        clean = jnp.repeat(jnp.all(tiles, axis=-2), BLOCK_SIZE, axis=-2)
    values = jnp.where(clean[..., None], values.reshape(blocked), 0.0)
    decoded = jnp.where(clean[..., None], decoded.reshape(blocked), 0.0)
    nonzero = values != 0
    occupied = jnp.any(nonzero, axis=-1)
    scales = t.scales.astype(jnp.float32).reshape(occupied.shape)
    count = functools.partial(jnp.sum, dtype=jnp.int32)
    return {
        "amax": jnp.asarray(t.amax, jnp.float32),
        "elements": jnp.asarray(x.size, jnp.int32),
        "nonfinite": x.size - count(jnp.isfinite(x)),
        "nonzero": count(nonzero),
        "underflow": count(nonzero & (decoded == 0)),
        "squares": jnp.sum(values * values),
        "error_squares": jnp.sum((decoded - values) ** 2),
        "occupied": count(occupied),
        "zero_scale": count(occupied & (scales == 0)),
        "subnormal_scale": count(occupied & (scales > 0) & (scales < _E4M3_MIN_NORMAL)),
    }


def _statistics(c) -> dict[str, jax.Array]:
    squares = c["squares"]
    relative = jnp.where(
        squares > 0,
        jnp.sqrt(c["error_squares"] / jnp.where(squares > 0, squares, 1)),
        0.0,
    )
    return {
        "amax": c["amax"],
        "nonfinite": _fraction(c["nonfinite"], c["elements"]),
        "underflow": _fraction(c["underflow"], c["nonzero"]),
        "relative_error": relative.astype(jnp.float32),
        "zero_scale_blocks": _fraction(c["zero_scale"], c["occupied"]),
        "subnormal_scale_blocks": _fraction(c["subnormal_scale"], c["occupied"]),
    }


def quantization_stats(
    x: jax.Array,
    axis: int = -1,
    *,
    block: Block = "1x16",
    rht: bool = False,
    implementation: Implementation = "ffi",
) -> dict[str, jax.Array]:
    """Statistics of x's NVFP4 quantization along ``axis`` (nearest rounding).

    ``axis``, ``block`` and ``rht`` mean what they mean for ``quantize``: the
    recipe quantizes a weight with ``block="16x16"``, and WGRAD's operands
    (x and dY along the token axis) with ``rht=True``; with the RHT the
    statistics are those of the transformed values, which are what is
    quantized. Jit-able; every result is a float32 scalar.

    Returns:
      A dict with the keys of ``STATISTICS``:
        amax: the largest finite |value|, which sets the tensor's scale.
        nonfinite: the fraction of elements that are NaN or infinite (the
          recipe carries them to the GEMM's outputs). The statistics below
          are over the blocks without one.
        underflow: of the nonzero elements, the fraction that quantize to
          zero.
        relative_error: ||decoded - x|| / ||x|| (0 for an x without a nonzero
          finite element).
        zero_scale_blocks: of the blocks holding a nonzero element, the
          fraction whose E4M3 scale is 0: every element of the block is
          lost.
        subnormal_scale_blocks: of those blocks, the fraction whose scale is
          nonzero but below E4M3's smallest normal value (2^-6), so keeps
          fewer significant bits.
    """
    return _statistics(_counts(x, axis, block, rht, None, implementation))


# The recipe's quantize primitives: (name, its amax operands, quantized sides).
_QUANTIZE = {
    "nvfp4_quantize_rows": ((1,), ("rows",)),
    "nvfp4_quantize_cols": ((1,), ("cols",)),
    "nvfp4_quantize_rows_cols": ((1, 2), ("rows", "cols")),
}
# Primitives that call one jaxpr on their operands, entered so that the
# quantizations inside them are measured (others run whole). A custom
# derivative's primal jaxpr is what runs when it is evaluated.
_CALLS = (
    "jit",
    "pjit",
    "closed_call",
    "core_call",
    "checkpoint",
    "remat",
    "remat2",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
    "eval_jaxpr",
)


def operand_stats(fn, *args, implementation: Implementation = "ffi", **kwargs):
    """Runs ``fn(*args, **kwargs)`` one operation at a time and measures every
    operand the NVFP4 recipe quantizes in it, as it is quantized there.

    For a model, pass its gradient (``jax.grad(loss)``, with the batch): the
    forward pass's x and w and the backward pass's dY of every NVFP4 product,
    per scanned layer (and, under remat, the recomputed forward's). Each is
    measured as ``quantization_stats`` does (round to nearest, with the amax
    the recipe passed it), along the side the recipe quantizes it, with the
    RHT where the recipe applies it. Loops (``lax.scan``, ``while``) run
    iteration by iteration and ``cond`` runs its branch taken; inside
    ``shard_map`` and other primitives that hold a jaxpr nothing is measured.
    Only the arrays among the arguments are traced; other leaves (static
    arguments, an Equinox model's functions) are passed as they are. Eager
    and slow: for diagnosis. ``out`` is the result of that op-by-op
    run (``jax.disable_jit()``'s), which can differ from the jitted result
    where XLA's fusions round differently and a quantization then rounds an
    element the other way.

    Returns:
      ``(out, records)``: fn's result and one dict per quantized side, in the
      order they ran, with
        site: which quantize of fn it is (the same number in every
          iteration of a loop around it), counted in the order first seen;
        iteration: the enclosing loops' iteration numbers, outermost first
          (for a scanned stack of layers, the layer; a reversed scan, as in
          the backward pass, counts down);
        side: "rows" (quantized along the operand's last axis) or "cols"
          (along its middle axis);
        shape: the quantized operand's shape, [items, rows, columns]: for a
          dense product x and dY are [1, tokens, features], w [1, K, N] or
          [1, N, K] as stored; ragged_dot's token buffer has 16-row items,
          each quantized with its group's amax, pooled in the record;
        weight: whether it is a weight's quantization (16x16 tiles, or both
          sides from one stream; x and dY draw theirs from two);
        block: "1x16" or "16x16"; rht; stochastic: whether the recipe rounds
          it stochastically (dY);
        and the keys of ``STATISTICS``.
    """
    # Arrays are the computation's inputs; every other leaf (a static
    # argument, an Equinox model's functions) is closed over, as
    # eqx.filter_jit does.
    leaves, tree = jax.tree.flatten((args, kwargs))
    dynamic = [isinstance(leaf, (jax.Array, np.ndarray, np.generic)) for leaf in leaves]

    def call(*arrays):
        it = iter(arrays)
        full = [
            next(it) if d else leaf for leaf, d in zip(leaves, dynamic, strict=True)
        ]
        call_args, call_kwargs = jax.tree.unflatten(tree, full)
        return fn(*call_args, **call_kwargs)

    arrays = [leaf for leaf, d in zip(leaves, dynamic, strict=True) if d]
    closed, out_shape = jax.make_jaxpr(call, return_shape=True)(*arrays)
    run = _Run(implementation)
    outs = run.jaxpr(closed.jaxpr, closed.consts, arrays, (), ())
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs), run.records


def _is_weight(eqn) -> bool:
    """Whether a quantize is a weight's, as the recipe lays them out: 16x16
    tiles, or both sides drawn from one stream (x and dY take streams 0 and
    1). A one-sided 1x16 weight quantization is not told apart."""
    specs = [eqn.params[side] for side in _QUANTIZE[eqn.primitive.name][1]]
    return specs[0].block_rows == 16 or (
        len(specs) == 2 and specs[0].stream == specs[1].stream
    )


def _closed(param):
    if isinstance(param, jax.extend.core.ClosedJaxpr):
        return param.jaxpr, param.consts
    return param, ()


class _Run:
    """An eager evaluation of a jaxpr that measures its quantizations.
    ``path``: the ids of the equations that enclose the one running (so that
    a jaxpr reused in two places, as JAX caches traced functions, gives two
    sites); ``iteration``: the enclosing loops' iteration numbers."""

    def __init__(self, implementation):
        self.implementation = implementation
        self.records: list[dict] = []
        self.sites: dict[tuple, int] = {}

    def jaxpr(self, jaxpr, consts, args, path, iteration):
        env = {}

        def read(v):
            return v.val if isinstance(v, jax.extend.core.Literal) else env[v]

        for v, value in zip(jaxpr.constvars, consts, strict=True):
            env[v] = value
        for v, value in zip(jaxpr.invars, args, strict=True):
            env[v] = value
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            here = (*path, id(eqn))
            if eqn.primitive.name in _QUANTIZE:
                self.measure(eqn, invals, here, iteration)
            outs = self.equation(eqn, invals, here, iteration)
            for v, value in zip(eqn.outvars, outs, strict=True):
                env[v] = value
        return [read(v) for v in jaxpr.outvars]

    def equation(self, eqn, invals, path, iteration):
        name, params = eqn.primitive.name, eqn.params
        if name in _CALLS and ("jaxpr" in params or "call_jaxpr" in params):
            body, consts = _closed(params.get("jaxpr") or params["call_jaxpr"])
            return self.jaxpr(body, consts, invals, path, iteration)
        if name == "scan":
            return self.scan(eqn, invals, path, iteration)
        if name == "while":
            return self.while_loop(eqn, invals, path, iteration)
        if name == "cond":
            branch = params["branches"][int(invals[0])]
            return self.jaxpr(branch.jaxpr, branch.consts, invals[1:], path, iteration)
        # As jax.core.eval_jaxpr binds: in the equation's context, with the
        # parameters a bind takes (shard_map's and pmap's differ).
        context = getattr(getattr(eqn, "ctx", None), "manager", None)
        bind_params = eqn.primitive.get_bind_params(params)
        subfuns = ()
        if isinstance(bind_params, tuple):  # older jax: (subfuns, params)
            subfuns, bind_params = bind_params
        with context if context is not None else contextlib.nullcontext():
            outs = eqn.primitive.bind(*subfuns, *invals, **bind_params)
        return outs if eqn.primitive.multiple_results else [outs]

    def measure(self, eqn, invals, path, iteration):
        amax_operands, sides = _QUANTIZE[eqn.primitive.name]
        site = self.sites.setdefault(path, len(self.sites))
        x = invals[0]  # [items, rows, columns]
        weight = _is_weight(eqn)
        for side, operand in zip(sides, amax_operands, strict=True):
            spec = eqn.params[side]
            block = "16x16" if spec.block_rows == 16 else "1x16"
            axis = 0 if side == "cols" else 1  # of an item [rows, columns]

            def counts(item, amax, axis=axis, block=block, rht=spec.rht):
                return _counts(item, axis, block, rht, amax, self.implementation)

            # One amax per item, or one for all of them.
            amax = jnp.reshape(invals[operand], (-1,))
            amax = jnp.broadcast_to(amax, (x.shape[0],))
            per_item = jax.vmap(counts)(x, amax)
            summed = {k: jnp.sum(v) for k, v in per_item.items() if k != "amax"}
            summed["amax"] = jnp.max(per_item["amax"])
            stats = _statistics(summed)
            self.records.append(
                {
                    "site": site,
                    "iteration": iteration,
                    "side": side,
                    "shape": tuple(x.shape),
                    "weight": weight,
                    "block": block,
                    "rht": spec.rht,
                    "stochastic": spec.stochastic,
                    **{k: float(v) for k, v in stats.items()},
                }
            )

    def scan(self, eqn, invals, path, iteration):
        p = eqn.params
        body, body_consts, consts, carry, xs = _scan_parts(p, invals)
        n_carry, length = len(carry), p["length"]
        ys = [None] * length
        order = range(length - 1, -1, -1) if p["reverse"] else range(length)
        for i in order:
            operands = [*consts, *carry, *(x[i] for x in xs)]
            outs = self.jaxpr(body, body_consts, operands, path, (*iteration, i))
            carry, ys[i] = outs[:n_carry], outs[n_carry:]
        stacked = [
            jnp.stack([ys[i][j] for i in range(length)])
            if length
            else jnp.zeros(v.aval.shape, v.aval.dtype)
            for j, v in enumerate(eqn.outvars[n_carry:])
        ]
        return [*carry, *stacked]

    def while_loop(self, eqn, invals, path, iteration):
        p = eqn.params
        n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts = invals[:n_cond], invals[n_cond : n_cond + n_body]
        carry = invals[n_cond + n_body :]
        cond, body = p["cond_jaxpr"], p["body_jaxpr"]

        def more(carry):
            operands = [*cond_consts, *carry]
            return bool(
                self.jaxpr(cond.jaxpr, cond.consts, operands, path, iteration)[0]
            )

        i = 0
        while more(carry):
            operands = [*body_consts, *carry]
            carry = self.jaxpr(body.jaxpr, body.consts, operands, path, (*iteration, i))
            i += 1
        return carry


def _scan_parts(p, invals):
    """A scan's body and its constants, and its operands as (consts, carry,
    xs)."""
    body, body_consts = _closed(p["jaxpr"])
    if "ft_in" in p:  # jax 0.11 on: the operands' tree is a parameter
        consts, carry, xs = (list(t) for t in p["ft_in"].update(invals).unpack())
    else:
        n_consts, n_carry = p["num_consts"], p["num_carry"]
        consts, carry = invals[:n_consts], invals[n_consts : n_consts + n_carry]
        xs = invals[n_consts + n_carry :]
    return body, [*body_consts], consts, carry, xs
