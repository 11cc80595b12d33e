"""The fused dispatch layout: `block_counts` and `dispatch_layout`, a dispatch's whole layout (see
`hybridep/torch_buffer/layout.py`) and the row tables the gathers and sums read (`Layout`), in two launches,
with no host read.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from megatron_ext.fused.common import _cdiv, _next_pow2, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _block_counts_kernel(map_ptr, out_ptr, N, stride, L: tl.constexpr, L_P2: tl.constexpr, BLOCK_N: tl.constexpr):
        # out[b, e]: how many of tokens [b * BLOCK_N, (b + 1) * BLOCK_N) the map routes to expert e.
        b = tl.program_id(0)
        tokens = b * BLOCK_N + tl.arange(0, BLOCK_N)
        experts = tl.arange(0, L_P2)
        mask = (tokens < N)[:, None] & (experts < L)[None, :]
        routed = tl.load(map_ptr + tokens[:, None].to(tl.int64) * stride + experts[None, :], mask=mask, other=0)
        tl.store(out_ptr + b * L + experts, tl.sum(routed.to(tl.int32), axis=0), mask=experts < L)

    @triton.jit
    def _layout_kernel(
        map_ptr,
        stride,
        block_counts_ptr,
        slot_of_token_ptr,
        row_slot_ptr,
        row_code_ptr,
        slot_rows_ptr,
        tokens_per_expert_ptr,
        overflow_ptr,
        real_rows_ptr,
        N,
        capacity,
        num_slots,
        pad,
        num_blocks,
        L: tl.constexpr,
        L_P2: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_S: tl.constexpr,
        HAS_SLOTS: tl.constexpr,
    ):
        b = tl.program_id(0)
        experts = tl.arange(0, L_P2)
        is_expert = experts < L
        # Every program sums the block counts: over all blocks (the experts' totals, hence the
        # segments) and over the blocks before its own (its tokens' offsets in their segments).
        counts = tl.zeros((L_P2,), dtype=tl.int64)
        earlier = tl.zeros((L_P2,), dtype=tl.int64)
        start = 0
        while start < num_blocks:
            blocks = start + tl.arange(0, BLOCK_B)
            part = tl.load(
                block_counts_ptr + blocks[:, None] * L + experts[None, :],
                mask=(blocks < num_blocks)[:, None] & is_expert[None, :],
                other=0,
            ).to(tl.int64)
            counts += tl.sum(part, axis=0)
            earlier += tl.sum(tl.where((blocks < b)[:, None], part, 0), axis=0)
            start += BLOCK_B
        padded = (counts + pad - 1) // pad * pad
        ends = tl.cumsum(padded, axis=0)
        starts = ends - padded
        total = tl.sum(padded, axis=0)
        # Rows of this block's routed pairs: segment start + tokens of the expert in earlier blocks
        # + rank within the block (ascending token index).
        tokens = b * BLOCK_N + tl.arange(0, BLOCK_N)
        is_token = tokens < N
        in_map = is_token[:, None] & is_expert[None, :]
        routed = tl.load(map_ptr + tokens[:, None].to(tl.int64) * stride + experts[None, :], mask=in_map, other=0)
        routed = routed.to(tl.int32)
        rank = tl.cumsum(routed, axis=0) - routed
        rows = (starts + earlier)[None, :] + rank.to(tl.int64)
        kept = (routed != 0) & in_map & (rows < capacity)
        if HAS_SLOTS:
            slot = tl.load(slot_of_token_ptr + tokens, mask=is_token, other=0).to(tl.int64)
            has_slot = tl.max(routed, axis=1) > 0
        else:
            slot = tokens.to(tl.int64)
            has_slot = is_token
        code = slot[:, None] * L + experts[None, :]
        tl.store(row_slot_ptr + rows, slot[:, None] + 0 * rows, mask=kept)
        tl.store(row_code_ptr + rows, code, mask=kept)
        tl.store(slot_rows_ptr + code, tl.where(kept, rows, -1).to(tl.int32), mask=in_map & has_slot[:, None])
        # Padding rows (each expert's last segment rows past its tokens) and spare rows past the
        # padded total point at slot `num_slots`, which holds no token.
        padding_start = starts + counts
        j = b
        while j < pad:
            at = padding_start + j
            fill = is_expert & (at < ends) & (at < capacity)
            tl.store(row_slot_ptr + at, num_slots + 0 * at, mask=fill)
            tl.store(row_code_ptr + at, num_slots * L + 0 * at, mask=fill)
            j += num_blocks
        spare = total + b * BLOCK_S
        while spare < capacity:
            at = spare + tl.arange(0, BLOCK_S)
            fill = at < capacity
            tl.store(row_slot_ptr + at, num_slots + 0 * at, mask=fill)
            tl.store(row_code_ptr + at, num_slots * L + 0 * at, mask=fill)
            spare += num_blocks * BLOCK_S
        if b == 0:
            tl.store(
                tokens_per_expert_ptr + experts,
                tl.minimum(ends, capacity) - tl.minimum(starts, capacity),
                mask=is_expert,
            )
            tl.store(overflow_ptr, (total > capacity).to(tl.int32))
            tl.store(real_rows_ptr, tl.minimum(total, capacity))


class Layout(NamedTuple):
    """One rank's dispatch layout, made on the device by `dispatch_layout` (see hybridep/torch_buffer/layout.py).

    row_slot: `[capacity]` int64, the receive slot of each row (`num_slots` for padding and spare rows).
    row_code: `[capacity]` int64, `slot * L + e` of each row (`num_slots * L` for padding and spare rows).
    slot_rows: `[num_slots, L]` int32, the row of (slot, expert), -1 where none.
    tokens_per_expert: `[L]` int64, padded counts truncated to the capacity.
    overflow: `[1]` int32, 1 when the padded total exceeds the capacity.
    real_rows: `[1]` int64, min(padded total, capacity).
    """

    row_slot: torch.Tensor
    row_code: torch.Tensor
    slot_rows: torch.Tensor
    tokens_per_expert: torch.Tensor
    overflow: torch.Tensor
    real_rows: torch.Tensor


def _map_bytes(local_map: torch.Tensor) -> tuple[torch.Tensor, int]:
    if local_map.dim() != 2 or local_map.dtype is not torch.bool or local_map.stride(1) != 1:
        raise ValueError(f"fused: the routing map must be a [N, L] bool tensor of unit column stride; got {local_map}")
    return local_map.view(torch.uint8), local_map.stride(0)


def _token_block(num_local: int) -> int:
    return max(16, min(256, 4096 // _next_pow2(num_local)))


def block_counts(local_map: torch.Tensor) -> torch.Tensor:
    """`[blocks, L]` int32: the routed tokens of each local expert per block of `_token_block(L)`
    tokens (one launch); `.sum(dim=0)` gives each expert's total.

    Args:
        local_map: `[N, L]` bool, rows of any stride, columns contiguous (a column slice of the
            gathered `[N, E]` map is taken as it is).
    """
    data, stride = _map_bytes(local_map)
    num_tokens, num_local = local_map.shape
    block = _token_block(num_local)
    blocks = max(1, _cdiv(num_tokens, block))
    counts = torch.empty(blocks, num_local, dtype=torch.int32, device=local_map.device)
    _block_counts_kernel[(blocks,)](
        data, counts, num_tokens, stride, L=num_local, L_P2=_next_pow2(num_local), BLOCK_N=block
    )
    return counts


def dispatch_layout(
    local_map: torch.Tensor,
    counts: torch.Tensor,
    capacity: int,
    pad_multiple: Optional[int],
    num_slots: int,
    slot_of_token: Optional[torch.Tensor] = None,
    *,
    spare_slots: bool = False,
) -> Layout:
    """The permuted layout of `hybridep.torch_buffer.layout.expert_layout`, with the row tables a fused
    dispatch and combine read, in one launch after `block_counts` (two in all).

    Args:
        local_map: the map `counts` came from. capacity: output rows (host int).
        num_slots: receive slots; slot of token g: g (`slot_of_token` None), or `slot_of_token[g]`
            for the tokens that have a local expert (the others get no slot).
        spare_slots: True when `num_slots` is a bound that the tokens' slots may not fill: the slot
            table's rows of slots no token takes are then -1 too (one more launch).
    """
    data, stride = _map_bytes(local_map)
    num_tokens, num_local = local_map.shape
    device = local_map.device
    row_slot = torch.empty(capacity, dtype=torch.int64, device=device)
    row_code = torch.empty(capacity, dtype=torch.int64, device=device)
    if spare_slots:
        slot_rows = torch.full((num_slots, num_local), -1, dtype=torch.int32, device=device)
    else:
        slot_rows = torch.empty(num_slots, num_local, dtype=torch.int32, device=device)
    tokens_per_expert = torch.empty(num_local, dtype=torch.int64, device=device)
    overflow = torch.empty(1, dtype=torch.int32, device=device)
    real_rows = torch.empty(1, dtype=torch.int64, device=device)
    blocks = counts.shape[0]
    _layout_kernel[(blocks,)](
        data,
        stride,
        counts,
        slot_of_token if slot_of_token is not None else row_slot,  # not read without slots
        row_slot,
        row_code,
        slot_rows,
        tokens_per_expert,
        overflow,
        real_rows,
        num_tokens,
        capacity,
        num_slots,
        pad_multiple or 1,
        blocks,
        L=num_local,
        L_P2=_next_pow2(num_local),
        BLOCK_N=_token_block(num_local),
        BLOCK_B=max(1, 4096 // _next_pow2(num_local)),
        BLOCK_S=1024,
        HAS_SLOTS=slot_of_token is not None,
    )
    return Layout(row_slot, row_code, slot_rows, tokens_per_expert, overflow, real_rows)
