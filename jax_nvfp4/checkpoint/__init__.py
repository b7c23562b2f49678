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

# Submodules: layout (file and tensor names, shared checks), export, load
# (import_nvfp4), calibrate, safetensors_io (the files themselves).
from jax_nvfp4.checkpoint.calibrate import calibrate
from jax_nvfp4.checkpoint.export import export_nvfp4, quantization_config
from jax_nvfp4.checkpoint.layout import (
    CONFIG_FILE,
    FUSED_GROUPS,
    MODEL_CONFIG_FILE,
    TOKENIZER_FILES,
    WEIGHTS_FILE,
    NVFP4Checkpoint,
)
from jax_nvfp4.checkpoint.load import import_nvfp4
from jax_nvfp4.checkpoint.safetensors_io import CheckpointError

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
