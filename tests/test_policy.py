"""The precision policy: path normalisation, rule order, defaults, errors."""

import warnings

import jax
import pytest

from jax_nvfp4 import NVFP4, NVFP4_NO_RHT, Recipe
from jax_nvfp4.policy import (
    Policy,
    path_string,
    transformer_policy,
    warn_unmatched_rules,
)

WGRAD_BF16 = Recipe(wgrad=False)


def test_path_string_names_and_indices():
    assert path_string(("layers", 3, "mlp", "up_proj")) == "layers.3.mlp.up_proj"
    assert path_string(()) == ""
    assert path_string(["lm_head"]) == "lm_head"


def test_path_string_from_jax_tree_paths():
    tree = {"blocks": [{"ffn": 1}, {"ffn": 2}]}
    paths = [path_string(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    assert paths == ["blocks.0.ffn", "blocks.1.ffn"]


@pytest.mark.parametrize("bad", [True, 1.5, None])
def test_path_string_rejects_other_entries(bad):
    with pytest.raises(TypeError, match="path entries"):
        path_string(("layers", bad))


def test_transformer_policy_defaults():
    policy = transformer_policy(4)
    for block in range(3):
        for name in ("mlp.up_proj", "mlp.gate_proj", "mlp.down_proj"):
            assert policy.recipe_for(f"layers.{block}.{name}") is NVFP4
        for name in ("attn.q_proj", "attention.o_proj", "self_attn.k_proj"):
            assert policy.recipe_for(f"layers.{block}.{name}") is None
    # The last block stays bf16 entirely, MLP included.
    assert policy.recipe_for("layers.3.mlp.up_proj") is None
    for path in ("embed", "tok_embeddings", "lm_head", "norm", "final_norm"):
        assert policy.recipe_for(path) is None


def test_transformer_policy_patterns_recipe_and_keep_last():
    policy = transformer_policy(
        6, recipe=NVFP4_NO_RHT, keep_last=2, nvfp4_patterns=("*feed_forward.w?",)
    )
    assert policy.recipe_for("model.blocks.3.feed_forward.w1") is NVFP4_NO_RHT
    assert policy.recipe_for("model.blocks.4.feed_forward.w1") is None
    assert policy.recipe_for("model.blocks.5.feed_forward.w1") is None
    assert policy.recipe_for("model.blocks.3.feed_forward.proj") is None
    assert policy.recipe_for("h.0.feed_forward.w2") is NVFP4_NO_RHT
    assert transformer_policy(3, keep_last=0).recipe_for("h.2.mlp.fc") is NVFP4


def test_first_matching_rule_wins_and_none_excludes():
    policy = Policy(
        rules=(
            ("*.mlp.down_proj", WGRAD_BF16),  # per-GEMM override
            ("layers.0.*", None),  # exclude block 0
            ("*mlp*", NVFP4),
        ),
        default=NVFP4_NO_RHT,
    )
    assert policy.recipe_for("layers.0.mlp.down_proj") is WGRAD_BF16
    assert policy.recipe_for("layers.0.mlp.up_proj") is None
    assert policy.recipe_for("layers.1.mlp.up_proj") is NVFP4
    assert policy.recipe_for("layers.1.attn.q_proj") is NVFP4_NO_RHT
    # Globs match the whole path, case sensitively.
    assert Policy(rules=(("mlp", NVFP4),)).recipe_for("layers.0.mlp.fc") is None
    assert Policy(rules=(("*MLP*", NVFP4),)).recipe_for("layers.0.mlp.fc") is None


def test_keep_last_overrides_rules_and_default():
    policy = Policy(rules=(("*", NVFP4),), default=NVFP4, keep_last=1, num_layers=2)
    assert policy.recipe_for("layers.0.mlp") is NVFP4
    assert policy.recipe_for("layers.1.mlp") is None
    assert policy.recipe_for("lm_head") is NVFP4  # not in a block


def test_block_pattern():
    policy = Policy(
        default=NVFP4, keep_last=1, num_layers=3, block_pattern=r"^stage(\d+)\."
    )
    assert policy.block_index("stage2.fc") == 2
    assert policy.block_index("layers.2.fc") is None
    assert policy.recipe_for("stage2.fc") is None
    assert policy.recipe_for("stage1.fc") is NVFP4
    default = Policy()
    assert default.block_index("decoder.layers.12.mlp") == 12
    assert default.block_index("blocks.7") == 7
    assert default.block_index("h.3.attn") == 3
    # The common shapes of a block's path in Flax, Equinox and Hugging Face.
    for path in (
        "layers.3.mlp",
        "layers_3.mlp",
        "decoder.layers_3.mlp.wi",
        "layer.3.ffn",
        "h.3.mlp.c_fc",
        "blocks.3",
        "block_3.mlp",
        "model.layers.3.mlp.up_proj",
    ):
        assert default.block_index(path) == 3, path
    assert default.block_index("mylayers.3.mlp") is None
    assert default.block_index("layers3.mlp") is None
    # A stacked (scanned) model's paths have no index.
    assert default.block_index("model.layers.mlp.up") is None


def test_transformer_policy_keep_last_for_every_path_shape():
    policy = transformer_policy(4, keep_last=1)
    for last in ("layer.3.mlp.up", "decoder.layers_3.mlp.wi", "h.3.mlp.c_fc"):
        assert policy.recipe_for(last) is None, last
    for first in ("layer.0.mlp.up", "decoder.layers_2.mlp.wi", "h.1.mlp.c_fc"):
        assert policy.recipe_for(first) is NVFP4, first


def test_stack_recipes():
    policy = transformer_policy(4, keep_last=1)
    assert policy.stack_recipes("layers.mlp.up", 4) == (NVFP4,) * 3 + (None,)
    assert policy.stack_recipes("layers.attn.q", 4) == (None,) * 4
    # A stack inside one block is decided by the block's index.
    assert policy.stack_recipes("layers.3.mlp.experts", 2) == (None, None)
    assert policy.stack_recipes("layers.1.mlp.experts", 2) == (NVFP4, NVFP4)
    with pytest.raises(ValueError, match="stack of 3 layers.*split the stack"):
        policy.stack_recipes("layers.mlp.up", 3)
    assert transformer_policy(4, keep_last=0).stack_recipes("x.mlp", 3) == (NVFP4,) * 3
    with pytest.raises(ValueError, match="size"):
        policy.stack_recipes("layers.mlp.up", 0)


def test_unmatched_rules_warn_with_the_paths_found():
    paths = ["layers.0.mlp.up", "layers.0.attn.q"]
    policy = Policy(rules=[("*mpl*", NVFP4), ("*atn*", None)])
    assert policy.unmatched_rules(paths) == ["*mpl*", "*atn*"]
    with pytest.warns(UserWarning, match=r"no rule.*layers.0.mlp.up, layers.0.attn.q"):
        warn_unmatched_rules(policy, paths)
    # One rule matching is enough: the default policy's globs are alternatives.
    partly = transformer_policy(2)
    assert partly.unmatched_rules(paths) == [
        "*router*",
        "*block_sparse_moe.gate",
        "*mlp.gate",
        "*ffn*",
        "*feed_forward*",
        "*block_sparse_moe.experts*",
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_unmatched_rules(partly, paths)


def test_assign_and_value_semantics():
    policy = Policy(rules=[("*mlp*", NVFP4)])  # a list is normalised to a tuple
    assert policy.rules == (("*mlp*", NVFP4),)
    assert policy == Policy(rules=(("*mlp*", NVFP4),))
    assert hash(policy) == hash(Policy(rules=(("*mlp*", NVFP4),)))
    assert policy.assign(["a.mlp", "a.attn"]) == {"a.mlp": NVFP4, "a.attn": None}


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"keep_last": 1}, ValueError, "needs num_layers"),
        ({"keep_last": -1, "num_layers": 2}, ValueError, "keep_last must be"),
        ({"rules": (("*mlp*",),)}, TypeError, "pair"),
        ({"rules": ((3, NVFP4),)}, TypeError, "pair"),
        ({"rules": (("*mlp*", "nvfp4"),)}, TypeError, "pair"),
        ({"default": "nvfp4"}, TypeError, "default must be"),
        ({"block_pattern": r"layers\.(\d+"}, ValueError, "not a regular"),
        ({"block_pattern": r"layers\.\d+"}, ValueError, "needs a group"),
    ],
)
def test_invalid_policies(kwargs, error, match):
    with pytest.raises(error, match=match):
        Policy(**kwargs)


