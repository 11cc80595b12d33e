"""The torch HybridEP buffer's combine rows: `TorchBufferCombine._combine_rows`, which sums each
token's rows over every expert and rank (on the expert's rank first, in float32, then in rank
order on the token's), on the process group's collectives or through the exact-rows exchange
(`_combine_exact_rows`), where a non-blocking combine's partials come back (`_returned_rows`),
and the torch path's row sums (`_accumulate`, padding rows spread over `PADDING_SPREAD`
discarded slots). `TorchHybridEPBuffer` inherits it; its `combine_with_unpermute` calls it.
"""

from __future__ import annotations

import torch

from megatron_ext import fused
from megatron_ext.hybridep.torch_buffer.handle import HybridEPHandle, _probs_width


def _probs_per_slot(probs: torch.Tensor, handle: HybridEPHandle, num_local: int) -> torch.Tensor:
    """`[num_slots, L]` float32: each row's value at its (slot, expert); zero where no row is."""
    table = torch.zeros(handle.num_slots + 1, num_local, dtype=torch.float32, device=probs.device)
    table.view(-1).index_put_((handle.row_prob_index,), probs)
    return table[: handle.num_slots]


# Padding rows all point at one zero slot. Accumulating thousands of rows into one slot serialises
# CUDA's deterministic index_put_ (measured on the H200: 2.8 ms instead of ~0.05 ms per combine at
# 8192 padding rows), so a combine spreads them over this many discarded slots instead.
PADDING_SPREAD = 1024


def _spread_padding(row_slot: torch.Tensor, num_slots: int) -> torch.Tensor:
    """`row_slot` with padding rows (slot `num_slots`) sent to slots num_slots .. num_slots + PADDING_SPREAD - 1."""
    spread = torch.arange(row_slot.numel(), device=row_slot.device).remainder_(PADDING_SPREAD).add_(num_slots)
    return torch.where(row_slot == num_slots, spread, row_slot)


def _accumulate(out: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """out[index[i]] += rows[i], adding each slot's rows in their order (deterministic)."""
    return out.index_put_((index,), rows.to(out.dtype), accumulate=True)


class TorchBufferCombine:
    """The combine rows of `TorchHybridEPBuffer` (it inherits them; the methods use the buffer's
    collectives `_exchange` and `_sent_elsewhere`, its exchange `_splits_exchange`, and its checks)."""

    def _returned_rows(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        """`[T, W]` int32 `w * T + t`: where a non-blocking combine's partial of token t from rank w
        comes back. The same for every dispatch of a token count: made once."""
        key = (num_tokens, device)
        table = self._returned_rows_cache.get(key)
        if table is None:
            W = self.world_size
            table = (torch.arange(W, device=device) * num_tokens + torch.arange(num_tokens, device=device)[:, None]).to(
                torch.int32
            )
            self._returned_rows_cache = {key: table}
        return table

    def _combine_rows(self, hidden, probs, handle: HybridEPHandle):
        """Sum each token's rows and bring the sums (and probs) back to the token's rank.
        Returns (tokens, probs, rows sent to other ranks).

        1. On the expert's rank: one float32 partial per received token, experts in order. The
        fused kernel gathers each token's rows (only the rows that exist are read); the torch path
        accumulates every row, padding rows into discarded slots.
        2. Partials back to their source ranks; 3. summed there in rank order, in float32 (by a
        gather per token where the fused kernels run, else by accumulation)."""
        if handle.send_counts is not None:
            return self._combine_exact_rows(hidden, probs, handle)
        T, W, L, width = handle.num_tokens, self.world_size, self.num_local_experts, hidden.shape[1]
        fused_kernels = handle.slot_rows is not None
        table = None  # the probs per slot, by local expert
        if fused_kernels and probs is not None:
            partial, table = fused.sum_rows_per_slot_and_values(hidden, handle.slot_rows, hidden.dtype, probs)
        elif fused_kernels:
            partial = fused.sum_rows_per_slot(hidden, handle.slot_rows, hidden.dtype)
        else:
            partial = torch.zeros(handle.num_slots + PADDING_SPREAD, width, dtype=torch.float32, device=hidden.device)
            _accumulate(partial, _spread_padding(handle.row_slot, handle.num_slots), hidden)
            partial = partial[: handle.num_slots].to(hidden.dtype)
        if handle.non_blocking:
            back = self._exchange(partial)
            rows_elsewhere = (W - 1) * T
        else:
            back = self._exchange(partial, handle.send_splits, handle.recv_splits)
            rows_elsewhere = self._sent_elsewhere(handle.recv_splits)
        if handle.non_blocking and W == 1:
            tokens = back  # token t's one partial is row t: a float32 sum of one term is the term
        elif fused_kernels:
            tokens = fused.sum_rows_per_slot(back, handle.token_rows, hidden.dtype)
        else:
            back_token = torch.arange(T, device=hidden.device).repeat(W) if handle.non_blocking else handle.send_token
            out = torch.zeros(T, width, dtype=torch.float32, device=hidden.device)
            tokens = _accumulate(out, back_token, back).to(hidden.dtype)

        token_probs = None
        if probs is not None:
            table = _probs_per_slot(probs, handle, L) if table is None else table
            if handle.non_blocking:
                back_probs = self._exchange(table)
                token_probs = back_probs.view(W, T, L).transpose(0, 1).reshape(T, W * L)
            else:
                back_probs = self._exchange(table, handle.send_splits, handle.recv_splits)
                token_probs = torch.zeros(T, W, L, dtype=torch.float32, device=probs.device)
                token_probs[handle.send_token, handle.send_dest] = back_probs
                token_probs = token_probs.view(T, W * L)
        return tokens, token_probs, rows_elsewhere

    def _combine_exact_rows(self, hidden, probs, handle: HybridEPHandle):
        """combine for a dispatch that sent exact rows: the partials of each received token go back
        to their source rank in slot order (by source, then token), which is each source's send
        order, so `token_rows` finds them; the probs travel alike."""
        W, L, T = self.world_size, self.num_local_experts, handle.num_tokens
        exchange, slots = self._splits_exchange, W * T
        exchange.barrier()
        send, recv = exchange.buffers("rows", slots, hidden.shape[1], hidden.dtype, hidden.device)
        if probs is None:
            fused.sum_rows_per_slot(hidden, handle.slot_rows, hidden.dtype, out=send)
        else:  # the probs by slot into their send buffer in the same launch
            send_probs, recv_probs = exchange.buffers("probs", slots, _probs_width(L), torch.float32, hidden.device)
            fused.sum_rows_per_slot_and_values(
                hidden, handle.slot_rows, hidden.dtype, probs, out=send, values_out=send_probs[:, :L]
            )
        exchange.exchange("rows", handle.recv_counts)
        tokens = fused.sum_rows_per_slot(recv[:slots], handle.token_rows, hidden.dtype)
        token_probs = None
        if probs is not None:
            exchange.exchange("probs", handle.recv_counts)
            returned = handle.token_rows.long()  # [T, W]: row of (token, rank) in send order, or -1
            picked = recv_probs[:slots, :L][returned.clamp(min=0)]  # [T, W, L]
            token_probs = torch.where((returned >= 0).unsqueeze(2), picked, 0.0).view(T, W * L)
        return tokens, token_probs, handle.recv_counts.sum() - handle.recv_counts[self.rank]
