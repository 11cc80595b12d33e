"""The routing-map all-gather, into a fresh tensor or into one buffer per process group.

HybridEP gathers every rank's `[T, E]` Boolean routing map on every dispatch. Allocating the
`[W * T, E]` output each time costs T x W x E bytes per rank per dispatch (16 MiB at T = 8192,
W = 8, E = 256). With reuse, the output lands in storage allocated once per process group and
grown only when a larger shape arrives.

Compact routing (`topk`, `--moe-hybridep-compact-routing`): each rank sends its map as `[T, k]`
expert indices (int16 below 32768 experts, int32 above), T x k x 2 bytes instead of T x E, E / (2k)
times fewer (16x at 256 experts, top-8); a row with fewer than k experts carries the index E,
which expands to nothing. Every rank expands the gathered indices back into the `[W * T, E]` map,
so the layout downstream reads the very map the dense gather gives. A row with more than k experts
cannot be sent this way: a device assert stops it (no host read) rather than drop experts.

Reuse is safe because the dispatch consumes the gathered map (to build its layout) on the
current stream before it returns, nothing keeps a view of it, and the next gather is ordered
after those reads on the same stream. A caller must not keep the returned tensor across
dispatches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_ext.options import COMPACT_ROUTING_FLAG

# One flat Boolean storage per process group, shared by every buffer on that group: the gathered
# map, or under compact routing the map expanded from the indices (plus one element, see `_expand`).
_SHARED_STORAGE: dict[dist.ProcessGroup, torch.Tensor] = {}
# Compact routing's gathered indices: one flat storage per process group and index dtype.
_SHARED_INDICES: dict[tuple[dist.ProcessGroup, torch.dtype], torch.Tensor] = {}


def release_shared_routing_map_buffers() -> None:
    """Free the reused routing-map buffers of every process group."""
    _SHARED_STORAGE.clear()
    _SHARED_INDICES.clear()


def index_dtype(num_experts: int) -> torch.dtype:
    """The dtype compact routing sends expert indices in: int16 holds 0..E (E: the empty slot)
    below 32768 experts."""
    return torch.int16 if num_experts < 2**15 else torch.int32


@dataclass
class GatherStats:
    """What the routing-map gathers of one buffer allocated and sent, for tests and the bench."""

    gathers: int = 0
    allocations: int = 0
    bytes_allocated: int = 0
    last_data_ptr: int = 0
    bytes_sent: int = 0  # routing bytes this rank handed the all-gathers for other ranks, summed
    last_bytes_sent: int = 0  # the same, of the latest gather


class RoutingMapGather:
    """All-gathers `[T, E]` Boolean routing maps of a process group into `[W * T, E]`; with `topk`,
    as `[T, topk]` expert indices (compact routing, see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup, reuse: bool, topk: Optional[int] = None):
        self.group = group
        self.world_size = group.size()
        self.reuse = reuse
        self.topk = topk
        self.stats = GatherStats()

    def _buffer(self, shared: dict, key, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """`numel` elements of `dtype`, flat: fresh without reuse; else the storage `shared[key]`,
        allocated once and grown only for a larger size."""
        if not self.reuse:
            self._count_allocation(numel, dtype)
            return torch.empty(numel, dtype=dtype, device=device)
        storage = shared.get(key)
        if storage is None or storage.numel() < numel or storage.device != device:
            storage = torch.empty(numel, dtype=dtype, device=device)
            shared[key] = storage
            self._count_allocation(numel, dtype)
        return storage[:numel]

    def _count_allocation(self, numel: int, dtype: torch.dtype) -> None:
        self.stats.allocations += 1
        self.stats.bytes_allocated += numel * dtype.itemsize

    def __call__(self, routing_map: torch.Tensor) -> torch.Tensor:
        """Gather `routing_map` (`[T, E]` bool, the same shape on every rank) from all ranks.

        Returns `[W * T, E]` bool, contiguous, rank r's rows at `[r * T, (r + 1) * T)`. With reuse,
        the result is overwritten by the next gather on this process group. A group of one rank
        gets its own map back (contiguous), gathered nowhere.
        """
        sent = 0
        if self.world_size == 1:  # one rank: its own map, with neither a copy nor an allocation
            out = routing_map.contiguous()
        elif self.topk is None:
            num_tokens, num_experts = routing_map.shape
            rows = self.world_size * num_tokens
            out = self._buffer(_SHARED_STORAGE, self.group, rows * num_experts, torch.bool, routing_map.device)
            out = out.view(rows, num_experts)
            dist.all_gather_into_tensor(out, routing_map.contiguous(), group=self.group)
            sent = (self.world_size - 1) * routing_map.numel()
        else:
            out, sent = self._gather_compact(routing_map)
        self.stats.gathers += 1
        self.stats.last_data_ptr = out.data_ptr()
        self.stats.bytes_sent += sent
        self.stats.last_bytes_sent = sent
        return out

    def _gather_compact(self, routing_map: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Compact routing's gather: (the expanded `[W * T, E]` map, bytes sent to other ranks).
        Device work only, the same shapes at every call: nothing is read on the host."""
        num_tokens, num_experts = routing_map.shape
        k, device = self.topk, routing_map.device
        # The k largest of a 0/1 row are its experts (in any order), then zeros: the empty slot E.
        present, experts = routing_map.to(torch.uint8).topk(k, dim=1, sorted=False)
        local = torch.where(present.bool(), experts, num_experts).to(index_dtype(num_experts))
        rows = self.world_size * num_tokens
        gathered = self._buffer(_SHARED_INDICES, (self.group, local.dtype), rows * k, local.dtype, device)
        gathered = gathered.view(rows, k)
        # As bytes: neither NCCL nor gloo gathers int16, and a gather moves bytes as they are.
        dist.all_gather_into_tensor(gathered.view(torch.uint8), local.view(torch.uint8), group=self.group)
        # After the gather (every rank has joined it): a row of more than k experts lost some above.
        torch._assert_async(
            routing_map.sum(dim=1).le(k).all(),
            f"megatron-ext: {COMPACT_ROUTING_FLAG} sends at most {k} experts per token (--moe-router-topk), and "
            "a token's routing map has more set; it would lose experts. Drop the flag for such routing.",
        )
        return self._expand(gathered, num_experts), (self.world_size - 1) * local.numel() * local.element_size()

    def _expand(self, gathered: torch.Tensor, num_experts: int) -> torch.Tensor:
        """`[rows, k]` expert indices (E: none) -> `[rows, E]` bool. The flat storage has one element
        past the map, where every empty slot writes (and nothing reads), so no slot needs a branch."""
        rows = gathered.shape[0]
        numel = rows * num_experts
        flat = self._buffer(_SHARED_STORAGE, self.group, numel + 1, torch.bool, gathered.device).zero_()
        row_start = torch.arange(0, numel, num_experts, device=gathered.device).unsqueeze(1)
        position = torch.where(gathered == num_experts, numel, gathered + row_start)
        flat.index_fill_(0, position.view(-1), True)
        return flat[:numel].view(rows, num_experts)
