"""The buffer's exact non-blocking path on torch's NVSHMEM exchange, at two ranks on one GPU.

NVSHMEM runs two ranks on one GPU only under CUDA MPS (without it, it ends the process: "limited
MPG"), and NCCL refuses two ranks on one GPU, so this test starts a private MPS daemon and runs the
buffer checks of `tests/test_torch_buffer.py` on two gloo ranks whose tensors are on GPU 0, with
`transport=NVSHMEMExchange`: rows, probs, counts, combine and both gradients bitwise equal to the
blocking dispatch, the truncated tail equal to the all-gather path's, the hidden bytes equal to blocking's.
A gloo group's collectives on CUDA tensors wait on the host, so the host-sync guard is off here; the
path's freedom from host reads is checked on CPU ranks (`test_torch_buffer.py` under Triton's
interpreter). Run this file in a pytest process of its own: nothing here touches CUDA in the parent.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from tests import test_torch_buffer
from tests.cuda_mps import private_mps
from tests.distributed import Checks, assert_ok, run_ranks

pytestmark = pytest.mark.gpu
WORLD = 2


def _nvshmem_exchange(group):
    from megatron_ext.hybridep.torch_buffer.exchange import choose_exchange
    from tests.device_splits import CountingExchange

    return CountingExchange(choose_exchange(group, "nvshmem", row_bytes=64))  # the cases' rows: 32 or 64 bytes


def _worker(rank, world_size, out_dir):
    import megatron_ext.tooling.sync as sync

    torch.cuda.set_device(0)
    test_torch_buffer._device = lambda: torch.device("cuda", 0)
    test_torch_buffer.EXACT_EXCHANGE = _nvshmem_exchange
    sync.forbid_host_sync = contextlib.nullcontext  # gloo waits on the host (see the docstring)
    checks = Checks()
    for index, case in enumerate(test_torch_buffer.CASES):
        test_torch_buffer._case(checks, rank, world_size, index, case)
    checks.save(out_dir, rank)
    torch.cuda.synchronize()
    os._exit(0)  # NVSHMEM's teardown at exit can hang with several ranks on one GPU


@pytest.fixture(scope="module")
def mps():
    """A private CUDA MPS daemon for this module's child processes."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from megatron_ext.hybridep.torch_buffer.exchange import nvshmem_unavailable  # noqa: F401 - import check only

    with private_mps(WORLD):
        yield


@pytest.fixture(scope="module")
def results(mps, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("nvshmem")
    run_ranks(WORLD, _worker, str(out_dir))
    from tests.distributed import merged_results

    return merged_results(out_dir, WORLD)


@pytest.mark.parametrize(
    "check", [c.__name__ for c in (*test_torch_buffer.CASE_CHECKS, *test_torch_buffer.EXACT_CHECKS)]
)
def test_exact_path_on_nvshmem(results, check):
    assert_ok(results, check)
