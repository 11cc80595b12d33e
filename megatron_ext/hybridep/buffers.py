"""One HybridEP buffer per process group and implementation, shared by every MoE layer on it.

Megatron keeps one process-global HybridEP buffer; megatron-ext keeps one per (implementation,
group, local experts, reuse), created on the first dispatch that needs it and replaced only when
a dispatch brings a wider hidden size or more tokens per rank than it was built for.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from megatron_ext.hybridep.torch_buffer import TorchHybridEPBuffer

logger = logging.getLogger("megatron_ext")

# key -> (buffer, hidden_dim, tokens per rank it was built for)
_BUFFERS: dict[tuple, tuple[Any, int, int]] = {}


def get_buffer(
    implementation: str,
    group: dist.ProcessGroup,
    *,
    hidden_dim: int,
    num_tokens: int,
    num_local_experts: int,
    reuse_allgather_buffer: bool,
) -> Any:
    """The shared buffer for these arguments (`implementation` is 'torch' or 'deep_ep')."""
    key = (implementation, group, num_local_experts, reuse_allgather_buffer)
    cached = _BUFFERS.get(key)
    if cached is not None and cached[1] == hidden_dim and cached[2] >= num_tokens:
        return cached[0]
    if implementation == "torch":
        buffer = TorchHybridEPBuffer(
            group, hidden_dim, num_tokens, num_local_experts, reuse_allgather_buffer=reuse_allgather_buffer
        )
    elif implementation == "deep_ep":
        from megatron_ext.hybridep.deep_ep_buffer import create_deep_ep_buffer

        buffer = create_deep_ep_buffer(
            group, hidden_dim, num_tokens, num_local_experts, reuse_allgather_buffer=reuse_allgather_buffer
        )
    else:
        raise ValueError(f"HybridEP implementation must be 'torch' or 'deep_ep'; got {implementation!r}.")
    logger.info(
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
