"""The buffer checks of `tests/test_torch_buffer.py` and the MoE layer checks of
`tests/test_moe_layer.py` with expert parallelism over every GPU of the machine: one NCCL rank per
GPU, two GPUs or more (skipped otherwise, reason printed).

The same check functions as on CPU gloo ranks: capacity mode bitwise equal to blocking with the
steps after calibration under the sync guard, the capacity taken from the EP-group maximum, equal
counts without the all-reduce, routing-map reuse, no flags equal to stock Megatron's alltoall, and
TP 2 x EP 2 on four GPUs. Left out: the checks whose failure path is a device assert (on a GPU it
ends the process instead of raising: `tests/test_gpu_moe_layer.py` covers it on one GPU), the
deep_ep stand-in, and the host-read count of a blocking dispatch (CUDA's sync-debug mode reports
the same read again on a GPU).
"""

from __future__ import annotations

import pytest
import torch

from tests import test_moe_layer as moe
from tests import test_torch_buffer
from tests.distributed import assert_ok, rank_results

pytestmark = pytest.mark.gpu

GPU_CHECKS = tuple(
    check.__name__
    for check in (
        moe.dispatcher_is_ours_with_flags,
        moe.no_flags_equal_stock_alltoall,
        moe.capacity_1_0_equals_blocking,
        moe.capacity_1_5_equals_blocking,
        moe.capacity_2_0_equals_blocking,
        moe.equal_token_counts_skip_the_all_reduce,
        moe.moe_recompute_same_gradients,
        moe.full_recompute_same_gradients,
        moe.moe_act_recompute_kept_in_capacity_mode,
        moe.reuse_allgather_buffer,
        moe.tensor_and_expert_parallel,
    )
)


def _gpus() -> int:
    gpus = torch.cuda.device_count()
    if gpus < 2:
        pytest.skip(f"needs 2 or more GPUs for expert parallelism across GPUs (found {gpus})")
    return gpus


@pytest.fixture(scope="module")
def buffer_results(tmp_path_factory):
    gpus = _gpus()
    if any(case[1] % gpus for case in test_torch_buffer.CASES):
        pytest.skip(f"the buffer cases' expert counts do not divide over {gpus} GPUs")
    return rank_results(tmp_path_factory, gpus, test_torch_buffer._worker, backend="nccl")


@pytest.mark.parametrize("check", test_torch_buffer.CHECKS)
def test_buffer_across_gpus(buffer_results, check):
    assert_ok(buffer_results, check)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    gpus = _gpus()
    return gpus, rank_results(tmp_path_factory, gpus, moe._worker, GPU_CHECKS, backend="nccl")


@pytest.mark.parametrize("check", GPU_CHECKS)
def test_moe_layer_across_gpus(results, check):
    gpus, outcomes = results
    if check in moe.FOUR_RANKS_ONLY and gpus != 4:
        pytest.skip("needs exactly 4 GPUs (TP 2 x EP 2)")
    assert_ok(outcomes, check)
