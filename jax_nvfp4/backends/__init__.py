"""Device choice and backend code: ``library`` (the compiled handlers),
``devices`` (what the lowered-for devices can do), ``hopper`` (the exact bf16
cuBLASLt GEMM for GPUs without FP4 tensor cores) and ``blackwell`` (the
native FP4 GEMM). Only the primitive layer, ``jax_nvfp4.ops``, uses them."""
