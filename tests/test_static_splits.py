"""Static expert splits (`--moe-hybridep-static-expert-splits`): capacity mode with a fixed row
budget per local expert, for experts that split their rows on the host.

The budget layout against a reference written with Python loops (fresh random counts, forward and
backward); real Megatron MoE layers with Megatron's SequentialMLP experts (which split by the
counts on the host) on 1, 2 and 4 spawned gloo ranks against the blocking dispatch, several steps
on fresh inputs; an expert over its budget stopped on the device, or re-run by the overflow policy
and its budget grown; the flag's refusals.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_ext.capacity import budget as budgets
from megatron_ext.capacity import budget_from_rows
from tests.megatron_env import FLEX, copy_weights, make_config, megatron_check_tests, moe_layer, run_steps, step_inputs

WORLD_SIZES = (1, 2, 4)
HIDDEN = 16
STATIC = dict(
    FLEX,
    moe_hybridep_capacity_factor=2.0,
    moe_hybridep_equal_token_counts=True,
    moe_hybridep_static_expert_splits=True,
)


# --------------------------------------------------------------------------- the layout alone


def _reference_layout(rows, counts, budget):
    """`rows` [capacity, H] with segments of `counts` back to back, in the budget layout (loops)."""
    out = torch.zeros(len(counts) * budget, *rows.shape[1:], dtype=rows.dtype)
    start = 0
    for expert, count in enumerate(counts):
        for j in range(min(count, budget)):
            out[expert * budget + j] = rows[start + j]
        start += count
    return out


@pytest.mark.parametrize("seed", range(6))
def test_budget_layout_matches_a_reference_forward_and_backward(seed):
    generator = torch.Generator().manual_seed(seed)
    num_local = int(torch.randint(1, 6, (1,), generator=generator))
    counts = torch.randint(0, 9, (num_local,), generator=generator)
    budget = int(torch.randint(1, 9, (1,), generator=generator))
    capacity = int(counts.sum()) + int(torch.randint(0, 5, (1,), generator=generator))  # spare rows at the end
    rows = torch.randn(capacity, 3, generator=generator, requires_grad=True)
    plan = budgets.budget_map(counts, capacity, budget)
    laid_out = budgets.to_budget(rows, plan)
    expected = _reference_layout(rows.detach(), counts.tolist(), budget)
    assert torch.equal(laid_out, expected)
    assert int(plan.overflow) == int((counts > budget).any())
    # Backward: the gradient of sum(out x w) is w at each kept row's slot, zero elsewhere.
    weights = torch.randn(laid_out.shape, generator=generator)
    (laid_out * weights).sum().backward()
    reference = rows.detach().clone().requires_grad_(True)
    (_reference_layout(reference, counts.tolist(), budget) * weights).sum().backward()
    assert torch.equal(rows.grad, reference.grad)
    # And back: every kept row returns to its place, the others (cut, spare) come back zero.
    back = budgets.from_budget(laid_out, plan)
    kept = torch.zeros(capacity, dtype=torch.bool)
    start = 0
    for count in counts.tolist():
        kept[start : start + min(count, budget)] = True
        start += count
    assert torch.equal(back[kept], rows.detach()[kept]) and not back[~kept].any()


def test_budgets_round_up_to_the_padding():
    assert budget_from_rows(10, 1.5, None) == 15
    assert budget_from_rows(10, 1.5, 16) == 16
    assert budget_from_rows(0, 2.0, 16) == 16  # an empty expert still gets room
    assert budget_from_rows(100, 1.0, 128) == 128
    assert budget_from_rows(100, 1.1, None) == 110  # exact on the factor, as a capacity (not 111)


# --------------------------------------------------------------------------- real MoE layers


def _layers(world, **overrides):
    static = moe_layer(make_config(world, **STATIC, **overrides), experts="spec", seed=3)
    blocking = moe_layer(make_config(world, **FLEX), experts="spec", seed=4)
    copy_weights(static, blocking)
    return static, blocking, static.token_dispatcher.capacity_manager


def _record_expert_counts(layer):
    """The counts each call of the layer's experts received."""
    seen = []
    layer.experts.register_forward_pre_hook(lambda module, args: seen.append(args[1]))
    return seen


