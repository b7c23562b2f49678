"""Which custom calls does each jitted quantize compile to on this backend?

python benchmarks/diagnose_lowering.py
"""

import re

import jax
import jax.numpy as jnp

import jax_nvfp4 as nv
from jax_nvfp4 import _ffi_registry


def targets(text):
    found = re.findall(r'custom_call_target="([^"]+)"', text)
    found += re.findall(r"stablehlo.custom_call @(\w+)", text)
    return sorted(set(found))


def main():
    print(
        "registered:",
        {k: sorted(v) for k, v in _ffi_registry.registered_targets().items()},
    )
    cases = {
        "rows": lambda x: nv.quantize(x),
        "rows_amax_given": lambda x: nv.quantize(x, amax=jnp.float32(1.0)),
        "cols": lambda x: nv.quantize(x, axis=0),
        "rows_cols": lambda x: nv.quantize_rowwise_and_columnwise(x),
        "dequantize": lambda x: nv.dequantize(nv.quantize(x)),
    }
    for shape in ((16, 32), (256, 256)):
        x = jnp.ones(shape, jnp.float32)
        for name, fn in cases.items():
            lowered = jax.jit(fn).lower(x)
            print(
                shape,
                name,
                "lowered:",
                targets(lowered.as_text()),
                "compiled:",
                targets(lowered.compile().as_text()),
            )


if __name__ == "__main__":
    main()
