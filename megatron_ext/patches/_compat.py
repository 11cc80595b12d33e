"""Which Megatron-Core we support, and finding its symbols with an error that names both."""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any, Optional

# Releases whose symbols megatron-ext was written and tested against.
SUPPORTED_MEGATRON_CORE = ((0, 19), (0, 20))  # [0.19, 0.20)


class UnsupportedMegatronError(RuntimeError):
    """The installed megatron-core is outside the supported range."""


class MovedSymbolError(RuntimeError):
    """A Megatron-Core symbol megatron-ext needs is not where the supported release keeps it."""


def megatron_core_version() -> str:
    """The installed megatron-core's version string (`megatron.core.__version__` as a fallback)."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        import megatron.core

        return getattr(megatron.core, "__version__", "unknown")


def _release(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return (-1, -1)


def check_megatron_version(version: Optional[str] = None) -> str:
    """Raise `UnsupportedMegatronError` unless `version` (default: installed) is supported."""
    version = version or megatron_core_version()
    low, high = SUPPORTED_MEGATRON_CORE
    if not low <= _release(version) < high:
        raise UnsupportedMegatronError(
            f"megatron-ext supports megatron-core >= {low[0]}.{low[1]}, < {high[0]}.{high[1]}; found "
            f"megatron-core {version}. Install a supported release (pip install 'megatron-core>=0.19,<0.20') "
            "or a megatron-ext release made for yours."
        )
    return version


def resolve(dotted: str) -> Any:
    """Import `package.module.Attr[.attr...]`; raise `MovedSymbolError` naming it and the version."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        try:
            for name in parts[split:]:
                obj = getattr(obj, name)
            return obj
        except AttributeError:
            break
    raise MovedSymbolError(
        f"megatron-ext needs `{dotted}`, which megatron-core {megatron_core_version()} does not have "
        f"(supported: >= {SUPPORTED_MEGATRON_CORE[0][0]}.{SUPPORTED_MEGATRON_CORE[0][1]}, "
        f"< {SUPPORTED_MEGATRON_CORE[1][0]}.{SUPPORTED_MEGATRON_CORE[1][1]})."
    )
