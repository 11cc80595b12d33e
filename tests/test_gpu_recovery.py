"""The overflow re-run policy's checks (`tests/test_recovery.py`) on one CUDA GPU: Megatron MoE
layers in bf16 on one NCCL rank, the overflow flag, its all-reduce and the step's one host read
on the device. The fail policy's device assert ends its process, so it runs in a subprocess
(`test_gpu_moe_layer.py`), not here; on one rank every row stays on that rank, so the routing
shift cannot outgrow a capacity and the forced overflow (a capacity of 4 rows) is the one that does.

The layers are the CPU checks' (hidden 16), which deep_ep's buffer does not take (its constructor
aborted the process on an H200, 2026-12-01), so they run on the PyTorch implementation here; the
policy on deep_ep runs in the bench's `deep_ep+capacity+equal+reuse+rerun` mode.
"""

from __future__ import annotations

import pytest

from tests import test_recovery

pytestmark = pytest.mark.gpu

ON_ONE_GPU = [check for check in test_recovery.CHECKS if check is not test_recovery.fail_policy_stops_on_the_device]


@pytest.mark.parametrize("check", ON_ONE_GPU, ids=lambda check: check.__name__)
def test_recovery_on_one_gpu(megatron, check, monkeypatch):
    monkeypatch.setattr(test_recovery, "FLEX", {**test_recovery.FLEX, "moe_hybridep_implementation": "torch"})
    check(0, 1)  # rank 0 of 1; the fixture set up Megatron's parallel state and the patch
