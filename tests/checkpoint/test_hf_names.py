"""jax_nvfp4.hf_names: Hugging Face Llama names for the weights of Flax NNX,
Flax linen (nested dicts) and Equinox models, stacked or numbered blocks, and
the export of those names with the policy's layer choice."""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from nvfp4_examples import train_common

import jax_nvfp4 as nv
from jax_nvfp4 import checkpoint, hf_names
from jax_nvfp4.policy import transformer_policy

LAYERS, D, FFN = 3, 32, 64


def _args(**extra):
    parser = argparse.ArgumentParser()
    train_common.add_common_flags(parser)
    args = parser.parse_args(
        ["--precision", "nvfp4", "--layers", str(LAYERS), "--keep-last", "1"]
        + ["--d-model", str(D), "--heads", "2", "--ffn", str(FFN)]
    )
    args.attention, args.remat, args.tie_embeddings = "xla", "fp4", False
    return args


def _llama_names(layers):
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    parts = (
        "input_layernorm",
        "post_attention_layernorm",
        *(f"self_attn.{p}_proj" for p in "qkvo"),
        *(f"mlp.{p}_proj" for p in ("gate", "up", "down")),
    )
    for i in range(layers):
        names |= {f"model.layers.{i}.{p}.weight" for p in parts}
    return names


def test_equinox_stacks_in_block_order():
    """The Equinox example: two stacks (layers, then the bf16 tail) numbered
    in order, Linear weights already [out, in]."""
    from nvfp4_examples import llama_equinox

    model = llama_equinox.to_bf16(llama_equinox.build(_args())[0])
    got = hf_names.llama_weights(model, stacks=("layers", "tail"))
    assert set(got) == _llama_names(LAYERS)
    up = model.layers.mlp.up_proj.weight  # [layers - 1, ffn, d]
    np.testing.assert_array_equal(got["model.layers.1.mlp.up_proj.weight"], up[1])
    np.testing.assert_array_equal(
        got["model.layers.2.mlp.up_proj.weight"], model.tail.mlp.up_proj.weight[0]
    )
    assert got["model.layers.0.self_attn.q_proj.weight"].shape == (D, D)


def test_flax_nnx_kernels_become_out_by_in():
    """The Flax NNX example: kernels [in, out] become weights [out, in],
    embedding and scale become weight."""
    from nvfp4_examples import llama_flax

    model = llama_flax.build(_args())[0]
    got = hf_names.llama_weights(model, stacks=("layers", "tail"))
    assert set(got) == _llama_names(LAYERS)
    kernel = np.asarray(jax.tree.leaves(model.layers.mlp.gate_proj.kernel)[0][0])
    np.testing.assert_array_equal(got["model.layers.0.mlp.gate_proj.weight"], kernel.T)
    assert got["model.layers.0.mlp.down_proj.weight"].shape == (D, FFN)
    assert got["lm_head.weight"].shape == (256, D)


def _linen_params(rng):
    """A linen-style params dict: numbered blocks, Meta's part names."""

    def dense(n_in, n_out):
        return {"kernel": rng.standard_normal((n_in, n_out)).astype(np.float32)}

    params = {"tok_embeddings": {"embedding": rng.standard_normal((256, D))}}
    for i in range(2):
        params[f"layers_{i}"] = {
            "attention_norm": {"scale": np.ones(D, np.float32)},
            "attention": {w: dense(D, D) for w in ("wq", "wk", "wv", "wo")},
            "ffn_norm": {"scale": np.ones(D, np.float32)},
            "feed_forward": {
                "w1": dense(D, FFN),
                "w3": dense(D, FFN),
                "w2": dense(FFN, D),
            },
            "step": np.int32(3),  # not a weight: skipped
        }
    params["final_norm"] = {"scale": np.ones(D, np.float32)}
    params["output"] = dense(D, 256)
    return params


def test_linen_numbered_blocks_and_meta_names():
    params = _linen_params(np.random.default_rng(0))
    got = hf_names.llama_weights(params)
    assert set(got) == _llama_names(2)
    np.testing.assert_array_equal(
        got["model.layers.1.mlp.down_proj.weight"],
        params["layers_1"]["feed_forward"]["w2"]["kernel"].T,
    )


def test_unknown_and_colliding_names_raise():
    params = _linen_params(np.random.default_rng(1))
    params["layers_0"]["mixer"] = {"kernel": np.zeros((D, D), np.float32)}
    with pytest.raises(ValueError, match="no Llama name for 'mixer'"):
        hf_names.llama_weights(params)
    # A rename maps it, here onto a name another path has: a collision.
    with pytest.raises(ValueError, match="as another path does"):
        hf_names.llama_weights(params, renames={"mixer": "self_attn.q_proj"})
    del params["layers_0"]["mixer"]
    params["tok_emb"] = {"embedding": np.zeros((4, D), np.float32)}
    with pytest.raises(ValueError, match="no Llama name for 'tok_emb'"):
        hf_names.llama_weights(params)
    with pytest.raises(TypeError, match="sequence of names"):
        hf_names.llama_weights(params, stacks="layers")
    stacked = {"layers": {"mlp": {"up_proj": {"kernel": np.zeros((3, D, FFN))}}}}
    stacked["layers"]["mlp"]["down_proj"] = {"kernel": np.zeros((2, FFN, D))}
    with pytest.raises(ValueError, match="leading axes of"):
        hf_names.llama_weights(stacked)


