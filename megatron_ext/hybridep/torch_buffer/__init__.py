"""A PyTorch implementation of the part of `deep_ep.HybridEPBuffer` that Megatron-Core uses.

It runs on any torch.distributed process group (NCCL or gloo) and reproduces HybridEP's
permuted dispatch layout, its non-blocking capacity mode and overflow flag, and its combine.

How tokens move (W ranks, T tokens per rank, rank r owns experts [r * L, (r + 1) * L)):

* Both modes all-gather the `[T, E]` Boolean routing maps (HybridEP does too), so every rank
  knows every token's destinations and computes its own layout locally (with compact routing as
  top-k indices, expanded back into the same maps: `allgather.py`).
* Blocking (`num_permuted_tokens=None`): one host read of a few counts, then an exact
  all-to-all: each token travels once to each rank that owns one of its experts, with the
  float32 probs of that rank's experts beside it.
* Non-blocking (`num_permuted_tokens=capacity`): no count reaches the host. On the group's
  collectives every collective then needs a shape the host already knows: hidden states are
  all-gathered (W x T rows received per rank instead of the exact T x k_r, k_r the mean number of
  ranks a token goes to) and the probs of each rank's own experts travel in equal all-to-all slabs
  (W x T x L floats per rank). Through an exchange that takes its counts on the device (NVSHMEM,
  `exchange.py`; the `transport` argument) the blocking plan runs instead, exact rows and all. The
  output has `capacity` rows; experts past them are truncated last expert first and flagged in
  the handle.
* Combine reduces each token's rows on the expert's rank first (float32, in expert order),
  sends one partial per (token, rank) back, and sums the partials in rank order (float32).
  Both modes add the same numbers in the same order, so their results are bitwise equal.
* On a GPU the layout, the permute and the combine are Triton kernels (`megatron_ext.fused`): the
  layout and the tables combine reads come from two launches; the permute gathers the existing
  rows (their count read on the device), a padding row reading as zeros; the combine gathers each
  token's rows by a [slots, L] table. Rows past the padded total (a capacity's spare rows) are
  left unwritten, as deep_ep leaves them; on CPU they are zero. One rank exchanges nothing.

This module holds the buffer's constructor, its dispatch (plan, layout, row moves), its
collectives and its combine's entry; the rest lives beside it in this package: the handle
(`handle.py`), the argument checks (`checks.py`) and the combine's row sums and moves
(`combine.py`), the last two inherited by `TorchHybridEPBuffer`; where each routed token lands
(`layout.py`), the routing-map all-gather (`allgather.py`) and the exchanges that take their counts
on the device (`exchange.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_ext import fused
from megatron_ext.hybridep.torch_buffer.allgather import RoutingMapGather
from megatron_ext.hybridep.torch_buffer.checks import (  # noqa: F401 (re-exported: the row dtypes, defined here before)
    FP8_HIDDEN_DTYPES,
    SUPPORTED_HIDDEN_DTYPES,
    TorchBufferChecks,
    _check,
)
from megatron_ext.hybridep.torch_buffer.combine import (  # noqa: F401 (re-exported: PADDING_SPREAD, defined here before)
    PADDING_SPREAD,
    TorchBufferCombine,
)
from megatron_ext.hybridep.torch_buffer.exchange import DeviceSplitsExchange, choose_exchange
from megatron_ext.hybridep.torch_buffer.handle import (  # noqa: F401 (re-exported: hybridep/__init__.py, handle.py)
    HybridEPHandle,
    _handle,
    _probs_row_bytes,
    _probs_width,
    _SendPlan,
)
from megatron_ext.hybridep.torch_buffer.layout import expert_layout, padded_counts, round_up
from megatron_ext.options import TRANSPORTS


@dataclass(frozen=True)
class Traffic:
    """Bytes this rank put on the wire to other ranks in one call (self-copies excluded)."""

    routing_map: int = 0
    hidden: int = 0
    probs: int = 0

    @property
    def total(self) -> int:
        return self.routing_map + self.hidden + self.probs


def _traffic(map_bytes: int, rows: int | torch.Tensor, row_bytes: int, probs_row_bytes: int) -> Traffic:
    rows = int(rows)  # a device count (a non-blocking dispatch that sent exact rows) is read here
    return Traffic(map_bytes, rows * row_bytes, rows * probs_row_bytes)


def _gather_or_zero(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`src[index]`, an index of `len(src)` (a padding row's slot) reading zeros: the torch path's
    gather (the fused one reads no zero row)."""
    return torch.cat([src, src.new_zeros(1, *src.shape[1:])])[index]


