"""Hugging Face Llama names for the weights of a JAX model, for the export.

``llama_weights(model)`` turns a Flax NNX module (or its ``nnx.State``), a
Flax linen params dict, an Equinox module or a nested dict of arrays whose
structure follows Llama's (embedding, blocks of attention and MLP with their
norms, final norm, output head) into ``{Hugging Face name: array}`` in
PyTorch orientation, ready for ``checkpoint.export_nvfp4``:

* blocks: a stack with a leading layer axis (``nnx.vmap`` /
  ``eqx.filter_vmap``-built, run by a scan) is split into its layers, stacks
  numbered one after another in ``stacks`` order; numbered blocks
  (``layers.3``, ``layers_3``, a list) keep their number;
* names: the usual spellings of each part map to Llama's (``attn`` ->
  ``self_attn``, ``attn_norm`` -> ``input_layernorm``, ``wq`` -> ``q_proj``,
  ``w1`` -> ``gate_proj``, ``embed`` -> ``model.embed_tokens``, ...); a part
  with no mapping raises, naming it (pass ``renames`` to add some);
* tensors: a Flax ``kernel`` [in, out] becomes ``weight`` [out, in]; an
  ``embedding`` or a norm's ``scale`` becomes ``weight``; an Equinox
  ``weight`` is already [out, in];
* mixtures of experts: in a block's ``mlp``, the router (``router``) and
  expert stacks (a projection with an expert axis, in
  ``jax.lax.ragged_dot``'s [E, in, out] layout, as ``jax_nvfp4``'s
  ``Experts`` layers hold it) take Mixtral's names
  (``block_sparse_moe.gate``, ``block_sparse_moe.experts.3.w1``: ``w1``
  gate, ``w3`` up, ``w2`` down) or, with ``moe="qwen"``, Qwen-MoE's
  (``mlp.gate``, ``mlp.experts.3.gate_proj``), one [out, in] tensor per
  expert.

Only floating-point arrays are taken (Equinox's per-layer NVFP4 switches and
other integer or boolean leaves are not weights). The policy's layer choice
then applies to these names as to the model's: ``transformer_policy``
matches ``*mlp*`` and reads the block index in ``model.layers.3``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jax_nvfp4.policy import path_string

__all__ = ["flat_arrays", "llama_weights"]

# A block's parts, by their usual spellings -> Hugging Face Llama's.
BLOCK_PARTS = {
    "attn": "self_attn",
    "attention": "self_attn",
    "self_attn": "self_attn",
    "mlp": "mlp",
    "ffn": "mlp",
    "feed_forward": "mlp",
    "attn_norm": "input_layernorm",
    "attention_norm": "input_layernorm",
    "input_layernorm": "input_layernorm",
    "mlp_norm": "post_attention_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_layernorm": "post_attention_layernorm",
    **{p: p for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{p: p for p in ("gate_proj", "up_proj", "down_proj")},
    "wq": "q_proj",
    "wk": "k_proj",
    "wv": "v_proj",
    "wo": "o_proj",
    "w1": "gate_proj",
    "w3": "up_proj",
    "w2": "down_proj",
    "router": "gate",
}
# Mixture-of-experts naming styles: (the block's MoE module, its router,
# {expert projection: its name}).
MOE_STYLES = {
    "mixtral": (
        "block_sparse_moe",
        "gate",
        {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
    ),
    "qwen": (
        "mlp",
        "gate",
        {p: p for p in ("gate_proj", "up_proj", "down_proj")},
    ),
}
# Parts outside the blocks -> their Hugging Face module.
TOP_PARTS = {
    "embed": "model.embed_tokens",
    "embed_tokens": "model.embed_tokens",
    "tok_embeddings": "model.embed_tokens",
    "norm": "model.norm",
    "final_norm": "model.norm",
    "lm_head": "lm_head",
    "output": "lm_head",
}
# Tensor names -> (Hugging Face name, transposed from [in, out]).
TENSORS = {
    "weight": ("weight", False),
    "kernel": ("weight", True),
    "embedding": ("weight", False),
    "scale": ("weight", False),
    "bias": ("bias", False),
}
_NUMBERED = re.compile(r"^(.*?)[._](\d+)$")


def flat_arrays(model: Any) -> dict[str, jax.Array]:
    """``{dotted path: array}`` of the floating-point arrays of ``model``: a
    Flax NNX module or state, an Equinox module, or nested dicts / lists
    (a linen params dict). NNX's ``.value`` path entries are dropped."""
    try:  # an NNX module: its parameters' state
        from flax import nnx

        if isinstance(model, nnx.Module):
            model = nnx.state(model, nnx.Param)
    except ImportError:  # pragma: no cover - flax is optional
        pass
    leaves = jax.tree_util.tree_flatten_with_path(model)[0]
    out = {}
    for path, leaf in leaves:
        if not hasattr(leaf, "dtype") or not jnp.issubdtype(leaf.dtype, jnp.floating):
            continue
        parts = [p for p in path_string(path).split(".") if p != "value"]
        out[".".join(parts)] = leaf
    return out


