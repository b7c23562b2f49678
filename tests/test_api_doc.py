"""The documentation follows the code (tools/api_doc_check.py): docs/API.md
documents every public name with the code's parameters, docs/DESIGN.md names
every FFI target and switch, and the docs' links and README's troubleshooting
references lead somewhere."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "api_doc_check", ROOT / "tools" / "api_doc_check.py"
)
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)


def test_api_reference_documents_every_public_name():
    api = (ROOT / "docs" / "API.md").read_text()
    assert check.check_api(api, check.available_modules()) == []


def test_design_names_every_target_and_switch():
    assert check.check_design((ROOT / "docs" / "DESIGN.md").read_text()) == []


def test_links_and_troubleshooting_references_resolve():
    docs = sorted((ROOT / "docs").glob("*.md"))
    assert check.check_links([ROOT / "README.md", *docs]) == []


# The checker itself must catch what it is for.
_GOOD = """
## `jax_nvfp4.policy`
### `Policy(rules=(), default=None, keep_last=0, num_layers=None, block_pattern=...)`
### `Policy.recipe_for(path)`
### `path_string(parts)`
### `transformer_policy(num_layers, *, recipe, keep_last, nvfp4_patterns, ...)`
### `warn_unmatched_rules(policy, paths, stacklevel=3)`
"""


def test_checker_accepts_a_complete_section():
    assert check.check_api(_GOOD, ["jax_nvfp4.policy"]) == []


@pytest.mark.parametrize(
    "edit,expected",
    [
        (("### `path_string(parts)`\n", ""), "path_string is public"),
        (("path_string(parts)", "path_string(parts, sep)"), "lists parameters"),
        (("(policy, paths, stacklevel=3)", "(paths, policy, stacklevel=3)"), "lists"),
        (("path_string(parts)", "path_string"), "write its signature"),
        (("### `Policy.recipe_for", "### `Policy.recipe_of"), "does not exist"),
        (("### `path_string", "### `old_name"), "not in __all__"),
        (("## `jax_nvfp4.policy`", "## `jax_nvfp4.policies`"), "no section"),
    ],
)
def test_checker_reports(edit, expected):
    problems = check.check_api(_GOOD.replace(*edit), ["jax_nvfp4.policy"])
    assert any(expected in p for p in problems), problems


def test_checker_reports_missing_targets_and_dangling_references(tmp_path):
    problems = check.check_design("`jax_nvfp4_quantize_rows`")
    assert any("jax_nvfp4_amax" in p for p in problems)
    assert any("JAX_NVFP4_NATIVE_GEMM" in p for p in problems)
    readme = "## Troubleshooting\n\n1. one\n2. two\n\n## Next\n"
    assert check._troubleshooting_entries(readme) == {1, 2}
