"""Precision policy: which linear layers of a model run in NVFP4.

A ``Policy`` maps a layer's normalised module path — names and integer
indices joined by ".", e.g. ``"layers.3.mlp.up_proj"`` — to a ``Recipe`` (run
that layer's GEMMs in NVFP4 as the recipe says) or ``None`` (leave the layer in
its original precision, bit-identical to the unconverted model). The Flax and
Equinox integrations build paths with ``path_string`` and ask
``Policy.recipe_for``, so one policy describes a model in either framework.

The defaults follow docs/DESIGN.md ("The linear-layer recipe"): ``transformer_policy``
puts MLP linears in NVFP4 and keeps attention projections, embeddings, the
output head and the last few blocks in bf16 (the NVFP4 paper keeps ~15% of the
linear layers, mostly at the end, in high precision). Per-GEMM overrides are
rules with another ``Recipe``, e.g. ``("*down_proj", Recipe(wgrad=False))``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import re
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

from jax_nvfp4.recipe import NVFP4, Recipe

__all__ = ["Policy", "path_string", "transformer_policy", "warn_unmatched_rules"]

# A block index is a number after one of these names, joined by "." or "_":
# layers.3, layers_3, layer.3, blocks.3, block_3, h.3 (GPT-2), anywhere in the
# path ("model.decoder.layers_3.mlp").
DEFAULT_BLOCK_PATTERN = r"(?:^|\.)(?:layers|layer|blocks|block|h)[._](\d+)(?:\.|$)"


def _path_part(part: Any) -> str:
    """One path entry as text: a name, an index, or a jax tree-path key."""
    if isinstance(part, bool):  # bool is an int; a path never holds one
        raise TypeError(f"path entries are names or indices, got {part!r}")
    if isinstance(part, (str, int)):
        return str(part)
    # jax.tree_util key entries: DictKey(.key), GetAttrKey(.name),
    # SequenceKey(.idx), FlattenedIndexKey(.key).
    for attr in ("name", "key", "idx"):
        if hasattr(part, attr):
            return _path_part(getattr(part, attr))
    raise TypeError(
        f"path entries are names (str), indices (int) or jax.tree_util key "
        f"entries; got {part!r} of type {type(part).__name__}"
    )


def path_string(parts: Sequence[Any]) -> str:
    """The normalised module path: entries joined by ".".

    Args:
      parts: names and integer indices from the root to the layer, e.g. an
        ``nnx.iter_graph`` path ``("layers", 3, "mlp", "up_proj")``; jax
        ``tree_util`` key entries (``GetAttrKey``, ``DictKey``, ``SequenceKey``)
        are accepted too and contribute their name or index.

    Returns:
      e.g. ``"layers.3.mlp.up_proj"``; the root (no entries) is ``""``.
    """
    return ".".join(_path_part(p) for p in parts)


@functools.lru_cache(maxsize=64)
def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which linear layers run in NVFP4, matched on the module path.

    ``recipe_for(path)`` decides in this order:

    1. ``keep_last`` > 0 and the path lies in one of the last ``keep_last``
       blocks (its block index, group 1 of ``block_pattern``, is
       ``>= num_layers - keep_last``): ``None``.
    2. The first rule whose ``fnmatch`` glob matches the whole path (case
       sensitive; ``*`` also matches "."): that rule's recipe (``None`` keeps
       the layer in bf16).
    3. ``default``.

    Attributes:
      rules: ``(glob, recipe or None)`` pairs; the first match wins.
      default: the recipe for paths no rule matches (``None``: bf16).
      keep_last: how many of the final blocks stay in bf16 (needs
        ``num_layers``).
      num_layers: the number of blocks of the model.
      block_pattern: a regular expression searched in the path whose group 1
        is the block index; by default ``layers.<i>``, ``blocks.<i>`` or
        ``h.<i>`` anywhere in the path.
    """

    rules: tuple[tuple[str, Recipe | None], ...] = ()
    default: Recipe | None = None
    keep_last: int = 0
    num_layers: int | None = None
    block_pattern: str = DEFAULT_BLOCK_PATTERN

    def __post_init__(self) -> None:
        rules = tuple(tuple(rule) for rule in self.rules)
        for rule in rules:
            if (
                len(rule) != 2
                or not isinstance(rule[0], str)
                or not (rule[1] is None or isinstance(rule[1], Recipe))
            ):
                raise TypeError(
                    "each rule is a (glob: str, recipe: Recipe | None) pair, e.g. "
                    f"('*mlp*', jax_nvfp4.NVFP4); got {rule!r}"
                )
        # Frozen dataclass: store the normalised tuple (lists are accepted).
        object.__setattr__(self, "rules", rules)
        if self.default is not None and not isinstance(self.default, Recipe):
            raise TypeError(
                f"default must be a Recipe or None, got {type(self.default).__name__}"
            )
        if not isinstance(self.keep_last, int) or self.keep_last < 0:
            raise ValueError(f"keep_last must be an int >= 0, got {self.keep_last!r}")
        if self.num_layers is not None and (
            not isinstance(self.num_layers, int) or self.num_layers < 0
        ):
            raise ValueError(
                f"num_layers must be an int >= 0 or None, got {self.num_layers!r}"
            )
        if self.keep_last and self.num_layers is None:
            raise ValueError(
                f"keep_last={self.keep_last} needs num_layers (the number of "
                "blocks) to know which blocks are last; pass num_layers=..."
            )
        try:
            compiled = _compile(self.block_pattern)
        except re.error as e:
            raise ValueError(
                f"block_pattern {self.block_pattern!r} is not a regular expression: {e}"
            ) from None
        if compiled.groups < 1:
            raise ValueError(
                f"block_pattern {self.block_pattern!r} needs a group that "
                r"captures the block index, e.g. r'layers\.(\d+)'"
            )

    def block_index(self, path: str) -> int | None:
        """The block index in ``path`` (group 1 of ``block_pattern``), or None."""
        match = _compile(self.block_pattern).search(path)
        return None if match is None else int(match.group(1))

    def recipe_for(self, path: str) -> Recipe | None:
        """The recipe for the layer at ``path``; None = leave the layer in bf16."""
        if not isinstance(path, str):
            raise TypeError(
                f"path must be a str (build it with path_string), got {path!r}"
            )
        if self.keep_last:
            index = self.block_index(path)
            if index is not None:
                assert self.num_layers is not None  # checked in __post_init__
                if index >= self.num_layers:
                    raise ValueError(
                        f"{path!r} is in block {index} but the policy has "
                        f"num_layers={self.num_layers}; pass the model's number "
                        "of blocks"
                    )
                if index >= self.num_layers - self.keep_last:
                    return None
        for glob, recipe in self.rules:
            if fnmatch.fnmatchcase(path, glob):
                return recipe
        return self.default

    def stack_recipes(self, path: str, size: int) -> tuple[Recipe | None, ...]:
        """The recipe of each layer of a stack: ``size`` layers held as one
        module with a leading layer axis (``nnx.vmap``- or
        ``eqx.filter_vmap``-built, run by a scan), whose ``path`` has no index.

        Entry i is layer i's recipe. The rules see the stack's path, so every
        entry gets the same recipe, except that ``keep_last`` puts the last
        ``keep_last`` layers of a stack of ``num_layers`` blocks in bf16
        (``None``). A stack inside one block (its path has a block index) is
        decided as a whole. A stack of another size cannot be told apart from
        the model's blocks: with ``keep_last`` that raises a ``ValueError``.
        """
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be an int >= 1, got {size!r}")
        recipe = self.recipe_for(path)
        if not self.keep_last or self.block_index(path) is not None:
            return (recipe,) * size
        if size != self.num_layers:
            raise ValueError(
                f"{path!r} is a stack of {size} layers, but the policy keeps the "
                f"last {self.keep_last} of num_layers={self.num_layers} blocks in "
                "bf16 and cannot tell which layers of this stack those are. Stack "
                "all num_layers blocks in one stack, split the stack (the last "
                "blocks unstacked, with an index in their path), or use keep_last=0"
            )
        first_kept = self.num_layers - self.keep_last
        return tuple(recipe if i < first_kept else None for i in range(size))

    def unmatched_rules(self, paths: Iterable[str]) -> list[str]:
        """The rule globs that match none of ``paths`` (a typo, most often)."""
        paths = list(paths)
        return [
            glob
            for glob, _ in self.rules
            if not any(fnmatch.fnmatchcase(path, glob) for path in paths)
        ]

    def assign(self, paths: Iterable[str]) -> dict[str, Recipe | None]:
        """``{path: recipe_for(path)}`` for each path (to print or log a plan)."""
        return {path: self.recipe_for(path) for path in paths}


