"""A `DeviceSplitsExchange` on a process group's collectives, for CPU tests of the buffer's exact
non-blocking path (`megatron_ext.hybridep.torch_buffer.exchange`), where NVSHMEM cannot run.

It keeps the exchange's contract without reading a count on the host: each rank sends every peer
a slab the size of the whole send buffer, its rows for that peer at the slab's head, and the counts
beside it (equal all-to-alls, whose sizes the host knows); the receiver then packs the rows it was
sent by source rank, from its receive buffer's first row, with tensor operations. It moves W times
the buffer's bytes: a stand-in for correctness, not for speed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class SlabExchange:
    name = "slabs"
    row_alignment = 1

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.world_size = group.size()
        self._held: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.barriers = 0
        self.exchanges = 0

    def barrier(self) -> None:
        self.barriers += 1  # collectives on CPU tensors complete before they return

    def buffers(self, key, rows, width, dtype, device):
        held = self._held.get(key)
        if held is None or held[0].shape[0] < rows or held[0].shape[1] != width or held[0].dtype != dtype:
            # Filled with NaN (bytes: 0xFF, an fp8 NaN): a row the caller reads without its exchange
            # having written it shows.
            fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).max
            held = tuple(torch.full((rows, width), fill, dtype=dtype, device=device) for _ in range(2))
            self._held[key] = held
        return held

    def exchange(self, key, send_counts):
        send, recv = self._held[key]
        W, R = self.world_size, send.shape[0]
        self.exchanges += 1
        starts = torch.cumsum(send_counts, 0) - send_counts
        at = torch.arange(R, device=send.device)
        slabs = send[(starts[:, None] + at[None, :]).clamp(max=R - 1).reshape(-1)]  # [W * R, width]
        got = torch.empty_like(slabs)
        dist.all_to_all_single(got, slabs, group=self.group)
        counts = torch.empty_like(send_counts)
        dist.all_to_all_single(counts, send_counts.contiguous(), group=self.group)
        ends = torch.cumsum(counts, 0)
        source = torch.searchsorted(ends, at, right=True).clamp(max=W - 1)
        position = (at - (ends - counts)[source]).clamp(0, R - 1)
        recv.copy_(got.view(W, R, -1)[source, position])

    @property
    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for held in self._held.values() for t in held)


class CountingExchange:
    """Another exchange, its barriers and exchanges counted (as `SlabExchange` counts its own)."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.row_alignment = inner.row_alignment
        self.barriers = 0
        self.exchanges = 0

    def barrier(self) -> None:
        self.barriers += 1
        self.inner.barrier()

    def buffers(self, key, rows, width, dtype, device):
        return self.inner.buffers(key, rows, width, dtype, device)

    def exchange(self, key, send_counts):
        self.exchanges += 1
        self.inner.exchange(key, send_counts)

    @property
    def memory_bytes(self) -> int:
        return self.inner.memory_bytes
