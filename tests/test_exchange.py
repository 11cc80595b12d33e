"""How the torch buffer's non-blocking dispatches choose their transport (`hybridep.torch_buffer.exchange`):
the group's collectives unless NVSHMEM's exact-bytes exchange can serve the group, the choice
logged, an explicit 'nvshmem' that cannot be had refused by name, and `get_buffer` handing the
flag's value to the buffer. (The exchange itself: `tests/test_torch_buffer.py` through a stand-in
on CPU ranks, `tests/test_gpu_nvshmem.py` on NVSHMEM.)"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from megatron_ext.hybridep.buffers import get_buffer, release_buffers
from megatron_ext.hybridep.torch_buffer.exchange import choose_exchange
from tests.distributed import run_ranks


def _on_two_cpu_ranks(rank, world_size):
    from megatron_ext.hybridep import TorchHybridEPBuffer
    from tests.device_splits import SlabExchange

    group = dist.group.WORLD
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("megatron_ext").addHandler(handler)
    logging.getLogger("megatron_ext").setLevel(logging.INFO)

    assert choose_exchange(group, "process_group", 64) is None
    assert choose_exchange(group, "auto", 64) is None
    said = [r.getMessage() for r in records]
    if rank == 0:  # the line is said once per group, by its first rank
        assert any("all-gather tokens" in s and "backend is gloo, not nccl" in s for s in said), said
    with pytest.raises(
        RuntimeError,
        match=r"--moe-hybridep-transport nvshmem \(transport='nvshmem'\) cannot serve this group: rank 0: no CUDA GPU",
    ):
        choose_exchange(group, "nvshmem", 64)
    with pytest.raises(
        RuntimeError, match=r"hidden rows of 48 bytes: NVSHMEM's all_to_all_vdev needs a multiple of 32"
    ):
        choose_exchange(group, "nvshmem", 48)
    given = SlabExchange(group)
    assert choose_exchange(group, given, 48) is given

    # A later dispatch whose rows do not suit the exchange chosen is refused by name.
    class Aligned(SlabExchange):
        row_alignment = 32

    import megatron_ext.fused as fused
    import megatron_ext.hybridep.torch_buffer as torch_buffer

    enabled_for, fused.enabled_for = fused.enabled_for, lambda t: True  # as where the kernels run
    chosen = []
    choose = torch_buffer.choose_exchange
    torch_buffer.choose_exchange = lambda *args: chosen.append(args) or choose(*args)
    try:
        aligned = TorchHybridEPBuffer(group, 16, 4, 2, transport=Aligned(group))
        # The choice (a collective with a host read) is made at the first dispatch, blocking or not:
        # a layer's first is its blocking calibration, so no non-blocking step pays for it.
        assert aligned._device_splits_exchange(torch.zeros(1), 64, non_blocking=False) is None
        assert len(chosen) == 1
        assert isinstance(aligned._device_splits_exchange(torch.zeros(1), 64, non_blocking=True), Aligned)
        assert len(chosen) == 1
        with pytest.raises(
            ValueError, match=r"`hidden` must be rows of a multiple of 32 bytes .*; got rows of 48 bytes"
        ):
            aligned._device_splits_exchange(torch.zeros(1), 48, non_blocking=True)
    finally:
        fused.enabled_for = enabled_for
        torch_buffer.choose_exchange = choose

    # A buffer asked for NVSHMEM with CPU tensors says so at its first dispatch.
    buf = TorchHybridEPBuffer(group, 8, 4, 2, transport="nvshmem")
    routing = torch.zeros(4, 2 * world_size, dtype=torch.bool)
    routing[:, 0] = True
    with pytest.raises(ValueError, match=r"`transport` must be 'auto' or 'process_group' for CPU tensors"):
        buf.dispatch_with_permute(
            hidden=torch.zeros(4, 8), routing_map=routing, num_permuted_tokens=8, non_blocking=True
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the choice where there is no GPU")
def test_the_choice_on_cpu_ranks():
    run_ranks(2, _on_two_cpu_ranks)


def test_one_rank_exchanges_nothing(gloo_group):
    for transport in ("auto", "process_group", "nvshmem"):
        assert choose_exchange(gloo_group, transport, 64) is None


def test_a_transport_that_is_not_one_is_refused(gloo_group):
    from megatron_ext.hybridep import TorchHybridEPBuffer

    with pytest.raises(ValueError, match=r"`transport` must be one of auto, process_group, nvshmem; got rdma"):
        TorchHybridEPBuffer(gloo_group, 8, 4, 2, transport="rdma")


def test_get_buffer_hands_the_transport_to_the_buffer(gloo_group):
    release_buffers()
    try:
        made = {
            transport: get_buffer(
                "torch",
                gloo_group,
                hidden_dim=8,
                num_tokens=4,
                num_local_experts=2,
                reuse_allgather_buffer=False,
                transport=transport,
            )
            for transport in ("auto", "process_group")
        }
        assert made["auto"] is not made["process_group"]
        assert made["auto"]._transport == "auto" and made["process_group"]._transport == "process_group"
    finally:
        release_buffers()
