"""The package's layers, declared once in `LAYERS` from the top down: each imports only what stands
below it, or its own files. So the product stands on its own (nothing below `bench/` and `tooling/`
imports them: they are for the tests, the bench and a user's measurements), and no import circle
runs between layers (one would import upward somewhere); a circle inside one package is
`tests/test_bench.py`'s check. The top of the package holds at most 4 modules beside its packages,
and nothing imports a module by its name from before it moved (`megatron_ext.MOVED`)."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

import megatron_ext

PACKAGE = Path(megatron_ext.__file__).parent
APART = ("tooling", "bench")
# From the top down: a package (folder) or a module at the top of `megatron_ext/`, by its name.
LAYERS = (
    "bench",
    "tooling",
    "launch",
    "patches",
    "training",
    "dispatcher",
    "capacity",
    "experts",
    "hybridep",
    "options",
    "fused",
    "logs",
)


def _imported(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every module and name `path` imports, relative imports resolved."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)  # also for tests/ and examples/
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


def _layer(name: str) -> str | None:
    """The layer of a dotted name inside the package (`megatron_ext.options.config.X` -> `options`),
    None for the package itself (its `__version__`) and for names outside it."""
    parts = name.split(".")
    return parts[1] if parts[0] == PACKAGE.name and len(parts) > 1 else None


def _upward(path: Path) -> list[str]:
    """Each import of `path` (a file of the package) that reaches a layer above its own, or none."""
    here = LAYERS.index(path.relative_to(PACKAGE).parts[0].removesuffix(".py"))
    return [
        f"{path.relative_to(PACKAGE.parent)}:{line} ({LAYERS[here]}) imports {name} ({layer})"
        for line, name in _imported(path)
        if (layer := _layer(name)) in LAYERS and LAYERS.index(layer) < here
    ]


def test_every_import_points_down_the_layers():
    files = sorted(PACKAGE.rglob("*.py"))
    tops = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in files} - {"__init__"}
    assert tops == set(LAYERS), f"a file outside the layers, or a layer gone: {tops ^ set(LAYERS)}"
    upward = [line for path in files if path != PACKAGE / "__init__.py" for line in _upward(path)]
    assert not upward, upward


def test_an_upward_import_is_seen(tmp_path, monkeypatch):
    """The check above fails on an import from a lower layer to a higher one, at any depth."""
    monkeypatch.setattr(f"{__name__}.PACKAGE", tmp_path / "megatron_ext")
    (tmp_path / "megatron_ext" / "options").mkdir(parents=True)
    module = tmp_path / "megatron_ext" / "options" / "m.py"
    for way in (
        "from megatron_ext.dispatcher import HybridEPTokenDispatcher",
        "def f():\n    import megatron_ext.training.recovery",
        "from megatron_ext import experts",
        "from .. import capacity",
    ):
        module.write_text(way + "\n")
        assert len(_upward(module)) == 1, way
    for fine in ("from megatron_ext import fused, logs", "from . import fields", "import megatron_ext", "import torch"):
        module.write_text(fine + "\n")
        assert _upward(module) == [], fine


def test_the_top_holds_at_most_four_modules():
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= 4, modules


def test_nothing_imports_a_former_name():
    """Former names still import (with a DeprecationWarning); the package, the tests and the examples
    use the new ones."""
    files = [
        *PACKAGE.rglob("*.py"),
        *(PACKAGE.parent / "tests").glob("*.py"),
        *(PACKAGE.parent / "examples").glob("*.py"),
    ]
    former = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}"
        for path in files
        for line, name in _imported(path)
        if any(name == old or name.startswith(f"{old}.") for old in megatron_ext.MOVED)
    ]
    assert not former, former


@pytest.mark.parametrize("old", sorted(megatron_ext.MOVED))
def test_a_former_name_imports_the_module_it_moved_to(old):
    new = importlib.import_module(megatron_ext.MOVED[old])
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new.__name__}"):
        assert importlib.import_module(old) is new
    assert new.__spec__.name == new.__name__
