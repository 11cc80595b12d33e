"""The sync guard traps every host read it promises to, lets sync-free work through, and cleans up."""

import pytest
import torch

from megatron_ext.capacity.host_constant import host_constant
from megatron_ext.tooling.sync import HostSyncError, count_host_syncs, forbid_host_sync, runahead_probe

X = torch.arange(1.0, 6.0)

SYNCING = {
    "item": lambda: X.sum().item(),
    "tolist": lambda: X.tolist(),
    "bool": lambda: bool(X[0] > 0),
    "int": lambda: int(X[0]),
    "float": lambda: float(X[0]),
    "index": lambda: [1, 2, 3][torch.tensor(1)],
    "cpu": lambda: X.cpu(),
    "numpy": lambda: X.numpy(),
    "nonzero": lambda: X.nonzero(),
    "mask indexing": lambda: X[X > 2],
    "masked_select": lambda: X.masked_select(X > 2),
    "unique": lambda: torch.unique(X),
    "repeat_interleave": lambda: torch.repeat_interleave(torch.tensor([1, 2])),
    "equal": lambda: torch.equal(X, X),
}


@pytest.mark.parametrize("name", sorted(SYNCING))
def test_guard_raises_on_host_read(name):
    with pytest.raises(HostSyncError, match="host synchronisation under forbid_host_sync"):
        with forbid_host_sync():
            SYNCING[name]()


def test_sync_free_work_passes():
    with forbid_host_sync() as log:
        y = torch.cumsum(X, 0) * 2
        torch.nonzero_static(X > 2, size=3)
        torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)
        (y.requires_grad_() * 3).sum().backward()
    assert log.count == 0


def test_count_mode_counts_each_read_once():
    with count_host_syncs() as log:
        X.sum().item()
        X.tolist()
        X.nonzero()
    assert [e.what for e in log.events] == [
        "Tensor.item()",
        "Tensor.tolist()",
        "torch.nonzero() (output size depends on values)",
    ]


def test_host_constants_are_read_freely_and_only_they():
    constant = host_constant(torch.full((4,), 8, dtype=torch.int64))
    with count_host_syncs() as log:
        constant.tolist()
        int(constant[0])  # a view is a new tensor, unmarked: counted
        (constant + 1).tolist()  # so is anything computed from it
    assert [e.what for e in log.events] == ["Tensor.__int__()", "Tensor.tolist()"]
    with pytest.raises(ValueError, match="takes a CPU tensor"):
        host_constant(torch.empty(1, device="meta"))


def test_guard_restores_tensor_methods():
    before = torch.Tensor.item
    with forbid_host_sync():
        assert torch.Tensor.item is not before
    assert torch.Tensor.item is before
    assert X.sum().item() == 15.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_runahead_probe_needs_cuda():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        runahead_probe(lambda: None)


def test_writing_a_python_value_into_a_tensor_counts():
    """On CUDA `t[i] = 5` copies a host scalar and waits for the GPU (measured); CPU tests see it too."""
    t = torch.zeros(4)
    with count_host_syncs() as log:
        t[1] = 5
        t[2] = torch.tensor(3.0)  # a tensor value: no host copy at this call
    assert log.count == 1 and "__setitem__" in log.events[0].what
    with pytest.raises(HostSyncError, match="__setitem__"), forbid_host_sync():
        t[0] = 1.0


@pytest.mark.gpu
def test_host_to_device_copies_count_on_cuda():
    host, pinned = torch.ones(4), torch.ones(4).pin_memory()
    with count_host_syncs() as log:
        host.cuda()
    assert log.count >= 1, log.events
    with count_host_syncs() as log:
        pinned.to("cuda", non_blocking=True)
    assert log.count == 0, log.events


@pytest.mark.gpu
def test_reads_of_cpu_tensors_are_free_where_cuda_is_in_use():
    """TE's grouped linear rebuilds its split sizes as a CPU tensor and reads them: no wait. A
    CUDA tensor's read, and the copy of one to the host, are syncs."""
    device = torch.ones(4, device="cuda")
    with count_host_syncs() as log:
        torch.tensor([1, 2, 3]).tolist()
        int(torch.ones(2)[0])
    assert log.count == 0, log.events
    with count_host_syncs() as log:
        device.tolist()
    assert [e.what for e in log.events] == ["Tensor.tolist()"], log.events
    with count_host_syncs() as log:
        device.to("cpu").tolist()
    assert log.count == 1 and "sync-debug" in log.events[0].what, log.events