def test_export_applies_the_policy_to_the_names(tmp_path):
    """transformer_policy reads the block index and '*mlp*' in the Hugging
    Face names: blocks 0-1's MLPs in NVFP4, attention and the last block in
    bf16 (exclude_modules)."""
    params = _linen_params(np.random.default_rng(2))
    params["layers_2"] = params["layers_1"]
    bf16 = jax.tree.map(
        lambda a: jnp.asarray(a, jnp.bfloat16) if np.ndim(a) else a, params
    )
    weights = hf_names.llama_weights(bf16)
    policy = transformer_policy(3, keep_last=1)
    mlp = [f"model.layers.{i}.mlp.{p}_proj" for i in (0, 1) for p in ("gate", "up")]
    mlp += [f"model.layers.{i}.mlp.down_proj" for i in (0, 1)]
    checkpoint.export_nvfp4(
        weights, tmp_path, nvfp4=policy, input_amax={m: 1.0 for m in mlp}
    )
    config = json.loads((tmp_path / "hf_quant_config.json").read_text())
    excluded = set(config["quantization"]["exclude_modules"])
    assert "model.layers.2.mlp.up_proj" in excluded
    assert "model.layers.0.self_attn.q_proj" in excluded
    assert not excluded & set(mlp)
    loaded = checkpoint.import_nvfp4(tmp_path)
    assert set(loaded.quantized) == set(mlp)
    assert isinstance(next(iter(loaded.quantized.values())), nv.NVFP4Tensor)


def _moe_names(layers, experts, style="mixtral"):
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    moe, projections = {
        "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
        "qwen": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    }[style]
    parts = [
        "input_layernorm",
        "post_attention_layernorm",
        *(f"self_attn.{p}_proj" for p in "qkvo"),
        f"{moe}.gate",
    ]
    parts += [f"{moe}.experts.{e}.{p}" for e in range(experts) for p in projections]
    for i in range(layers):
        names |= {f"model.layers.{i}.{p}.weight" for p in parts}
    return names


@pytest.mark.parametrize("style", ["mixtral", "qwen"])
def test_experts_take_mixtral_or_qwen_names(style):
    """The Equinox example's MoE blocks: the router and one [out, in] tensor
    per expert (Experts hold [E, in, out]), under either naming."""
    from nvfp4_examples import llama_equinox

    args = _args()
    args.experts, args.top_k = 4, 2
    model = llama_equinox.to_bf16(llama_equinox.build(args)[0])
    got = hf_names.llama_weights(model, stacks=("layers", "tail"), moe=style)
    assert set(got) == _moe_names(LAYERS, 4, style)
    gate = model.layers.mlp.gate_proj.weight  # [layers - 1, E, d, ffn]
    name = {
        "mixtral": "block_sparse_moe.experts.2.w1",
        "qwen": "mlp.experts.2.gate_proj",
    }
    np.testing.assert_array_equal(
        got[f"model.layers.1.{name[style]}.weight"], gate[1, 2].T
    )
    router = {"mixtral": "block_sparse_moe.gate", "qwen": "mlp.gate"}[style]
    assert got[f"model.layers.0.{router}.weight"].shape == (4, D)
    # The default policy keeps the router in bf16 and the experts in NVFP4.
    policy = transformer_policy(LAYERS)
    assert policy.recipe_for(f"model.layers.0.{router}") is None
    assert policy.recipe_for(f"model.layers.0.{name[style]}") is not None


def test_flax_experts_and_the_export_of_mixtral_names(tmp_path):
    """The Flax NNX example's experts (kernels [E, in, out]) under Mixtral's
    names; transformer_policy puts blocks 0-1's experts in NVFP4 and keeps
    the routers and block 2 in bf16."""
    from nvfp4_examples import llama_flax

    args = _args()
    args.experts, args.top_k = 2, 1
    model = llama_flax.build(args)[0]
    weights = hf_names.llama_weights(model, stacks=("layers", "tail"))
    assert set(weights) == _moe_names(LAYERS, 2)
    kernel = np.asarray(jax.tree.leaves(model.layers.mlp.down_proj.kernel)[0])
    np.testing.assert_array_equal(
        weights["model.layers.0.block_sparse_moe.experts.1.w2.weight"], kernel[0, 1].T
    )
    weights = {k: jnp.asarray(v, jnp.bfloat16) for k, v in weights.items()}
    experts = [
        f"model.layers.{i}.block_sparse_moe.experts.{e}.{p}"
        for i in (0, 1)
        for e in (0, 1)
        for p in ("w1", "w2", "w3")
    ]
    checkpoint.export_nvfp4(
        weights,
        tmp_path,
        nvfp4=transformer_policy(3, keep_last=1),
        input_amax={m: 1.0 for m in experts},
    )
    config = json.loads((tmp_path / "hf_quant_config.json").read_text())
    excluded = set(config["quantization"]["exclude_modules"])
    assert "model.layers.0.block_sparse_moe.gate" in excluded
    assert "model.layers.2.block_sparse_moe.experts.0.w1" in excluded
    assert not excluded & set(experts)
    assert set(checkpoint.import_nvfp4(tmp_path).quantized) == set(experts)


def test_experts_outside_an_mlp_are_refused():
    params = {"layers_0": {"attention": {"wq": {"kernel": np.zeros((2, D, D))}}}}
    with pytest.raises(ValueError, match="belongs in a block's mlp"):
        hf_names.llama_weights(params)
    params = {"layers_0": {"mlp": {"mixer": {"kernel": np.zeros((2, D, D))}}}}
    with pytest.raises(ValueError, match="expert stack must be"):
        hf_names.llama_weights(params, renames={"mixer": "mixer"})
    with pytest.raises(ValueError, match="moe must be one of"):
        hf_names.llama_weights({}, moe="deepseek")
