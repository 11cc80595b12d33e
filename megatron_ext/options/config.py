"""Megatron `TransformerConfig` with megatron-ext's fields.

`megatron_ext.patches.apply()` makes Megatron's argument parser and
`core_transformer_config_from_args` use these classes, so the fields below become
`--moe-hybridep-...` flags (their docstrings are the `--help` text) and reach the config built
from the parsed arguments. Code that builds its config by hand can instantiate them directly.
"""

# No `from __future__ import annotations` here: Megatron's ArgumentGroupFactory turns these
# annotations into argparse types and needs them evaluated.
from dataclasses import dataclass, fields
from typing import Optional

from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron_ext import options


@dataclass
class HybridEPTransformerConfig(TransformerConfig):
    """Megatron's TransformerConfig plus megatron-ext's HybridEP dispatch fields."""

    moe_hybridep_capacity_factor: Optional[float] = None
    """[megatron-ext] Capacity mode for the HybridEP flex dispatcher. Unset: Megatron's blocking
    dispatch, which reads the permuted row count on the host at every MoE layer. A factor f >= 1.0:
    each MoE layer runs one blocking calibration dispatch, then sizes every later dispatch to
    ceil(rows x f) (the EP-group maximum, aligned) and runs it without any host synchronisation;
    a dispatch that needs more rows is never trained on: see --moe-hybridep-overflow-policy.
    Needs --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep."""

    moe_hybridep_equal_token_counts: bool = False
    """[megatron-ext] Declare that every rank of the expert-parallel group holds the same number
    of tokens (fixed-shape batches). HybridEP dispatch inputs are then padded to the local count
    aligned to 64, with no all-reduce and no host read. Keep it off for variable-length or
    packed inputs (use --moe-hybridep-pad-uneven-dispatch-inputs there)."""

    moe_hybridep_verify_equal_token_counts: bool = False
    """[megatron-ext] With --moe-hybridep-equal-token-counts, check on the device at every
    dispatch that all ranks hold the same number of tokens, and fail loudly if not. Costs one
    small all-reduce per dispatch, no host read."""

    moe_hybridep_reuse_allgather_buffer: bool = False
    """[megatron-ext] Gather the routing maps of each HybridEP dispatch into one buffer per
    process group instead of a fresh tensor per dispatch (saves tokens x ranks x experts bytes of
    allocation per dispatch). With deep_ep, its persistent all-gather buffer is used where the
    topology allows (one node, 16-byte aligned rows) and the plain all-gather elsewhere."""

    moe_hybridep_implementation: options.Implementation = options.AUTO
    """[megatron-ext] Which HybridEP buffer dispatches tokens: deep_ep (DeepEP's hybrid-ep
    kernels), torch (megatron-ext's implementation on torch.distributed, any GPU or CPU), or
    auto (deep_ep where its HybridEPBuffer imports and takes the hidden size, 128 or more and a
    multiple of 16; torch otherwise, logged)."""

    moe_hybridep_overflow_policy: options.OverflowPolicy = "rerun"
    """[megatron-ext] What a capacity-mode overflow does in Megatron's training loop. rerun: the
    step's overflow is recorded on the device and checked once at its end (one all-reduce for the
    model); if any dispatch overflowed, the step's gradients are discarded, the same micro-batches
    run again with blocking dispatches, and the overflowed layers' capacities grow to ceil(rows x
    factor) for the steps after (as they also grow, without a re-run, once a step used more than
    half of the room above the calibrated rows). fail: stop at the overflowing dispatch with a
    device assert.
    Outside Megatron's training loop an overflow always stops with the device assert."""

    moe_hybridep_transport: options.Transport = options.AUTO
    """[megatron-ext] How the torch implementation's non-blocking (capacity-mode) dispatches move
    tokens. process_group: all-gather every token on the expert-parallel group's collectives (W /
    k_r times the exact bytes, k_r the ranks a token goes to). nvshmem: send each token only to the
    ranks of its experts, the counts kept on the GPU, through torch's NVSHMEM all_to_all_vdev
    (torch 2.8+, one GPU per rank, symmetric buffers of ranks x tokens rows). auto: nvshmem for an
    NCCL group of 2+ ranks on one node where torch's NVSHMEM is available, process_group otherwise;
    the choice is logged."""

    moe_hybridep_static_expert_splits: bool = False
    """[megatron-ext] Capacity mode for experts that split their rows by counts read on the host
    (Megatron's TEGroupedMLP without --use-transformer-engine-op-fuser, which fp8 with
    --fp8-recipe delayed needs, and SequentialMLP): each local expert gets a fixed row budget,
    ceil(its calibrated rows x the capacity factor) for the layer's largest expert (EP-group max),
    aligned; its rows fill the start of it and zero rows the rest. The experts get these budgets
    as their counts, host constants, so nothing is read on the host after calibration. An expert
    over its budget is an overflow like a capacity's (re-run and growth, or the device assert).
    Costs one copy of the rows each way and the memory of every expert's budget."""

    moe_hybridep_compact_routing: bool = False
    """[megatron-ext] Gather each dispatch's routing maps as top-k expert indices (int16 below
    32768 experts) instead of the dense tokens x experts Boolean map: experts / (2 x top-k) times
    fewer bytes (16x at 256 experts, top-8), expanded back on every rank into the same map, so
    results are bitwise unchanged. A token routed to more than --moe-router-topk experts stops the
    run with a device assert. The torch implementation only (auto picks it; deep_ep's dispatch
    gathers the dense map whatever it is given)."""

    moe_hybridep_fp8_dispatch: bool = False
    """[megatron-ext] With --fp8-format e4m3 --fp8-recipe blockwise: quantize each token in
    1 x 128 blocks before the dispatch, by the rule of the experts' own quantization, move its e4m3
    bytes and float32 scales (H + H/32 bytes a row, 0.52x bf16's), and dequantize the rows on
    arrival. The experts' forward then computes what it would from bf16 rows (their quantization
    gives back the same values); the first expert GEMM's weight gradient sees the dequantized rows.
    Pays where rows cross GPUs (expert parallelism); on one rank it adds a quantization and a
    dequantization pass. The hidden size must be a multiple of 128 (512 with deep_ep)."""

    moe_hybridep_warm_up: bool = False
    """[megatron-ext] Before Megatron's training loop starts, build every MoE layer's HybridEP
    buffer and run its dispatch and combine once, forward and backward, on made-up tokens of the
    training shape (--seq-length x --micro-batch-size per rank), so that deep_ep's and Triton's
    kernels compile there, every pipeline stage at once, instead of inside the first step. Changes
    no layer state (capacity mode still calibrates on the first real step). Keep deep_ep's compiled
    kernels across jobs with --moe-hybridep-kernel-cache."""

    moe_hybridep_kernel_cache: Optional[str] = None
    """[megatron-ext] A folder that keeps deep_ep's compiled HybridEP kernels across jobs: each
    process loads the kernels stored there before its first deep_ep buffer is built, and stores
    the ones it compiled after the warm-up (--moe-hybridep-warm-up) and at exit. deep_ep alone
    compiles into a folder of the process (HYBRID_EP_CACHE_DIR/.deepep/hybrid_ep/jit/proc-PID) that
    no later job reads. One sub-folder per deep_ep build, CUDA version and GPU architecture. Put it
    on a disk that outlives the job and that the job's nodes share. deep_ep only: the torch
    implementation's Triton kernels are kept by Triton (TRITON_CACHE_DIR), and the log says the
    flag has no effect there."""

    def __post_init__(self):
        # Megatron refuses `--cuda-graph-modules moe` for every MoE but drop-and-pad ones (a dropless
        # layer reads its counts on the host). Capacity mode with equal token counts reads none after
        # calibration: for it alone, `moe` is left out of the list while Megatron's checks run.
        lift = options.graphs_dropless_moe(self)
        if lift:
            modules = self.cuda_graph_modules
            modules = [modules] if isinstance(modules, str) else modules
            self.cuda_graph_modules = [m for m in modules if getattr(m, "name", m) != "moe"]
        try:
            super().__post_init__()
        finally:
            if lift:
                from megatron.core.transformer.enums import CudaGraphModule

                self.cuda_graph_modules = [*self.cuda_graph_modules, CudaGraphModule.moe]
        options.validate(self)


@dataclass
class HybridEPMLATransformerConfig(HybridEPTransformerConfig, MLATransformerConfig):
    """Megatron's MLATransformerConfig plus megatron-ext's HybridEP dispatch fields."""


# The names of megatron-ext's own fields, in declaration order.
FIELD_NAMES: tuple[str, ...] = tuple(
    f.name for f in fields(HybridEPTransformerConfig) if f.name not in {g.name for g in fields(TransformerConfig)}
)
