"""The files and tensor names of a ModelOpt NVFP4 checkpoint, and the value
checks export and import share."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4.format import SCALE_RANGE, NVFP4Tensor

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
    if t.rht or t.batch_ndim or t.ndim != 2 or t.axis != 1:
        raise ValueError(
            f"{name!r}: an NVFP4Tensor exports only as an [N, K] weight quantized "
            f"along K (axis=1, no RHT, packed codes); got {t!r}"
        )


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
