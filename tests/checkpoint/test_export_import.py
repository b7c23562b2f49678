"""Export to and import from ModelOpt's NVFP4 checkpoint (jax_nvfp4.checkpoint).

The reader and writer at the top of this file are written from the format's
description (safetensors: 8-byte little-endian header length, JSON header,
raw bytes; ModelOpt NVFP4: uint8 [N, K/2] with the even element in the low
nibble, float8_e4m3fn [N, K/16], float32 weight_scale_2 and input_scale), not
from the module under test, so they check it independently.
"""

import json
import os
import stat
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_nvfp4
from jax_nvfp4 import NVFP4, Recipe, checkpoint
from jax_nvfp4.checkpoint import CheckpointError, export_nvfp4, import_nvfp4
from jax_nvfp4.policy import transformer_policy
from jax_nvfp4.recipe.steps import quantize_weights

UP = "model.layers.0.mlp.up_proj"
DOWN = "model.layers.0.mlp.down_proj"
Q = "model.layers.0.self_attn.q_proj"
UP1 = "model.layers.1.mlp.up_proj"

# --------------------------------------------------------------------------
# An independent reader / writer.

ST_DTYPES = {
    "U8": np.uint8,
    "I8": np.int8,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "BF16": ml_dtypes.bfloat16,
    "F32": np.float32,
}
# E2M1: bit 3 the sign, bits 0-2 index the magnitudes.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E2M1_TABLE = np.array(E2M1 + [-v for v in E2M1], np.float32)


