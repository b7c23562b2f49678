"""Device choice and backend code: ``library`` (the compiled handlers),
``devices`` (what the lowered-for devices can do), ``bf16_gemm`` (the exact bf16
cuBLASLt GEMM for GPUs without FP4 tensor cores), ``fp4_gemm`` (the native
FP4 GEMM), ``bf16_grouped_gemm`` (``ragged_dot``'s GEMM on GPUs) and
``w4a16_gemm`` (``matmul`` of bf16 activations by an NVFP4 weight). The
primitive layer (``jax_nvfp4.ops``) uses the first four; ``ragged_dot.py`` and
``matmul.py`` the last two, which are custom calls of their own (no
primitive: no partitioning rule, so under a sharded ``jit`` they run on
gathered operands)."""


def export_safety_checks() -> list:
    """The ``jax.export.DisabledSafetyCheck`` list that lets ``jax.export``
    serialize computations holding jax_nvfp4's custom calls.

    XLA's export refuses custom calls without a compatibility guarantee; these
    handlers have none across jax_nvfp4 versions, so a module exported with
    these checks disabled must run with the same jax_nvfp4 build::

        exported = jax.export.export(
            jax.jit(step), disabled_checks=jax_nvfp4.export_safety_checks()
        )(*args)
    """
    from jax import export

    from jax_nvfp4.backends import bf16_gemm, fp4_gemm, library

    names = set().union(*library.registered_targets().values())
    names |= {bf16_gemm.TARGET, bf16_gemm.GRAPH_TARGET, bf16_gemm.DECODE_TARGET}
    names.add(fp4_gemm.TARGET)
    return [export.DisabledSafetyCheck.custom_call(n) for n in sorted(names)]
