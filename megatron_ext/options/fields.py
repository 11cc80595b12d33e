"""megatron-ext's options themselves: the fields of `HybridEPOptions`, their allowed values, their
flags (`flag`), and the error every check of them raises (`HybridEPConfigError`).

The base the checks build on (`megatron_ext.options`, `megatron_ext.options.implementation`,
`megatron_ext.options.graph_checks`); like them it does not import Megatron-Core.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any, Final, Literal, Optional, get_args

# The one list of implementation names: `--moe-hybridep-implementation`'s choices (config.py
# annotates its field with `Implementation`, which Megatron's parser turns into the choices),
# the check below, and, less "auto", the buffers `megatron_ext.hybridep.buffers` builds.
Implementation = Literal["auto", "deep_ep", "torch"]
IMPLEMENTATIONS: tuple[str, ...] = get_args(Implementation)
AUTO: Final = "auto"
BUFFER_IMPLEMENTATIONS: tuple[str, ...] = tuple(name for name in IMPLEMENTATIONS if name != AUTO)
OverflowPolicy = Literal["rerun", "fail"]
OVERFLOW_POLICIES: tuple[str, ...] = get_args(OverflowPolicy)
# How the torch implementation's non-blocking dispatches move tokens (`megatron_ext.hybridep.torch_buffer.exchange`).
Transport = Literal["auto", "process_group", "nvshmem"]
TRANSPORTS: tuple[str, ...] = get_args(Transport)


class HybridEPConfigError(ValueError):
    """A megatron-ext option, or its combination with a Megatron option, is invalid."""


def near_miss(given: str, known: Iterable[str], cutoff: float = 0.6) -> Optional[str]:
    """The name of `known` that `given` most likely mistypes, or None: for "did you mean" in the
    refusals of a flag, a bench mode or a patch feature."""
    close = difflib.get_close_matches(given, list(known), n=1, cutoff=cutoff)
    return close[0] if close else None


def flag(name: str) -> str:
    """The command-line spelling of a config field: `moe_x_y` -> `--moe-x-y`."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class HybridEPOptions:
    """The megatron-ext fields of a config (defaults: stock Megatron behaviour)."""

    capacity_factor: Optional[float] = None
    equal_token_counts: bool = False
    verify_equal_token_counts: bool = False
    reuse_allgather_buffer: bool = False
    implementation: Implementation = AUTO
    overflow_policy: OverflowPolicy = "rerun"
    transport: Transport = AUTO
    static_expert_splits: bool = False
    compact_routing: bool = False
    fp8_dispatch: bool = False
    warm_up: bool = False
    kernel_cache: Optional[str] = None

    @classmethod
    def from_config(cls, config: Any) -> HybridEPOptions:
        """Read the options from a config or namespace; absent fields take their defaults."""
        defaults = cls()
        return cls(**{name: getattr(config, CONFIG_PREFIX + name, getattr(defaults, name)) for name in OPTION_NAMES})

    def set_flags(self) -> list[str]:
        """The flags whose values differ from their defaults, for messages."""
        defaults = HybridEPOptions()
        return [flag(CONFIG_PREFIX + n) for n in OPTION_NAMES if getattr(self, n) != getattr(defaults, n)]

    @property
    def changes_dispatch(self) -> bool:
        """Whether any option other than the implementation departs from stock behaviour."""
        return any(f != flag(CONFIG_PREFIX + "implementation") for f in self.set_flags())


# Config field of option `x`: `moe_hybridep_x` (flag `--moe-hybridep-x`).
CONFIG_PREFIX = "moe_hybridep_"
OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in fields(HybridEPOptions))


CAPACITY_FACTOR_FLAG = flag(CONFIG_PREFIX + "capacity_factor")
FP8_DISPATCH_FLAG = flag(CONFIG_PREFIX + "fp8_dispatch")
COMPACT_ROUTING_FLAG = flag(CONFIG_PREFIX + "compact_routing")