def read_st(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    metadata = header.pop("__metadata__", {})
    body = raw[8 + n :]
    out = {}
    for name, e in header.items():
        begin, end = e["data_offsets"]
        dtype = np.dtype(ST_DTYPES[e["dtype"]])
        out[name] = np.frombuffer(body[begin:end], dtype).reshape(e["shape"])
    return out, metadata, header


def write_st(path, tensors, metadata=None, header_text=None):
    header, blobs, offset = {}, [], 0
    names = {np.dtype(v): k for k, v in ST_DTYPES.items()}
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        header[name] = {
            "dtype": names[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        blobs.append(a.tobytes())
        offset += a.nbytes
    if metadata is not None:
        header["__metadata__"] = metadata
    text = header_text if header_text is not None else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def serve_dequantize(tensors, name):
    """Dequantizes as the serving engines do: e2m1 * weight_scale *
    weight_scale_2, float32."""
    w = tensors[name + ".weight"]
    lo, hi = E2M1_TABLE[w & 0x0F], E2M1_TABLE[w >> 4]
    e2m1 = np.stack([lo, hi], axis=-1).reshape(w.shape[0], 2 * w.shape[1])
    s = tensors[name + ".weight_scale"].astype(np.float32)
    s = np.repeat(s, 16, axis=1)
    s2 = np.float32(tensors[name + ".weight_scale_2"].reshape(()))
    return e2m1 * s, (e2m1 * s) * s2


def rounding_amax(seed=0):
    """A float32 amax whose amax / 2688 * 2688 is not itself."""
    rng = np.random.default_rng(seed)
    while True:
        a = np.float32(rng.uniform(0.5, 8.0))
        if (a / np.float32(2688)) * np.float32(2688) != a:
            return a


def model(dtype=jnp.bfloat16):
    keys = jax.random.split(jax.random.key(0), 6)
    # A weight scaled to an amax that /2688*2688 does not give back.
    up = jax.random.normal(keys[0], (64, 32), jnp.float32)
    up = up / jnp.max(jnp.abs(up)) * rounding_amax(1)
    return {
        "model.embed_tokens.weight": jax.random.normal(keys[1], (50, 32), dtype),
        UP: up.astype(jnp.float32),
        DOWN + ".weight": jax.random.normal(keys[2], (32, 64), dtype),
        Q: jax.random.normal(keys[3], (32, 32), dtype),
        UP1: jax.random.normal(keys[4], (64, 32), dtype),
        "model.norm.weight": jnp.ones((32,), jnp.float32),
        "lm_head.weight": jax.random.normal(keys[5], (50, 32), dtype),
    }


AMAX = {UP: float(rounding_amax(2)), DOWN: 2.5, UP1: 7.0, Q: 1.0}


def export(tmp_path, weights=None, **kw):
    kw.setdefault("nvfp4", {UP, DOWN})
    kw.setdefault("input_amax", AMAX)
    return export_nvfp4(model() if weights is None else weights, tmp_path, **kw)


# --------------------------------------------------------------------------


def test_round_trip_byte_identical(tmp_path):
    weights = model()
    policy = transformer_policy(2)  # MLPs of block 0; block 1 kept in bf16
    export(tmp_path / "a", weights, nvfp4=policy)
    ckpt = import_nvfp4(tmp_path / "a")
    assert set(ckpt.quantized) == {UP, DOWN}
    assert ckpt.input_amax == {UP: AMAX[UP], DOWN: AMAX[DOWN]}
    for name in (UP, DOWN):
        w = weights.get(name, weights.get(name + ".weight"))
        want = jax_nvfp4.quantize(w, 1, block="16x16")
        got = ckpt.quantized[name]
        assert (got.shape, got.axis, got.block, got.rht) == (w.shape, 1, "16x16", False)
        np.testing.assert_array_equal(got.codes, want.codes)
        assert got.scales.dtype == jnp.float8_e4m3fn
        np.testing.assert_array_equal(
            np.asarray(got.scales).view(np.uint8),
            np.asarray(want.scales).view(np.uint8),
        )
        assert np.asarray(got.amax).tobytes() == np.asarray(want.amax).tobytes()
    # UP's amax does not survive weight_scale_2 * 2688: the metadata keeps it.
    amax = np.float32(ckpt.quantized[UP].amax)
    assert (amax / np.float32(2688)) * np.float32(2688) != amax
    for name in ("model.norm.weight", "lm_head.weight", Q + ".weight", UP1 + ".weight"):
        key = name if name in weights else name[: -len(".weight")]
        assert ckpt.tensors[name].dtype == weights[key].dtype
        np.testing.assert_array_equal(ckpt.tensors[name], weights[key])
    assert set(ckpt.tensors) == {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        Q + ".weight",
        UP1 + ".weight",
    }

    export_nvfp4(
        {**ckpt.quantized, **ckpt.tensors},
        tmp_path / "b",
        nvfp4=set(ckpt.quantized),
        input_amax=ckpt.input_amax,
    )
    for file in ("model.safetensors", "hf_quant_config.json"):
        assert (tmp_path / "a" / file).read_bytes() == (
            tmp_path / "b" / file
        ).read_bytes()
    # The same policy on the imported tensors selects the same layers.
    export_nvfp4(
        {**ckpt.quantized, **ckpt.tensors},
        tmp_path / "c",
        nvfp4=policy,
        input_amax=ckpt.input_amax,
    )
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (
        tmp_path / "c" / "model.safetensors"
    ).read_bytes()


def test_round_trip_of_a_foreign_checkpoint(tmp_path):
    """Without our metadata (another producer's file), amax = weight_scale_2 *
    2688 and re-exporting writes the same scales and codes."""
    export(tmp_path / "a")
    tensors, _, _ = read_st(tmp_path / "a" / "model.safetensors")
    (tmp_path / "b").mkdir()
    write_st(tmp_path / "b" / "model.safetensors", tensors, {"format": "pt"})
    (tmp_path / "b" / "hf_quant_config.json").write_text(
        json.dumps({"quantization": {"quant_algo": "NVFP4", "group_size": 16}})
    )
    ckpt = import_nvfp4(tmp_path / "b")
    assert ckpt.quantized[UP].block == "1x16"  # ModelOpt's blocks
    s2 = tensors[UP + ".weight_scale_2"]
    assert np.float32(ckpt.quantized[UP].amax) == s2 * np.float32(2688)
    export_nvfp4(
        {**ckpt.quantized, **ckpt.tensors},
        tmp_path / "c",
        nvfp4=set(ckpt.quantized),
        input_amax=ckpt.input_amax,
    )
    again, _, _ = read_st(tmp_path / "c" / "model.safetensors")
    assert set(again) == set(tensors)
    for name in tensors:
        assert again[name].tobytes() == tensors[name].tobytes(), name


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("recipe", [NVFP4, Recipe(weight_2d=False)])
def test_fp4_bytes_are_training_fprop(tmp_path, dtype, recipe):
    w_nk = jax.random.normal(jax.random.key(3), (48, 64), dtype)  # [N, K]
    export_nvfp4({UP: w_nk}, tmp_path, nvfp4={UP}, input_amax=AMAX, recipe=recipe)
    tensors, _, _ = read_st(tmp_path / "model.safetensors")
    # FPROP's weight, in the PyTorch orientation and in Flax's [K, N].
    # (codes, scales, amax [1]) of one expert, stored [1, N, K/2] both ways.
    fprop_nk = quantize_weights(w_nk[None], recipe, k_last=True)[0]
    fprop_kn = quantize_weights(w_nk.T[None], recipe, k_last=False)[0]
    block = "16x16" if recipe.weight_2d else "1x16"
    plain = jax_nvfp4.quantize(w_nk.T, 0, block=block)
    for codes, scales, amax in (
        fprop_nk,
        fprop_kn,
        (plain.codes, plain.scales, plain.amax),
    ):
        assert tensors[UP + ".weight"].tobytes() == np.asarray(codes).tobytes()
        assert tensors[UP + ".weight_scale"].tobytes() == np.asarray(scales).tobytes()
        amax = np.float32(np.asarray(amax).reshape(()))
        assert tensors[UP + ".weight_scale_2"] == amax / np.float32(2688)


def test_nibble_order_and_scale_layout(tmp_path):
    n, k = 32, 64
    # Values on the E2M1 grid with a 6 in every 16x16 tile: amax 6, every
    # tile's scale 448 and encode multiplier 1, so the codes are the values.
    codes = (np.arange(n)[:, None] * 3 + np.arange(k)[None, :] * 5) % 16
    w = E2M1_TABLE[codes]
    w[::16, ::16] = 6.0
    w[0, 0], w[0, 1] = 1.0, -3.0  # codes 2 and 8 | 5 = 13
    w[0, 2] = 6.0
    export_nvfp4({UP: jnp.asarray(w)}, tmp_path, nvfp4={UP}, input_amax=AMAX)
    tensors, _, header = read_st(tmp_path / "model.safetensors")
    q = tensors[UP + ".weight"]
    assert header[UP + ".weight"]["dtype"] == "U8" and q.shape == (n, k // 2)
    assert q[0, 0] == 0xD2  # element 0 in the low nibble, element 1 high
    assert q[0, 1] & 0x0F == 7  # element 2 = 6.0
    codes[::16, ::16] = 7
    codes[0, :3] = [2, 13, 7]
    np.testing.assert_array_equal(q, codes[:, 0::2] | codes[:, 1::2] << 4)


def test_scale_layout_is_linear(tmp_path):
    n, k = 32, 64
    # Tile (i, j) has amax 6 * 2^-(i + 2j): global amax 6, scale 448 * 2^-(i+2j).
    rng = np.random.default_rng(0)
    w = rng.uniform(-0.5, 0.5, (n, k)).astype(np.float32)
    for i in range(n // 16):
        for j in range(k // 16):
            tile = w[16 * i : 16 * i + 16, 16 * j : 16 * j + 16]
            tile *= 2.0 ** -(i + 2 * j)
            tile[(5 * i + j) % 16, (3 * j + i) % 16] = 6.0 * 2.0 ** -(i + 2 * j)
    export_nvfp4({UP: jnp.asarray(w)}, tmp_path, nvfp4={UP}, input_amax=AMAX)
    tensors, _, header = read_st(tmp_path / "model.safetensors")
    s = tensors[UP + ".weight_scale"]
    assert header[UP + ".weight_scale"]["dtype"] == "F8_E4M3"
    assert s.shape == (n, k // 16)  # linear: no padding to 128x4 tiles
    rows = np.arange(n)[:, None] // 16
    cols = np.arange(k // 16)[None, :]
    np.testing.assert_array_equal(
        s.astype(np.float32), 448.0 * 2.0 ** -(rows + 2 * cols)
    )


def test_independent_reader_matches_dequantize(tmp_path):
    weights = model()
    export(tmp_path, weights)
    tensors, metadata, header = read_st(tmp_path / "model.safetensors")
    assert metadata["format"] == "pt"
    ckpt = import_nvfp4(tmp_path)
    for name in (UP, DOWN):
        assert header[name + ".weight_scale_2"] | {"data_offsets": 0} == {
            "dtype": "F32",
            "shape": [],
            "data_offsets": 0,
        }
        assert header[name + ".input_scale"]["shape"] == []
        t = ckpt.quantized[name]
        amax = np.float32(t.amax)
        s2 = tensors[name + ".weight_scale_2"]
        assert s2 == amax / np.float32(2688)  # the GEMM alpha's quotient
        assert tensors[name + ".input_scale"] == np.float32(AMAX[name]) / np.float32(
            2688
        )
        unit, served = serve_dequantize(tensors, name)
        # e2m1 * weight_scale is exact in float32, and equals our dequantize
        # with the tensor scale taken out (amax 2688: (s * 2688) * (1/2688)
        # is s for every E4M3 scale).
        ones = jax_nvfp4.NVFP4Tensor(
            t.codes, t.scales, jnp.float32(2688), t.shape, t.axis, t.block
        )
        np.testing.assert_array_equal(unit, jax_nvfp4.dequantize(ones, jnp.float32))
        # With the tensor scale: ours computes e2m1 * ((s * A) * (1/2688)), the
        # engine (e2m1 * s) * (A / 2688); the two roundings differ by at most
        # one float32 ulp.
        ours = np.asarray(jax_nvfp4.dequantize(t, jnp.float32))
        assert np.all(np.abs(served - ours) <= np.spacing(np.abs(ours)))
        # And the engine sees the bytes training's weight quantizes to.
        w = weights.get(name, weights.get(name + ".weight"))
        ref = jax_nvfp4.dequantize(jax_nvfp4.quantize(w, 1, block="16x16"), jnp.float32)
        np.testing.assert_array_equal(ours, ref)


def test_hf_quant_config(tmp_path):
    export(tmp_path)
    config = json.loads((tmp_path / "hf_quant_config.json").read_text())
    assert config == {
        "producer": {"name": "jax_nvfp4", "version": jax_nvfp4.__version__},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": 16,
            # 2-D weights left in bf16 (the embedding included: harmless).
            "exclude_modules": sorted(["lm_head", "model.embed_tokens", Q, UP1]),
        },
    }
    assert import_nvfp4(tmp_path).config == config


# --------------------------------------------------------------------------
# Malformed checkpoints


def rewrite(tmp_path, edit, metadata=True):
    """Exports, edits the tensors dict, writes it back with the test's writer."""
    export(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors, meta, _ = read_st(path)
    tensors = dict(tensors)
    edit(tensors)
    write_st(path, tensors, meta if metadata else None)


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda t: t.update({UP + ".weight": t[UP + ".weight"].view(np.int8)}),
            "uint8",
        ),
        (
            lambda t: t.update(
                {UP + ".weight_scale": t[UP + ".weight_scale"].astype(np.float32)}
            ),
            "float8_e4m3fn",
        ),
        (
            lambda t: t.update({UP + ".weight": t[UP + ".weight"][:, :8]}),
            r"float8_e4m3fn \[N, K/16\]",
        ),
        (
            lambda t: t.update(
                {UP + ".weight_scale": t[UP + ".weight_scale"].T.copy()}
            ),
            r"\[64, 2\]",
        ),
        (lambda t: t.pop(UP + ".weight_scale"), "weight_scale'"),
        (lambda t: t.pop(UP + ".weight_scale_2"), "weight_scale_2'"),
        (lambda t: t.pop(UP + ".input_scale"), "input_scale'"),
        (
            lambda t: t.update(
                {
                    UP + ".weight_scale_2": t[UP + ".weight_scale_2"].astype(
                        np.float32
                    )[None, None]
                }
            ),
            "float32 scalar",
        ),
        (
            lambda t: t.update(
                {UP + ".weight_scale_2": np.float32(t[UP + ".weight_scale_2"] * 2)}
            ),
            "disagree",
        ),
    ],
)
def test_malformed_tensors(tmp_path, edit, match):
    rewrite(tmp_path, edit)
    with pytest.raises(CheckpointError, match=match):
        import_nvfp4(tmp_path)


def test_malformed_files(tmp_path):
    export(tmp_path)
    path = tmp_path / "model.safetensors"
    good = path.read_bytes()
    path.write_bytes(good[:-5])
    with pytest.raises(CheckpointError, match="truncated"):
        import_nvfp4(tmp_path)
    path.write_bytes(good[:6])
    with pytest.raises(CheckpointError, match="truncated"):
        import_nvfp4(tmp_path)
    path.write_bytes(struct.pack("<Q", 1 << 40) + good[8:])
    with pytest.raises(CheckpointError, match="truncated"):
        import_nvfp4(tmp_path)
    write_st(path, {}, header_text=b"{not json at all")
    with pytest.raises(CheckpointError, match="not JSON"):
        import_nvfp4(tmp_path)
    path.write_bytes(good)
    config = tmp_path / "hf_quant_config.json"
    config.write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    with pytest.raises(CheckpointError, match="not 'NVFP4'"):
        import_nvfp4(tmp_path)
    config.write_text("[")
    with pytest.raises(CheckpointError, match="not a quantization config"):
        import_nvfp4(tmp_path)
    config.unlink()
    with pytest.raises(CheckpointError, match="no hf_quant_config.json"):
        import_nvfp4(tmp_path)


# --------------------------------------------------------------------------
# Bad export input


def test_bad_export_input(tmp_path):
    w = model()
    with pytest.raises(ValueError, match=r"K=24 must be a multiple of 16"):
        export(tmp_path, {UP: jnp.ones((32, 24))}, nvfp4={UP})
    with pytest.raises(ValueError, match=r"N=24 \(16x16 weight tiles\) must be"):
        export(tmp_path, {UP: jnp.ones((24, 32))}, nvfp4={UP})
    with pytest.raises(
        ValueError, match=rf"no input_amax for the NVFP4 layers \['{UP}'\]"
    ):
        export(tmp_path, w, input_amax={DOWN: 1.0})
    with pytest.raises(ValueError, match="not 2-D weights in weights: .'model.nope'"):
        export(tmp_path, w, nvfp4={UP, "model.nope"})
    with pytest.raises(ValueError, match="not 2-D weights"):
        export(tmp_path, w, nvfp4={"model.norm"})
    with pytest.raises(TypeError, match="wrap one name in a set"):
        export(tmp_path, w, nvfp4=UP)
    with pytest.raises(ValueError, match="FPROP in bf16"):
        export(tmp_path, w, recipe=Recipe(fprop=False))
    with pytest.raises(ValueError, match="finite and positive"):
        export(tmp_path, w, input_amax={**AMAX, UP: 0.0})
    assert not (tmp_path / "model.safetensors").exists()


# --------------------------------------------------------------------------
# Calibration


def test_calibrate(tmp_path):
    weights = model(jnp.float32)

    def forward(x, record):
        h = record(UP, x) @ weights[UP].T
        h = jax.nn.relu(h)
        return record(DOWN, h) @ weights[DOWN + ".weight"].T

    batches = [
        jax.random.normal(jax.random.key(i), (4, 32)) * (i + 1) for i in range(3)
    ]
    amax = checkpoint.calibrate(forward, batches)
    assert amax[UP] == float(max(jnp.max(jnp.abs(b)) for b in batches))
    want = max(float(jnp.max(jax.nn.relu(b @ weights[UP].T))) for b in batches)
    assert amax[DOWN] == pytest.approx(want, rel=1e-6)
    assert checkpoint.calibrate(forward, batches, jit=False)[UP] == amax[UP]
    export_nvfp4(weights, tmp_path, nvfp4={UP, DOWN}, input_amax=amax)
    assert import_nvfp4(tmp_path).input_amax == amax
    with pytest.raises(ValueError, match="record"):
        checkpoint.calibrate(lambda x, record: x, batches)


def test_sharded_checkpoint_and_dtype(tmp_path):
    """A checkpoint split over files by model.safetensors.index.json imports
    as the single file; ``dtype`` casts the tensors left unquantized."""
    export(tmp_path / "a", dtype=jnp.bfloat16)
    tensors, meta, _ = read_st(tmp_path / "a" / "model.safetensors")
    assert tensors["model.norm.weight"].dtype == ml_dtypes.bfloat16
    assert tensors[UP + ".weight_scale_2"].dtype == np.float32
    names = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": names[::2]}
    parts["model-00002-of-00002.safetensors"] = names[1::2]
    b = tmp_path / "b"
    b.mkdir()
    for file, part in parts.items():
        write_st(b / file, {n: tensors[n] for n in part}, meta)
    index = {"weight_map": {n: f for f, part in parts.items() for n in part}}
    (b / "model.safetensors.index.json").write_text(json.dumps(index))
    (b / "hf_quant_config.json").write_bytes(
        (tmp_path / "a" / "hf_quant_config.json").read_bytes()
    )
    one, many = import_nvfp4(tmp_path / "a"), import_nvfp4(b)
    assert set(one.tensors) == set(many.tensors)
    for name, t in one.quantized.items():
        np.testing.assert_array_equal(t.codes, many.quantized[name].codes)
        assert np.float32(t.amax) == np.float32(many.quantized[name].amax)


# --------------------------------------------------------------------------
# fused layers


def _fused_block(seed=0):
    """q/k/v and gate/up of one block, each with its own amax."""
    keys = jax.random.split(jax.random.key(seed), 6)
    prefix = "model.layers.0."
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    names += ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    return {
        prefix + n: jax.random.normal(key, (32, 32), jnp.float32) * (1 + i)
        for i, (n, key) in enumerate(zip(names, keys, strict=True))
    }


def test_fused_siblings_share_their_scales(tmp_path):
    """q/k/v and gate/up (loaded by serving engines as one GEMM each) share
    the largest weight amax and input amax of their group; the shard with
    that amax keeps training's bytes, the others are quantized with it;
    down_proj keeps its own."""
    weights = _fused_block()
    amax = {m: 1.0 + i for i, m in enumerate(weights)}
    export_nvfp4(weights, tmp_path / "a", nvfp4=set(weights), input_amax=amax)
    tensors, _, _ = read_st(tmp_path / "a" / "model.safetensors")
    qkv = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    gate_up = [f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up")]
    down = "model.layers.0.mlp.down_proj"
    for group in (qkv, gate_up):
        w_amax = max(jax_nvfp4.global_amax(weights[m]) for m in group)
        for m in group:
            assert tensors[m + ".weight_scale_2"] == np.float32(w_amax) / np.float32(
                2688
            )
            assert tensors[m + ".input_scale"] == np.float32(
                max(amax[g] for g in group)
            ) / np.float32(2688)
            want = jax_nvfp4.quantize(weights[m], 1, block="16x16", amax=w_amax)
            assert tensors[m + ".weight"].tobytes() == np.asarray(want.codes).tobytes()
            assert (
                tensors[m + ".weight_scale"].tobytes()
                == np.asarray(want.scales).tobytes()
            )
        # The largest shard's bytes are training's own.
        own = jax_nvfp4.quantize(weights[group[-1]], 1, block="16x16")
        assert (
            tensors[group[-1] + ".weight"].tobytes() == np.asarray(own.codes).tobytes()
        )
    own = jax_nvfp4.quantize(weights[down], 1, block="16x16")
    assert tensors[down + ".weight_scale_2"] == np.float32(own.amax) / np.float32(2688)
    # Re-exporting the import writes the same files; the reader agrees.
    ckpt = import_nvfp4(tmp_path / "a")
    export_nvfp4(
        {**ckpt.quantized, **ckpt.tensors},
        tmp_path / "b",
        nvfp4=set(ckpt.quantized),
        input_amax=ckpt.input_amax,
    )
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (
        tmp_path / "b" / "model.safetensors"
    ).read_bytes()
    # What an engine dequantizes with the group's one weight_scale_2 is our
    # dequantize of the imported shard, up to the float32 roundings of the
    # two orders (two on the engine's side, up to four on ours).
    for m in weights:
        served = serve_dequantize(tensors, m)[1]
        ours = np.asarray(jax_nvfp4.dequantize(ckpt.quantized[m], jnp.float32))
        assert np.all(np.abs(served - ours) <= 4 * np.spacing(np.abs(ours)))
    # fuse=(): every layer its own scales, training's bytes.
    export_nvfp4(weights, tmp_path / "c", nvfp4=set(weights), input_amax=amax, fuse=())
    plain, _, _ = read_st(tmp_path / "c" / "model.safetensors")
    for m in weights:
        own = jax_nvfp4.quantize(weights[m], 1, block="16x16")
        assert plain[m + ".weight"].tobytes() == np.asarray(own.codes).tobytes()
        assert plain[m + ".input_scale"] == np.float32(amax[m]) / np.float32(2688)


def test_fused_groups_all_nvfp4_or_all_bf16(tmp_path):
    weights = _fused_block(1)
    amax = dict.fromkeys(weights, 1.0)
    half = {"model.layers.0.mlp.gate_proj"}
    with pytest.raises(ValueError, match="one fused GEMM"):
        export_nvfp4(weights, tmp_path / "a", nvfp4=half, input_amax=amax)
    export_nvfp4(weights, tmp_path / "b", nvfp4=half, input_amax=amax, fuse=())
    # An import of per-layer scales re-exports as it is, fused or not.
    ckpt_dir = export_nvfp4(
        weights, tmp_path / "c", nvfp4=set(weights), input_amax=amax, fuse=()
    )
    ckpt = import_nvfp4(ckpt_dir)
    export_nvfp4(
        {**ckpt.quantized, **ckpt.tensors},
        tmp_path / "d",
        nvfp4=set(ckpt.quantized),
        input_amax=ckpt.input_amax,
    )
    assert (tmp_path / "c" / "model.safetensors").read_bytes() == (
        tmp_path / "d" / "model.safetensors"
    ).read_bytes()
    # A quantized shard beside an unquantized one must hold the largest amax.
    gate, up = "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"
    mixed = {**weights, gate: ckpt.quantized[gate]}  # gate's amax < up's
    with pytest.raises(ValueError, match="already quantized with different amaxes"):
        export_nvfp4(mixed, tmp_path / "e", nvfp4=set(weights), input_amax=amax)
    assert np.float32(ckpt.quantized[gate].amax) < np.float32(
        jax_nvfp4.global_amax(weights[up])
    )
    # fuse as a one-shot iterator works like the tuple.
    export_nvfp4(
        weights,
        tmp_path / "f",
        nvfp4=set(weights),
        input_amax=amax,
        fuse=iter(checkpoint.FUSED_GROUPS),
    )
    assert (tmp_path / "f" / "model.safetensors").read_bytes() == export_nvfp4(
        weights, tmp_path / "g", nvfp4=set(weights), input_amax=amax
    ).joinpath("model.safetensors").read_bytes()
    with pytest.raises(TypeError, match="sequence of groups"):
        export_nvfp4(
            weights,
            tmp_path / "e",
            nvfp4=set(weights),
            input_amax=amax,
            fuse=("q_proj", "k_proj"),
        )


# --------------------------------------------------------------------------
# config.json and the files serving engines read

# config.json's quantization_config as NVIDIA ModelOpt 0.47's Hugging Face
# exporter writes it for NVFP4 (written out here from its output, not built
# by the module under test).
FP4_ARGS = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
EXCLUDED = sorted(["lm_head", "model.embed_tokens", Q, UP1])


def modelopt_quantization_config(ignore):
    return {
        "config_groups": {
            "group_0": {
                "input_activations": FP4_ARGS,
                "weights": FP4_ARGS,
                "targets": ["Linear"],
            }
        },
        "ignore": ignore,
        "quant_algo": "NVFP4",
        "producer": {"name": "jax_nvfp4", "version": jax_nvfp4.__version__},
        "quant_method": "modelopt",
    }


LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "vocab_size": 50,
    "torch_dtype": "bfloat16",
}


def test_config_json_without_a_model_config(tmp_path):
    export(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config == {"quantization_config": modelopt_quantization_config(EXCLUDED)}
    # hf_quant_config.json stays beside it, naming the same bf16 layers.
    quant = json.loads((tmp_path / "hf_quant_config.json").read_text())
    assert quant["quantization"]["exclude_modules"] == EXCLUDED


@pytest.mark.parametrize("given", ["dict", "file", "directory"])
def test_config_json_merges_the_model_config(tmp_path, given):
    source = tmp_path / "hf_model"
    source.mkdir()
    # A quantization_config already there (e.g. a config copied from another
    # quantized model) is replaced by this checkpoint's.
    original = {**LLAMA_CONFIG, "quantization_config": {"quant_method": "fp8"}}
    (source / "config.json").write_text(json.dumps(original))
    (source / "generation_config.json").write_text('{"eos_token_id": 2}')
    arg = {
        "dict": original,
        "file": source / "config.json",
        "directory": str(source),
    }[given]
    export(tmp_path / "out", model_config=arg)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config == {
        **LLAMA_CONFIG,
        "quantization_config": modelopt_quantization_config(EXCLUDED),
    }
    assert original["quantization_config"] == {"quant_method": "fp8"}  # untouched
    copied = (tmp_path / "out" / "generation_config.json").exists()
    assert copied == (given == "directory")
    # The checkpoint still imports, with hf_quant_config.json's content.
    assert import_nvfp4(tmp_path / "out").config["quantization"]["quant_algo"] == (
        "NVFP4"
    )


def test_tokenizer_is_copied(tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    files = {
        "tokenizer.json": '{"version": "1.0"}',
        "tokenizer_config.json": '{"model_max_length": 128}',
        "special_tokens_map.json": "{}",
    }
    for name, text in files.items():
        (tok / name).write_text(text)
    (tok / "notes.txt").write_text("not a tokenizer file")
    export(tmp_path / "a", tokenizer=tok)
    for name, text in files.items():
        assert (tmp_path / "a" / name).read_text() == text
    assert not (tmp_path / "a" / "notes.txt").exists()
    # Or the files themselves.
    export(tmp_path / "b", tokenizer=[tok / "tokenizer.json"])
    assert (tmp_path / "b" / "tokenizer.json").read_text() == files["tokenizer.json"]
    assert not (tmp_path / "b" / "tokenizer_config.json").exists()
    # Exporting into the tokenizer's own directory leaves its files as they are.
    export(tok, tokenizer=tok)
    assert (tok / "tokenizer.json").read_text() == files["tokenizer.json"]


def test_bad_model_config_and_tokenizer(tmp_path):
    out = tmp_path / "out"
    (tmp_path / "empty").mkdir()
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "bad.json").write_text("{nope")
    cases = [
        (dict(model_config=tmp_path / "empty"), "has no config.json"),
        (dict(model_config=tmp_path / "missing.json"), "does not exist"),
        (dict(model_config=tmp_path / "list.json"), "JSON list, not an object"),
        (dict(model_config=tmp_path / "bad.json"), "cannot read .* as JSON"),
        (dict(model_config={"a": object()}), "JSON-serializable"),
        (dict(tokenizer=tmp_path / "empty"), "none of the tokenizer files"),
        (dict(tokenizer=[tmp_path / "nope.json"]), "are not files"),
        (dict(tokenizer=[tmp_path / "list.json"]), None),  # fine: a file
    ]
    for kw, match in cases:
        if match is None:
            export(tmp_path / "ok", **kw)
            continue
        with pytest.raises(ValueError, match=match):
            export(out, **kw)
        assert not out.exists(), kw  # refused before writing anything
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="overwrite the checkpoint's own files"):
        export(out, tokenizer=[tmp_path / "config.json"])
    with pytest.raises(TypeError, match="model_config is the model's"):
        export(out, model_config=3)


# --------------------------------------------------------------------------
# Non-finite weights


def _poison(array, value, at=(3, 5)):
    a = np.array(array)
    a[at] = value
    return a


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize(
    "key, tensor",
    [
        (UP, UP + ".weight"),  # an NVFP4 layer (float32)
        (DOWN + ".weight", DOWN + ".weight"),  # an NVFP4 layer (bf16)
        (Q, Q + ".weight"),  # a bf16 linear
        ("lm_head.weight", "lm_head.weight"),
    ],
)
def test_non_finite_weight_is_refused(tmp_path, key, tensor, bad):
    weights = model()
    weights[key] = _poison(weights[key], bad)
    with pytest.raises(ValueError, match=rf"'{tensor}' holds 1 non-finite .*\[3, 5\]"):
        export(tmp_path, weights)
    assert not tmp_path.joinpath("model.safetensors").exists()
    # As a jax array too (checked on its device).
    weights[key] = jnp.asarray(weights[key])
    with pytest.raises(ValueError, match=rf"'{tensor}' holds 1 non-finite"):
        export(tmp_path, weights)


def test_non_finite_bias_norm_and_cast(tmp_path):
    weights = model()
    weights["model.norm.weight"] = _poison(weights["model.norm.weight"], np.nan, 7)
    with pytest.raises(ValueError, match="'model.norm.weight' holds 1 non-finite"):
        export(tmp_path, weights)
    weights = model()
    weights[DOWN + ".bias"] = np.full((32,), np.inf, np.float32)
    with pytest.raises(ValueError, match=rf"'{DOWN}.bias' holds 32 non-finite"):
        export(tmp_path, weights)
    # Finite in float32, infinite once cast to the requested dtype.
    weights = model()
    weights["model.norm.weight"] = np.full((32,), 3.4e38, np.float32)
    with pytest.raises(ValueError, match="32 non-finite value.* in float16"):
        export(tmp_path, weights, dtype=jnp.float16)
    assert not tmp_path.joinpath("model.safetensors").exists()


@pytest.mark.parametrize("amax", [np.nan, np.inf])
def test_quantized_input_with_a_non_finite_amax_is_refused(tmp_path, amax):
    """An NVFP4Tensor (e.g. an import, or one quantized from a NaN weight)
    whose amax or block scales are not finite."""
    t = jax_nvfp4.quantize(model()[UP], 1, block="16x16")
    bad = jax_nvfp4.NVFP4Tensor(
        t.codes, t.scales, jnp.float32(amax), t.shape, t.axis, t.block
    )
    with pytest.raises(ValueError, match=rf"'{UP}.weight': the NVFP4Tensor's amax"):
        export(tmp_path, {UP: bad}, nvfp4={UP})
    nan_scales = np.asarray(t.scales).copy()
    nan_scales.view(np.uint8)[0, 0] = 0x7F  # E4M3's NaN
    bad = jax_nvfp4.NVFP4Tensor(
        t.codes, jnp.asarray(nan_scales), t.amax, t.shape, t.axis, t.block
    )
    with pytest.raises(ValueError, match=rf"'{UP}.weight': the NVFP4Tensor's block"):
        export(tmp_path, {UP: bad}, nvfp4={UP})
    # Quantized from a weight holding NaN or Inf: the amax leaves them out
    # (finite), the blocks holding them get a NaN scale.
    for block in ("1x16", "16x16"):
        w = jax_nvfp4.quantize(_poison(model()[UP], amax), 1, block=block)
        assert np.isfinite(np.float32(w.amax))
        with pytest.raises(ValueError, match="block scales hold NaN or Inf"):
            export(tmp_path, {UP: w}, nvfp4={UP})
    assert not tmp_path.joinpath("model.safetensors").exists()


# --------------------------------------------------------------------------
# import_nvfp4 given something other than a checkpoint directory


def test_import_needs_the_checkpoint_directory(tmp_path):
    export(tmp_path / "ckpt")
    for name in ("model.safetensors", "hf_quant_config.json", "config.json"):
        file = tmp_path / "ckpt" / name
        with pytest.raises(CheckpointError, match="is a file, not a directory") as e:
            import_nvfp4(file)
        assert repr(str(tmp_path / "ckpt")) in str(e.value)
        assert "model.safetensors" in str(e.value)
        assert "hf_quant_config.json" in str(e.value)
    with pytest.raises(CheckpointError, match="does not exist; import_nvfp4 reads"):
        import_nvfp4(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no hf_quant_config.json; import_nv"):
        import_nvfp4(tmp_path / "empty")
    (tmp_path / "empty" / "hf_quant_config.json").write_bytes(
        (tmp_path / "ckpt" / "hf_quant_config.json").read_bytes()
    )
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        import_nvfp4(tmp_path / "empty")
    with pytest.raises(TypeError, match="checkpoint's directory"):
        import_nvfp4(None)


# --------------------------------------------------------------------------
# Our export read by NVIDIA ModelOpt's and compressed-tensors' own code
# (skipped where they are not installed: pip install torch nvidia-modelopt
# compressed-tensors).


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def modelopt(torch):
    import warnings

    with warnings.catch_warnings():
        # It warns about the installed transformers version on import.
        warnings.simplefilter("ignore")
        qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")
        convert = pytest.importorskip("modelopt.torch.export.convert_hf_config")
    return qtensor, convert


def _torch_tensors(torch, path):
    """The checkpoint's tensors through Hugging Face's own safetensors reader."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    return safetensors_torch.load_file(str(path))


def test_modelopt_converts_our_hf_quant_config_to_our_config_json(tmp_path, modelopt):
    _, convert = modelopt
    export(tmp_path, model_config=LLAMA_CONFIG)
    quant = json.loads((tmp_path / "hf_quant_config.json").read_text())
    config = json.loads((tmp_path / "config.json").read_text())
    assert (
        convert.convert_hf_quant_config_format(quant) == config["quantization_config"]
    )
    # The public helper on other hf_quant_config.json contents ModelOpt writes.
    for other in (
        {"quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8"}},
        {
            "producer": {"name": "modelopt", "version": "0.47.0"},
            "quantization": {"quant_algo": "NVFP4", "group_size": 16},
        },
    ):
        want = convert.convert_hf_quant_config_format(other)
        assert checkpoint.quantization_config(other) == want


def test_modelopt_dequantizes_our_export(tmp_path, torch, modelopt):
    qtensor, _ = modelopt
    export(tmp_path)
    tensors = _torch_tensors(torch, tmp_path / "model.safetensors")
    ckpt = import_nvfp4(tmp_path)
    for name in (UP, DOWN):
        packed = tensors[name + ".weight"]
        assert packed.dtype == torch.uint8
        assert tensors[name + ".weight_scale"].dtype == torch.float8_e4m3fn
        n, k = packed.shape[0], 2 * packed.shape[1]
        q = qtensor.NVFP4QTensor(torch.Size([n, k]), torch.float32, packed)
        theirs = q.dequantize(
            dtype=torch.float32,
            scale=tensors[name + ".weight_scale"],
            double_scale=tensors[name + ".weight_scale_2"],
            block_sizes={-1: 16},
        ).numpy()
        ours = np.asarray(jax_nvfp4.dequantize(ckpt.quantized[name], jnp.float32))
        # ModelOpt multiplies e2m1 * (weight_scale * weight_scale_2), we
        # e2m1 * ((weight_scale * amax) / 2688): one float32 rounding apart.
        assert np.all(np.abs(theirs - ours) <= np.spacing(np.abs(ours))), name
        assert np.count_nonzero(ours) > ours.size // 2


def test_modelopt_quantizes_our_1x16_weight_to_the_same_bytes(
    tmp_path, torch, modelopt
):
    """ModelOpt's own NVFP4 quantizer, given the same bf16 weight, picks the
    same block scales and tensor scale, and the same codes except for values
    that lie within a few float32 ulps of a rounding midpoint (the two
    compute the scaled value in a different order)."""
    qtensor, _ = modelopt
    w = jax.random.normal(jax.random.key(7), (64, 128), jnp.float32) * 3
    w = w.astype(jnp.bfloat16)
    export_nvfp4(
        {UP: w}, tmp_path, nvfp4={UP}, input_amax=AMAX, recipe=Recipe(weight_2d=False)
    )
    ours, _, _ = read_st(tmp_path / "model.safetensors")
    tw = torch.from_numpy(np.asarray(w, np.float32)).to(torch.bfloat16)
    q, scale, scale_2 = qtensor.NVFP4QTensor.quantize(tw, 16)
    assert np.float32(scale_2.item()) == ours[UP + ".weight_scale_2"]
    np.testing.assert_array_equal(
        scale.view(torch.uint8).numpy(), ours[UP + ".weight_scale"].view(np.uint8)
    )
    theirs_codes = q._quantized_data.numpy()

    def nibbles(b):
        return np.stack([b & 15, b >> 4], -1).reshape(b.shape[0], -1)

    differ = nibbles(theirs_codes) != nibbles(ours[UP + ".weight"])
    assert differ.mean() < 1e-3
    # Where they differ, the scaled value is at a midpoint between two E2M1
    # values (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) up to float32 rounding.
    s = np.repeat(ours[UP + ".weight_scale"].astype(np.float32), 16, axis=1)
    x = np.abs(np.asarray(w, np.float32)[differ]) / (s[differ] * scale_2.item())
    midpoints = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    gap = np.min(np.abs(x[:, None] - midpoints[None, :]), axis=1)
    assert np.all(gap <= 4 * np.spacing(np.float32(x))), x


def test_compressed_tensors_unpacks_our_export(tmp_path, torch):
    pytest.importorskip("compressed_tensors")
    try:
        from compressed_tensors.compressors.nvfp4.helpers import (
            pack_fp4_to_uint8,
            unpack_fp4_from_uint8,
        )
    except ImportError:  # older releases
        from compressed_tensors.compressors.quantized_compressors.nvfp4_quantized import (  # noqa: E501
            pack_fp4_to_uint8,
            unpack_fp4_from_uint8,
        )
    export(tmp_path)
    tensors = _torch_tensors(torch, tmp_path / "model.safetensors")
    ckpt = import_nvfp4(tmp_path)
    for name in (UP, DOWN):
        packed = tensors[name + ".weight"]
        n, k = packed.shape[0], 2 * packed.shape[1]
        values = unpack_fp4_from_uint8(packed, n, k, dtype=torch.float32)
        # The E2M1 values as this file's own reader decodes them ...
        unit, _ = serve_dequantize(read_st(tmp_path / "model.safetensors")[0], name)
        s = np.repeat(
            tensors[name + ".weight_scale"].to(torch.float32).numpy(), 16, axis=1
        )
        np.testing.assert_array_equal(values.numpy() * s, unit)
        # ... packed back to the same bytes (the even element in the low nibble)
        np.testing.assert_array_equal(pack_fp4_to_uint8(values).numpy(), packed)
        served = values.numpy() * s * tensors[name + ".weight_scale_2"].item()
        ours = np.asarray(jax_nvfp4.dequantize(ckpt.quantized[name], jnp.float32))
        assert np.all(np.abs(served - ours) <= np.spacing(np.abs(ours))), name


def test_export_files_are_readable_as_any_new_file(tmp_path):
    """The weights get the permissions of any new file (0o666 less the
    umask), like the JSON files beside them: a serving engine running as
    another user reads them all. No temporary file is left behind."""
    old = os.umask(0o022)
    try:
        export(tmp_path / "a", model(), nvfp4=transformer_policy(2))
    finally:
        os.umask(old)
    files = sorted((tmp_path / "a").iterdir())
    assert [f.name for f in files if f.suffix == ".tmp"] == []
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in files}
    assert modes["model.safetensors"] == 0o644, modes
    assert modes["hf_quant_config.json"] == 0o644, modes
