"""Buffers built and dispatch kernels compiled before the first training step.

deep_ep's HybridEP compiles its dispatch and combine kernels on first use (seconds each), and the
torch implementation's Triton kernels compile on theirs. Left to the first step, that work runs
inside the schedule: under pipeline parallelism a stage that compiles holds up the stages waiting
on its sends, so the compile times add up across stages. `warm_up` runs every MoE layer's
dispatch once on made-up tokens of training's shape, forward and backward, before the schedule
starts, so the stages (each with its own expert-parallel group) compile at the same time.

In Megatron's training loop `--moe-hybridep-warm-up` runs it before `train` (the patch's training
feature); other loops call `warm_up(model, num_tokens)` themselves, on every rank, before their
first step. With `--moe-hybridep-kernel-cache DIR` the kernels deep_ep compiled here are stored in
DIR right after the warm-up, and the next job's processes load them instead of compiling them
(`megatron_ext.hybridep.deep_ep_buffer.kernel_cache`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from megatron_ext.dispatcher import HybridEPCapacityManager, dispatch_managers, group_device
from megatron_ext.hybridep.deep_ep_buffer import kernel_cache
from megatron_ext.logs import once_per_job

logger = logging.getLogger("megatron_ext.warmup")  # the name its lines had: users may filter by it


def tokens_per_rank(config: Any, seq_length: int, micro_batch_size: int) -> int:
    """The tokens one rank's MoE layer dispatches in a micro-batch: the sequence split over context
    parallelism, and over tensor parallelism where sequence parallelism splits it."""
    tokens = seq_length * micro_batch_size // getattr(config, "context_parallel_size", 1)
    if getattr(config, "sequence_parallel", False):
        tokens //= getattr(config, "tensor_model_parallel_size", 1)
    return tokens


def _device(manager: HybridEPCapacityManager) -> torch.device:
    """Where the manager's layer lives (its group's device where the layer has no parameter)."""
    layer = manager._layer() if manager._layer is not None else None
    parameter = next(layer.parameters(), None) if layer is not None else None
    return parameter.device if parameter is not None else group_device(manager.group)


def warm_up(model: Any, num_tokens: int) -> int:
    """Build the buffer and run the dispatch kernels of every megatron-ext MoE layer of `model` for
    `num_tokens` tokens per rank, forward and backward; layers that share a buffer and kernels are
    warmed once. Collective: every rank calls it with the same `num_tokens` (each pipeline stage
    warms its own layers over its own groups). Returns how many warm-ups ran. No layer's state
    changes: calibration, counters and statistics start from the first real step. The kernels
    deep_ep compiled are stored in `--moe-hybridep-kernel-cache`'s folder where one is set."""
    if num_tokens < 1:
        raise ValueError(f"warm_up: num_tokens must be a positive number of tokens per rank, got {num_tokens}")
    started = time.monotonic()
    warmed: set[tuple] = set()
    for manager in dispatch_managers(model):
        manager.warm_up(num_tokens, _device(manager), warmed)
    kernel_cache.store_all()  # what deep_ep compiled, for the next job (--moe-hybridep-kernel-cache)
    if warmed:
        logger.log(
            once_per_job(logging.INFO),
            "megatron-ext: warmed %d HybridEP dispatch(es) for %d tokens per rank in %.1f s.",
            len(warmed),
            num_tokens,
            time.monotonic() - started,
        )
    return len(warmed)


def warm_up_before_training(model: Any) -> int:
    """`warm_up` at the shape of Megatron's parsed arguments (`--seq-length`,
    `--micro-batch-size`), where the model's config asks for it (`--moe-hybridep-warm-up`)."""
    from megatron.core.utils import get_model_config
    from megatron.training.global_vars import get_args

    chunks = model if isinstance(model, (list, tuple)) else [model]
    config = get_model_config(chunks[0])
    if not getattr(config, "moe_hybridep_warm_up", False):
        return 0
    args = get_args()
    return warm_up(model, tokens_per_rank(config, args.seq_length, args.micro_batch_size))
