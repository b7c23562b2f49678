"""``export_nvfp4``: a model's weights to a ModelOpt NVFP4 checkpoint
(``quantization_config`` for a model's config.json)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from jax_nvfp4.checkpoint.layout import (
    _INPUT_SCALE,
    _SCALE,
    _SCALE_2,
    _WEIGHT,
    CONFIG_FILE,
    FUSED_GROUPS,
    GENERATION_CONFIG_FILE,
    INDEX_FILE,
    METADATA_KEY,
    MODEL_CONFIG_FILE,
    TOKENIZER_FILES,
    WEIGHTS_FILE,
    _check_finite,
    _check_nvfp4_tensor,
    _float32,
    _names,
    _read_json_object,
    _scale_of,
)
from jax_nvfp4.checkpoint.safetensors_io import (
    write_safetensors,
)
from jax_nvfp4.format import BLOCK_SIZE, NVFP4Tensor
from jax_nvfp4.policy import Policy
from jax_nvfp4.quantize import global_amax, quantize
from jax_nvfp4.recipe import NVFP4, Recipe

__all__ = ["export_nvfp4", "quantization_config"]


def export_nvfp4(
    weights: Mapping[str, Any],
    directory: str | os.PathLike,
    *,
    nvfp4: Policy | Iterable[str],
    input_amax: Mapping[str, Any] | None = None,
    recipe: Recipe = NVFP4,
    dtype=None,
    fuse: Iterable[Sequence[str]] = FUSED_GROUPS,
    model_config: Mapping[str, Any] | str | os.PathLike | None = None,
    tokenizer: str | os.PathLike | Iterable[str | os.PathLike] | None = None,
) -> Path:
    """Writes ``weights`` as a ModelOpt NVFP4 checkpoint in ``directory``.

    Args:
      weights: ``{name: array}`` in PyTorch / Hugging Face orientation (a
        linear weight is ``[N=out, K=in]``). A key ending in ``.weight`` or
        ``.bias`` is written under that name; any other key is a module name
        (``"model.layers.0.mlp.up_proj"``) whose tensor is written as
        ``<key>.weight``. An ``NVFP4Tensor`` value (``import_nvfp4``'s
        ``quantized``) is written as it is, always in NVFP4.
      directory: created if needed; receives ``model.safetensors``,
        ``hf_quant_config.json`` and ``config.json`` (and the files of
        ``model_config`` and ``tokenizer``), replacing files of those names.
      nvfp4: the module names of the linear layers to write in NVFP4, or a
        ``Policy`` asked about each 2-D ``.weight`` by its module name (its
        recipe for that layer decides the block kind).
      input_amax: ``{module name: activation amax}`` for every NVFP4 layer
        (entries for other layers are ignored): recorded during training,
        e.g. ``jax_nvfp4.global_amax(x)`` of the layer's input, or from
        ``calibrate``.
      recipe: the training recipe of the layers named in ``nvfp4`` (a set of
        names). The weight is quantized as its FPROP quantizes it: 16x16 tiles
        with ``weight_2d`` (else 1x16 blocks along K), nearest rounding, the
        tensor's own amax, so the FP4 bytes are training's.
      dtype: if given, the dtype of the other floating-point tensors (e.g.
        ``jnp.bfloat16``); by default each keeps its own.
      fuse: groups of sibling layer names that serving engines fuse (the
        module docstring): the NVFP4 layers of a group share the largest
        weight amax and input amax. ``()``: every layer keeps its own.
      model_config: the model's own Hugging Face config (``architectures``,
        ``model_type``, ``hidden_size``, ...): a dict, the path of its
        ``config.json``, or a directory holding one (whose
        ``generation_config.json``, if there, is copied too). It is written
        as ``config.json`` with ``quantization_config`` set to this
        checkpoint's (one already there is replaced). Without it
        ``config.json`` holds only ``quantization_config``: a serving engine
        then also needs the architecture fields, so merge the model's config
        into it (or pass it here) before serving.
      tokenizer: the tokenizer's files to copy beside the weights: a
        directory (its ``tokenizer.json``, ``tokenizer_config.json``,
        ``special_tokens_map.json``, ``tokenizer.model``, ``vocab.json``,
        ``merges.txt``, ... whichever are there; ``TOKENIZER_FILES``) or the
        paths of the files themselves.

    Returns:
      The directory.

    Raises:
      ValueError: a tensor holds NaN or Inf (naming it), a layer cannot be
        NVFP4, an ``input_amax`` is missing, not finite or not positive, or
        ``model_config`` / ``tokenizer`` name no usable file. Nothing is
        written then.

    The linear layers written in bf16 (2-D ``.weight`` tensors not in NVFP4)
    are listed in ``exclude_modules`` (``ignore`` in ``config.json``).
    """
    from jax_nvfp4 import __version__

    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a dict of arrays, got {type(weights)}")
    entries: dict[str, tuple[str, Any]] = {}  # tensor name -> (module, value)
    for key, value in weights.items():
        if not isinstance(key, str):
            raise TypeError(f"weights keys must be str names, got {key!r}")
        module, tensor = _names(key)
        if tensor in entries:
            raise ValueError(f"{key!r} and another key both name tensor {tensor!r}")
        _check_finite(tensor, value)
        entries[tensor] = (module, value)
    config_data, generation_config = _model_config(model_config)
    tokenizer_files = _tokenizer_files(tokenizer)
    # Candidates: the modules of 2-D (or already quantized) weights.
    linears = {
        module: value
        for tensor, (module, value) in entries.items()
        if tensor == module + _WEIGHT
        and (isinstance(value, NVFP4Tensor) or np.ndim(value) == 2)
    }

    recipes: dict[str, Recipe | None]
    if isinstance(nvfp4, Policy):
        recipes = {module: nvfp4.recipe_for(module) for module in linears}
    else:
        if isinstance(nvfp4, str):
            raise TypeError(
                f"nvfp4 is a set of module names or a Policy; wrap one name in a "
                f"set: {{{nvfp4!r}}}"
            )
        chosen = set(nvfp4)
        unknown = sorted(chosen - set(linears))
        if unknown:
            raise ValueError(
                f"nvfp4 names layers that are not 2-D weights in weights: "
                f"{unknown}; the linear layers are named "
                f"{sorted(linears)[:8]}{' ...' if len(linears) > 8 else ''}"
            )
        recipes = {m: recipe if m in chosen else None for m in linears}
    for module, value in linears.items():
        if isinstance(value, NVFP4Tensor) and recipes[module] is None:
            recipes[module] = recipe  # already quantized: written as it is
    selected = sorted(m for m, r in recipes.items() if r is not None)

    amaxes = dict(input_amax or {})
    missing = [m for m in selected if m not in amaxes]
    if missing:
        raise ValueError(
            f"no input_amax for the NVFP4 layers {missing}: input_scale is each "
            "layer's activation amax / 2688. Record jax_nvfp4.global_amax of the "
            "layer's input during training, or run checkpoint.calibrate"
        )

    x_amaxes = {m: _float32(amaxes[m], f"input_amax[{m!r}]") for m in selected}
    shared = _shared_amaxes(linears, recipes, x_amaxes, fuse)

    out: dict[str, np.ndarray] = {}
    layers_meta: dict[str, dict[str, str]] = {}
    for module in selected:
        layer_recipe = recipes[module]
        assert layer_recipe is not None
        w_amax, x_amax = shared.get(module, (None, x_amaxes[module]))
        t = _quantize_weight(module, linears[module], layer_recipe, w_amax)
        amax = _float32(t.amax, f"{module!r}: the weight's amax")
        out[module + _WEIGHT] = np.asarray(t.codes, np.uint8)
        out[module + _SCALE] = np.asarray(t.scales)
        out[module + _SCALE_2] = _scale_of(amax)
        out[module + _INPUT_SCALE] = _scale_of(x_amax)
        layers_meta[module] = {
            "amax": float(amax).hex(),
            "input_amax": float(x_amax).hex(),
            "block": t.block,
        }
    excluded = []
    for tensor, (module, value) in entries.items():
        if module in layers_meta and tensor == module + _WEIGHT:
            continue
        array = np.asarray(value)
        if dtype is not None and np.issubdtype(array.dtype, np.floating):
            with np.errstate(over="ignore"):  # refused just below
                array = array.astype(jnp.dtype(dtype))
            _check_finite(tensor, array, f" in {jnp.dtype(dtype).name}")
        if tensor in out:
            raise ValueError(f"{tensor!r} collides with a tensor of an NVFP4 layer")
        out[tensor] = array
        if module in linears:
            excluded.append(module)

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    metadata = {
        "format": "pt",  # PyTorch orientation; transformers checks this key
        METADATA_KEY: json.dumps({"layers": layers_meta}, sort_keys=True),
    }
    write_safetensors(directory / WEIGHTS_FILE, out, metadata)
    config = {
        "producer": {"name": "jax_nvfp4", "version": __version__},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": BLOCK_SIZE,
            "exclude_modules": sorted(excluded),
        },
    }
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    config_data["quantization_config"] = quantization_config(config)
    (directory / MODEL_CONFIG_FILE).write_text(json.dumps(config_data, indent=2) + "\n")
    for source, name in [
        *([(generation_config, GENERATION_CONFIG_FILE)] if generation_config else []),
        *((f, f.name) for f in tokenizer_files),
    ]:
        _copy(source, directory / name)
    return directory


def quantization_config(hf_quant_config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``quantization_config`` of ``config.json`` for the content of an
    NVFP4 ``hf_quant_config.json``, with the keys and values ModelOpt's
    Hugging Face exporter writes: the scheme as a compressed-tensors config
    group (4-bit float weights and static input activations in groups of
    16, targets ``Linear``), ``ignore`` (the bf16 layers, ModelOpt's
    ``exclude_modules``), ``quant_algo``, ``producer`` and ``quant_method:
    "modelopt"``, which vLLM and SGLang read to pick their ModelOpt NVFP4
    method. ``kv_cache_scheme`` is present only when the KV cache is
    quantized (``export_nvfp4`` never quantizes it)."""
    quant = hf_quant_config["quantization"]
    group_size = quant.get("group_size", BLOCK_SIZE)
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": group_size}
    out: dict[str, Any] = {
        "config_groups": {
            "group_0": {
                "input_activations": dict(fp4),
                "weights": dict(fp4),
                "targets": ["Linear"],
            }
        },
        "ignore": list(quant.get("exclude_modules") or []),
        "quant_algo": quant["quant_algo"],
    }
    kv_cache = quant.get("kv_cache_quant_algo")
    if kv_cache:
        out["kv_cache_scheme"] = (
            {"dynamic": False, "num_bits": 8, "type": "float"}
            if kv_cache == "FP8"
            else kv_cache
        )
    if hf_quant_config.get("producer"):
        out["producer"] = dict(hf_quant_config["producer"])
    out["quant_method"] = "modelopt"
    return out


