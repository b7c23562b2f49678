"""The code that runs the primitives' work, below the primitive layer
(``jax_nvfp4.ops``, the only importer of this package): ``library`` (finds
and registers the compiled handlers), ``devices`` (what the devices lowered
for can do) and one module per GEMM engine, named as its CUDA source:
``bf16_gemm`` (the exact bf16 cuBLASLt GEMM for GPUs without FP4 tensor
cores), ``fp4_gemm`` (the native FP4 GEMM), ``bf16_grouped_gemm`` and
``fp4_grouped_gemm`` (``ragged_dot``'s grouped GEMMs), ``w4a16_gemm`` (bf16
activations by an NVFP4 weight), with ``operands`` (what the cuBLASLt
handlers share). Each is a lowering body the dispatcher (``ops.dispatch``)
picks; none reads the configuration."""
