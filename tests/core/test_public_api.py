"""The public surface is what is documented, and the packages export only what another part uses.

Public: `import fsdp2_strategy as f2` names and each adapter package's `__all__`; each must have a
generated reference entry (`::: ...` in docs/reference). Internal: a core sub-package's `__all__` is
its interface to the other packages and the adapters; every name in it must be used by one of them
(imported, or reached as an attribute of the package), by the command's entry point, or named in the
docs by its dotted path; anything else stays inside its package. Read with `ast`: nothing imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from helpers import ROOT

CORE = ROOT / "fsdp2_strategy"
ADAPTERS = ROOT / "integrations"
SUBPACKAGES = sorted(p.name for p in CORE.iterdir() if (p / "__init__.py").is_file())
ADAPTER_PACKAGES = sorted(p.name for p in ADAPTERS.iterdir() if (p / "__init__.py").is_file() and p.name[0] != "_")


def _all(init: Path) -> list[str]:
    tree = ast.parse(init.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "integrations":
        parts.insert(0, "fsdp2_strategy")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _uses(path: Path, package: str) -> set[str]:
    """Names `path` takes from `package`: `from package import x`, and `alias.x` where `alias` is
    `package` imported as a module (`from parent import sub`, `import package as alias`)."""
    module = _module(path)
    here = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    names, aliases = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = here.split(".")[: len(here.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
            for alias in node.names:
                if target == package:
                    names.add(alias.name)
                elif f"{target}.{alias.name}" == package:
                    aliases.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == package and a.asname}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            names.add(node.attr)
    return names


@pytest.mark.parametrize("sub", SUBPACKAGES)
def test_every_exported_name_has_a_user_outside_its_package(sub):
    package = f"fsdp2_strategy.{sub}"
    exported = _all(CORE / sub / "__init__.py")
    users = [p for p in [*CORE.rglob("*.py"), *ADAPTERS.rglob("*.py")] if (CORE / sub) not in p.parents]
    used = set().union(*(_uses(p, package) for p in users))
    docs = "\n".join(p.read_text() for p in (ROOT / "docs").rglob("*.md"))
    used |= {n for n in exported if re.search(rf"\b{re.escape(package)}\.{re.escape(n)}\b", docs)}
    if sub == "cli":
        used.add("main")  # the `fsdp2-strategy` entry point (pyproject.toml)
        used.add("build_parser")  # the docs' generated command-line reference (docs/hooks.py)
    unused = sorted(set(exported) - used)
    assert not unused, f"{package}.__all__ exports {unused}, which nothing outside it uses: drop them from __all__"


def test_every_public_name_has_a_reference_entry():
    documented = set(
        re.findall(r"^::: (\S+)$", "\n".join(p.read_text() for p in (ROOT / "docs/reference").glob("*.md")), re.M)
    )
    public = {f"fsdp2_strategy.{n}" for n in _all(CORE / "__init__.py")}
    for adapter in ADAPTER_PACKAGES:
        public |= {f"integrations.{adapter}.{n}" for n in _all(ADAPTERS / adapter / "__init__.py")}
    assert public <= documented, f"public but not in docs/reference: {sorted(public - documented)}"
