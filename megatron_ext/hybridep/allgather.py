"""The routing-map all-gather, into a fresh tensor or into one buffer per process group.

HybridEP gathers every rank's `[T, E]` Boolean routing map on every dispatch. Allocating the
`[W * T, E]` output each time costs T x W x E bytes per rank per dispatch (16 MiB at T = 8192,
W = 8, E = 256). With reuse, the output lands in storage allocated once per process group and
grown only when a larger shape arrives.

Reuse is safe because the dispatch consumes the gathered map (to build its layout) on the
current stream before it returns, nothing keeps a view of it, and the next gather is ordered
after those reads on the same stream. A caller must not keep the returned tensor across
dispatches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# One flat Boolean storage per process group, shared by every buffer on that group.
_SHARED_STORAGE: dict[dist.ProcessGroup, torch.Tensor] = {}


def release_shared_routing_map_buffers() -> None:
    """Free the reused routing-map buffers of every process group."""
    _SHARED_STORAGE.clear()


@dataclass
class GatherStats:
    """What the routing-map gathers of one buffer allocated, for tests and the bench."""

    gathers: int = 0
    allocations: int = 0
    bytes_allocated: int = 0
    last_data_ptr: int = 0


class RoutingMapGather:
    """All-gathers `[T, E]` Boolean routing maps of a process group into `[W * T, E]`."""

    def __init__(self, group: dist.ProcessGroup, reuse: bool):
        self.group = group
        self.world_size = group.size()
        self.reuse = reuse
        self.stats = GatherStats()

    def _output(self, map_rows: int, num_experts: int, device: torch.device) -> torch.Tensor:
        numel = map_rows * num_experts
        if not self.reuse:
            self._count_allocation(numel)
            return torch.empty(map_rows, num_experts, dtype=torch.bool, device=device)
        storage = _SHARED_STORAGE.get(self.group)
        if storage is None or storage.numel() < numel or storage.device != device:
            storage = torch.empty(numel, dtype=torch.bool, device=device)
            _SHARED_STORAGE[self.group] = storage
            self._count_allocation(numel)
        return storage[:numel].view(map_rows, num_experts)

    def _count_allocation(self, numel: int) -> None:
        self.stats.allocations += 1
        self.stats.bytes_allocated += numel

    def __call__(self, routing_map: torch.Tensor) -> torch.Tensor:
        """Gather `routing_map` (`[T, E]` bool, the same shape on every rank) from all ranks.

        Returns `[W * T, E]` bool, rank r's rows at `[r * T, (r + 1) * T)`. With reuse, the result
        is overwritten by the next gather on this process group. A group of one rank gets its own
        map back (contiguous), gathered nowhere.
        """
        if self.world_size == 1:  # one rank: its own map, with neither a copy nor an allocation
            out = routing_map.contiguous()
        else:
            num_tokens, num_experts = routing_map.shape
            out = self._output(self.world_size * num_tokens, num_experts, routing_map.device)
            dist.all_gather_into_tensor(out, routing_map.contiguous(), group=self.group)
        self.stats.gathers += 1
        self.stats.last_data_ptr = out.data_ptr()
        return out