def _model_config(model_config) -> tuple[dict[str, Any], Path | None]:
    """(the model's config as a dict, its generation_config.json or None)."""
    if model_config is None:
        return {}, None
    if isinstance(model_config, Mapping):
        try:
            return json.loads(json.dumps(dict(model_config))), None
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"model_config must be JSON-serializable (a Hugging Face config as "
                f"a dict, e.g. transformers' config.to_dict()): {e}"
            ) from None
    if not isinstance(model_config, (str, os.PathLike)):
        raise TypeError(
            "model_config is the model's Hugging Face config: a dict, a path to "
            f"its config.json or a directory holding one; got {type(model_config)}"
        )
    path = Path(model_config)
    generation = None
    if path.is_dir():
        if not (path / MODEL_CONFIG_FILE).is_file():
            raise ValueError(
                f"model_config: the directory {path} has no {MODEL_CONFIG_FILE}; "
                "pass the model's Hugging Face directory or its config.json"
            )
        generation = path / GENERATION_CONFIG_FILE
        generation = generation if generation.is_file() else None
        path = path / MODEL_CONFIG_FILE
    return _read_json_object(path, "model_config"), generation


def _tokenizer_files(tokenizer) -> list[Path]:
    if tokenizer is None:
        return []
    if isinstance(tokenizer, (str, os.PathLike)):
        path = Path(tokenizer)
        if path.is_dir():
            files = [path / n for n in TOKENIZER_FILES if (path / n).is_file()]
            if not files:
                raise ValueError(
                    f"tokenizer: {path} holds none of the tokenizer files "
                    f"{list(TOKENIZER_FILES)}; pass the tokenizer's directory (e.g. "
                    "where tokenizer.save_pretrained wrote) or its files"
                )
            return files
        sources = [path]
    else:
        sources = [Path(f) for f in tokenizer]
    missing = [str(f) for f in sources if not f.is_file()]
    if missing:
        raise ValueError(
            f"tokenizer: {missing} are not files; pass the tokenizer's directory "
            "or the paths of its files (tokenizer.json, tokenizer_config.json, ...)"
        )
    names = [f.name for f in sources]
    if len(set(names)) != len(names):
        raise ValueError(f"tokenizer: two files share a name: {sorted(names)}")
    own = {WEIGHTS_FILE, INDEX_FILE, CONFIG_FILE, MODEL_CONFIG_FILE}
    clash = sorted(
        own.intersection(names) | {n for n in names if n.endswith(".safetensors")}
    )
    if clash:
        raise ValueError(
            f"tokenizer: {clash} would overwrite the checkpoint's own files; pass "
            "only the tokenizer's files (and the model's config as model_config)"
        )
    return sources


