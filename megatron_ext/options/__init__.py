"""The flags, their fields and their checks.

Here: megatron-ext's MoE dispatch options, read from a Megatron config or an argparse namespace,
and their validation. Beside them: the options' fields, flags and error type (`fields.py`), whether
deep_ep is usable and what `auto` picks (`implementation.py`), the CUDA-graph checks of a flag set
(`graph_checks.py`), the TransformerConfig fields (`config.py`) and the hook into Megatron's
argparse (`arguments.py`). Every name of the first three is imported here too.

This module does not import Megatron-Core (`config.py` does): the same checks run on `parse_args`'
namespace (so a bad flag combination stops the launch before anything is built), on a
`TransformerConfig` at construction, and in the dispatcher. Every message names the flag and the fix.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Optional

# The moved pieces, imported back: the names the checks below use, and re-exports (marked noqa F401)
# of those other modules and tests import from here (`from megatron_ext.options import ...`).
from megatron_ext.options.fields import (  # noqa: F401 (re-exported: config.py, the buffers, the tools)
    AUTO,
    BUFFER_IMPLEMENTATIONS,
    CAPACITY_FACTOR_FLAG,
    COMPACT_ROUTING_FLAG,
    CONFIG_PREFIX,
    FP8_DISPATCH_FLAG,
    IMPLEMENTATIONS,
    OPTION_NAMES,
    OVERFLOW_POLICIES,
    TRANSPORTS,
    HybridEPConfigError,
    HybridEPOptions,
    Implementation,
    OverflowPolicy,
    Transport,
    flag,
    near_miss,
)
from megatron_ext.options.graph_checks import (  # noqa: F401 (re-exported: config.py, recovery.py)
    PER_LAYER_GRAPHS,
    _check_graphs,
    _local_graph_inputs_released,
    drop_and_pad,
    graph_impl,
    graph_modules,
    graphs_dropless_moe,
    graphs_hold_dispatch,
)
from megatron_ext.options.implementation import (  # noqa: F401 (re-exported: dispatcher.py, buffers, bench, tests)
    _AUTO_FALLBACKS_LOGGED,
    DEEP_EP_DISPATCH_ARGUMENTS,
    DEEP_EP_FP8_HIDDEN_MULTIPLE,
    DEEP_EP_HIDDEN_MULTIPLE,
    DEEP_EP_MIN_HIDDEN,
    DEEP_EP_TESTED_COMMIT,
    accepts_keyword,
    deep_ep_import_error,
    deep_ep_shape_error,
    requested_implementation,
    resolve_implementation,
)

# The largest capacity factor accepted. A rank of an EP group of W ranks receives at most W times
# its balanced share of rows, and an overflow grows a capacity anyway (the re-run policy), so no
# layout needs more; a larger factor only sizes buffers that cannot be allocated (1e300 rows).
MAX_CAPACITY_FACTOR = 100.0


def check_capacity_factor(factor: Any, name: str = CAPACITY_FACTOR_FLAG) -> float:
    """`factor` if it is a finite number from 1.0 (a capacity that cannot drop tokens) to
    MAX_CAPACITY_FACTOR (buffers that can be sized), else raise.

    The one check of a capacity factor: the config, the argument parsers (Megatron's, the bench's,
    the round trip's) and `capacity_from_rows` all call it. Raises `HybridEPConfigError` (a
    ValueError) naming `name`, the flag or argument the factor came from, and the fix.
    """
    accepted = f"use a number from 1.0 to {MAX_CAPACITY_FACTOR:g} (1.5 is a good start)"
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor):
        raise HybridEPConfigError(f"{name} {factor!r} is not a finite number; {accepted}.")
    if factor > MAX_CAPACITY_FACTOR:
        raise HybridEPConfigError(
            f"{name} {factor:g} would size each layer's buffers to {factor:g} times its calibrated rows, more than "
            f"any expert-parallel layout can receive; {accepted}: an overflow grows the room where needed."
        )
    if factor < 1.0:
        unset = ", or leave it unset for the blocking dispatch" if name == CAPACITY_FACTOR_FLAG else ""
        raise HybridEPConfigError(
            f"{name} {factor} would drop tokens; use >= 1.0 (1.5 leaves room for routing to drift after "
            f"calibration){unset}."
        )
    return factor


def capacity_factor_argument(text: str) -> float:
    """argparse `type=` of the tools' `--capacity-factor` (the bench, its profile, the round trip):
    `check_capacity_factor`, its error a parse error."""
    try:
        factor = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--capacity-factor {text!r} is not a number") from None
    try:
        return check_capacity_factor(factor, "--capacity-factor")
    except HybridEPConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


FP8_DISPATCH_BLOCK = 128  # the values per scale of --moe-hybridep-fp8-dispatch (megatron_ext.hybridep.fp8)


KERNEL_CACHE_FLAG = flag(CONFIG_PREFIX + "kernel_cache")


def can_make_files_in(folder: str | Path) -> bool:
    """Whether this process can make a file in `folder`: one is made and removed (`os.access` says
    yes to root in folders like /proc, where nothing can be made)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def _check_kernel_cache(options: HybridEPOptions) -> None:
    """--moe-hybridep-kernel-cache: refused for a path that is not a writable folder and cannot
    become one. With the torch implementation it keeps nothing (Triton caches its own kernels) and
    the dispatcher logs so, as for Megatron's deep_ep tuning flags: a launch template may set it
    for every job."""
    path = Path(options.kernel_cache)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if not options.kernel_cache or existing is None or not existing.is_dir() or not can_make_files_in(existing):
        raise HybridEPConfigError(
            f"{KERNEL_CACHE_FLAG} {options.kernel_cache!r}: not a folder this process can write, nor one it "
            "can create. Give a writable folder (on a disk that outlives the job, shared by the job's nodes "
            "where it can be)."
        )


