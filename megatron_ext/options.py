"""megatron-ext's MoE dispatch options, read from a Megatron config or an argparse namespace.

This module does not import Megatron-Core: the same checks run on `parse_args`' namespace (so a
bad flag combination stops the launch before anything is built), on a `TransformerConfig` at
construction, and in the dispatcher. Every message names the flag and the fix.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
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
# How the torch implementation's non-blocking dispatches move tokens (`megatron_ext.hybridep.exchange`).
Transport = Literal["auto", "process_group", "nvshmem"]
TRANSPORTS: tuple[str, ...] = get_args(Transport)

logger = logging.getLogger(__name__)


class HybridEPConfigError(ValueError):
    """A megatron-ext option, or its combination with a Megatron option, is invalid."""


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


def check_capacity_factor(factor: Any, name: str = CAPACITY_FACTOR_FLAG) -> float:
    """`factor` if it is a finite number >= 1.0 (a capacity that cannot drop tokens), else raise.

    The one check of a capacity factor: the config, the argument parsers (Megatron's, the bench's,
    the round trip's) and `capacity_from_rows` all call it. Raises `HybridEPConfigError` (a
    ValueError) naming `name`, the flag or argument the factor came from, and the fix.
    """
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor):
        raise HybridEPConfigError(f"{name} must be a finite number >= 1.0; got {factor!r}.")
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


# What megatron-ext passes to `HybridEPBuffer.dispatch_with_permute` that hybrid-ep builds before
# non-blocking dispatch (late 2025) lack; megatron-core 0.19 passes them too.
DEEP_EP_DISPATCH_ARGUMENTS = ("num_permuted_tokens", "non_blocking", "pad_multiple")
DEEP_EP_TESTED_COMMIT = "94a9f8f"


def deep_ep_import_error() -> Optional[str]:
    """None when `deep_ep.HybridEPBuffer` imports and its dispatch takes what megatron-ext passes,
    else why not (imported lazily, here only)."""
    try:
        from deep_ep import HybridEPBuffer
    except Exception as exc:  # ImportError, or a CUDA/driver error raised at import
        return f"{type(exc).__name__}: {exc}"
    missing = [
        name
        for name in DEEP_EP_DISPATCH_ARGUMENTS
        if not accepts_keyword(HybridEPBuffer, "dispatch_with_permute", name)
    ]
    if missing:
        return (
            f"its dispatch_with_permute takes no {', '.join(missing)}: a hybrid-ep build older than megatron-ext "
            f"needs (tested: hybrid-ep {DEEP_EP_TESTED_COMMIT})"
        )
    return None


def accepts_keyword(cls: Any, method: str, argument: str) -> bool:
    """Whether `cls.method` accepts `argument` by keyword (True where its signature cannot be read)."""
    function = getattr(cls, method, None)
    if function is None:
        return False
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # a C++ binding without a readable signature
        return True
    return argument in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


# deep_ep 1.2.1's HybridEPBuffer allocates, fp8 or not, a scaling-factor buffer of hidden // 128
# floats per token; at a hidden size below 128 that is zero bytes, and its constructor aborts the
# process (SIGABRT, no Python error; seen on an H200, 2026-12-01). Its config raises on a hidden
# size that is not a multiple of 16.
DEEP_EP_MIN_HIDDEN = 128
DEEP_EP_HIDDEN_MULTIPLE = 16
DEEP_EP_FP8_HIDDEN_MULTIPLE = 512  # deep_ep 1.2.1's fp8 dispatch kernels
FP8_DISPATCH_FLAG = flag(CONFIG_PREFIX + "fp8_dispatch")
FP8_DISPATCH_BLOCK = 128  # the values per scale of --moe-hybridep-fp8-dispatch (megatron_ext.hybridep.fp8)


def deep_ep_shape_error(hidden_size: Optional[int], fp8_dispatch: bool = False) -> Optional[str]:
    """None when deep_ep's HybridEPBuffer takes this hidden size (or it is not known), in fp8 where
    `fp8_dispatch` (--moe-hybridep-fp8-dispatch), else why not."""
    if hidden_size is None:
        return None
    if hidden_size < DEEP_EP_MIN_HIDDEN:
        return (
            f"hidden size {hidden_size} is below {DEEP_EP_MIN_HIDDEN}, where deep_ep's HybridEPBuffer "
            "constructor aborts the process"
        )
    if hidden_size % DEEP_EP_HIDDEN_MULTIPLE:
        return (
            f"hidden size {hidden_size} is not a multiple of {DEEP_EP_HIDDEN_MULTIPLE}, as deep_ep's "
            "HybridEPBuffer needs"
        )
    if fp8_dispatch and hidden_size % DEEP_EP_FP8_HIDDEN_MULTIPLE:
        return (
            f"hidden size {hidden_size} is not a multiple of {DEEP_EP_FP8_HIDDEN_MULTIPLE}, as deep_ep's fp8 "
            f"dispatch ({FP8_DISPATCH_FLAG}) needs"
        )
    return None


_AUTO_FALLBACKS_LOGGED: set[str] = set()


def resolve_implementation(requested: str, hidden_size: Optional[int] = None, fp8_dispatch: bool = False) -> str:
    """'deep_ep' or 'torch': 'auto' picks deep_ep where its HybridEPBuffer imports and takes
    `hidden_size` (in fp8 where `fp8_dispatch`); where it imports but cannot take the size,
    'torch', logged once per reason."""
    if requested != AUTO:
        return requested
    if deep_ep_import_error() is not None:
        return "torch"
    reason = deep_ep_shape_error(hidden_size, fp8_dispatch)
    if reason is None:
        return "deep_ep"
    if reason not in _AUTO_FALLBACKS_LOGGED:
        _AUTO_FALLBACKS_LOGGED.add(reason)
        logger.warning(
            "megatron-ext: %s auto uses the torch implementation: %s.", flag(CONFIG_PREFIX + "implementation"), reason
        )
    return "torch"


COMPACT_ROUTING_FLAG = flag(CONFIG_PREFIX + "compact_routing")
KERNEL_CACHE_FLAG = flag(CONFIG_PREFIX + "kernel_cache")


def _check_kernel_cache(options: HybridEPOptions) -> None:
    """--moe-hybridep-kernel-cache: refused for a path that is not a writable folder and cannot
    become one. With the torch implementation it keeps nothing (Triton caches its own kernels) and
    the dispatcher logs so, as for Megatron's deep_ep tuning flags: a launch template may set it
    for every job."""
    path = Path(options.kernel_cache)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if not options.kernel_cache or existing is None or not existing.is_dir() or not os.access(existing, os.W_OK):
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


def requested_implementation(options: HybridEPOptions) -> str:
    """The implementation `options` ask for: `--moe-hybridep-implementation`, except that `auto`
    with compact routing is torch (logged once): deep_ep 1.2.1's dispatch turns top-k indices into
    the dense map before its own all-gather, so compact routing would save nothing there."""
    if options.implementation != AUTO or not options.compact_routing:
        return options.implementation
    if COMPACT_ROUTING_FLAG not in _AUTO_FALLBACKS_LOGGED:
        _AUTO_FALLBACKS_LOGGED.add(COMPACT_ROUTING_FLAG)
        logger.info(
            "megatron-ext: %s auto uses the torch implementation for %s (deep_ep's dispatch gathers the dense "
            "routing map).",
            flag(CONFIG_PREFIX + "implementation"),
            COMPACT_ROUTING_FLAG,
        )
    return "torch"


PER_LAYER_GRAPHS = ("local", "transformer_engine")


def graph_modules(config: Any) -> set[str]:
    """The names in `--cuda-graph-modules` (strings on a parsed namespace, enums on a config)."""
    modules = getattr(config, "cuda_graph_modules", None) or []
    if isinstance(modules, str):
        modules = [modules]
    return {getattr(module, "name", str(module)) for module in modules}


def graph_impl(config: Any) -> str:
    """`--cuda-graph-impl`, with Megatron's deprecated switches read as the implementation they mean."""
    impl = getattr(config, "cuda_graph_impl", None) or "none"
    if impl == "none" and getattr(config, "enable_cuda_graph", False):
        return "local"
    if impl == "none" and getattr(config, "external_cuda_graph", False):
        return "transformer_engine"
    return impl


