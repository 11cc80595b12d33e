"""The torch HybridEP buffer's handle: what its dispatch hands to the combine (and to a dispatch
that reuses the layout), how one is put together (`_handle`), an exact-rows dispatch's send plan
(`_SendPlan`), and the width of the probs a handle's rows carry (`_probs_width`,
`_probs_row_bytes`). Used by `torch_buffer.py` and `torch_combine.py`.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class HybridEPHandle(NamedTuple):
    """What combine (and a dispatch that reuses a layout) needs from a dispatch.

    Index 10 is the overflow flag, as in deep_ep's handle (Megatron reads it by position).
    """

    row_slot: torch.Tensor  # [capacity] int64: receive slot of each output row (num_slots = zero row)
    row_prob_index: torch.Tensor  # [capacity] int64: each row's place in the flat [num_slots + 1, L] probs
    num_slots: int  # receive slots: exact received tokens (blocking) or W * T (non-blocking)
    send_token: Optional[torch.Tensor]  # blocking: [S] int64 token of each sent row, by destination
    send_dest: Optional[torch.Tensor]  # blocking: [S] int64 destination rank of each sent row
    send_splits: Optional[tuple[int, ...]]  # blocking: rows sent to each rank
    recv_splits: Optional[tuple[int, ...]]  # blocking: rows received from each rank
    num_tokens: int  # T, tokens per rank at dispatch
    capacity: int  # output rows: the capacity asked for, or (blocking without one) the exact padded total
    non_blocking: bool
    overflow_flag: torch.Tensor  # [1] int32; written in both modes, 0 unless truncated
    tokens_per_expert: torch.Tensor  # [L] int64 padded counts, truncated to the capacity
    pad_multiple: Optional[int]
    real_rows: torch.Tensor  # [1] int64: sum(tokens_per_expert), the rows that exist (<= capacity), on the device
    slot_rows: Optional[torch.Tensor]  # fused kernels only: [num_slots, L] int32, row of (slot, expert) or -1
    token_rows: Optional[
        torch.Tensor
    ]  # fused kernels only: [T, W] int32, combine's returned row of (token, rank) or -1
    send_counts: Optional[torch.Tensor]  # exact non-blocking only: [W] int64 rows sent to each rank, on the device
    recv_counts: Optional[
        torch.Tensor
    ]  # exact non-blocking only: [W] int64 rows received from each rank, on the device
    # Made by a dispatch with use_fp8=True: a dispatch that reuses it must be one too, as in deep_ep,
    # whose handle carries the kernel configuration (1-byte rows) of the dispatch that made it.
    use_fp8: bool = False


def _handle(
    layout_rows: tuple[torch.Tensor, torch.Tensor],
    counts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    num_slots: int,
    num_tokens: int,
    capacity: int,
    pad_multiple: Optional[int],
    tables: tuple[Optional[torch.Tensor], Optional[torch.Tensor]] = (None, None),
    send: Optional[tuple[torch.Tensor, torch.Tensor, tuple[int, ...], tuple[int, ...]]] = None,
    exact: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> HybridEPHandle:
    """A handle from its parts: `layout_rows` (row_slot, row_prob_index), `counts` (overflow flag,
    tokens_per_expert, real_rows), the fused kernels' `tables` (slot_rows, token_rows), for a
    dispatch that sends exact rows `send` (send_token, send_dest, and, when blocking, send_splits
    and recv_splits), and for a non-blocking one of those `exact` (send_counts, recv_counts)."""
    send_token, send_dest, send_splits, recv_splits = send if send is not None else (None, None, None, None)
    send_counts, recv_counts = exact if exact is not None else (None, None)
    return HybridEPHandle(
        row_slot=layout_rows[0],
        row_prob_index=layout_rows[1],
        num_slots=num_slots,
        send_token=send_token,
        send_dest=send_dest,
        send_splits=send_splits,
        recv_splits=recv_splits,
        num_tokens=num_tokens,
        capacity=capacity,
        non_blocking=send is None or exact is not None,
        overflow_flag=counts[0],
        tokens_per_expert=counts[1],
        pad_multiple=pad_multiple,
        real_rows=counts[2],
        slot_rows=tables[0],
        token_rows=tables[1],
        send_counts=send_counts,
        recv_counts=recv_counts,
    )


class _SendPlan(NamedTuple):
    """A dispatch's exact send plan, made on the device (`TorchHybridEPBuffer._send_plan`)."""

    slot_of_token: torch.Tensor  # [W * T] receive slot of gathered token g (received ones ascending; others none)
    token_rows: torch.Tensor  # [T, W] int32 combine's returned row of (token, rank), or -1: send order
    pairs: torch.Tensor  # [W * T, 2] (rank, token) of each row to send, by rank then token; the real ones first
    send_counts: torch.Tensor  # [W] int64 rows sent to each rank
    recv_counts: torch.Tensor  # [W] int64 rows received from each rank


def _probs_width(num_local: int) -> int:
    """Floats per row of an exact exchange's probs: L, rounded up to whole 32-byte rows (what
    NVSHMEM's all-to-all needs, `exchange.NVSHMEMExchange.row_alignment`)."""
    return -(-num_local // 8) * 8


def _probs_row_bytes(handle: HybridEPHandle, num_local: int) -> int:
    """Bytes of probs one row carries on the wire: L floats, padded on the exact path."""
    return 4 * (_probs_width(num_local) if handle.send_counts is not None else num_local)