def static_splits_equal_blocking(rank, world):
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_ext.tooling.sync import forbid_host_sync

    static, blocking, manager = _layers(world)
    assert isinstance(static.experts, SequentialMLP)  # kept: it splits by host counts, which it now gets
    seen = _record_expert_counts(static)
    inputs = step_inputs(rank, 4, 32, HIDDEN, seed=31)
    expected = run_steps(blocking, inputs)
    actual = run_steps(static, inputs[:1])
    # SequentialMLP reads the budgets it gets (`tolist()`): a host constant's read, not a sync.
    with forbid_host_sync():
        actual += run_steps(static, inputs[1:])
    for step, ((out_a, dx_a, g_a), (out_b, dx_b, g_b)) in enumerate(zip(expected, actual, strict=True)):
        torch.testing.assert_close(out_b, out_a, rtol=1e-5, atol=1e-6, msg=f"step {step}: output")
        torch.testing.assert_close(dx_b, dx_a, rtol=1e-5, atol=1e-6, msg=f"step {step}: input grad")
        assert g_a.keys() == g_b.keys()
        for name in g_a:
            torch.testing.assert_close(g_b[name], g_a[name], rtol=1e-5, atol=1e-6, msg=f"step {step}: {name}")
    # The calibration's largest expert, as the EP group's maximum, x the factor: the budget.
    largest = [None] * world
    dist.all_gather_object(largest, manager.blocking_expert_rows_max)
    assert manager.expert_budget == budget_from_rows(max(largest), 2.0, manager.pad_multiple)
    assert manager.stats.calibrations == 1 and manager.stats.non_blocking_dispatches == len(inputs) - 1
    # Step 0 calibrated (blocking: the exact counts, on the dispatch's device); every later
    # dispatch handed the experts the budgets as a CPU tensor: host constants, nothing to read.
    assert int(seen[0].sum()) == manager.local_calibration_rows
    budgets_seen = seen[1:]
    assert len(budgets_seen) == len(inputs) - 1
    for counts in budgets_seen:
        assert counts.device.type == "cpu"
        assert counts.tolist() == [manager.expert_budget] * manager.num_local_experts
    assert int(manager.overflows) == 0


def over_budget_stops_on_the_device(rank, world):
    static, _, manager = _layers(world)
    inputs = step_inputs(rank, 2, 32, HIDDEN, seed=32)
    run_steps(static, inputs[:1])
    assert manager.blocking_expert_rows_max > 1  # so every rank overflows below, none waits for the others
    manager.expert_budget = 1  # as if one expert's routing had drifted past its budget
    manager._budget_counts = torch.ones(manager.num_local_experts, dtype=torch.int64)
    with pytest.raises(RuntimeError) as caught:
        run_steps(static, inputs[1:])
    message = str(caught.value)
    for part in ("MoE layer 1", "its budget of 1", "--moe-hybridep-capacity-factor", "truncated"):
        assert part in message, message


def over_budget_is_rerun_and_the_budget_grows(rank, world):
    """In Megatron's loop (the overflow policy around the step): the step re-runs blocking, equal to
    the blocking layer, and the budget grows to fit; the next step runs non-blocking again."""
    from megatron_ext.training.recovery import OverflowRerun
    from tests.test_recovery import _assert_same_step, _forward_backward, _step

    static, blocking, manager = _layers(world)
    inputs = step_inputs(rank, 3, 32, HIDDEN, seed=33)
    rerun = OverflowRerun(_forward_backward)
    _step(static, inputs[:1], rerun)
    _step(blocking, inputs[:1])
    manager.expert_budget = 1
    manager._budget_counts = torch.ones(manager.num_local_experts, dtype=torch.int64)
    expected, actual = _step(blocking, inputs[1:2]), _step(static, inputs[1:2], rerun)
    _assert_same_step(expected, actual)  # the re-run is blocking, as the reference
    assert rerun.reruns == 1 and manager.expert_budget > 1
    before = manager.stats.non_blocking_dispatches
    losses, _ = _step(static, inputs[2:], rerun)
    reference, _ = _step(blocking, inputs[2:])
    torch.testing.assert_close(losses[0], reference[0], rtol=1e-5, atol=1e-6)
    assert rerun.reruns == 1 and manager.stats.non_blocking_dispatches == before + 1