def graphs_hold_dispatch(config: Any) -> bool:
    """Whether Megatron's CUDA graphs capture the MoE dispatch: the full iteration, or per-layer
    graphs of the whole layer (no modules named) or of the `moe` module."""
    impl = graph_impl(config)
    if impl == "full_iteration":
        return True
    if impl not in PER_LAYER_GRAPHS:
        return False
    modules = graph_modules(config) - {"full"}  # 'full': Megatron's deprecated name of the whole layer
    return not modules or "moe" in modules


def drop_and_pad(config: Any) -> bool:
    """Megatron's own token-dropping MoE, which its CUDA-graph checks allow in a graph."""
    return getattr(config, "moe_expert_capacity_factor", None) is not None and bool(
        getattr(config, "moe_pad_expert_input_to_capacity", False)
    )


def graphs_dropless_moe(config: Any) -> bool:
    """Whether `config` graphs the `moe` module per layer with capacity mode and equal token counts:
    the one dropless MoE a graph can hold, which Megatron's check (drop-and-pad only) refuses, so
    `HybridEPTransformerConfig` passes it over for this case alone."""
    options = HybridEPOptions.from_config(config)
    return (
        graph_impl(config) in PER_LAYER_GRAPHS
        and "moe" in graph_modules(config)
        and not drop_and_pad(config)
        and options.capacity_factor is not None
        and options.equal_token_counts
    )


