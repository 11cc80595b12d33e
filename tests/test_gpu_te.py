"""Transformer Engine's grouped experts in capacity mode, on one CUDA GPU (NCCL, one rank, bf16).

Megatron's TEGroupedMLP through TE's op fuser takes the per-expert counts on the device, so
megatron-ext keeps it in capacity mode. These tests hold it to what capacity mode promises: the
same results as a blocking dispatch (the rows past the real count are TE's to leave unwritten and
ours to ignore), no host read after calibration, and a host that runs ahead of the GPU; stock
Megatron with TE's unfused experts makes the host wait. Skipped without TE (CI has none).
"""

from __future__ import annotations

import pytest
import torch

from tests.megatron_env import FLEX, copy_weights, run_steps
from tests.test_gpu_moe_layer import GPU, LAYERS, _inputs, _relative_error, _Summed

pytestmark = pytest.mark.gpu

OP_FUSER = dict(use_transformer_engine_op_fuser=True)
CAPACITY = dict(FLEX, moe_hybridep_capacity_factor=2.0, moe_hybridep_equal_token_counts=True)


@pytest.fixture(scope="module", autouse=True)
def transformer_engine():
    from megatron_ext.bench.stack import allow_gated_op_fuser_experts, te_import_error

    reason = te_import_error()
    if reason is not None:
        pytest.skip(f"needs Transformer Engine 2.14 or newer (docs/install.md): {reason}")
    allow_gated_op_fuser_experts()  # SwiGLU on the op fuser, as a launch script must export it


def _stacked(steps):
    """run_steps' gradients with TE's per-expert `weight{i}` stacked as GroupedMLP's `weight`."""
    from megatron_ext.bench.stack import stack_per_expert

    return [(output, grad, stack_per_expert(grads)) for output, grad, grads in steps]


def _te_stack(experts, seed, **overrides):
    from tests.megatron_env import make_config, moe_layer

    config = make_config(1, **GPU, **overrides)
    return _Summed(torch.nn.ModuleList([moe_layer(config, experts=experts, seed=seed + i) for i in range(LAYERS)]))


def test_op_fuser_experts_in_capacity_mode_equal_blocking_without_host_syncs(megatron):
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    from megatron_ext.tooling.sync import forbid_host_sync, runahead_probe

    wrap = lambda layer, x: layer(x)  # noqa: E731
    ours = _te_stack("grouped", 90, **FLEX)  # megatron-ext's GroupedMLP, blocking: a second reference
    blocking = _te_stack("te-op-fuser", 90, **FLEX, **OP_FUSER)
    capacity = _te_stack("te-op-fuser", 90, **CAPACITY, **OP_FUSER)
    copy_weights(ours, blocking)
    copy_weights(ours, capacity)
    for layer in capacity.layers:
        assert isinstance(layer.experts, TEGroupedMLP) and layer.experts._with_fused_impl, type(layer.experts)
    inputs = _inputs(4)
    reference = run_steps(ours, inputs, wrap)
    expected = _stacked(run_steps(blocking, inputs, wrap))
    actual = run_steps(capacity, inputs[:1], wrap)
    with forbid_host_sync():
        actual += run_steps(capacity, inputs[1:], wrap)
    torch.cuda.synchronize()
    actual = _stacked(actual)
    assert sorted(actual[0][2]) == sorted(reference[0][2]), "TE's gradients do not map onto GroupedMLP's"
    worst = {"blocking": 0.0, "GroupedMLP": 0.0}
    for step in range(len(inputs)):
        for against, runs in (("blocking", expected), ("GroupedMLP", reference)):
            (out_a, dx_a, g_a), (out_b, dx_b, g_b) = runs[step], actual[step]
            pairs = [("output", out_a, out_b), ("input grad", dx_a, dx_b)]
            pairs += [(f"grad {name}", g_a[name], g_b[name]) for name in g_a]
            for what, a, b in pairs:
                assert torch.isfinite(b).all(), f"step {step}: {what} is not finite"
                error = _relative_error(b, a)
                worst[against] = max(worst[against], error)
                assert error <= 2e-2, f"step {step}: {what} against {against}: relative error {error:.3g}"
    for layer in capacity.layers:
        stats = layer.token_dispatcher.capacity_manager.stats
        assert stats.calibrations == 1 and stats.non_blocking_dispatches == len(inputs) - 1
    ahead = runahead_probe(lambda: run_steps(capacity, inputs[:1], wrap))
    print(f"\nTEGroupedMLP (op fuser), capacity 2.0 + equal counts: worst relative error {worst}; {ahead}")
    assert not ahead.waited, ahead


