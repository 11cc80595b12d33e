"""All-to-alls whose splits stay on the device: how a non-blocking dispatch sends exact bytes.

A non-blocking dispatch cannot read how many rows go to each rank, so on the process group's
collectives it all-gathers every token (`torch_buffer`: W / k_r times the exact bytes). An
exchange that takes its splits on the device sends only the rows each rank needs, the way a
blocking dispatch does, with nothing read on the host. `TorchHybridEPBuffer` uses one for its
non-blocking dispatches and their combines when one is chosen (`transport`, below).

The exchange here is torch's symmetric memory on NVSHMEM (`torch.ops.symm_mem.all_to_all_vdev`,
torch 2.8+, one GPU per rank; seen working on an H200 with torch 2.11 and NVSHMEM 3.4.5). Its
buffers are symmetric: allocated once, collectively, with the same shape on every rank, sized
for the most rows a call can move (W x T: each token once to each rank) and reused. The op pulls
rows from the peers' send buffers and lets a peer write into a rank's split buffer as soon as it
starts, with no barrier at either end; so every call that writes these buffers starts with
`barrier()`, which on an NCCL group is a one-element all-reduce on the stream (no host wait): when
it completes, every rank has finished the previous call's exchanges.

`transport` (the buffer's argument, `--moe-hybridep-transport`): 'process_group' keeps the group's
collectives; 'nvshmem' asks for this exchange and raises where it cannot be had; 'auto' takes it
for an NCCL group of 2+ ranks on one node, one GPU each, where torch's NVSHMEM is available, and
the collectives otherwise (logged, with the reason, once per group).
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
from typing import Optional, Protocol

import torch
import torch.distributed as dist

from megatron_ext.logs import once_per_group

logger = logging.getLogger("megatron_ext.hybridep.exchange")  # the name its lines had: users may filter by it


class DeviceSplitsExchange(Protocol):
    """Moves rows between the ranks of a group with per-destination counts held on the device.

    A call: `barrier()`, then for each key, `buffers(key, ...)`, the caller writes the rows for
    rank 0, then rank 1, ... from the send buffer's first row, then `exchange(key, counts)`; the
    receive buffer then holds the rows from rank 0, then rank 1, ... from its first row (how many
    from each, the caller knows from the gathered routing maps).
    """

    name: str
    row_alignment: int  # the bytes of a row must be a multiple of this

    def barrier(self) -> None: ...

    def buffers(
        self, key: str, rows: int, width: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def exchange(self, key: str, send_counts: torch.Tensor) -> None: ...

    @property
    def memory_bytes(self) -> int: ...


class NVSHMEMExchange:
    """`DeviceSplitsExchange` on torch's symmetric memory (NVSHMEM's all_to_all_vdev)."""

    name = "nvshmem"
    # torch's all_to_all_vdev splits the bytes it takes from each peer evenly over up to 64 / W
    # thread blocks (32 at two ranks) and asserts on the device that they divide: rows whose bytes
    # are a multiple of 32 always do.
    row_alignment = 32

    def __init__(self, group: dist.ProcessGroup):
        import torch.distributed._symmetric_memory as symm_mem

        self._symm = symm_mem
        self.group = group
        self.world_size = group.size()
        self._group_name = group.group_name
        symm_mem.set_backend("NVSHMEM")
        with warnings.catch_warnings():  # torch 2.11 deprecates the call it still needs here
            warnings.simplefilter("ignore")
            symm_mem.enable_symm_mem_for_group(self._group_name)
        self._held: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._token: Optional[torch.Tensor] = None
        self._on_nccl = dist.get_backend(group) == "nccl"

    def _empty(self, *shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        tensor = self._symm.empty(*shape, dtype=dtype, device=device)
        self._symm.rendezvous(tensor, self._group_name)
        return tensor

    def barrier(self) -> None:
        if not self._on_nccl:
            # Another backend's all-reduce does not wait for the GPU: wait for it here (a host read;
            # only tests put this exchange on a gloo group).
            torch.cuda.synchronize()
            dist.barrier(group=self.group)
            return
        if self._token is None:
            self._token = torch.zeros(1, dtype=torch.int32, device=torch.cuda.current_device())
        dist.all_reduce(self._token, group=self.group)

    def buffers(self, key, rows, width, dtype, device):
        held = self._held.get(key)
        if held is None or held[0].shape[0] < rows or held[0].shape[1] != width or held[0].dtype != dtype:
            # Collective: every rank asks for the same key and shape at the same call.
            held = (
                self._empty(rows, width, dtype=dtype, device=device),
                self._empty(rows, width, dtype=dtype, device=device),
                self._empty(self.world_size, dtype=torch.int64, device=device),
                self._empty(2, self.world_size, dtype=torch.int64, device=device),
            )
            self._held[key] = held
        return held[0], held[1]

    def exchange(self, key, send_counts):
        send, recv, in_splits, out_splits_offsets = self._held[key]
        in_splits.copy_(send_counts)
        torch.ops.symm_mem.all_to_all_vdev(send, recv, in_splits, out_splits_offsets, self._group_name)

    @property
    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for held in self._held.values() for t in held)


def _local_reason() -> Optional[str]:
    """Why this process cannot run `NVSHMEMExchange`, from what it sees alone, or None."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as error:
        return f"torch has no symmetric memory ({error})"
    if not hasattr(torch.ops.symm_mem, "all_to_all_vdev") or not symm_mem.is_nvshmem_available():
        return f"torch {torch.__version__} has no NVSHMEM all_to_all_vdev"
    return None