def _check_graphs(config: Any, options: HybridEPOptions) -> None:
    """Refuse CUDA-graph settings that cannot hold the MoE dispatch this config asks for."""
    impl = graph_impl(config)
    if impl in PER_LAYER_GRAPHS and {"moe", "moe_router"} <= graph_modules(config):
        # Megatron's own check, which `HybridEPTransformerConfig` would not reach when it lifts the
        # drop-and-pad one (it hides `moe` from Megatron's checks).
        raise HybridEPConfigError(
            "--cuda-graph-modules moe and moe_router: the first graphs the whole MoE layer, the second its "
            "router alone; name one of them."
        )
    if impl in PER_LAYER_GRAPHS and "moe" in graph_modules(config) and not drop_and_pad(config):
        if options.capacity_factor is None or not options.equal_token_counts:
            raise HybridEPConfigError(
                "--cuda-graph-modules moe graphs the whole MoE layer, which needs a layer that reads no token "
                "count on the host: Megatron's drop-and-pad MoE (--moe-expert-capacity-factor with "
                "--moe-pad-expert-input-to-capacity), or megatron-ext's capacity mode with equal token counts "
                "(--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep "
                f"{CAPACITY_FACTOR_FLAG} 1.5 {flag(CONFIG_PREFIX + 'equal_token_counts')}). Add one, or graph "
                "--cuda-graph-modules moe_router moe_preprocess instead."
            )
    uses_hybridep = (
        getattr(config, "moe_token_dispatcher_type", None) == "flex"
        and getattr(config, "moe_flex_dispatcher_backend", None) == "hybridep"
    )
    if not (uses_hybridep and options.set_flags() and graphs_hold_dispatch(config)):
        return
    where = f"--cuda-graph-impl {impl}" + (
        f" --cuda-graph-modules {' '.join(sorted(graph_modules(config)))}" if graph_modules(config) else ""
    )
    equal = flag(CONFIG_PREFIX + "equal_token_counts")
    if options.capacity_factor is None or not options.equal_token_counts:
        raise HybridEPConfigError(
            f"{where} captures the HybridEP dispatch, which reads the host unless it runs in capacity mode with "
            f"equal token counts (a blocking dispatch reads its row count; the uneven-count pad all-reduces and "
            f"reads). Set {CAPACITY_FACTOR_FLAG} 1.5 {equal} (fixed-shape batches), or drop the CUDA-graph flags."
        )
    if getattr(config, "cuda_graph_warmup_steps", 1) < 1:
        raise HybridEPConfigError(
            f"{where} with {CAPACITY_FACTOR_FLAG}: --cuda-graph-warmup-steps 0 would capture the first step, whose "
            "calibration dispatch is blocking (it reads the host); use --cuda-graph-warmup-steps 1 or more."
        )
    timing = getattr(config, "timing_log_level", 0) or 0  # on a parsed namespace; no config field
    if impl == "full_iteration" and timing >= 1:
        raise HybridEPConfigError(
            f"{where} with --timing-log-level {timing}: Megatron's timers of level 1 and up (forward-backward, "
            "forward-compute, ...) synchronize the device inside the step that the graph captures, which CUDA "
            "refuses at the first capture (cudaErrorStreamCaptureUnsupported; seen on an H200). Use "
            "--timing-log-level 0 with full-iteration graphs, or time the eager capacity mode."
        )
    if impl == "local" and not graph_modules(config) and _local_graph_inputs_released(config):
        raise HybridEPConfigError(
            f"{where} with --transformer-impl local: with Transformer Engine installed, megatron-core 0.19.2 "
            "releases a per-layer graph's input buffer unless a Python autograd function saved it for the "
            "backward, and the local spec's torch norms (no apex) save it in C++: the first graphed layer's "
            "input-norm weight then gets a wrong gradient (seen on an H200). Use --transformer-impl "
            "transformer_engine, or graph --cuda-graph-modules moe, or --cuda-graph-impl full_iteration."
        )
    if impl == "transformer_engine" and options.overflow_policy == "rerun":
        # Transformer Engine's graphs are made once, at the end of the warm-up steps, by a helper
        # of Megatron's training loop that megatron-ext cannot call again after a capacity grows.
        raise HybridEPConfigError(
            f"{where} with {CAPACITY_FACTOR_FLAG}: {flag(CONFIG_PREFIX + 'overflow_policy')} rerun re-runs an "
            "overflowed step eagerly with blocking dispatches and captures again at the new capacity, which "
            "Transformer Engine's per-layer graphs cannot do in Megatron's loop. Use --cuda-graph-impl local or "
            f"full_iteration (re-run and re-capture supported), or {flag(CONFIG_PREFIX + 'overflow_policy')} fail "
            "(an overflow stops the job at the device assert inside the graph), or graph only --cuda-graph-modules "
            "moe_router moe_preprocess (the dispatch stays eager)."
        )


def _local_graph_inputs_released(config: Any) -> bool:
    """Whether Megatron's per-layer graphs would release a whole layer's input buffer that its norm
    reads in the backward: its graph code weak-references graph inputs where Transformer Engine
    imports, keeping those a Python `save_for_backward` saw; torch's native norms (the local spec's
    `WrappedTorchNorm`, built without apex) save theirs in C++, unseen."""
    if getattr(config, "transformer_impl", "transformer_engine") != "local":
        return False
    try:
        from megatron.core.models.gpt import gpt_layer_specs
        from megatron.core.transformer import cuda_graphs
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
    except ImportError:  # nothing to graph with, or a Megatron-Core whose check names it
        return False
    return bool(cuda_graphs.HAVE_TE_GRAPHS) and gpt_layer_specs.LNImpl is WrappedTorchNorm


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
