"""The HybridEP buffer API that megatron-ext drives, as a `typing.Protocol` (for type checkers only).

deep_ep's `HybridEPBuffer` (DeepEP's hybrid-ep branch) and megatron-ext's `TorchHybridEPBuffer`
both satisfy `HybridEPBuffer` structurally: neither inherits from it and nothing checks it at run
time. It lists only what megatron-ext calls on a buffer (`megatron_ext.hybridep.autograd`, the
dispatcher through it, `megatron_ext.tooling.roundtrip`), with DeepEP's keyword-only signatures
and DeepEP's names. `num_permuted_tokens` is DeepEP's name for what megatron-ext's own code calls
the capacity of a dispatch: the number of rows its output has.

Shapes below: T tokens on this rank (the same on every rank of the buffer's group), H the hidden
size, W ranks, L local experts per rank, E = W x L experts, and R the output rows of a dispatch:
its capacity (`num_permuted_tokens`) when given, else (a blocking dispatch) the exact number of
rows the routing produces on this rank, each expert's padded to a multiple of `pad_multiple`.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch

type Handle = Any
"""What a dispatch hands its combine (and a later dispatch that reuses its layout): deep_ep's tuple
or megatron-ext's `HybridEPHandle`. Opaque to callers, but for the one-element overflow flag that
`megatron_ext.hybridep.handle.overflow_flag` finds in either."""

type DispatchOutput = tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor, Handle]
"""`(rows, row_probs, scaling_factor, tokens_per_expert, handle)` of `dispatch_with_permute`."""


class HybridEPBuffer(Protocol):
    """A HybridEP buffer: one process group's dispatch with permute and combine with unpermute.

    Both calls are plain, non-differentiable collectives over the buffer's group (every rank
    calls them alike); `megatron_ext.hybridep.autograd` makes them each other's backward.
    """

    def dispatch_with_permute(
        self,
        *,
        hidden: torch.Tensor,
        routing_map: Optional[torch.Tensor] = None,
        probs: Optional[torch.Tensor] = None,
        num_of_experts_per_rank: Optional[int] = None,
        num_permuted_tokens: Optional[int] = None,
        pad_multiple: Optional[int] = None,
        handle: Optional[Handle] = None,
        non_blocking: bool = False,
    ) -> DispatchOutput:
        """Send each token to the ranks of its experts; return this rank's rows grouped by local expert.

        Args:
            hidden: `[T, H]` bf16 (deep_ep; also fp16/fp32 in the torch buffer), this rank's tokens.
            routing_map: `[T, E]` bool, token t goes to expert e. None with a `handle`.
            probs: `[T, E]` float32 routing probabilities, or None (no `row_probs`).
            num_of_experts_per_rank: L (the buffer's own when None).
            num_permuted_tokens: None for a blocking dispatch (the output is sized exactly, which
                reads a count on the host), or a host int capacity R (a multiple of
                `pad_multiple`): exactly R rows, the tail past R dropped and flagged in the handle.
            pad_multiple: pad each local expert's rows to a multiple of this (None: no padding).
            handle: a handle from an earlier dispatch of this buffer: reuse its layout (the
                backward of a combine); no routing map needed.
            non_blocking: True (requires `num_permuted_tokens`): nothing is read on the host.

        Returns:
            `(rows [R, H] in hidden's dtype, row_probs [R] float32 or None, scaling_factor (None
            without fp8), tokens_per_expert [L] int64 padded counts on the device, handle)`; rows
            past the padded total (a capacity's spare rows) hold no token.
        """
        ...

    def combine_with_unpermute(
        self,
        *,
        hidden: torch.Tensor,
        probs: Optional[torch.Tensor] = None,
        handle: Handle,
        pad_multiple: Optional[int] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Return each token the unweighted sum of its rows, over every expert and rank.

        Args:
            hidden: `[R, H]` rows in the layout of `handle`'s dispatch.
            probs: `[R]` float32 per-row values (e.g. gradients of the dispatched probs), or None.
            handle: the handle of the dispatch that made the layout.
            pad_multiple: the dispatch's `pad_multiple`.

        Returns:
            `(tokens [T, H] in hidden's dtype, probs [T, E] float32 or None)`.
        """
        ...
