"""jax_nvfp4.config: the settings' values are checked, in ``override`` and
in the environment."""

import pytest

from jax_nvfp4 import config


def test_override_checks_each_value():
    with pytest.raises(ValueError, match="gemm_operands must be one of .*'bf16'"):
        with config.override(gemm_operands="bf16"):
            pass
    with pytest.raises(TypeError, match="gemm_operands must be one of"):
        with config.override(gemm_operands=True):
            pass
    with pytest.raises(TypeError, match="native_gemm must be True or False"):
        with config.override(native_gemm="codes"):
            pass
    with pytest.raises(TypeError, match="'decoded_operands' is not a jax_nvfp4"):
        with config.override(decoded_operands=True):
            pass
    with config.override(gemm_operands="codes") as settings:
        assert settings.gemm_operands == config.settings().gemm_operands == "codes"


def test_environment_switches(monkeypatch):
    for variable in (*config.SWITCHES, "JAX_NVFP4_GEMM_OPERANDS"):
        monkeypatch.delenv(variable, raising=False)
    assert config._from_environment() == config.Settings()
    assert config.Settings().gemm_operands == "auto"
    monkeypatch.setenv("JAX_NVFP4_GEMM_OPERANDS", " Decoded ")
    assert config._from_environment().gemm_operands == "decoded"
    monkeypatch.setenv("JAX_NVFP4_GEMM_OPERANDS", "")
    assert config._from_environment().gemm_operands == "auto"
    monkeypatch.setenv("JAX_NVFP4_GEMM_OPERANDS", "bf16")
    with pytest.raises(ValueError, match="JAX_NVFP4_GEMM_OPERANDS='bf16'.*'codes'"):
        config._from_environment()
    monkeypatch.setenv("JAX_NVFP4_GEMM_OPERANDS", "codes")
    monkeypatch.setenv("JAX_NVFP4_NATIVE_GEMM", "maybe")
    with pytest.raises(ValueError, match="JAX_NVFP4_NATIVE_GEMM='maybe'"):
        config._from_environment()