def _copy(source: Path, target: Path) -> None:
    if target.exists() and os.path.samefile(source, target):
        return  # exporting into the directory the file came from
    shutil.copyfile(source, target)


def _weight_amax(module: str, value) -> np.float32:
    if isinstance(value, NVFP4Tensor):
        return _float32(value.amax, f"{module!r}: the weight's amax")
    return _float32(global_amax(jnp.asarray(value)), f"{module!r}: the weight's amax")


def _shared_amaxes(linears, recipes, x_amaxes, fuse):
    """{module: (weight amax, input amax)} shared by the NVFP4 layers of each
    fused group of siblings present; checks that a group is all NVFP4 or all
    bf16. A group of already quantized layers (an import) is written as it
    is, so that export -> import -> export gives the same files; a group
    mixing quantized and unquantized layers needs the quantized ones to hold
    the group's largest amax."""
    groups_given = [] if isinstance(fuse, str) else list(fuse)
    if isinstance(fuse, str) or any(isinstance(g, str) for g in groups_given):
        raise TypeError(
            "fuse is a sequence of groups of layer names, e.g. "
            "(('q_proj', 'k_proj', 'v_proj'),); () fuses none"
        )
    fuse = [tuple(g) for g in groups_given]
    groups = {}
    for module in linears:
        parent, _, leaf = module.rpartition(".")
        for spec in fuse:
            if leaf in spec:
                members = tuple(
                    m
                    for m in (f"{parent}.{s}" if parent else s for s in spec)
                    if m in linears
                )
                if len(members) > 1:
                    groups[members] = None
    shared = {}
    for members in groups:
        nvfp4 = [m for m in members if recipes[m] is not None]
        if not nvfp4:
            continue
        if len(nvfp4) != len(members):
            rest = sorted(set(members) - set(nvfp4))
            raise ValueError(
                f"{sorted(nvfp4)} would be NVFP4 but {rest} bf16: serving "
                "engines load these layers as one fused GEMM, all NVFP4 or all "
                "bf16. Choose the whole group, or pass fuse=() for a consumer "
                "that does not fuse them"
            )
        fixed = [m for m in members if isinstance(linears[m], NVFP4Tensor)]
        if len(fixed) == len(members):
            continue  # already quantized (an import): written as they are
        w_amaxes = {m: _weight_amax(m, linears[m]) for m in members}
        w_amax = max(w_amaxes.values())
        if any(w_amaxes[m] != w_amax for m in fixed):
            raise ValueError(
                f"{members}: already quantized with different amaxes "
                f"({[float(w_amaxes[m]) for m in members]}), which a fused GEMM "
                "cannot share; export them from their unquantized weights, or "
                "pass fuse=()"
            )
        x_amax = max(x_amaxes[m] for m in members)
        shared.update({m: (w_amax, x_amax) for m in members})
    return shared