TE_FP32_BLOCK_SCALES_ENV = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"  # TE's blockwise without power-of-two scales


def _check_fp8_dispatch(config: Any, options: HybridEPOptions) -> None:
    """--moe-hybridep-fp8-dispatch: the experts must quantize their input as the dispatch does
    (TE's `blockwise`, e4m3 forward), else the layer would train on values no recipe asked for;
    and the hidden size must split into its blocks (deep_ep's own multiple of 512: `deep_ep_shape_error`)."""
    recipe = getattr(config, "fp8_recipe", None)
    fmt = getattr(config, "fp8", None)
    if not fmt or recipe != "blockwise" or fmt not in ("e4m3", "hybrid"):
        have = f"--fp8-format {fmt} --fp8-recipe {recipe}" if fmt else "no --fp8-format (bf16 experts)"
        raise HybridEPConfigError(
            f"{FP8_DISPATCH_FLAG} quantizes tokens in 1 x 128 blocks as --fp8-recipe blockwise quantizes the "
            f"experts' input, so that the experts compute what they would from bf16 rows; with {have} it would "
            f"change the layer's results. Use --fp8-format e4m3 --fp8-recipe blockwise, or drop {FP8_DISPATCH_FLAG}."
        )
    if os.environ.get(TE_FP32_BLOCK_SCALES_ENV, "0") == "1":
        raise HybridEPConfigError(
            f"{FP8_DISPATCH_FLAG} with {TE_FP32_BLOCK_SCALES_ENV}=1: the dispatch quantizes with power-of-two scales, "
            "TE's default, which TE's quantization of the dispatched rows gives back unchanged; with float32 "
            f"scales it would not. Unset {TE_FP32_BLOCK_SCALES_ENV}, or drop {FP8_DISPATCH_FLAG}."
        )
    hidden = getattr(config, "hidden_size", None)
    if hidden is not None and hidden % FP8_DISPATCH_BLOCK:
        raise HybridEPConfigError(
            f"{FP8_DISPATCH_FLAG} with --hidden-size {hidden}: tokens are quantized in blocks of "
            f"{FP8_DISPATCH_BLOCK} values; use a hidden size that is a multiple of {FP8_DISPATCH_BLOCK}, or drop it."
        )


# fp8 recipes whose grouped GEMM in Transformer Engine's op fuser takes the expert counts on the
# device (TE 2.20: per-tensor current scaling on Hopper with cuBLASLt >= 13.5, block scaling on
# Hopper with cuBLASLt >= 13.6); with any other recipe TE splits the rows by counts read on the host.
FP8_RECIPES = ("tensorwise", "blockwise")
# With static expert splits the experts split rows by host constants: TE's GroupedLinear quantizes
# with any of Megatron's Hopper recipes then.
STATIC_SPLITS_FP8_RECIPES = ("delayed", "tensorwise", "blockwise")
STATIC_SPLITS_FLAG = flag(CONFIG_PREFIX + "static_expert_splits")


