"""Which Megatron-Core we support, and finding its symbols with an error that names both."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass
from typing import Any, Optional

# Releases whose symbols megatron-ext was written and tested against: 0.19.x and the 0.20 line.
SUPPORTED_MEGATRON_CORE = ((0, 19), (0, 21))  # [0.19, 0.21)
# The torch releases megatron-ext runs on (its package's requirement): 2.8 brought what the
# non-blocking dispatch needs; 2.14 is the newest tested.
SUPPORTED_TORCH = ((2, 8), (2, 15))  # [2.8, 2.15)


class UnsupportedMegatronError(RuntimeError):
    """The installed megatron-core is outside the supported range."""


class UnsupportedTorchError(RuntimeError):
    """The installed torch is outside the supported range."""


class MovedSymbolError(RuntimeError):
    """A Megatron-Core symbol megatron-ext needs is not where the supported release keeps it."""


class ChangedSignatureError(MovedSymbolError):
    """A Megatron-Core callable megatron-ext calls or wraps no longer takes the parameters it passes."""


def supported_range(releases: tuple[tuple[int, int], tuple[int, int]] = SUPPORTED_MEGATRON_CORE) -> str:
    """The supported releases (default: megatron-core's), as a requirement: `>=0.19,<0.21`."""
    (low_major, low_minor), (high_major, high_minor) = releases
    return f">={low_major}.{low_minor},<{high_major}.{high_minor}"


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
            f"megatron-ext supports megatron-core {supported_range()}; found megatron-core {version}. "
            f"Install a supported release (pip install 'megatron-core{supported_range()}') "
            "or a megatron-ext release made for yours."
        )
    return version


def check_torch_version(version: Optional[str] = None) -> str:
    """Raise `UnsupportedTorchError` unless `version` (default: the installed torch's) is supported."""
    if version is None:
        import torch

        version = torch.__version__
    low, high = SUPPORTED_TORCH
    if not low <= _release(version) < high:
        wanted = supported_range(SUPPORTED_TORCH)
        raise UnsupportedTorchError(
            f"megatron-ext supports torch {wanted}; found torch {version}. Install a supported release "
            f"(pip install 'torch{wanted}') or a megatron-ext release made for yours."
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
        f"(supported: megatron-core {supported_range()})."
    )


@dataclass(frozen=True)
class Takes:
    """What megatron-ext passes to a Megatron-Core callable it calls or wraps: the parameters it
    passes by position (the callable's first ones, in this order; `self` and `cls` not counted) and
    those it passes or reads by name (each must be a named parameter, not swallowed by `**kwargs`).
    A class is checked by its `__init__`."""

    positional: tuple[str, ...] = ()
    keyword: tuple[str, ...] = ()


def _parameters(obj: Any) -> Optional[list[inspect.Parameter]]:
    try:
        signature = inspect.signature(obj.__init__ if isinstance(obj, type) else obj)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check against
        return None
    parameters = list(signature.parameters.values())
    if parameters and parameters[0].name in ("self", "cls"):
        parameters = parameters[1:]
    return parameters


def check_signature(dotted: str, obj: Any, takes: Takes) -> None:
    """Raise `ChangedSignatureError` naming `dotted` unless `obj` takes what `takes` says."""
    parameters = _parameters(obj)
    if parameters is None:
        return
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    wrong_order = tuple(positional[: len(takes.positional)]) != takes.positional
    missing = [name for name in takes.keyword if name not in named]
    if wrong_order or missing:
        found = ", ".join(str(p) for p in parameters)
        wanted = ", ".join([*takes.positional, *(f"{name}=" for name in takes.keyword)])
        raise ChangedSignatureError(
            f"megatron-ext calls `{dotted}` as ({wanted}), which megatron-core {megatron_core_version()} does not "
            f"take: its parameters are ({found}) (supported: megatron-core {supported_range()})."
        )
