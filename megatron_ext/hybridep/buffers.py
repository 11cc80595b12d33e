"""One HybridEP buffer per process group and implementation, shared by every MoE layer on it.

Megatron keeps one process-global HybridEP buffer; megatron-ext keeps one per (implementation,
group, local experts, reuse), created on the first dispatch that needs it and replaced only when
a dispatch brings a wider hidden size or more tokens per rank than it was built for.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch.distributed as dist

from megatron_ext.hybridep.deep_ep_buffer import DeepEPTuning, create_deep_ep_buffer, map_alignment_reason
from megatron_ext.hybridep.protocol import HybridEPBuffer
from megatron_ext.hybridep.torch_buffer import TorchHybridEPBuffer
from megatron_ext.logs import once_per_group
from megatron_ext.options import BUFFER_IMPLEMENTATIONS

logger = logging.getLogger(__name__)

# key -> (buffer, hidden_dim, tokens per rank it was built for)
_BUFFERS: dict[tuple, tuple[HybridEPBuffer, int, int]] = {}
# (group, tokens per rank) whose fall-back to deep_ep's plain all-gather was logged
_PLAIN_GATHER_LOGGED: set[tuple] = set()


def get_buffer(
    implementation: str,
    group: dist.ProcessGroup,
    *,
    hidden_dim: int,
    num_tokens: int,
    num_local_experts: int,
    reuse_allgather_buffer: bool,
    transport: str = "auto",
    deep_ep_tuning: Optional[DeepEPTuning] = None,
    compact_routing_topk: Optional[int] = None,
    kernel_cache: Optional[str] = None,
) -> HybridEPBuffer:
    """The shared buffer for these arguments (`implementation`: one of `BUFFER_IMPLEMENTATIONS`,
    'deep_ep' or 'torch', as `options.resolve_implementation` gives; `transport`: the torch
    buffer's, see `megatron_ext.hybridep.torch_buffer.exchange`; `deep_ep_tuning`: deep_ep's SM and block
    counts, which the torch buffer's kernels have no equivalent of; `compact_routing_topk`: the torch
    buffer's routing maps gathered as that many expert indices per token, `--moe-hybridep-compact-routing`).

    deep_ep's persistent all-gather buffer asserts, at every dispatch, that each rank's routing map
    is a multiple of 16 bytes. A buffer built for T tokens serves any smaller count, so the check
    is made here for each call's count (the same on every rank): a count that breaks it is served
    by a buffer with deep_ep's plain all-gather, and the log says so once per count.
    """
    if implementation == "deep_ep" and reuse_allgather_buffer:
        reason = map_alignment_reason(num_tokens, num_local_experts * group.size())
        if reason is not None:
            if (group, num_tokens) not in _PLAIN_GATHER_LOGGED:
                _PLAIN_GATHER_LOGGED.add((group, num_tokens))
                logger.log(
                    once_per_group(logging.WARNING, group),
                    "megatron-ext: --moe-hybridep-reuse-allgather-buffer: %s; this dispatch uses deep_ep's "
                    "plain all-gather.",
                    reason,
                )
            reuse_allgather_buffer = False
    tuning = (deep_ep_tuning or DeepEPTuning()) if implementation == "deep_ep" else None
    compact = compact_routing_topk if implementation == "torch" else None
    key = (implementation, group, num_local_experts, reuse_allgather_buffer, transport, tuning, compact)
    cached = _BUFFERS.get(key)
    if cached is not None and cached[1] == hidden_dim and cached[2] >= num_tokens:
        return cached[0]
    buffer: HybridEPBuffer
    if implementation == "torch":
        buffer = TorchHybridEPBuffer(
            group,
            hidden_dim,
            num_tokens,
            num_local_experts,
            reuse_allgather_buffer=reuse_allgather_buffer,
            transport=transport,
            compact_routing_topk=compact,
        )
    elif implementation == "deep_ep":
        buffer = create_deep_ep_buffer(
            group,
            hidden_dim,
            num_tokens,
            num_local_experts,
            reuse_allgather_buffer=reuse_allgather_buffer,
            tuning=tuning,
            kernel_cache=kernel_cache,
        )
    else:
        raise ValueError(
            f"HybridEP implementation must be one of {', '.join(BUFFER_IMPLEMENTATIONS)}; got {implementation!r}."
        )
    logger.log(
        once_per_group(logging.INFO, group),
        "megatron-ext: %s HybridEP buffer for %d ranks, hidden %d, %d tokens per rank, %d local experts.",
        implementation,
        group.size(),
        hidden_dim,
        num_tokens,
        num_local_experts,
    )
    _BUFFERS[key] = (buffer, hidden_dim, num_tokens)
    return buffer


def release_buffers() -> None:
    """Drop every shared buffer (tests, or before destroying process groups)."""
    _BUFFERS.clear()
    _PLAIN_GATHER_LOGGED.clear()