def _check_static_expert_splits(config: Any, options: HybridEPOptions) -> None:
    if not options.static_expert_splits:
        return
    if options.capacity_factor is None:
        raise HybridEPConfigError(
            f"{STATIC_SPLITS_FLAG} gives capacity mode's experts a fixed row budget each; set {CAPACITY_FACTOR_FLAG} "
            "too, or drop it (a blocking dispatch hands the experts exact counts anyway)."
        )
    if getattr(config, "use_transformer_engine_op_fuser", False):
        raise HybridEPConfigError(
            f"{STATIC_SPLITS_FLAG} is for experts that split their rows by counts read on the host (TEGroupedMLP "
            "without the op fuser, SequentialMLP); --use-transformer-engine-op-fuser's experts take the counts on "
            "the device. Drop one of the two."
        )
    if getattr(config, "transformer_impl", None) == "local" and getattr(config, "moe_grouped_gemm", False):
        raise HybridEPConfigError(
            f"{STATIC_SPLITS_FLAG} with --transformer-impl local --moe-grouped-gemm: {GROUPED_MLP_TAKES_DEVICE_COUNTS}"
        )


# Why static expert splits are refused for megatron-ext's GroupedMLP, and the two fixes.
GROUPED_MLP_TAKES_DEVICE_COUNTS = (
    "capacity mode builds megatron-ext's GroupedMLP for these experts, which takes the counts on the device and "
    "needs no row budgets. Drop the flag, or, for Transformer Engine's TEGroupedMLP (the experts static splits are "
    "for), use --transformer-impl transformer_engine without --use-transformer-engine-op-fuser (TE installed)."
)


CUTEDSL_GROUPED_MLP_ENV = "NVTE_CUTEDSL_FUSED_GROUPED_MLP"


def _gated_activation(config: Any) -> Optional[str]:
    """The gated activation megatron-core's op-fuser experts gate on, as its flag, or None; from a
    parsed namespace (--swiglu, --quick-geglu) or a TransformerConfig."""
    if getattr(config, "swiglu", False):
        return "--swiglu"
    if getattr(config, "quick_geglu", False):
        return "--quick-geglu"
    if getattr(config, "gated_linear_unit", False):
        import torch.nn.functional as F

        activation = getattr(config, "activation_func", None)
        if activation is F.silu:
            return "--swiglu"
        if getattr(activation, "__name__", "") == "quick_gelu":
            return "--quick-geglu"
    return None


def _check_op_fuser_activation(config: Any) -> None:
    """megatron-core 0.19.2 builds TE's op-fuser experts with a gated activation only while
    NVTE_CUTEDSL_FUSED_GROUPED_MLP asks for TE's CuTe DSL grouped MLP (TE runs that kernel on
    compute capability 10 and its separate grouped ops elsewhere); otherwise its layer build fails
    with an assertion that names neither. Refused here with the fix."""
    if not getattr(config, "use_transformer_engine_op_fuser", False):
        return
    gated = _gated_activation(config)
    try:
        asked = int(os.environ.get(CUTEDSL_GROUPED_MLP_ENV, "0")) > 0
    except ValueError:
        asked = False
    if gated and not asked:
        raise HybridEPConfigError(
            f"--use-transformer-engine-op-fuser with {gated}: megatron-core 0.19.2 builds TE's op-fuser experts "
            f"with a gated activation only when {CUTEDSL_GROUPED_MLP_ENV}=1 is set (on Hopper TE then runs its "
            f"separate grouped ops; the fused kernel is for compute capability 10). Export "
            f"{CUTEDSL_GROUPED_MLP_ENV}=1 in the launch script, or drop --use-transformer-engine-op-fuser."
        )