def _first(reasons: list) -> Optional[str]:
    """The first rank's reason among every rank's, named by rank, or None when there is none."""
    for rank, reason in enumerate(reasons):
        if reason is not None:
            return reason if len(reasons) == 1 else f"rank {rank}: {reason}"
    return None


def nvshmem_unavailable(group: dist.ProcessGroup, one_node: bool = False) -> Optional[str]:
    """None where `NVSHMEMExchange` can serve `group` (every rank on a GPU of its own, or sharing one
    under CUDA MPS; with `one_node`, all on one host), else why not. Collective: one object
    all-gather, so every rank reaches the same verdict."""
    if group.size() < 2:
        return "one rank exchanges nothing"
    local = _local_reason()
    place = (socket.gethostname(), torch.cuda.current_device() if local is None else -1)
    seen: list = [None] * group.size()
    dist.all_gather_object(seen, (local, place, bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY"))), group=group)
    reason = _first([r for r, _, _ in seen])
    if reason is not None:
        return reason
    places = [p for _, p, _ in seen]
    # NVSHMEM ends the process when two ranks share a GPU without CUDA MPS ("limited MPG").
    if len(set(places)) < len(places) and not all(mps for _, _, mps in seen):
        return "ranks share a GPU (NVSHMEM needs CUDA MPS for that)"
    if one_node and len({host for host, _ in places}) > 1:
        return "the group spans several nodes"
    return None


def _start(group: dist.ProcessGroup) -> tuple[Optional[NVSHMEMExchange], Optional[str]]:
    """`NVSHMEMExchange(group)` with one symmetric allocation made, or why not: the same verdict
    on every rank (collective)."""
    exchange, error = None, None
    try:
        exchange = NVSHMEMExchange(group)
        exchange.buffers("start", 1, 1, torch.int64, torch.device("cuda", torch.cuda.current_device()))
    except Exception as failure:  # noqa: BLE001 - any failure to set NVSHMEM up falls back or is named
        error = f"NVSHMEM did not start: {type(failure).__name__}: {failure}"
    errors: list = [None] * group.size()
    dist.all_gather_object(errors, error, group=group)
    reason = _first(errors)
    return (None, reason) if reason is not None else (exchange, None)


def choose_exchange(group: dist.ProcessGroup, transport, row_bytes: int) -> Optional[DeviceSplitsExchange]:
    """The exchange for `transport` (one of `options.TRANSPORTS`, or a `DeviceSplitsExchange` to use
    as is) and hidden rows of `row_bytes`, or None for the group's collectives. Collective: called
    once per buffer, on every rank of `group`, which all reach the same choice."""
    if not isinstance(transport, str):
        return transport
    if transport == "process_group" or group.size() < 2:
        return None
    exchange = None
    if transport == "auto" and dist.get_backend(group) != "nccl":
        reason = f"the group's backend is {dist.get_backend(group)}, not nccl"
    elif row_bytes % NVSHMEMExchange.row_alignment:
        reason = (
            f"hidden rows of {row_bytes} bytes: NVSHMEM's all_to_all_vdev needs a multiple of "
            f"{NVSHMEMExchange.row_alignment}"
        )
    else:
        reason = nvshmem_unavailable(group, one_node=transport == "auto")
    if reason is None:
        exchange, reason = _start(group)
    if reason is not None:
        if transport == "nvshmem":
            raise RuntimeError(
                f"--moe-hybridep-transport nvshmem (transport='nvshmem') cannot serve this group: {reason}. Use "
                "--moe-hybridep-transport auto or process_group (the group's collectives)."
            )
        logger.log(
            once_per_group(logging.INFO, group),
            "megatron-ext: non-blocking dispatches all-gather tokens on the group's collectives (%s).",
            reason,
        )
        return None
    logger.log(
        once_per_group(logging.INFO, group),
        "megatron-ext: non-blocking dispatches send exact bytes through NVSHMEM (torch symmetric memory).",
    )
    return exchange
