"""Checks that the documentation follows the code.

- docs/API.md documents every public name: each name in the ``__all__`` of
  ``jax_nvfp4`` and of its public submodules has a heading in that module's
  section (``## `jax_nvfp4.flax` ``), and a heading with a signature
  (``### `convert(model, policy, rngs=None, *, rng_collection, strict)` ``)
  lists the parameters of the callable in their order. ``...`` in a
  signature stands for parameters left out (a base class's). Headings of
  names that are not public, or of attributes that do not exist, fail too.
- docs/DESIGN.md names every FFI target of ``ffi/targets.inc`` and every
  ``JAX_NVFP4_*`` switch that ``jax_nvfp4/config.py`` documents.
- Relative links in README.md and docs/*.md lead to files that exist, and
  README's "troubleshooting N" references lead to an entry N of its
  Troubleshooting section.

Run ``python tools/api_doc_check.py`` from the repository root (it imports
``jax_nvfp4`` and its Flax, Equinox and qwix modules); it prints each problem
and exits 1 if there is one. ``tests/test_api_doc.py`` runs it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The public modules and the package each needs besides jax.
MODULES = {
    "jax_nvfp4": None,
    "jax_nvfp4.policy": None,
    "jax_nvfp4.checkpoint": None,
    "jax_nvfp4.hf_names": None,
    "jax_nvfp4.config": None,
    "jax_nvfp4.statistics": None,
    "jax_nvfp4.flax": "flax",
    "jax_nvfp4.equinox": "equinox",
    "jax_nvfp4.qwix": "qwix",
}

_MODULE_HEADING = re.compile(r"^##\s+`([\w.]+)`\s*$")
_NAME_HEADING = re.compile(r"^#{3,}\s+`([\w.]+)(\(.*\))?`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def available_modules() -> list[str]:
    """The public modules whose optional dependency is installed."""
    return [
        name
        for name, needs in MODULES.items()
        if needs is None or importlib.util.find_spec(needs) is not None
    ]


def _parameters(obj) -> list[str] | None:
    """The public parameter names of a callable, in order; None if it has
    no signature (a module, a constant, a callable object such as a remat
    policy, a builtin exception)."""
    if not (inspect.isroutine(obj) or inspect.isclass(obj)):
        return None
    target = obj
    if inspect.isclass(obj):
        init = obj.__dict__.get("__init__") or getattr(obj, "__init__", None)
        target = init if init not in (None, object.__init__) else obj
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    names = []
    for i, p in enumerate(signature.parameters.values()):
        if i == 0 and p.name in ("self", "cls"):
            continue
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name.startswith("_"):
            continue
        names.append(p.name)
    if _is_linen_module(obj):
        names = [n for n in names if n not in ("parent", "name")]
    return names


def _is_linen_module(obj) -> bool:
    try:
        from flax import linen
    except ImportError:
        return False
    return inspect.isclass(obj) and issubclass(obj, linen.Module)


def _documented_parameters(text: str) -> tuple[list[str], bool]:
    """(parameter names, whether ``...`` leaves some out) of ``(a, b=1, *, c)``."""
    inner = text[1:-1]
    parts, depth, current = [], 0, ""
    for ch in inner:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    names, ellipsis = [], False
    for part in (p.strip() for p in parts):
        if not part or part in ("*", "/"):
            continue
        if part == "...":
            ellipsis = True
            continue
        if part.startswith("*"):  # *args, **kwargs: the code's are left out too
            continue
        names.append(re.split(r"[=:]", part, maxsplit=1)[0].strip())
    return names, ellipsis


def _is_subsequence(short: list[str], long: list[str]) -> bool:
    it = iter(long)
    return all(name in it for name in short)


def _sections(text: str) -> dict[str, list[tuple[int, str, str | None]]]:
    """{module: [(line number, name, signature or None)]} of docs/API.md."""
    sections: dict[str, list] = {}
    current = None
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("## "):
            match = _MODULE_HEADING.match(line)
            current = match.group(1) if match else None
            if current is not None:
                sections.setdefault(current, [])
            continue
        match = _NAME_HEADING.match(line)
        if match and current is not None:
            sections[current].append((number, match.group(1), match.group(2)))
    return sections


def check_api(api_text: str, modules: list[str]) -> list[str]:
    """Problems of docs/API.md against the ``__all__`` of ``modules``."""
    problems = []
    sections = _sections(api_text)
    for module_name in modules:
        module = importlib.import_module(module_name)
        public = list(module.__all__)
        entries = sections.get(module_name)
        if entries is None:
            problems.append(f"docs/API.md has no section '## `{module_name}`'")
            continue
        documented = {name for _, name, _ in entries}
        for name in public:
            if name not in documented:
                problems.append(
                    f"docs/API.md: {module_name}.{name} is public (in __all__) "
                    f"but has no '### `{name}...`' heading in its section"
                )
        for line, name, signature in entries:
            head, _, attr = name.partition(".")
            where = f"docs/API.md:{line}: {module_name}.{name}"
            if head not in public:
                problems.append(f"{where} is documented but not in __all__")
                continue
            obj = getattr(module, head)
            if attr:
                if not hasattr(obj, attr):
                    problems.append(f"{where} does not exist")
                    continue
                obj = getattr(obj, attr)
                if isinstance(obj, property):
                    obj = None
            actual = _parameters(obj) if obj is not None else None
            if signature is None:
                if actual and not attr:
                    problems.append(
                        f"{where} takes {actual}: write its signature in the heading"
                    )
                continue
            if actual is None:
                continue
            names, ellipsis = _documented_parameters(signature)
            ok = _is_subsequence(names, actual) if ellipsis else names == actual
            if not ok:
                problems.append(
                    f"{where}: the heading lists parameters {names}, the code has "
                    f"{actual}" + (" (in this order)" if ellipsis else "")
                )
    return problems


def check_design(design_text: str) -> list[str]:
    """FFI targets and environment switches that docs/DESIGN.md does not name."""
    problems = []
    targets = re.findall(
        r'^JAX_NVFP4_TARGET\("(\w+)"',
        (ROOT / "ffi" / "targets.inc").read_text(),
        re.M,
    )
    for target in sorted(set(targets)):
        if f"`{target}`" not in design_text:
            problems.append(f"docs/DESIGN.md does not name the FFI target {target}")
    config_text = (ROOT / "jax_nvfp4" / "config.py").read_text()
    for switch in sorted(set(re.findall(r"``(JAX_NVFP4_\w+)``", config_text))):
        if f"`{switch}`" not in design_text:
            problems.append(f"docs/DESIGN.md does not name the switch {switch}")
    return problems


def _troubleshooting_entries(readme: str) -> set[int]:
    match = re.search(r"^## Troubleshooting\s*$(.*?)(?=^## |\Z)", readme, re.M | re.S)
    if not match:
        return set()
    return {int(n) for n in re.findall(r"^(\d+)\. ", match.group(1), re.M)}


def check_links(paths: list[pathlib.Path]) -> list[str]:
    """Relative links to missing files; README troubleshooting references to
    missing entries."""
    problems = []
    for path in paths:
        text = path.read_text()
        for target in _LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            file = (path.parent / target.split("#")[0]).resolve()
            if not file.exists():
                problems.append(
                    f"{path.relative_to(ROOT)} links to {target}, which does not exist"
                )
    readme = (ROOT / "README.md").read_text()
    entries = _troubleshooting_entries(readme)
    for n in re.findall(r"[Tt]roubleshooting (\d+)", readme):
        if int(n) not in entries:
            problems.append(
                f"README.md cites troubleshooting {n}, which does not exist"
            )
    return problems


def check_all() -> list[str]:
    docs = ROOT / "docs"
    return (
        check_api((docs / "API.md").read_text(), available_modules())
        + check_design((docs / "DESIGN.md").read_text())
        + check_links([ROOT / "README.md", *sorted(docs.glob("*.md"))])
    )


def main() -> int:
    sys.path.insert(0, str(ROOT))  # check the package beside these docs
    problems = check_all()
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