def _check_quantized_experts(config: Any, options: HybridEPOptions) -> None:
    """Capacity mode with --fp8-format / --fp4-format: experts that quantize with the counts on the
    device (Transformer Engine's op-fuser experts with an fp8 recipe of FP8_RECIPES), or, with
    static expert splits, TE's TEGroupedMLP with a recipe of STATIC_SPLITS_FP8_RECIPES."""
    if getattr(config, "fp4", None):
        raise HybridEPConfigError(
            f"{CAPACITY_FACTOR_FLAG} with --fp4-format: Transformer Engine's grouped GEMM takes the expert counts "
            "on the device for NVFP4 on Blackwell only, and megatron-ext has not run it. Drop --fp4-format, or "
            f"use --fp8-format e4m3 --fp8-recipe {' or '.join(FP8_RECIPES)} with TE's op-fuser experts."
        )
    if not getattr(config, "fp8", None):
        return
    recipe = getattr(config, "fp8_recipe", None)
    recipe = str(getattr(recipe, "value", recipe))
    if options.static_expert_splits:
        if recipe not in STATIC_SPLITS_FP8_RECIPES:
            raise HybridEPConfigError(
                f"{CAPACITY_FACTOR_FLAG} {STATIC_SPLITS_FLAG} with --fp8-recipe {recipe}: megatron-ext has run "
                f"fp8 with static expert splits for {', '.join(STATIC_SPLITS_FP8_RECIPES)} only (Hopper). Use one "
                "of them, or drop --fp8-format."
            )
        if getattr(config, "transformer_impl", "transformer_engine") != "transformer_engine":
            raise HybridEPConfigError(
                f"{STATIC_SPLITS_FLAG} with --fp8-format: fp8 experts are Transformer Engine's TEGroupedMLP. Add "
                "--transformer-impl transformer_engine --moe-grouped-gemm, or drop --fp8-format."
            )
        return
    if recipe not in FP8_RECIPES:
        why = {
            "delayed": "TE has no grouped quantization for delayed scaling, so its grouped GEMM would split the "
            f"rows by counts read on the host (or add {STATIC_SPLITS_FLAG} with --transformer-impl transformer_engine "
            "--moe-grouped-gemm and without --use-transformer-engine-op-fuser: TEGroupedMLP, each expert a fixed "
            "row budget, host constants)",
            "mxfp8": "TE's grouped GEMM takes the counts on the device for MXFP8 on Blackwell only, and "
            "megatron-ext has not run it",
        }.get(recipe, "TE's grouped GEMM does not take the counts on the device for it")
        default = " (Megatron's default recipe)" if recipe == "delayed" else ""
        raise HybridEPConfigError(
            f"{CAPACITY_FACTOR_FLAG} with --fp8-recipe {recipe}{default}: {why}. Use --fp8-recipe "
            f"{' or '.join(FP8_RECIPES)} (Hopper: cuBLASLt >= 13.5, >= 13.6 for blockwise), or drop --fp8-format."
        )
    if getattr(config, "transformer_impl", "transformer_engine") != "transformer_engine" or not getattr(
        config, "use_transformer_engine_op_fuser", False
    ):
        raise HybridEPConfigError(
            f"{CAPACITY_FACTOR_FLAG} with --fp8-format: fp8 experts in capacity mode are Transformer Engine's "
            "op-fuser experts (megatron-ext's GroupedMLP computes in bf16). Add --transformer-impl "
            "transformer_engine --use-transformer-engine-op-fuser, or drop --fp8-format."
        )


def _check_router_topk(config: Any) -> None:
    """Megatron's --moe-router-topk, which it takes as any integer: a token goes to 1 to E experts."""
    # The expert count: `num_experts` on a parsed namespace, `num_moe_experts` on a config.
    experts = getattr(config, "num_moe_experts", None) or getattr(config, "num_experts", None)
    topk = getattr(config, "moe_router_topk", None)
    if not experts or not isinstance(topk, int) or 1 <= topk <= experts:
        return
    raise HybridEPConfigError(
        f"--moe-router-topk {topk}: each token goes to between 1 and --num-experts ({experts}) experts; "
        f"use a top-k in that range (2 or 8 are common)."
    )


def expert_tensor_parallel_size(config: Any) -> int:
    """--expert-tensor-parallel-size, which Megatron sets to --tensor-model-parallel-size when it is
    not given (a parsed namespace still holds None; a config has it filled in)."""
    size = getattr(config, "expert_tensor_parallel_size", None)
    return size if size is not None else getattr(config, "tensor_model_parallel_size", 1) or 1


def _check_parallelism(config: Any) -> None:
    """Capacity mode with the parallelisms megatron-ext has not run it with (docs/support.md)."""
    etp = expert_tensor_parallel_size(config)
    if etp != 1:
        given = getattr(config, "expert_tensor_parallel_size", None) is not None
        source = "" if given else f" (Megatron's default: --tensor-model-parallel-size {etp})"
        raise HybridEPConfigError(
            f"{CAPACITY_FACTOR_FLAG} with --expert-tensor-parallel-size {etp}{source}: capacity mode's experts are "
            "not split by tensor parallelism (megatron-ext's GroupedMLP keeps each expert whole; Transformer "
            "Engine's experts have not been run that way in capacity mode). Pass --expert-tensor-parallel-size 1 "
            f"(attention keeps its tensor parallelism), or drop {CAPACITY_FACTOR_FLAG}."
        )
    cp = getattr(config, "context_parallel_size", 1) or 1
    if cp != 1:
        raise HybridEPConfigError(
            f"{CAPACITY_FACTOR_FLAG} with --context-parallel-size {cp}: megatron-ext has not run or tested capacity "
            "mode with context parallelism, and refuses it rather than train on an unchecked path. Use "
            f"--context-parallel-size 1, or drop {CAPACITY_FACTOR_FLAG} for the blocking dispatch."
        )