def test_block_index_beyond_num_layers_raises():
    policy = transformer_policy(2)
    with pytest.raises(ValueError, match="num_layers=2"):
        policy.recipe_for("layers.5.mlp.up_proj")
    with pytest.raises(TypeError, match="path_string"):
        policy.recipe_for(("layers", 0))


def test_transformer_policy_errors():
    with pytest.raises(ValueError, match="exceeds num_layers"):
        transformer_policy(2, keep_last=3)
    with pytest.raises(TypeError, match="sequence of globs"):
        transformer_policy(2, nvfp4_patterns="*mlp*")


def test_transformer_policy_bf16_patterns_win_over_nvfp4_patterns():
    """A separately stacked tail of blocks stays in bf16 by its path; the
    other stack's MLPs (no block index, so keep_last=0) run NVFP4."""
    policy = transformer_policy(8, keep_last=0, bf16_patterns=("tail.*",))
    assert policy.recipe_for("layers.mlp.up_proj") == NVFP4
    assert policy.recipe_for("tail.mlp.up_proj") is None
    assert policy.stack_recipes("layers.mlp.up_proj", 7) == (NVFP4,) * 7
    assert policy.stack_recipes("tail.mlp.up_proj", 1) == (None,)
    with pytest.raises(TypeError, match="bf16_patterns is a sequence"):
        transformer_policy(8, bf16_patterns="tail.*")