def thin_budget_headroom_grows_the_budget_before_an_overflow(rank, world):
    """A step in which some expert used more than half the room above the calibrated rows: no
    re-run, the budget grows after it (as the capacity does), the step equal to blocking's."""
    from megatron_ext.training.recovery import OverflowRerun
    from tests.test_recovery import _forward_backward, _step

    static, blocking, manager = _layers(world)
    inputs = step_inputs(rank, 1, 32, HIDDEN, seed=34)
    rerun = OverflowRerun(_forward_backward)
    _step(static, inputs, rerun)
    largest = manager.calibrated_expert_rows  # the EP group's largest expert in that batch
    assert largest >= 2
    # As if calibrated on a batch that used half as many rows, with a budget just above this one's.
    manager.calibrated_expert_rows, manager.expert_budget = 0, largest + 1
    manager._budget_counts = torch.full((manager.num_local_experts,), largest + 1, dtype=torch.int64)
    losses, _ = _step(static, inputs, rerun)  # the same batch: no expert over the budget, but past half
    reference, _ = _step(blocking, inputs)
    torch.testing.assert_close(losses[0], reference[0], rtol=1e-5, atol=1e-6)
    assert (rerun.reruns, rerun.resizes) == (0, 1)
    assert manager.expert_budget == budget_from_rows(largest, 2.0, manager.pad_multiple) > largest + 1
    assert int(manager.expert_rows_used) <= largest + 1


CHECKS = [
    static_splits_equal_blocking,
    over_budget_stops_on_the_device,
    over_budget_is_rerun_and_the_budget_grows,
    thin_budget_headroom_grows_the_budget_before_an_overflow,
]


results, test_static_expert_splits = megatron_check_tests(CHECKS, WORLD_SIZES)


# --------------------------------------------------------------------------- the flag's checks


def _namespace(**fields):
    import argparse

    base = dict(
        moe_token_dispatcher_type="flex",
        moe_flex_dispatcher_backend="hybridep",
        moe_hybridep_capacity_factor=1.5,
        moe_hybridep_static_expert_splits=True,
        transformer_impl="transformer_engine",
        use_transformer_engine_op_fuser=False,
        fp8=None,
        fp4=None,
    )
    return argparse.Namespace(**{**base, **fields})


@pytest.mark.parametrize(
    ("fields", "refusal"),
    [
        (dict(moe_hybridep_capacity_factor=None), "set --moe-hybridep-capacity-factor too"),
        (dict(use_transformer_engine_op_fuser=True), "take the counts on the device. Drop one of the two"),
        (dict(fp8="e4m3", fp8_recipe="mxfp8"), "for delayed, tensorwise, blockwise only"),
        (dict(fp8="e4m3", fp8_recipe="delayed", transformer_impl="local"), "--transformer-impl transformer_engine"),
        (dict(fp8="e4m3", fp8_recipe="delayed"), None),
        (dict(fp8="e4m3", fp8_recipe="tensorwise"), None),
        (dict(), None),
    ],
)
def test_the_flag_is_checked_with_the_experts_and_fp8(fields, refusal):
    from megatron_ext.options import HybridEPConfigError, validate

    namespace = _namespace(**fields)
    if refusal is None:
        assert validate(namespace).static_expert_splits
        return
    with pytest.raises(HybridEPConfigError) as refused:
        validate(namespace)
    assert refusal in str(refused.value) and "--moe-hybridep-static-expert-splits" in str(refused.value)


def test_delayed_scaling_without_the_flag_names_it():
    from megatron_ext.options import HybridEPConfigError, validate

    with pytest.raises(HybridEPConfigError) as refused:
        validate(_namespace(moe_hybridep_static_expert_splits=False, fp8="e4m3", fp8_recipe="delayed"))
    assert "--fp8-recipe delayed" in str(refused.value) and "--moe-hybridep-static-expert-splits" in str(refused.value)


def test_megatron_ext_grouped_experts_are_refused_with_the_flag():
    """megatron-ext's GroupedMLP takes device counts: static splits have nothing to give it."""
    import functools
    import types

    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    from megatron_ext.experts import GroupedMLP
    from megatron_ext.options import HybridEPConfigError
    from megatron_ext.patches._moe_layer import select_experts

    config = types.SimpleNamespace(moe_hybridep_capacity_factor=1.5, moe_hybridep_static_expert_splits=True)
    with pytest.raises(HybridEPConfigError) as refused:
        select_experts(config, MoESubmodules(experts=functools.partial(GroupedMLP)))
    for text in ("--moe-hybridep-static-expert-splits here", "Drop the flag", "--transformer-impl transformer_engine"):
        assert text in str(refused.value), str(refused.value)