def _quantize_weight(module: str, value, recipe: Recipe, amax=None) -> NVFP4Tensor:
    """The FP4 weight of training's FPROP for a ``[N, K]`` weight, or with
    the given tensor amax (a fused group's)."""
    if isinstance(value, NVFP4Tensor):
        _check_nvfp4_tensor(module, value)
        return value
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a jax_nvfp4.Recipe, got {recipe!r}")
    if not recipe.fprop:
        raise ValueError(
            f"{module!r}: its recipe runs FPROP in bf16, so training has no FP4 "
            "weight to export; leave the layer out of nvfp4"
        )
    w = jnp.asarray(value)
    n, k = w.shape
    tile = recipe.weight_2d
    bad = [f"K={k}"] if k % BLOCK_SIZE else []
    if tile and n % BLOCK_SIZE:
        bad.append(f"N={n} (16x16 weight tiles)")
    if bad:
        raise ValueError(
            f"{module!r}: weight [N={n}, K={k}] cannot be NVFP4: "
            f"{' and '.join(bad)} must be a multiple of 16"
        )
    # FPROP quantizes w along K; for the [N, K] orientation that is the
    # row-wise copy, the same bytes as the column-wise copy of [K, N].
    return quantize(
        w,
        1,
        block="16x16" if tile else "1x16",
        amax=None if amax is None else jnp.float32(amax),
        implementation=recipe.implementation,
    )


# --------------------------------------------------------------------------
# import
