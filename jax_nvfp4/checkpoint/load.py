"""``import_nvfp4``: reads a ModelOpt NVFP4 checkpoint back."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jax_nvfp4.checkpoint.layout import (
    _INPUT_SCALE,
    _SCALE,
    _SCALE_2,
    _WEIGHT,
    CONFIG_FILE,
    INDEX_FILE,
    METADATA_KEY,
    WEIGHTS_FILE,
    NVFP4Checkpoint,
    _scale_of,
)
from jax_nvfp4.checkpoint.safetensors_io import (
    DTYPES,
    CheckpointError,
    read_safetensors,
)
from jax_nvfp4.format import BLOCK_SIZE, SCALE_RANGE, NVFP4Tensor

__all__ = ["import_nvfp4"]


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
