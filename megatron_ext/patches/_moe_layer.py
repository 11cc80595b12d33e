"""What megatron-ext changes when Megatron builds a MoE layer: the experts, and the layer's name
(its dispatch manager is bound to the layer, whose number Megatron may set later).

Capacity mode hands the experts more rows than tokens (the capacity) and the real counts on the
device. Megatron's SequentialMLP and TEGroupedMLP's unfused path read the counts on the host and
split the rows by them, which both syncs and fails on the extra rows, so in capacity mode their
spec is swapped for megatron-ext's `GroupedMLP` before the layer builds them (its parameters are
named as TEGroupedMLP's). TEGroupedMLP is kept with `--use-transformer-engine-op-fuser`, whose
path hands TE the counts on the device. With `--moe-hybridep-static-expert-splits` the experts are
kept as they are: they get host-constant counts (`megatron_ext.capacity.budget`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

from megatron_ext.logs import once_per_job
from megatron_ext.options import HybridEPOptions

logger = logging.getLogger(__name__)


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
    if HybridEPOptions.from_config(config).static_expert_splits:
        # The experts get host-constant counts: those that split on the host read nothing.
        if isinstance(built, type) and issubclass(built, GroupedMLP):
            from megatron_ext.options import GROUPED_MLP_TAKES_DEVICE_COUNTS, STATIC_SPLITS_FLAG, HybridEPConfigError

            raise HybridEPConfigError(f"{STATIC_SPLITS_FLAG} here: {GROUPED_MLP_TAKES_DEVICE_COUNTS}")
        return submodules
    if isinstance(built, type) and issubclass(built, GroupedMLP):
        return submodules
    if isinstance(built, type) and issubclass(built, TEGroupedMLP) and config.use_transformer_engine_op_fuser:
        _check_te_takes_device_counts(config)
        return submodules
    logger.log(
        once_per_job(logging.INFO),
        "megatron-ext: capacity mode: experts %s -> megatron_ext.experts.GroupedMLP (counts stay on the device).",
        getattr(built, "__qualname__", built),
    )
    return dataclasses.replace(submodules, experts=GroupedMLP)


def check_experts(config: Any, submodules: Any) -> None:
    """Refuse, without building anything, what the experts of `submodules` (as `select_experts`
    returns them) would refuse when built: megatron-ext's `GroupedMLP` runs the check its build
    runs, with the expert tensor-parallel size Megatron gives its group. For a dry run of the flags."""
    from megatron_ext.experts import GroupedMLP

    built = _builder_class(submodules.experts)
    if isinstance(built, type) and issubclass(built, GroupedMLP):
        built._check_config(config, config.expert_tensor_parallel_size)


def _fp8_recipe(config: Any) -> Any:
    """The Transformer Engine recipe Megatron trains `config`'s fp8 with (None without fp8)."""
    if not getattr(config, "fp8", None):
        return None
    from megatron.core.fp8_utils import get_fp8_recipe

    return get_fp8_recipe(config)


# TE 2.20's graph-safe grouped GEMM takes per-expert weights (Megatron's default: one parameter per
# expert) as a list of at most this many tensors (`kMaxGroups` in its cublaslt_grouped_gemm.cu); more
# fail inside the first forward. One grouped weight (`--moe-single-grouped-weight`) has no such limit.
TE_MAX_EXPERTS_PER_GEMM = 64


def te_expert_count_error(config: Any) -> str | None:
    """Why TE's op-fuser experts cannot run `config`'s local experts in one grouped GEMM, or None."""
    local = config.num_moe_experts // max(getattr(config, "expert_model_parallel_size", 1) or 1, 1)
    if local <= TE_MAX_EXPERTS_PER_GEMM or getattr(config, "moe_single_grouped_weight", False):
        return None
    # Megatron refuses one grouped weight with fp8 (but mxfp8, which capacity mode does not take).
    single_weight = (
        ""
        if getattr(config, "fp8", None)
        else ", or pass --moe-single-grouped-weight with NVTE_GROUPED_LINEAR_SINGLE_PARAM=1"
    )
    return (
        f"Transformer Engine's grouped GEMM (op fuser) takes at most {TE_MAX_EXPERTS_PER_GEMM} per-expert weights, "
        f"and each rank holds {local} experts (--num-experts {config.num_moe_experts} over "
        f"--expert-model-parallel-size {getattr(config, 'expert_model_parallel_size', 1)}): raise "
        f"--expert-model-parallel-size to hold at most {TE_MAX_EXPERTS_PER_GEMM} per rank{single_weight}"
    )


def _check_te_takes_device_counts(config: Any) -> None:
    """TE's op fuser keeps the counts on the device only on its graph-safe grouped GEMM. Elsewhere
    (older TE or cuBLASLt, fp32, an fp8 recipe it has no grouped quantization for) it reads them on
    the host and splits the rows by them, which fails on capacity mode's extra rows deep in a step:
    refuse here instead, with the fix. Too many local experts for its grouped GEMM are refused too."""
    from megatron_ext.options import CAPACITY_FACTOR_FLAG, HybridEPConfigError

    too_many = te_expert_count_error(config)
    if too_many is not None:
        raise HybridEPConfigError(f"--use-transformer-engine-op-fuser: {too_many}.")
    cublas = "13.6" if getattr(config, "fp8", None) else "13.4"  # fp8 blockwise needs 13.6
    try:
        from transformer_engine.pytorch.ops.basic.grouped_linear import is_op_fuser_grouped_tensor_path_supported
    except ImportError as exc:
        reason = f"this Transformer Engine has no graph-safe grouped GEMM ({exc}; TE >= 2.14 has it)"
        upgrade = f"Install Transformer Engine >= 2.14 (tested: 2.20.2) with nvidia-cublas>={cublas}"
    else:
        upgrade = f"Install nvidia-cublas>={cublas} (tested: TE 2.20.2 with cuBLAS 13.10)"
        dtype = getattr(config, "params_dtype", None)
        recipe = _fp8_recipe(config)
        if is_op_fuser_grouped_tensor_path_supported(recipe, dtype):
            return
        what = f"{dtype}" if recipe is None else f"{dtype} with fp8 recipe {type(recipe).__name__}"
        reason = (
            f"TE's graph-safe grouped GEMM does not run here for {what} (it needs bf16 or fp16 and, on Hopper, "
            "cuBLASLt >= 13.4; fp8 tensorwise >= 13.5, blockwise >= 13.6)"
        )
    raise HybridEPConfigError(
        f"{CAPACITY_FACTOR_FLAG} with --use-transformer-engine-op-fuser: {reason}, so TE would read "
        "the expert counts on the host and split the rows by them, which fails on capacity mode's extra rows. "
        + (
            f"{upgrade}, or drop --use-transformer-engine-op-fuser so that megatron-ext builds its GroupedMLP experts."
            if not getattr(config, "fp8", None)
            else f"{upgrade} for fp8, or train the experts in bf16 (drop --fp8-format)."
        )
    )


def wrap_init(original: Callable) -> Callable:
    """`MoELayer.__init__` that selects the experts first and names the dispatch manager after."""

    @functools.wraps(original)
    def __init__(self, config, submodules=None, *args, **kwargs):
        original(self, config, select_experts(config, submodules), *args, **kwargs)
        manager = getattr(getattr(self, "token_dispatcher", None), "_comm_manager", None)
        if manager is not None and hasattr(manager, "bind_layer"):
            manager.bind_layer(self)

    __init__.__megatron_ext_original__ = original
    return __init__