class TorchHybridEPBuffer(TorchBufferCombine, TorchBufferChecks):
    """`deep_ep.HybridEPBuffer` on torch.distributed.

    It satisfies `megatron_ext.hybridep.protocol.HybridEPBuffer` structurally (the calls
    megatron-ext makes on any HybridEP buffer, keyword-only as in DeepEP), and takes the rest of
    deep_ep's `dispatch_with_permute` keywords too.

    The constructor takes deep_ep's arguments; the kernel-tuning ones (`num_sms_*`,
    `num_blocks_*`, `load_cached_kernels`, `use_shared_buffer`) and `use_fp8` have no meaning here
    and are accepted for compatibility (any buffer takes fp8 dispatches).
    `enable_custom_allgather=True` or `reuse_allgather_buffer=True` gathers routing maps into one
    buffer per process group instead of a fresh tensor each time.
    `compact_routing_topk=k` gathers them as `[T, k]` expert indices and expands them back (every
    token routed to at most k experts, asserted on the device): `megatron_ext.hybridep.torch_buffer.allgather`.

    `dispatch_with_permute` and `combine_with_unpermute` are plain (non-differentiable) calls, as
    in deep_ep; `megatron_ext.hybridep.autograd` wraps them for autograd.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        hidden_dim: int,
        max_num_of_tokens_per_rank: int,
        num_local_experts: int,
        use_fp8: bool = False,
        num_sms_dispatch_api: Optional[int] = None,
        num_sms_combine_api: Optional[int] = None,
        num_sms_preprocessing_api: Optional[int] = None,
        num_blocks_permute: Optional[int] = None,
        num_blocks_unpermute: Optional[int] = None,
        load_cached_kernels: bool = False,
        use_shared_buffer: bool = True,
        enable_custom_allgather: bool = False,
        *,
        reuse_allgather_buffer: bool = False,
        transport: str | DeviceSplitsExchange = "auto",
        compact_routing_topk: Optional[int] = None,
    ):
        _check(group is not None, "group", "a torch.distributed ProcessGroup", group)
        _check(isinstance(hidden_dim, int) and hidden_dim > 0, "hidden_dim", "a positive int", hidden_dim)
        _check(
            isinstance(max_num_of_tokens_per_rank, int) and max_num_of_tokens_per_rank >= 0,
            "max_num_of_tokens_per_rank",
            "a non-negative int",
            max_num_of_tokens_per_rank,
        )
        _check(
            isinstance(num_local_experts, int) and num_local_experts > 0,
            "num_local_experts",
            "a positive int",
            num_local_experts,
        )
        _check(isinstance(use_fp8, bool), "use_fp8", "a bool (fp8 dispatches need no setting here)", use_fp8)
        _check(
            transport in TRANSPORTS or hasattr(transport, "exchange"),
            "transport",
            f"one of {', '.join(TRANSPORTS)}",
            transport,
        )
        num_experts = group.size() * num_local_experts
        _check(
            compact_routing_topk is None
            or (isinstance(compact_routing_topk, int) and 1 <= compact_routing_topk <= num_experts),
            "compact_routing_topk",
            f"None or an int from 1 to the number of experts ({num_experts})",
            compact_routing_topk,
        )
        self.group = group
        self.world_size = group.size()
        self.rank = group.rank()
        self.hidden_dim = hidden_dim
        self.max_num_of_tokens_per_rank = max_num_of_tokens_per_rank
        self.num_local_experts = num_local_experts
        self.routing_map_gather = RoutingMapGather(
            group, reuse=reuse_allgather_buffer or enable_custom_allgather, topk=compact_routing_topk
        )
        self._transport = transport
        self._splits_exchange: Optional[DeviceSplitsExchange] = None
        self._exchange_chosen = False
        # (routing-map bytes, rows sent to other ranks (an int, or a device count), bytes per
        # hidden row, bytes of probs per row) of the last dispatch and combine: `last_*_traffic`.
        self._dispatch_traffic: tuple = (0, 0, 0, 0)
        self._combine_traffic: tuple = (0, 0, 0, 0)
        self._returned_rows_cache: dict = {}

    @property
    def last_dispatch_traffic(self) -> Traffic:
        """Bytes the last dispatch sent to other ranks. After a non-blocking dispatch that sent
        exact rows, reading this reads their count on the host."""
        return _traffic(*self._dispatch_traffic)

    @property
    def last_combine_traffic(self) -> Traffic:
        """Bytes the last combine sent to other ranks (as `last_dispatch_traffic`)."""
        return _traffic(*self._combine_traffic)

    @property
    def non_blocking_transport(self) -> str:
        """How non-blocking dispatches have moved tokens: 'process_group' (the all-gather; also
        before the first), or the name of the exchange that sends exact rows ('nvshmem')."""
        return "process_group" if self._splits_exchange is None else self._splits_exchange.name

    @property
    def symmetric_memory_bytes(self) -> int:
        """Bytes of symmetric (NVSHMEM) buffers this buffer's exact non-blocking path holds."""
        return 0 if self._splits_exchange is None else self._splits_exchange.memory_bytes

    def _device_splits_exchange(
        self, t: torch.Tensor, row_bytes: int, non_blocking: bool
    ) -> Optional[DeviceSplitsExchange]:
        """The exchange a non-blocking dispatch of tensors like `t`, hidden rows of `row_bytes`,
        sends exact rows through, or None (the all-gather; and for a blocking dispatch). Chosen at
        the buffer's first dispatch of either kind, a collective with a host read: a layer's first
        dispatch is its blocking calibration, so no non-blocking step pays for it. A later
        dispatch's rows must suit the exchange chosen."""
        if self.world_size == 1 or not fused.enabled_for(t):
            _check(
                self._transport != "nvshmem" or self.world_size == 1,
                "transport",
                "'auto' or 'process_group' for CPU tensors ('nvshmem' moves CUDA tensors)",
                self._transport,
            )
            return None
        if not self._exchange_chosen:
            self._splits_exchange = choose_exchange(self.group, self._transport, row_bytes)
            self._exchange_chosen = True
        exchange = self._splits_exchange if non_blocking else None
        if exchange is not None:
            alignment = getattr(exchange, "row_alignment", 1)
            _check(
                row_bytes % alignment == 0,
                "hidden",
                f"rows of a multiple of {alignment} bytes for the {exchange.name} transport chosen at this "
                "buffer's first non-blocking dispatch",
                f"rows of {row_bytes} bytes",
            )
        return exchange

    # ------------------------------------------------------------------ dispatch

    def dispatch_with_permute(
        self,
        *,
        hidden: torch.Tensor,
        topk_idx: Optional[torch.Tensor] = None,
        topk_weights: Optional[torch.Tensor] = None,
        num_of_experts_per_rank: Optional[int] = None,
        num_of_experts: Optional[int] = None,
        use_fp8: bool = False,
        routing_map: Optional[torch.Tensor] = None,
        probs: Optional[torch.Tensor] = None,
        scaling_factor: Optional[torch.Tensor] = None,
        num_permuted_tokens: Optional[int | torch.Tensor] = None,
        pad_multiple: Optional[int] = None,
        handle: Optional[HybridEPHandle] = None,
        non_blocking: bool = False,
        fuse_permute_dispatch: bool = False,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor, HybridEPHandle]:
        """Send each token to the ranks of its experts, grouped by local expert.

        Args:
            hidden: `[T, H]` bf16/fp16/fp32, this rank's tokens (T equal on every rank); with
                `use_fp8=True` their quantized data, one byte per element (float8_e4m3fn,
                float8_e5m2 or uint8), and `scaling_factor` `[T, S]` float32 their scales (S per
                token: H / 128 for 1 x 128 blocks). Both move as the rows do, bytes unchanged,
                so the rows arrive quantized exactly as their tokens were.
            routing_map: `[T, E]` bool, token t goes to expert e; or give `topk_idx` `[T, K]`
                (with `num_of_experts`) and `topk_weights` `[T, K]` float32.
            probs: `[T, E]` float32 routing probabilities, or None.
            num_of_experts_per_rank: local experts per rank (default: the constructor's).
            num_permuted_tokens: the capacity (DeepEP's name): None for a blocking dispatch (exact
                size, one host read); a host int (a multiple of `pad_multiple`) for exactly that
                many rows, truncated and flagged when too few (also with non_blocking=False, which
                still reads counts on the host). With a handle, the handle's size is used and an
                int must match it; a tensor (stock Megatron passes one) is never read.
            pad_multiple: pad each expert's rows to a multiple of this (None: no padding).
            handle: a handle from an earlier dispatch; reuse its layout (no routing needed).
            non_blocking: True requires `num_permuted_tokens`; nothing is read on the host.

        Returns:
            `(rows [capacity, H], probs [capacity] float32 or None, scaling factors [capacity, S]
            float32 or None (without fp8), tokens_per_expert [L] int64, handle)` where the
            capacity is `num_permuted_tokens`, or the padded total
            (blocking without one); rows past the padded total are zero on CPU and unwritten on a
            GPU. `handle.overflow_flag` (index 10) is 1 when the padded total exceeded the
            capacity and the tail was dropped.
        """
        self._check_hidden(hidden, "hidden", fp8=bool(use_fp8))
        if use_fp8:
            self._check_scaling_factor(scaling_factor, hidden)
        else:
            _check(scaling_factor is None, "scaling_factor", "None without use_fp8=True", scaling_factor)
        map_bytes, row_bytes = 0, hidden.shape[1] * hidden.element_size()
        if use_fp8:
            row_bytes += scaling_factor.shape[1] * scaling_factor.element_size()
        if handle is None:
            routing_map, probs = self._resolve_routing(
                hidden, routing_map, probs, topk_idx, topk_weights, num_of_experts, num_of_experts_per_rank
            )
            capacity = self._check_capacity(num_permuted_tokens, pad_multiple, non_blocking)
            handle = self._plan(routing_map, capacity, pad_multiple, non_blocking, row_bytes)._replace(
                use_fp8=bool(use_fp8)
            )
            map_bytes = self.routing_map_gather.stats.last_bytes_sent
        else:
            self._check_handle(handle, "handle")
            _check(
                bool(use_fp8) == handle.use_fp8,
                "use_fp8",
                f"{handle.use_fp8}, as in the dispatch that made this handle (deep_ep's handle keeps that "
                "dispatch's row type: quantize the rows with use_fp8=True and scaling_factor, or make a new handle)",
                use_fp8,
            )
            _check(
                hidden.shape[0] == handle.num_tokens,
                "hidden",
                f"[{handle.num_tokens}, H] to match the handle",
                hidden,
            )
            if isinstance(num_permuted_tokens, int):
                _check(
                    num_permuted_tokens == handle.capacity,
                    "num_permuted_tokens",
                    f"{handle.capacity} (the handle's) or None when a handle is given",
                    num_permuted_tokens,
                )
            if probs is not None:
                self._check_probs(probs, handle.num_tokens, self.world_size * self.num_local_experts)
        scales = None
        if use_fp8:  # the data as bytes (neither NCCL nor gloo moves fp8), then the scales alike
            rows, row_probs, rows_elsewhere = self._move_rows(hidden.view(torch.uint8), probs, handle)
            rows = rows.view(hidden.dtype)
            scales = self._move_rows(scaling_factor, None, handle, key="scales")[0]
        else:
            rows, row_probs, rows_elsewhere = self._move_rows(hidden, probs, handle)
        self._dispatch_traffic = (
            map_bytes,
            rows_elsewhere,
            row_bytes,
            0 if probs is None else _probs_row_bytes(handle, self.num_local_experts),
        )
        return rows, row_probs, scales, handle.tokens_per_expert, handle

    def _plan(self, routing_map, capacity, pad_multiple, non_blocking, row_bytes) -> HybridEPHandle:
        """Gather the routing maps and compute this rank's layout and send plan."""
        W, L = self.world_size, self.num_local_experts
        num_tokens = routing_map.shape[0]
        global_map = self.routing_map_gather(routing_map)
        local_map = global_map[:, self.rank * L : (self.rank + 1) * L]
        exact = self._device_splits_exchange(routing_map, row_bytes, non_blocking) is not None
        if fused.enabled_for(routing_map):
            return self._plan_fused(routing_map, local_map, capacity, pad_multiple, non_blocking, exact)

        if non_blocking:
            # Receive slot g holds token g, so a row's code g * L + e indexes the probs directly.
            layout = expert_layout(local_map, capacity, pad_multiple)
            return _handle(
                (layout.row_code.div(L, rounding_mode="floor"), layout.row_code),
                (layout.overflow, layout.tokens_per_expert, layout.tokens_per_expert.sum().reshape(1)),
                num_slots=W * num_tokens,
                num_tokens=num_tokens,
                capacity=capacity,
                pad_multiple=pad_multiple,
            )

        # Blocking: the exact layout; one host read of the counts that size the all-to-all.
        received = local_map.any(dim=1)  # [W * T]: token g has at least one expert here
        dest_mask = routing_map.view(num_tokens, W, L).any(dim=2)  # [T, W]
        send_counts = dest_mask.sum(dim=0)
        recv_counts = received.view(W, num_tokens).sum(dim=1)
        counts = padded_counts(local_map, pad_multiple)
        host = torch.cat([send_counts, recv_counts, counts.sum().reshape(1)]).tolist()  # the one host read
        send_splits, recv_splits, padded_total = tuple(host[:W]), tuple(host[W : 2 * W]), host[2 * W]
        # A capacity with non_blocking=False sizes the output as in non-blocking mode (deep_ep
        # would write out of bounds when it is too small): truncated and flagged, never raised
        # here, because a raise on one rank would leave the others waiting in the all-to-all.
        if capacity is None:
            capacity = padded_total  # sized to the rows there are
        num_slots = sum(recv_splits)
        layout = expert_layout(local_map, capacity, pad_multiple, counts)
        # Received tokens sit in ascending g; token N (padding rows) maps to the zero slot.
        slot_of_token = torch.nn.functional.pad(torch.cumsum(received, dim=0) - 1, (0, 1), value=num_slots)
        row_slot = slot_of_token[layout.row_code.div(L, rounding_mode="floor")]
        # Sent rows grouped by destination rank, ascending token index within each.
        pairs = torch.nonzero_static(dest_mask.t(), size=sum(send_splits))
        return _handle(
            (row_slot, row_slot * L + layout.row_code.remainder(L)),
            (layout.overflow, layout.tokens_per_expert, layout.tokens_per_expert.sum().reshape(1)),
            num_slots=num_slots,
            num_tokens=num_tokens,
            capacity=capacity,
            pad_multiple=pad_multiple,
            send=(pairs[:, 1], pairs[:, 0], send_splits, recv_splits),
        )

    def _plan_fused(self, routing_map, local_map, capacity, pad_multiple, non_blocking, exact) -> HybridEPHandle:
        """`_plan` where the fused kernels run: the layout and both row tables in two launches
        (`exact`: a non-blocking dispatch that sends exact rows through the device-splits exchange)."""
        W = self.world_size
        num_tokens = routing_map.shape[0]
        counts = fused.block_counts(local_map)
        send = exact_counts = None  # plans that send exact rows: what to send and (non-blocking) its counts
        if exact:
            # Exact rows, their counts on the device: the blocking plan, with W x T receive slots
            # (the most there can be) instead of the count read on the host.
            plan = self._send_plan(routing_map, local_map)
            num_slots = W * num_tokens
            layout = fused.dispatch_layout(
                local_map, counts, capacity, pad_multiple, num_slots, plan.slot_of_token, spare_slots=True
            )
            token_rows = plan.token_rows
            send = (plan.pairs[:, 1], plan.pairs[:, 0], None, None)
            exact_counts = (plan.send_counts, plan.recv_counts)
        elif non_blocking:
            num_slots = W * num_tokens
            layout = fused.dispatch_layout(local_map, counts, capacity, pad_multiple, num_slots)
            token_rows = self._returned_rows(num_tokens, routing_map.device)
        else:
            # Blocking. Whatever the host read does not size is launched before it, so that once the
            # counts arrive (the GPU idle by then) only the layout and the moves are left to launch.
            plan = self._send_plan(routing_map, local_map)
            padded_total = round_up(counts.sum(dim=0, dtype=torch.int64), pad_multiple).sum().reshape(1)
            host = torch.cat([plan.send_counts, plan.recv_counts, padded_total]).tolist()
            send_splits, recv_splits = tuple(host[:W]), tuple(host[W : 2 * W])
            if capacity is None:  # as in `_plan`: a given capacity truncates and flags
                capacity = host[2 * W]
            num_slots, num_sent = sum(recv_splits), sum(send_splits)
            layout = fused.dispatch_layout(local_map, counts, capacity, pad_multiple, num_slots, plan.slot_of_token)
            token_rows = plan.token_rows
            send = (plan.pairs[:num_sent, 1], plan.pairs[:num_sent, 0], send_splits, recv_splits)
        return _handle(
            (layout.row_slot, layout.row_code),
            (layout.overflow, layout.tokens_per_expert, layout.real_rows),
            num_slots=num_slots,
            num_tokens=num_tokens,
            capacity=capacity,
            pad_multiple=pad_multiple,
            tables=(layout.slot_rows, token_rows),
            send=send,
            exact=exact_counts,
        )

    def _send_plan(self, routing_map, local_map) -> _SendPlan:
        """What a dispatch that sends exact rows knows before any count reaches the host."""
        W, L = self.world_size, self.num_local_experts
        num_tokens = routing_map.shape[0]
        received = local_map.any(dim=1)  # [W * T]: token g has at least one expert here
        by_dest = routing_map.view(num_tokens, W, L).any(dim=2).t()  # [W, T]: token t goes to rank w
        sent = by_dest.reshape(-1)
        send_order = torch.cumsum(sent, dim=0, dtype=torch.int32) - 1
        return _SendPlan(
            slot_of_token=torch.cumsum(received, dim=0) - 1,
            token_rows=torch.where(sent, send_order, -1).view(W, num_tokens).t().contiguous(),
            pairs=torch.nonzero_static(by_dest, size=W * num_tokens),
            send_counts=by_dest.sum(dim=1),
            recv_counts=received.view(W, num_tokens).sum(dim=1),
        )

    def _move_rows(self, hidden, probs, handle: HybridEPHandle, key: str = "rows"):
        """Bring the rows of `handle`'s layout to this rank and place them; a padding row (a slot
        past the received ones) reads as zeros. Returns (rows, probs, rows sent to other ranks).
        `key` names the exact exchange's buffers of this payload (an fp8 dispatch's scales have
        their own)."""
        W, L, T = self.world_size, self.num_local_experts, handle.num_tokens
        if handle.send_counts is not None:
            return self._move_exact_rows(hidden, probs, handle, key)
        fused_kernels = handle.slot_rows is not None
        if handle.non_blocking:
            received = self._all_gather(hidden)
            rows_elsewhere = (W - 1) * T
        else:
            received = self._exchange(hidden[handle.send_token], handle.recv_splits, handle.send_splits)
            rows_elsewhere = self._sent_elsewhere(handle.send_splits)
        table = None
        if probs is not None:
            per_rank = probs.view(T, W, L)
            if handle.non_blocking:
                table = self._exchange(per_rank.transpose(0, 1).reshape(W * T, L))
            else:
                sent = per_rank[handle.send_token, handle.send_dest]
                table = self._exchange(sent, handle.recv_splits, handle.send_splits)
        if not fused_kernels:
            rows = _gather_or_zero(received, handle.row_slot)
            row_probs = None if table is None else _gather_or_zero(table.reshape(-1), handle.row_prob_index)
            return rows, row_probs, rows_elsewhere
        # The existing rows only (those past them unwritten), and the probs in the same launch.
        if table is None:
            return fused.gather_rows(received, handle.row_slot, handle.real_rows), None, rows_elsewhere
        rows, row_probs = fused.gather_rows_and_values(
            received, handle.row_slot, handle.real_rows, table, handle.row_prob_index
        )
        return rows, row_probs, rows_elsewhere

    def _move_exact_rows(self, hidden, probs, handle: HybridEPHandle, key: str = "rows"):
        """`_move_rows` for a non-blocking dispatch that sends exact rows: each token once to each
        rank of its experts, packed by rank into the exchange's send buffer, the counts on the
        device; received rows land by source rank, which is the order of the receive slots."""
        W, L, T = self.world_size, self.num_local_experts, handle.num_tokens
        exchange, slots = self._splits_exchange, W * T
        exchange.barrier()
        send, recv = exchange.buffers(key, slots, hidden.shape[1], hidden.dtype, hidden.device)
        num_sent = handle.send_counts.sum().reshape(1)
        fused.gather_rows(hidden, handle.send_token, num_sent, out=send)
        exchange.exchange(key, handle.send_counts)
        sent_elsewhere = num_sent[0] - handle.send_counts[self.rank]
        if probs is None:
            return fused.gather_rows(recv[:slots], handle.row_slot, handle.real_rows), None, sent_elsewhere
        send_probs, recv_probs = exchange.buffers("probs", slots, _probs_width(L), torch.float32, hidden.device)
        # Row t * W + w of the [T * W, L] view holds token t's probs for rank w's experts.
        fused.gather_rows(
            probs.view(T * W, L), handle.send_token * W + handle.send_dest, num_sent, out=send_probs[:, :L]
        )
        exchange.exchange("probs", handle.send_counts)
        rows, row_probs = fused.gather_rows_and_values(
            recv[:slots], handle.row_slot, handle.real_rows, recv_probs[:slots, :L], handle.row_prob_index
        )
        return rows, row_probs, sent_elsewhere

    # ------------------------------------------------------------------ combine

    def combine_with_unpermute(
        self,
        *,
        hidden: torch.Tensor,
        probs: Optional[torch.Tensor] = None,
        handle: HybridEPHandle,
        pad_multiple: Optional[int] = None,
        fuse_unpermute_combine: bool = False,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Return each token the unweighted sum of its rows, over every expert and rank.

        Args:
            hidden: `[capacity, H]` rows in the dispatch layout of `handle` (padding rows and rows past
                the padded total are ignored).
            probs: `[capacity]` float32 per-row values (e.g. gradients of dispatched probs), or None.
            handle: the handle of the dispatch that produced the layout.

        Returns:
            `(tokens [T, H] in hidden's dtype, probs [T, E] float32 or None)`.
        """
        self._check_handle(handle, "handle")
        self._check_hidden(hidden, "hidden")
        capacity = handle.capacity
        _check(hidden.shape[0] == capacity, "hidden", f"[{capacity}, H] (the dispatch's rows)", hidden)
        if pad_multiple is not None:
            _check(
                pad_multiple == handle.pad_multiple,
                "pad_multiple",
                f"{handle.pad_multiple} (the dispatch's)",
                pad_multiple,
            )
        if probs is not None:
            _check(
                probs.dtype == torch.float32 and tuple(probs.shape) == (capacity,),
                "probs",
                f"a float32 tensor of shape [{capacity}]",
                probs,
            )
        tokens, token_probs, rows_elsewhere = self._combine_rows(hidden, probs, handle)
        self._combine_traffic = (
            0,
            rows_elsewhere,
            hidden.shape[1] * hidden.element_size(),
            0 if probs is None else _probs_row_bytes(handle, self.num_local_experts),
        )
        return tokens, token_probs

    # ------------------------------------------------------------------ helpers

    def _exchange(
        self, inp: torch.Tensor, out_splits: Optional[Sequence[int]] = None, in_splits: Optional[Sequence[int]] = None
    ) -> torch.Tensor:
        """`inp` through an all-to-all (equal slabs without splits) into a new tensor; one rank
        keeps what it has, without a copy (the caller only reads the result)."""
        if self.world_size == 1:
            return inp.contiguous()
        rows = inp.shape[0] if out_splits is None else sum(out_splits)
        out = torch.empty(rows, *inp.shape[1:], dtype=inp.dtype, device=inp.device)
        dist.all_to_all_single(
            out,
            inp.contiguous(),
            output_split_sizes=None if out_splits is None else list(out_splits),
            input_split_sizes=None if in_splits is None else list(in_splits),
            group=self.group,
        )
        return out

    def _all_gather(self, inp: torch.Tensor) -> torch.Tensor:
        """Every rank's `inp`, rank order, in a new tensor; one rank keeps its own without a copy."""
        if self.world_size == 1:
            return inp.contiguous()
        out = torch.empty(self.world_size * inp.shape[0], *inp.shape[1:], dtype=inp.dtype, device=inp.device)
        dist.all_gather_into_tensor(out, inp.contiguous(), group=self.group)
        return out

    def _sent_elsewhere(self, splits: Sequence[int]) -> int:
        return sum(splits) - splits[self.rank]