def transformer_policy(
    num_layers: int,
    *,
    recipe: Recipe = NVFP4,
    keep_last: int = 1,
    nvfp4_patterns: Sequence[str] = (
        "*mlp*",
        "*ffn*",
        "*feed_forward*",
        "*block_sparse_moe.experts*",
    ),
    bf16_patterns: Sequence[str] = (
        "*router*",
        "*block_sparse_moe.gate",
        "*mlp.gate",
    ),
) -> Policy:
    """The default policy for a transformer with ``num_layers`` blocks.

    MLP linears (paths matching any of ``nvfp4_patterns``) run ``recipe``;
    everything else — attention projections, embeddings, the output head — and
    every layer of the last ``keep_last`` blocks stays in bf16.

    Args:
      num_layers: the number of transformer blocks.
      recipe: the recipe of the NVFP4 layers (e.g. ``NVFP4_NO_RHT``).
      keep_last: how many final blocks stay entirely in bf16.
      nvfp4_patterns: ``fnmatch`` globs of the module paths to run in NVFP4.
      bf16_patterns: globs of paths that stay in bf16 although an
        ``nvfp4_patterns`` glob matches them (checked first): by default
        mixture-of-experts routers (their N is the expert count, and the
        recipe keeps them in high precision), also under Mixtral's and
        Qwen-MoE's names (``block_sparse_moe.gate``, ``mlp.gate``; a dense
        MLP's ``gate_proj`` is not matched). For a model
        whose last blocks are a stack of their own (``"tail.*"``): inside one
        scanned stack, ``keep_last`` needs a per-layer switch, and under
        ``grad`` a switch keeps both its branches' residuals.
    """
    for name, globs in (
        ("nvfp4_patterns", nvfp4_patterns),
        ("bf16_patterns", bf16_patterns),
    ):
        if isinstance(globs, str):
            raise TypeError(
                f"{name} is a sequence of globs; wrap a single glob in a "
                f"tuple: ({globs!r},)"
            )
    if keep_last > num_layers:
        raise ValueError(
            f"keep_last={keep_last} exceeds num_layers={num_layers}; at most "
            "every block can stay in bf16"
        )
    return Policy(
        rules=tuple((glob, None) for glob in bf16_patterns)
        + tuple((glob, recipe) for glob in nvfp4_patterns),
        default=None,
        keep_last=keep_last,
        num_layers=num_layers,
    )


def warn_unmatched_rules(policy: Policy, paths: Sequence[str], stacklevel: int = 3):
    """Warns when none of the rules of ``policy`` matches any of ``paths`` (the
    linear layers a converter found), listing those paths so that the globs
    can be fixed. (One unmatched rule among matching ones is normal: the
    default policy's globs are alternatives; ``Policy.unmatched_rules`` lists
    them.)"""
    if not policy.rules:
        return
    unmatched = policy.unmatched_rules(paths)
    if len(unmatched) < len(policy.rules):
        return
    shown = [p if p else "'' (the model itself)" for p in paths[:20]]
    found = ", ".join(shown) + (", ..." if len(paths) > 20 else "")
    warnings.warn(
        f"no rule of the policy ({unmatched}) matches a linear layer of this "
        f"model; its linear layers are at: {found or '(none)'}. Globs match the "
        "whole path ('*' also matches '.'), e.g. '*mlp*'",
        UserWarning,
        stacklevel=stacklevel,
    )
