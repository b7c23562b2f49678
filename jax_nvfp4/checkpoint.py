"""Export to and import from NVIDIA ModelOpt's NVFP4 checkpoint format.

The format (docs/DESIGN.md, "Serving format (export)") is what vLLM, SGLang and
TensorRT-LLM load for ``quant_algo: NVFP4``. For each NVFP4 linear layer
``<name>`` in PyTorch orientation ``[N=out, K=in]``:

* ``<name>.weight``: uint8 ``[N, K/2]``, E2M1 codes packed along K, element
  ``2j`` in the low nibble of byte ``j`` (our packing);
* ``<name>.weight_scale``: float8_e4m3fn ``[N, K/16]``, one scale per 16
  elements of a row, linear (not swizzled). A 16x16 weight tile stores its
  scale repeated in each of its 16 rows, which is this layout: training's
  16x16 weights export without loss;
* ``<name>.weight_scale_2``: float32 scalar ``A_w / 2688``;
* ``<name>.input_scale``: float32 scalar ``A_x / 2688`` (the activation amax
  from training or from a calibration pass);

the other tensors (norms, embeddings, linear layers left in bf16) under their
own names, and a ``hf_quant_config.json`` naming the bf16 linear layers in
``exclude_modules``. A serving engine dequantizes ``e2m1 * weight_scale *
weight_scale_2`` and runs the GEMM with ``alpha = input_scale *
weight_scale_2``; both quotients are those of our GEMM's alpha
(``A / 2688``, correctly rounded), so it sees training's FP4 weight bytes and
scales.

Files (docs/SERVING.md): one ``model.safetensors`` (import also reads a
sharded checkpoint through ``model.safetensors.index.json``),
``hf_quant_config.json`` (ModelOpt's own description of the quantization,
which TensorRT-LLM reads) and ``config.json`` holding the same description
as ``quantization_config`` in the form ModelOpt's Hugging Face exporter
embeds it (``quant_method: "modelopt"``, ``ignore`` for the bf16 layers),
which vLLM and SGLang read, merged into the model's own Hugging Face config
when the caller passes it; the tokenizer's files when given. The
safetensors reader and writer are a few lines of this module (no new
dependency): an 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}``, then the
tensors' little-endian bytes.

``weight_scale_2 * 2688`` does not always give back the float32 amax it came
from (``A / 2688`` rounds), while ``dequantize`` uses the amax itself. Export
therefore also records each layer's exact amax, input amax and block kind in
the safetensors metadata (``"jax_nvfp4"``, float hex strings), and import uses
them when they agree with the scales: export -> import -> export gives
byte-identical files and the same ``NVFP4Tensor``s. A checkpoint from another
producer (no such metadata) imports with ``amax = weight_scale_2 * 2688``,
which gives back the same ``weight_scale_2``.

Fused layers: the serving engines load some sibling layers as one GEMM
(``q_proj``, ``k_proj``, ``v_proj`` as ``qkv_proj``; ``gate_proj`` and
``up_proj``; an expert's ``w1`` and ``w3``) with one ``weight_scale_2`` and
one ``input_scale``: vLLM and SGLang take the largest of the shards' and
keep each shard's block scales (a shard quantized with a smaller amax then
dequantizes too large), TensorRT-LLM refuses unequal ones. ModelOpt's
exporter therefore quantizes such shards with a shared amax, and so does
``export_nvfp4`` by default (``fuse``): each shard is quantized with the
largest weight amax of its group and given the largest input amax. The
shard with that amax keeps training's FP4 bytes; the others are requantized
from their weights. ``fuse=()`` keeps every layer's own scales (training's
bytes everywhere), for consumers that do not fuse. Layers that are already
``NVFP4Tensor``s (an import) are written as they are.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4.format import BLOCK_SIZE, SCALE_RANGE, NVFP4Tensor
from jax_nvfp4.policy import Policy
from jax_nvfp4.quantize import global_amax, quantize
from jax_nvfp4.recipe import NVFP4, Recipe
from jax_nvfp4.safetensors_io import (
    DTYPES,
    CheckpointError,
    read_safetensors,
    write_safetensors,
)

__all__ = [
    "CONFIG_FILE",
    "MODEL_CONFIG_FILE",
    "WEIGHTS_FILE",
    "CheckpointError",
    "NVFP4Checkpoint",
    "TOKENIZER_FILES",
    "calibrate",
    "export_nvfp4",
    "FUSED_GROUPS",
    "import_nvfp4",
    "quantization_config",
]

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "hf_quant_config.json"
MODEL_CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# The files of a Hugging Face tokenizer that a serving engine reads (those
# present are copied from a tokenizer directory).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
METADATA_KEY = "jax_nvfp4"

# The suffixes of the four tensors of an NVFP4 layer.
_WEIGHT, _SCALE, _SCALE_2, _INPUT_SCALE = (
    ".weight",
    ".weight_scale",
    ".weight_scale_2",
    ".input_scale",
)
_TENSOR_SUFFIXES = (_WEIGHT, ".bias")
# Sibling layers the serving engines fuse into one GEMM with one tensor
# scale (by their last name; siblings share the rest of the name).
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))


class NVFP4Checkpoint(NamedTuple):
    """What ``import_nvfp4`` reads.

    Attributes:
      quantized: ``{module name: NVFP4Tensor}`` of each NVFP4 linear layer, the
        ``[N, K]`` weight quantized along K (``shape=(N, K)``, ``axis=1``).
      tensors: ``{tensor name: numpy array}`` of every other tensor, in its
        stored dtype (``"model.norm.weight"``, ``"lm_head.weight"``, ...).
      config: the content of ``hf_quant_config.json``.
      input_amax: ``{module name: float}``, the activation amax of each NVFP4
        layer (``input_scale * 2688``, or the exact value export recorded).
    """

    quantized: dict[str, NVFP4Tensor]
    tensors: dict[str, np.ndarray]
    config: dict[str, Any]
    input_amax: dict[str, float]


# --------------------------------------------------------------------------
# export


def _float32(value, what: str) -> np.float32:
    """A finite, positive float32 scalar (an amax)."""
    array = np.asarray(value)
    if array.size != 1 or not np.issubdtype(array.dtype, np.floating):
        raise ValueError(f"{what} must be a float scalar, got {value!r}")
    out = np.float32(array.reshape(()))
    if not (np.isfinite(out) and out > 0):
        raise ValueError(f"{what} must be finite and positive, got {float(out)}")
    return out


def _scale_of(amax: np.float32) -> np.ndarray:
    # A / 2688 correctly rounded in float32: the quotient of the GEMM's alpha
    # (docs/DESIGN.md section 2); numpy divides float32 by IEEE rules.
    return np.asarray(amax / np.float32(SCALE_RANGE), np.float32)


def _names(key: str) -> tuple[str, str]:
    """(module name, tensor name) of a ``weights`` key: a key ending in
    ``.weight`` or ``.bias`` is a tensor name, any other a module name whose
    tensor is ``<key>.weight``."""
    if key.endswith(_WEIGHT):
        return key[: -len(_WEIGHT)], key
    if key.endswith(_TENSOR_SUFFIXES):
        return key, key
    return key, key + _WEIGHT


def _check_nvfp4_tensor(name: str, t: NVFP4Tensor) -> None:
    if t.decoded or t.rht or t.batch_ndim or t.ndim != 2 or t.axis != 1:
        raise ValueError(
            f"{name!r}: an NVFP4Tensor exports only as an [N, K] weight quantized "
            f"along K (axis=1, no RHT, packed codes); got {t!r}"
        )


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


def _check_finite(tensor: str, value, how: str = "") -> None:
    """Refuses a tensor holding NaN or Inf: a serving engine would multiply
    by it silently. An ``NVFP4Tensor``'s codes are always finite; its amax
    and block scales are checked."""
    if isinstance(value, NVFP4Tensor):
        scales = np.asarray(value.scales)
        if (
            jnp.issubdtype(scales.dtype, jnp.floating)
            and not np.isfinite(scales.astype(np.float32)).all()
        ):
            raise ValueError(
                f"{tensor!r}: the NVFP4Tensor's block scales hold NaN or Inf (the "
                "weight it was quantized from did); a serving checkpoint needs "
                "finite weights. Quantize the layer again from a finite weight"
            )
        if not np.isfinite(np.asarray(value.amax, np.float32)).all():
            raise ValueError(
                f"{tensor!r}: the NVFP4Tensor's amax is "
                f"{np.asarray(value.amax).tolist()}, not finite (its weight held "
                "NaN or Inf); a serving checkpoint needs finite weights"
            )
        return
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        value = np.asarray(value)
        dtype = value.dtype
    if not jnp.issubdtype(dtype, jnp.inexact):
        return
    finite = jnp.isfinite(value) if isinstance(value, jax.Array) else np.isfinite(value)
    if bool(finite.all()):
        return
    bad = np.logical_not(np.asarray(finite))
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    first = np.asarray(value)[where] if where else np.asarray(value)
    raise ValueError(
        f"{tensor!r} holds {int(bad.sum())} non-finite value(s){how} (NaN or "
        f"Inf; the first, {float(first)}, at index {list(where)}): a serving "
        "engine would compute with them silently. Fix the weight (e.g. restore "
        "an earlier training step) or leave the tensor out"
    )


def _read_json_object(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{what}: {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{what}: cannot read {path} as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{what}: {path} holds a JSON {type(data).__name__}, not an object"
        )
    return data


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


def _load_tensors(directory: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    single, index = directory / WEIGHTS_FILE, directory / INDEX_FILE
    if single.exists():
        return read_safetensors(single)
    if not index.exists():
        raise CheckpointError(
            f"{directory}: neither {WEIGHTS_FILE} nor {INDEX_FILE}; {_EXPECTED}"
        )
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index}: not a safetensors index ({e!r})") from None
    tensors: dict[str, np.ndarray] = {}
    metadata: dict[str, str] = {}
    for file in files:
        part, part_meta = read_safetensors(directory / file)
        clash = sorted(set(part) & set(tensors))
        if clash:
            raise CheckpointError(f"{directory}: tensors in two files: {clash[:4]}")
        tensors.update(part)
        metadata.update(part_meta)
    return tensors, metadata


def _scalar(tensors, name: str) -> np.float32:
    array = tensors[name]
    if array.dtype != np.float32 or array.size != 1 or array.ndim > 1:
        raise CheckpointError(
            f"{name!r} must be a float32 scalar, got {array.dtype} {list(array.shape)}"
        )
    value = array.reshape(())[()]
    if not (np.isfinite(value) and value > 0):
        raise CheckpointError(f"{name!r} must be finite and positive, got {value}")
    return value


def _amax_from(scale: np.float32, recorded: str | None, name: str) -> np.float32:
    """The amax whose ``/ 2688`` is ``scale``: the recorded one if it agrees."""
    if recorded is None:
        amax = np.float32(scale * np.float32(SCALE_RANGE))
    else:
        try:
            amax = np.float32(float.fromhex(recorded))
        except (TypeError, ValueError):
            raise CheckpointError(
                f"{name!r}: metadata amax {recorded!r} is not a float hex string"
            ) from None
    if not np.isfinite(amax) or _scale_of(amax) != scale:
        raise CheckpointError(
            f"{name!r} = {scale!r} is not (amax = {amax!r}) / 2688: the scale "
            "and the recorded amax disagree"
        )
    return amax


_EXPECTED = (
    f"import_nvfp4 reads the directory that export_nvfp4 (or NVIDIA ModelOpt) "
    f"writes, holding {WEIGHTS_FILE} (or {INDEX_FILE} and its shards) and "
    f"{CONFIG_FILE}"
)


def _check_directory(directory: Path) -> None:
    if directory.is_dir():
        return
    if not directory.exists():
        raise CheckpointError(f"{directory} does not exist; {_EXPECTED}")
    raise CheckpointError(
        f"{directory} is a file, not a directory; {_EXPECTED}: pass the "
        f"directory holding them (this file's is {str(directory.parent)!r})"
    )


def import_nvfp4(directory: str | os.PathLike) -> NVFP4Checkpoint:
    """Reads a ModelOpt NVFP4 checkpoint (ours or another producer's).

    Returns an ``NVFP4Checkpoint`` ``(quantized, tensors, config,
    input_amax)``; exporting its ``quantized`` and ``tensors`` with its
    ``input_amax`` writes the same files again. Raises ``CheckpointError``
    (a ``ValueError``) naming the file or tensor when ``directory`` is not a
    checkpoint directory (missing, a file, without ``hf_quant_config.json``
    or the weights) or the checkpoint is malformed: a config that is not
    NVFP4, a safetensors header that is not JSON, a truncated file, a layer
    missing one of its four tensors, wrong dtypes or shapes.
    """
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(
            "import_nvfp4 takes the checkpoint's directory (a str or a Path), "
            f"got {type(directory)}"
        )
    directory = Path(directory)
    _check_directory(directory)
    config_path = directory / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text())
        quant = config["quantization"]
        algo = quant["quant_algo"]
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: no {CONFIG_FILE}; {_EXPECTED}") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{config_path}: not a quantization config ({e!r}); expected "
            '{"quantization": {"quant_algo": "NVFP4", ...}}'
        ) from None
    if algo != "NVFP4":
        raise CheckpointError(f"{config_path}: quant_algo is {algo!r}, not 'NVFP4'")
    if quant.get("group_size", BLOCK_SIZE) != BLOCK_SIZE:
        raise CheckpointError(
            f"{config_path}: group_size {quant['group_size']}, NVFP4 has 16"
        )

    tensors, metadata = _load_tensors(directory)
    try:
        recorded = json.loads(metadata.get(METADATA_KEY, "{}")).get("layers", {})
    except (json.JSONDecodeError, AttributeError):
        raise CheckpointError(
            f"{directory}: malformed {METADATA_KEY!r} metadata"
        ) from None

    # A layer is NVFP4 when any of its scale tensors is present (or its weight
    # is packed uint8): then all four must be.
    modules = set()
    for name, array in tensors.items():
        for suffix in (_SCALE, _SCALE_2, _INPUT_SCALE):
            if name.endswith(suffix):
                modules.add(name[: -len(suffix)])
        if name.endswith(_WEIGHT) and array.dtype == np.uint8:
            modules.add(name[: -len(_WEIGHT)])
    quantized: dict[str, NVFP4Tensor] = {}
    input_amax: dict[str, float] = {}
    for module in sorted(modules):
        absent = [
            module + s
            for s in (_WEIGHT, _SCALE, _SCALE_2, _INPUT_SCALE)
            if module + s not in tensors
        ]
        if absent:
            raise CheckpointError(f"NVFP4 layer {module!r} has no {absent}")
        codes = tensors.pop(module + _WEIGHT)
        scales = tensors.pop(module + _SCALE)
        if codes.dtype != np.uint8 or codes.ndim != 2:
            raise CheckpointError(
                f"{module + _WEIGHT!r} must be uint8 [N, K/2] (packed E2M1), got "
                f"{codes.dtype} {list(codes.shape)}"
            )
        n, k = codes.shape[0], 2 * codes.shape[1]
        if scales.dtype != DTYPES["F8_E4M3"] or scales.shape != (n, k // 16):
            raise CheckpointError(
                f"{module + _SCALE!r} must be float8_e4m3fn [N, K/16] = "
                f"[{n}, {k / 16:g}] for weight {list(codes.shape)}, got "
                f"{scales.dtype} {list(scales.shape)}"
            )
        if k % BLOCK_SIZE:
            raise CheckpointError(
                f"{module + _WEIGHT!r}: K = {k} is not a multiple of 16"
            )
        meta = recorded.get(module, {})
        amax = _amax_from(
            _scalar(tensors, module + _SCALE_2), meta.get("amax"), module + _SCALE_2
        )
        x_amax = _amax_from(
            _scalar(tensors, module + _INPUT_SCALE),
            meta.get("input_amax"),
            module + _INPUT_SCALE,
        )
        del tensors[module + _SCALE_2], tensors[module + _INPUT_SCALE]
        block = meta.get("block", "1x16")  # ModelOpt's own blocks are 1x16
        if block not in ("1x16", "16x16"):
            raise CheckpointError(f"{module!r}: metadata block {block!r}")
        quantized[module] = NVFP4Tensor(
            codes=jnp.asarray(codes),
            scales=jnp.asarray(scales),
            amax=jnp.asarray(amax, jnp.float32),
            shape=(n, k),
            axis=1,
            block=block,
        )
        input_amax[module] = float(x_amax)
    return NVFP4Checkpoint(quantized, tensors, config, input_amax)


# --------------------------------------------------------------------------
# calibration


def calibrate(
    forward_fn: Callable[[Any, Callable[[str, jax.Array], jax.Array]], Any],
    batches: Iterable[Any],
    *,
    jit: bool = True,
) -> dict[str, float]:
    """Activation amaxes for ``export_nvfp4``'s ``input_amax``.

    ``forward_fn(batch, record)`` runs the model on one batch and passes each
    linear layer's input through ``record(name, x)`` (which returns ``x``),
    e.g. ``y = record("model.layers.0.mlp.up_proj", h) @ w_up.T``. The result
    is ``{name: max over batches of jax_nvfp4.global_amax(x)}`` (NaN and inf
    left out, as the quantizer does). With ``jit`` each batch runs as one
    jitted computation; ``record`` must then be called in ``forward_fn``'s own
    trace, not inside a ``lax.scan`` or an inner ``jax.jit`` (record those
    layers' amaxes as outputs of the scan and take their max instead).
    """

    def run(batch):
        seen: dict[str, jax.Array] = {}

        def record(name: str, x: jax.Array) -> jax.Array:
            amax = global_amax(x)
            seen[name] = jnp.maximum(seen[name], amax) if name in seen else amax
            return x

        forward_fn(batch, record)
        return seen

    step = jax.jit(run) if jit else run
    out: dict[str, np.float32] = {}
    for batch in batches:
        for name, amax in step(batch).items():
            amax = np.float32(amax)
            out[name] = max(out[name], amax) if name in out else amax
    if not out:
        raise ValueError(
            "calibrate saw no activations: forward_fn must call record(name, x) "
            "on each linear layer's input (and batches must not be empty)"
        )
    return {name: float(amax) for name, amax in out.items()}