# What a user can do instead of megatron-ext's GroupedMLP, which capacity mode builds for most experts.
GROUPED_MLP_WAYS_AROUND = (
    "use Transformer Engine's op-fuser experts (--transformer-impl transformer_engine "
    f"--use-transformer-engine-op-fuser), or drop {CAPACITY_FACTOR_FLAG}"
)


def check_parsed_precision(args: Any) -> None:
    """Parsed launch flags only (a TransformerConfig is checked where its experts are built, by
    `GroupedMLP._check_config`): capacity mode builds megatron-ext's GroupedMLP for every expert
    kind but TE's op-fuser experts and static splits' own, and on a GPU it computes in bf16 only."""
    options = HybridEPOptions.from_config(args)
    if options.capacity_factor is None or options.static_expert_splits:
        return
    te_op_fuser = getattr(args, "transformer_impl", None) == "transformer_engine" and getattr(
        args, "use_transformer_engine_op_fuser", False
    )
    if te_op_fuser or getattr(args, "use_cpu_initialization", False) or getattr(args, "bf16", False):
        return
    precision = "--fp16" if getattr(args, "fp16", False) else "fp32 (neither --bf16 nor --fp16)"
    raise HybridEPConfigError(
        f"{CAPACITY_FACTOR_FLAG} with {precision}: capacity mode's experts here are megatron-ext's GroupedMLP, "
        "which computes in bf16 on a GPU (torch's grouped GEMM reads the expert counts on the host for any other "
        f"dtype, a stall in every step). Train with --bf16, or {GROUPED_MLP_WAYS_AROUND} (blocking dispatch)."
    )


