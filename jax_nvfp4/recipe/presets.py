"""The recipe's switches (``Recipe``) and its presets."""

from __future__ import annotations

import dataclasses

__all__ = ["BF16", "NVFP4", "NVFP4_NO_RHT", "NVFP4_NO_SR", "Recipe"]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Which GEMMs run in NVFP4 and how (the switches of the reference recipe).

    Attributes:
      fprop, dgrad, wgrad: run that GEMM in NVFP4 (False: in the input dtype).
      rht: Random Hadamard Transform on WGRAD's inputs (te_nvfp4); False is
        te_nvfp4_no_rht.
      stochastic_rounding: stochastic rounding of dY (needs a key per call).
      weight_2d: 16x16 block scaling of w (False: 1x16 blocks along each GEMM's
        contraction axis, so FPROP's and DGRAD's w differ).
      implementation: "ffi" (custom calls) or "reference" (pure JAX).
    """

    fprop: bool = True
    dgrad: bool = True
    wgrad: bool = True
    rht: bool = True
    stochastic_rounding: bool = True
    weight_2d: bool = True
    implementation: str = "ffi"

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "implementation":
                if value not in ("ffi", "reference"):
                    raise ValueError(
                        "Recipe.implementation must be 'ffi' or 'reference', "
                        f"got {value!r}"
                    )
            elif not isinstance(value, bool):
                raise TypeError(
                    f"Recipe.{field.name} must be True or False, got {value!r}"
                )
        if not (self.fprop or self.dgrad or self.wgrad) and (
            self.rht or self.stochastic_rounding
        ):
            raise ValueError(
                "this Recipe runs every GEMM in bf16, so rht and "
                "stochastic_rounding do nothing: use jax_nvfp4.BF16, or set "
                "them to False"
            )
        if self.stochastic_rounding and not (self.dgrad or self.wgrad):
            raise ValueError(
                "stochastic_rounding rounds dY for the backward GEMMs, but this "
                "Recipe runs both in bf16: set stochastic_rounding=False (or "
                "dgrad/wgrad=True)"
            )

    @property
    def needs_key(self) -> bool:
        return self.stochastic_rounding and (self.dgrad or self.wgrad)


NVFP4 = Recipe()


NVFP4_NO_RHT = Recipe(rht=False)


NVFP4_NO_SR = Recipe(stochastic_rounding=False)


BF16 = Recipe(
    fprop=False, dgrad=False, wgrad=False, rht=False, stochastic_rounding=False
)
