"""examples/serve_nvfp4.py end to end on a tiny model: train in NVFP4,
export to ModelOpt's format, import, serve with the W4A16 GEMM, generate."""

import numpy as np
import serve_nvfp4  # examples/ is on the tests' path (pyproject.toml)


def test_train_export_reload_serve(tmp_path):
    result = serve_nvfp4.main(
        [
            "--steps", "6", "--layers", "2", "--d-model", "32", "--heads", "2",
            "--ffn", "64", "--batch", "4", "--seq-len", "32", "--log-every", "3",
            "--eval-every", "100", "--out", str(tmp_path / "runs"),
            "--export-dir", str(tmp_path / "ckpt"), "--new-tokens", "5",
            "--data", str(tmp_path / "missing.bin"),  # the sample in tests/data
        ]
    )  # fmt: skip
    # Block 0's three MLP projections trained in NVFP4 (block 1 is the bf16
    # tail); the checkpoint holds training's FP4 bytes for them.
    assert result["nvfp4_layers"] == 3
    assert result["same_fp4_bytes"]
    assert (tmp_path / "ckpt" / "hf_quant_config.json").exists()
    # The same products as the dequantized weights, up to summation order
    # (and the bf16 roundings it may flip downstream).
    assert result["max_diff_vs_dequantized"] <= 2e-2
    # W4A16 serving against W4A4 training: close, mostly the same argmax.
    assert result["max_diff_vs_training_forward"] < 0.2
    assert result["top1_agreement_vs_training_forward"] >= 0.8
    # The KV-cache decode computes the whole-window forward's logits, one
    # row at a time (bf16 roundings in other places, attention's sums).
    assert result["max_diff_cached_vs_forward"] <= 2e-2
    assert result["tokens_per_s"] > 0 and result["tokens_per_s_bf16"] > 0
    generated = result["generated"]
    assert generated.startswith("WATER, n.") and len(generated) == len("WATER, n.") + 5
    assert np.isfinite(result["max_diff_vs_dequantized"])


def test_mixture_of_experts_serves_its_nvfp4_experts(tmp_path):
    """The MoE model (--experts 4 --top-k 2): each expert exported as a
    layer of its own, imported, stacked and served by ragged_dot with the
    experts in NVFP4 (the grouped W4A16 GEMM)."""
    result = serve_nvfp4.main(
        [
            "--steps", "6", "--layers", "2", "--d-model", "32", "--heads", "2",
            "--ffn", "64", "--batch", "4", "--seq-len", "32", "--log-every", "3",
            "--eval-every", "100", "--out", str(tmp_path / "runs"),
            "--export-dir", str(tmp_path / "ckpt"), "--new-tokens", "5",
            "--data", str(tmp_path / "missing.bin"), "--experts", "4",
            "--top-k", "2",
        ]
    )  # fmt: skip
    # Block 0's 4 experts x 3 projections in NVFP4 (block 1 is the bf16
    # tail), with training's FP4 bytes.
    assert result["nvfp4_layers"] == 12
    assert result["same_fp4_bytes"]
    # A barely trained router sits near ties, so a rounding elsewhere can
    # send a row to another expert downstream: looser than the dense model.
    assert result["max_diff_vs_dequantized"] < 0.2
    assert result["max_diff_cached_vs_forward"] < 0.2
    assert result["top1_agreement_vs_training_forward"] >= 0.8
    generated = result["generated"]
    assert generated.startswith("WATER, n.") and len(generated) == len("WATER, n.") + 5
    assert result["tokens_per_s"] > 0