def validate(config: Any) -> HybridEPOptions:
    """Check megatron-ext's options on `config` (a TransformerConfig or a parsed namespace).

    Raises `HybridEPConfigError` naming the flag and the fix; returns the options otherwise.
    """
    options = HybridEPOptions.from_config(config)
    if options.implementation not in IMPLEMENTATIONS:
        raise HybridEPConfigError(
            f"{flag('moe_hybridep_implementation')} {options.implementation!r} is not one of "
            f"{', '.join(IMPLEMENTATIONS)}."
        )
    if options.overflow_policy not in OVERFLOW_POLICIES:
        raise HybridEPConfigError(
            f"{flag('moe_hybridep_overflow_policy')} {options.overflow_policy!r} is not one of "
            f"{', '.join(OVERFLOW_POLICIES)}."
        )
    if options.transport not in TRANSPORTS:
        raise HybridEPConfigError(
            f"{flag('moe_hybridep_transport')} {options.transport!r} is not one of {', '.join(TRANSPORTS)}."
        )
    if options.transport != AUTO:
        if options.capacity_factor is None:
            raise HybridEPConfigError(
                f"{flag('moe_hybridep_transport')} {options.transport} says how capacity mode's non-blocking "
                f"dispatches move tokens (a blocking dispatch sends exact rows anyway); set {CAPACITY_FACTOR_FLAG} "
                "too, or drop it."
            )
        if options.implementation == "deep_ep":
            raise HybridEPConfigError(
                f"{flag('moe_hybridep_transport')} {options.transport} chooses the torch implementation's "
                f"transport; deep_ep's kernels move their own bytes. Use {flag('moe_hybridep_implementation')} "
                "torch, or drop the transport flag."
            )
    if options.compact_routing and options.implementation == "deep_ep":
        raise HybridEPConfigError(
            f"{COMPACT_ROUTING_FLAG} with {flag('moe_hybridep_implementation')} deep_ep: deep_ep's dispatch turns "
            "top-k indices into the dense routing map before its all-gather, so nothing would be saved. Use "
            f"{flag('moe_hybridep_implementation')} torch (or auto, which picks it), or drop {COMPACT_ROUTING_FLAG}."
        )
    if options.kernel_cache is not None:
        _check_kernel_cache(options)
    if options.fp8_dispatch:
        _check_fp8_dispatch(config, options)
    if options.overflow_policy != "rerun" and options.capacity_factor is None:
        raise HybridEPConfigError(
            f"{flag('moe_hybridep_overflow_policy')} {options.overflow_policy} says what a capacity-mode "
            f"overflow does; set {CAPACITY_FACTOR_FLAG} too, or drop it."
        )
    _check_graphs(config, options)
    _check_router_topk(config)
    set_flags = options.set_flags()
    if not set_flags:
        return options

    dispatcher = getattr(config, "moe_token_dispatcher_type", None)
    backend = getattr(config, "moe_flex_dispatcher_backend", None)
    if dispatcher != "flex" or backend != "hybridep":
        raise HybridEPConfigError(
            f"{', '.join(set_flags)}: megatron-ext's options work with the HybridEP flex dispatcher only; got "
            f"--moe-token-dispatcher-type {dispatcher} --moe-flex-dispatcher-backend {backend}. "
            "Set --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep, or drop "
            f"{', '.join(set_flags)}."
        )

    if options.capacity_factor is not None:
        check_capacity_factor(options.capacity_factor)
        capacity = CAPACITY_FACTOR_FLAG
        if getattr(config, "moe_expert_rank_capacity_factor", None) is not None:
            raise HybridEPConfigError(
                f"{capacity} and --moe-expert-rank-capacity-factor both size the HybridEP dispatch; "
                "use one. megatron-ext's calibrates each layer and never trains on an overflow; Megatron's is "
                "a static budget whose overflow is rerun by the paged-stash runner."
            )
        # Megatron's token-dropping MoE: its router drops the tokens beyond each expert's capacity
        # (--moe-expert-capacity-factor; Megatron reads a negative factor as unset); the padding flag
        # pads every expert's input to that capacity.
        expert_factor = getattr(config, "moe_expert_capacity_factor", None)
        megatron_dropping = {
            "--moe-expert-capacity-factor": (
                expert_factor is not None and expert_factor >= 0,
                "Megatron's factor drops tokens per expert in the router",
            ),
            "--moe-pad-expert-input-to-capacity": (
                bool(getattr(config, "moe_pad_expert_input_to_capacity", False)),
                "Megatron's padding pads every expert's input to its token-dropping capacity",
            ),
        }
        dropping = {name: why for name, (set_, why) in megatron_dropping.items() if set_}
        if dropping:
            named = " and ".join(dropping)
            raise HybridEPConfigError(
                f"{capacity} cannot be combined with {named}: drop {named}: capacity mode sizes the dispatch "
                f"itself and drops nothing; {'; '.join(dropping.values())}. (Or drop {capacity} to train with "
                "Megatron's token-dropping MoE.)"
            )
        _check_parallelism(config)
        _check_quantized_experts(config, options)
        _check_op_fuser_activation(config)
    _check_static_expert_splits(config, options)

    if options.equal_token_counts and getattr(config, "moe_hybridep_pad_uneven_dispatch_inputs", False):
        raise HybridEPConfigError(
            f"{flag('moe_hybridep_equal_token_counts')} declares every rank holds the same number of "
            "tokens; --moe-hybridep-pad-uneven-dispatch-inputs pads unequal counts with an all-reduce "
            "per dispatch. Use one: the first for fixed-shape batches, the second for variable ones."
        )
    if options.verify_equal_token_counts and not options.equal_token_counts:
        raise HybridEPConfigError(
            f"{flag('moe_hybridep_verify_equal_token_counts')} checks the declaration made by "
            f"{flag('moe_hybridep_equal_token_counts')}; set that flag too, or drop this one."
        )
    if options.implementation == "deep_ep":
        shape = deep_ep_shape_error(getattr(config, "hidden_size", None), options.fp8_dispatch)
        if shape is not None:
            raise HybridEPConfigError(
                f"{flag('moe_hybridep_implementation')} deep_ep: {shape}. Use "
                f"{flag('moe_hybridep_implementation')} torch (or auto, which picks torch for this size)."
            )
        reason = deep_ep_import_error()
        if reason is not None:
            raise HybridEPConfigError(
                f"{flag('moe_hybridep_implementation')} deep_ep: deep_ep's HybridEPBuffer is not usable "
                f"here ({reason}). Install DeepEP's hybrid-ep branch (tested: {DEEP_EP_TESTED_COMMIT}), or use "
                f"{flag('moe_hybridep_implementation')} torch (or auto)."
            )
    return options
