"""safetensors files without a dependency: an 8-byte little-endian header
length, a JSON header ``{name: {"dtype", "shape", "data_offsets"},
"__metadata__": {...}}``, then the tensors' little-endian bytes
(https://github.com/huggingface/safetensors, "Format")."""

from __future__ import annotations

import json
import math
import os
import struct
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["DTYPES", "CheckpointError", "read_safetensors", "write_safetensors"]

DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint file that is missing, malformed or not NVFP4."""


def _little_endian_bytes(array: np.ndarray) -> bytes:
    array = np.ascontiguousarray(array)
    if sys.byteorder != "little" and array.dtype.itemsize > 1:
        array = array.byteswap()
    return array.tobytes()


def write_safetensors(
    path: Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]
) -> None:
    """Writes ``tensors`` as one safetensors file (atomically: a temporary file
    renamed into place)."""
    # Widest dtypes first, then by name: every tensor starts at a multiple of
    # its item size (the header is padded to 8 bytes), as the reference writer
    # lays them out, and the file depends only on its content.
    order = sorted(tensors, key=lambda n: (-tensors[n].dtype.itemsize, n))
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name in order:
        array = tensors[name]
        dtype = _DTYPE_NAMES.get(array.dtype)
        if dtype is None:
            raise TypeError(f"{name!r}: dtype {array.dtype} has no safetensors name")
        header[name] = {
            "dtype": dtype,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    # Written beside the file, then renamed over it. Created with mode 0o666
    # less the umask, as any new file (mkstemp's are private, which a serving
    # engine running as another user could not read).
    tmp = path.parent / f"{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    fd = os.open(tmp, flags, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for name in order:
                f.write(_little_endian_bytes(tensors[name]))
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Reads every tensor of a safetensors file and its ``__metadata__``."""
    data = path.read_bytes()
    if len(data) < 8:
        raise CheckpointError(
            f"{path}: truncated ({len(data)} bytes; a safetensors file starts "
            "with an 8-byte header length)"
        )
    (size,) = struct.unpack("<Q", data[:8])
    if 8 + size > len(data):
        raise CheckpointError(
            f"{path}: truncated or not safetensors: the header length says "
            f"{size} bytes, the file has {len(data) - 8} after it"
        )
    try:
        header = json.loads(data[8 : 8 + size].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"{path}: the safetensors header is not JSON ({e})"
        ) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: __metadata__ is not a JSON object")
    body = memoryview(data)[8 + size :]
    tensors = {}
    for name, entry in header.items():
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(entry["shape"])
            begin, end = entry["data_offsets"]
            if not all(isinstance(d, int) and d >= 0 for d in (*shape, begin, end)):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"{path}: tensor {name!r} has a malformed header entry {entry!r} "
                f"(dtype one of {sorted(DTYPES)}, shape a list of ints, "
                "data_offsets [begin, end])"
            ) from None
        if end > len(body):
            raise CheckpointError(
                f"{path}: truncated: tensor {name!r} ends at byte {end} of the "
                f"data, which has {len(body)} bytes"
            )
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(
                f"{path}: tensor {name!r} has {end - begin} bytes, but "
                f"{entry['dtype']} {list(shape)} needs "
                f"{math.prod(shape) * dtype.itemsize}"
            )
        array = np.frombuffer(body[begin:end], dtype=dtype.newbyteorder("<"))
        tensors[name] = array.astype(dtype).reshape(shape)
    return tensors, metadata