def test_stock_te_experts_make_the_host_wait(megatron):
    """The comparison the bench draws: stock Megatron's alltoall dispatcher with TEGroupedMLP unfused."""
    from megatron_ext.tooling.sync import runahead_probe

    stock = _te_stack("te", 90, moe_token_dispatcher_type="alltoall")
    x = _inputs(1)[0]
    run_steps(stock, [x], lambda layer, x: layer(x))
    waits = runahead_probe(lambda: run_steps(stock, [x], lambda layer, x: layer(x)))
    print(f"\nstock alltoall + TEGroupedMLP (unfused): {waits}")
    assert waits.waited, waits


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fp8_op_fuser_experts_in_capacity_mode_match_blocking_without_host_syncs(megatron, recipe):
    """Capacity mode with an fp8 recipe whose grouped GEMM takes the counts on the device, against
    the blocking dispatch with the same recipe and experts (same padded rows per expert, so the
    same kernels). Before each capacity-mode step the allocator's free memory is filled with NaN,
    so that the capacity's spare rows (left unwritten) would poison any quantization that read
    them (an amax over the whole buffer, say)."""
    from megatron.core.fp8_utils import get_fp8_context

    from megatron_ext.options import HybridEPConfigError
    from megatron_ext.tooling.sync import forbid_host_sync

    fp8 = dict(fp8="e4m3", fp8_recipe=recipe)
    try:
        capacity = _te_stack("te-op-fuser", 90, **CAPACITY, **OP_FUSER, **fp8)
    except HybridEPConfigError as refused:  # TE or cuBLASLt too old for this recipe's device-count path
        pytest.skip(str(refused))
    blocking = _te_stack("te-op-fuser", 90, **FLEX, **OP_FUSER, **fp8)
    copy_weights(blocking, capacity)
    config = capacity.layers[0].config

    def wrap(layer, x):
        with get_fp8_context(config):
            return layer(x)

    def poisoned(step):
        free = torch.cuda.mem_get_info()[0]
        torch.full((min(free // 4, 2**30) // 2,), float("nan"), dtype=torch.bfloat16, device="cuda")
        return step()  # the NaN block is freed again: its memory backs the step's new tensors

    inputs = _inputs(4)
    expected = run_steps(blocking, inputs, wrap)
    actual = poisoned(lambda: run_steps(capacity, inputs[:1], wrap))
    with forbid_host_sync():
        for x in inputs[1:]:
            actual += poisoned(lambda x=x: run_steps(capacity, [x], wrap))
    torch.cuda.synchronize()
    bitwise, worst = True, 0.0
    for step, ((out_a, dx_a, g_a), (out_b, dx_b, g_b)) in enumerate(zip(expected, actual, strict=True)):
        pairs = [("output", out_a, out_b), ("input grad", dx_a, dx_b)]
        pairs += [(f"grad {name}", g_a[name], g_b[name]) for name in g_a]
        for what, a, b in pairs:
            assert torch.isfinite(b).all(), f"{recipe} step {step}: {what} is not finite"
            bitwise = bitwise and torch.equal(a, b)
            error = _relative_error(b, a)
            worst = max(worst, error)
            assert error <= 2e-2, f"{recipe} step {step}: {what}: relative error {error:.3g}"
    for layer in capacity.layers:
        stats = layer.token_dispatcher.capacity_manager.stats
        assert stats.calibrations == 1 and stats.non_blocking_dispatches == len(inputs) - 1
    print(
        f"\nfp8 {recipe}, TE op-fuser experts: capacity 2.0 + equal counts against blocking: bitwise {bitwise}, "
        f"worst relative error {worst:.3g}"
    )


@pytest.mark.parametrize("recipe", [None, "delayed", "tensorwise"])
def test_static_expert_splits_feed_te_unfused_experts_without_host_syncs(megatron, recipe):
    """`--moe-hybridep-static-expert-splits`: Megatron's TEGroupedMLP without the op fuser (host
    split sizes; the one TE path for fp8 delayed scaling) gets each expert's fixed budget as its
    counts. Against the blocking dispatch with the same experts and recipe, which hands them the
    exact counts (another GEMM shape per expert: close, not bitwise); no host read after calibration."""
    from megatron.core.fp8_utils import get_fp8_context
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    from megatron_ext.tooling.sync import forbid_host_sync

    fp8 = {} if recipe is None else dict(fp8="e4m3", fp8_recipe=recipe)
    static = _te_stack("te", 90, **CAPACITY, moe_hybridep_static_expert_splits=True, **fp8)
    blocking = _te_stack("te", 90, **FLEX, **fp8)
    copy_weights(blocking, static)
    for layer in static.layers:
        assert isinstance(layer.experts, TEGroupedMLP) and not layer.experts._with_fused_impl, type(layer.experts)
    config = static.layers[0].config

    def wrap(layer, x):
        with get_fp8_context(config):
            return layer(x)

    inputs = _inputs(4)
    expected = run_steps(blocking, inputs, wrap)
    actual = run_steps(static, inputs[:1], wrap)
    with forbid_host_sync():
        actual += run_steps(static, inputs[1:], wrap)
    torch.cuda.synchronize()
    worst = 0.0
    for step, ((out_a, dx_a, g_a), (out_b, dx_b, g_b)) in enumerate(zip(expected, actual, strict=True)):
        pairs = [("output", out_a, out_b), ("input grad", dx_a, dx_b)]
        pairs += [(f"grad {name}", g_a[name], g_b[name]) for name in g_a]
        for what, a, b in pairs:
            assert torch.isfinite(b).all(), f"{recipe} step {step}: {what} is not finite"
            error = _relative_error(b, a)
            worst = max(worst, error)
            assert error <= 2e-2, f"{recipe} step {step}: {what}: relative error {error:.3g}"
    for layer in static.layers:
        manager = layer.token_dispatcher.capacity_manager
        assert manager.stats.calibrations == 1 and manager.stats.non_blocking_dispatches == len(inputs) - 1
        assert manager.expert_budget is not None and int(manager.overflows) == 0
    print(f"\nstatic expert splits, TEGroupedMLP unfused, {recipe or 'bf16'}: worst relative error {worst:.3g}")
