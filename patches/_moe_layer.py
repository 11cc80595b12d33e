"""What megatron-ext changes when Megatron builds a MoE layer: the experts, and the layer's name.

Capacity mode hands the experts more rows than tokens (the capacity) and the real counts on the
device. Megatron's SequentialMLP and TEGroupedMLP's unfused path read the counts on the host and
split the rows by them, which both syncs and fails on the extra rows, so in capacity mode their
spec is swapped for megatron-ext's `GroupedMLP` before the layer builds them (its parameters are
named as TEGroupedMLP's). TEGroupedMLP is kept with `--use-transformer-engine-op-fuser`, whose
path hands TE the counts on the device.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

from megatron_ext.options import HybridEPOptions

logger = logging.getLogger("megatron_ext")


def _builder_class(builder: Any) -> Any:
    while isinstance(builder, functools.partial):
        builder = builder.func
    return builder


def select_experts(config: Any, submodules: Any) -> Any:
    """`submodules` with experts that take device counts when capacity mode needs them."""
    if submodules is None or HybridEPOptions.from_config(config).capacity_factor is None:
        return submodules
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    from megatron_ext.experts import GroupedMLP

    built = _builder_class(submodules.experts)
    if isinstance(built, type) and issubclass(built, GroupedMLP):
        return submodules
    if isinstance(built, type) and issubclass(built, TEGroupedMLP) and config.use_transformer_engine_op_fuser:
        return submodules
    logger.info(
        "megatron-ext: capacity mode: experts %s -> megatron_ext.experts.GroupedMLP (counts stay on the device).",
        getattr(built, "__qualname__", built),
    )
    return dataclasses.replace(submodules, experts=GroupedMLP)


def wrap_init(original: Callable) -> Callable:
    """`MoELayer.__init__` that selects the experts first and names the dispatch manager after."""

    @functools.wraps(original)
    def __init__(self, config, submodules=None, *args, **kwargs):
        original(self, config, select_experts(config, submodules), *args, **kwargs)
        manager = getattr(getattr(self, "token_dispatcher", None), "_comm_manager", None)
        if manager is not None and hasattr(manager, "stats") and self.layer_number is not None:
            manager.name = f"MoE layer {self.layer_number}"

    __init__.__megatron_ext_original__ = original
    return __init__
