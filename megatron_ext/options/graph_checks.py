"""megatron-ext's checks of Megatron's CUDA-graph flags: which graph settings capture the MoE
dispatch (`graphs_hold_dispatch`), the one dropless MoE a per-layer graph can hold
(`graphs_dropless_moe`), and the refusal of settings that cannot hold the dispatch a config asks
for (`_check_graphs`, run by `megatron_ext.options.validate`). It does not import Megatron-Core
at module level.
"""

from __future__ import annotations

from typing import Any

from megatron_ext.options.fields import (
    CAPACITY_FACTOR_FLAG,
    CONFIG_PREFIX,
    HybridEPConfigError,
    HybridEPOptions,
    flag,
)

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