def _block_number(parts: list[str], stacks: Sequence[str]):
    """(stack name, block number or None, the rest of the path) if the path
    is inside a block, else None."""
    if parts[0] in stacks:
        if len(parts) > 2 and parts[1].isdigit():
            return parts[0], int(parts[1]), parts[2:]
        return parts[0], None, parts[1:]
    match = _NUMBERED.match(parts[0])
    if match and match.group(1) in stacks:
        return match.group(1), int(match.group(2)), parts[1:]
    return None


def llama_weights(
    model: Any,
    *,
    stacks: Sequence[str] = ("layers",),
    renames: Mapping[str, str] | None = None,
    moe: str = "mixtral",
) -> dict[str, jax.Array]:
    """``{Hugging Face Llama name: array}`` of a Llama-like model.

    Args:
      model: a Flax NNX module or state, a Flax linen params dict, an Equinox
        module, or nested dicts of arrays (``flat_arrays``).
      stacks: the names of the block containers, in block order: a stack
        with a leading layer axis is split and numbered after the ones
        before it (e.g. ``("layers", "tail")`` for a model whose last blocks
        are a second stack); numbered blocks keep their numbers.
      renames: more spellings, ``{part: Hugging Face part}``: a block part
        (``{"mixer": "self_attn"}``) or a top-level module
        (``{"tok_emb": "model.embed_tokens"}``).
      moe: the naming of mixture-of-experts blocks, ``"mixtral"`` or
        ``"qwen"`` (see the module's docstring); ``transformer_policy``
        keeps either router in bf16.

    Returns:
      ``{"model.layers.0.mlp.up_proj.weight": [out, in] array, ...}``.

    Raises:
      ValueError: a path with a part that maps to no Llama name, two paths
        that map to one name, a stack whose leading axes disagree, or a
        router or expert stack outside a block's MLP.
    """
    if isinstance(stacks, str):
        raise TypeError(f"stacks is a sequence of names; got {stacks!r}")
    if moe not in MOE_STYLES:
        raise ValueError(f"moe must be one of {sorted(MOE_STYLES)}, got {moe!r}")
    moe_module, router, expert_names = MOE_STYLES[moe]
    block_parts = {**BLOCK_PARTS, **(renames or {})}
    top_parts = {**TOP_PARTS, **(renames or {})}
    flat = flat_arrays(model)
    # Each stack's layer count (its arrays' leading axis), in stacks order.
    sizes: dict[str, int] = {}
    for path, value in flat.items():
        found = _block_number(path.split("."), stacks)
        if found and found[1] is None:
            size = value.shape[0]
            if sizes.setdefault(found[0], size) != size:
                raise ValueError(
                    f"the arrays of stack {found[0]!r} have leading axes of "
                    f"{sizes[found[0]]} and {size} ({path}): a stack's arrays "
                    "all have one leading layer axis"
                )
    offsets, first = {}, 0
    for name in stacks:
        offsets[name] = first
        first += sizes.get(name, 0)

    out: dict[str, jax.Array] = {}

    def put(name, value, source):
        if name in out:
            raise ValueError(f"{source!r} maps to {name!r}, as another path does")
        out[name] = value

    def unknown(part, path):
        return ValueError(
            f"{path!r}: no Llama name for {part!r}; pass renames={{{part!r}: ...}} "
            f"(known block parts: {sorted(block_parts)})"
        )

    for path, value in flat.items():
        parts = path.split(".")
        if parts[-1] not in TENSORS:
            raise unknown(parts[-1], path)
        tensor, transposed = TENSORS[parts[-1]]
        found = _block_number(parts[:-1], stacks)
        if found is None:
            module = ".".join(parts[:-1])
            if module not in top_parts:
                raise unknown(module, path)
            put(f"{top_parts[module]}.{tensor}", _oriented(value, transposed), path)
            continue
        stack, number, rest = found
        mapped = []
        for part in rest:
            if part not in block_parts:
                raise unknown(part, path)
            mapped.append(block_parts[part])
        per_layer = value.ndim - (number is None)
        is_router, is_experts = mapped[-1] == "gate", per_layer == 3
        if (is_router or is_experts) and mapped[:1] != ["mlp"]:
            raise ValueError(
                f"{path!r}: a router or expert stack (3-D per layer) belongs in a "
                "block's mlp; rename its parts with renames="
            )
        if is_experts and (len(mapped) != 2 or mapped[1] not in expert_names):
            raise ValueError(
                f"{path!r}: an expert stack must be the mlp's gate_proj, up_proj "
                "or down_proj (or w1, w3, w2)"
            )
        if is_router:
            module = f"{moe_module}.{router}"
        elif is_experts:
            module = f"{moe_module}.experts.{{expert}}.{expert_names[mapped[1]]}"
        else:
            module = ".".join(mapped)
        layers = (
            [(number, value)]
            if number is not None
            else [(offsets[stack] + i, value[i]) for i in range(value.shape[0])]
        )
        for layer, layer_value in layers:
            prefix = f"model.layers.{layer}"
            if not is_experts:
                name = f"{prefix}.{module}.{tensor}"
                put(name, _oriented(layer_value, transposed), path)
                continue
            for e in range(layer_value.shape[0]):  # [E, in, out] -> [out, in]
                name = f"{prefix}.{module.format(expert=e)}.{tensor}"
                put(name, _oriented(layer_value[e], True), path)
    return out


def _oriented(value, transposed: bool):
    return jnp.swapaxes(value, -1, -2) if transposed else value
