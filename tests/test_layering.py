"""The product stands on its own: no module outside `megatron_ext/tooling/` and `megatron_ext/bench/`
imports either of them (they are for the tests, the bench and a user's measurements)."""

from __future__ import annotations

import ast
from pathlib import Path

import megatron_ext

PACKAGE = Path(megatron_ext.__file__).parent
APART = ("tooling", "bench")


def _imported(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every module and name `path` imports, relative imports resolved."""
    parts = [PACKAGE.name, *path.relative_to(PACKAGE).with_suffix("").parts]
    package = parts[:-1]  # `from . import x` in a module (an `__init__` is its own package: same thing)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])])
            module = base if node.level else node.module
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def _offending(path: Path) -> list[str]:
    return [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}"
        for line, name in _imported(path)
        if any(name == f"{PACKAGE.name}.{apart}" or name.startswith(f"{PACKAGE.name}.{apart}.") for apart in APART)
    ]


def test_no_product_module_imports_the_tooling_or_the_bench():
    product = [p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0] not in APART]
    assert len(product) > 20 and PACKAGE / "dispatcher.py" in product
    offending = [line for path in product for line in _offending(path)]
    assert not offending, offending


def test_every_way_of_importing_the_tooling_is_seen(tmp_path, monkeypatch):
    """The check above sees absolute, relative and from-package imports, at any depth in a function."""
    monkeypatch.setattr(f"{__name__}.PACKAGE", tmp_path / "megatron_ext")
    (tmp_path / "megatron_ext" / "hybridep").mkdir(parents=True)
    module = tmp_path / "megatron_ext" / "hybridep" / "m.py"
    ways = [
        "import megatron_ext.tooling.sync",
        "from megatron_ext.tooling.sync import host_constant",
        "from megatron_ext import tooling",
        "from ..tooling import sync",
        "from .. import bench",
        "def f():\n    from megatron_ext.bench.modes import all_modes",
    ]
    for way in ways:
        module.write_text(way + "\n")
        assert len(_offending(module)) == 1, way
    for fine in ("import megatron_ext.options", "from . import protocol", "from ..host_constant import host_constant"):
        module.write_text(fine + "\n")
        assert _offending(module) == [], fine
