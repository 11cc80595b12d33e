"""Megatron-Core MoE layers with megatron-ext on one CUDA GPU (NCCL, one rank, bf16).

A stack of MoE layers in capacity mode against the same stack dispatching blocking: equal
outputs and gradients; after calibration no host synchronisation (the guard, with CUDA's
sync-debug mode) and the run-ahead probe's verdict; a too-small capacity stops the process on
the device with the layer's message.
"""

from __future__ import annotations

import pytest
import torch

from tests.megatron_env import FLEX, assert_same_steps, copy_weights, run_steps

pytestmark = pytest.mark.gpu

LAYERS, TOKENS, HIDDEN, EXPERTS, TOPK, FFN = 4, 2048, 1024, 16, 4, 512
GPU = dict(
    hidden_size=HIDDEN,
    num_moe_experts=EXPERTS,
    moe_router_topk=TOPK,
    moe_ffn_hidden_size=FFN,
    params_dtype=torch.bfloat16,
    bf16=True,
    use_cpu_initialization=False,
)


def _stack(seed, **options):
    from tests.megatron_env import make_config, moe_layer

    config = make_config(1, **GPU, **options)
    return torch.nn.ModuleList([moe_layer(config, experts="grouped", seed=seed + i) for i in range(LAYERS)])


class _Stack(torch.nn.Module):
    """The layers in sequence, called like one MoE layer (returns (output, None))."""

    def __init__(self, layers):
        super().__init__()
        self.layers = layers

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)[0]
        return x, None


def _inputs(steps):
    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = (TOKENS, 1, HIDDEN)
    return [torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator) for _ in range(steps)]


def test_capacity_stack_equals_blocking_without_host_syncs(megatron):
    from megatron_ext.tooling.sync import forbid_host_sync

    blocking = _Stack(_stack(10, **FLEX))
    capacity = _Stack(_stack(50, **FLEX, moe_hybridep_capacity_factor=1.5))
    copy_weights(blocking, capacity)
    inputs = _inputs(4)
    expected = run_steps(blocking, inputs)
    actual = run_steps(capacity, inputs[:1])
    with forbid_host_sync():
        actual += run_steps(capacity, inputs[1:])
    torch.cuda.synchronize()
    assert_same_steps(expected, actual)
    for layer in capacity.layers:
        stats = layer.token_dispatcher.capacity_manager.stats
        assert stats.calibrations == 1 and stats.non_blocking_dispatches == len(inputs) - 1


def _step(stack, x):
    def step():
        x_ = x.detach().requires_grad_(True)
        stack(x_)[0].float().sum().backward()

    return step


def test_capacity_stack_runs_ahead_and_blocking_waits(megatron):
    from megatron_ext.tooling.sync import count_host_syncs, runahead_probe

    x = _inputs(1)[0][: TOKENS - 8]  # not a multiple of 64: equal counts pad on the device
    equal = dict(moe_hybridep_equal_token_counts=True, moe_hybridep_verify_equal_token_counts=True)
    capacity = _Stack(_stack(50, **FLEX, **equal, moe_hybridep_capacity_factor=1.5))
    blocking = _Stack(_stack(10, **FLEX))
    _step(capacity, x)()  # calibration
    with count_host_syncs() as log:
        _step(capacity, x)()
    ahead = runahead_probe(_step(capacity, x))
    waits = runahead_probe(_step(blocking, x))
    print(f"\n{LAYERS} MoE layers, T {TOKENS - 8}, H {HIDDEN}, E {EXPERTS}, top-{TOPK}, bf16, forward+backward:")
    print(f"  capacity mode + equal counts (checked): {ahead}; host syncs counted: {log.count}")
    print(f"  blocking dispatch:                      {waits}")
    assert log.count == 0, log.events
    assert not ahead.waited, ahead
    assert waits.waited, waits


def test_too_small_capacity_stops_on_the_device():
    from tests.megatron_env import overflow_on_the_device

    overflow_on_the_device(dict(GPU, **FLEX), TOKENS, HIDDEN, capacity=4, port=29533)


# ------------------------------------------------------------------ every mode of the bench


def _modes():
    from megatron_ext.bench.modes import BLOCKING, all_modes

    return [
        m
        for m in all_modes(1.5)
        if m.name != BLOCKING and not m.needs_deep_ep and not m.needs_te and not m.overflow_rerun and not m.graph
    ]


class _Summed(torch.nn.Module):
    """x + sum of the layers on x: routing in one layer never depends on another's rounding, so
    stock Megatron (which sums in another order) can be held to a tolerance."""

    def __init__(self, layers):
        super().__init__()
        self.layers = layers

    def forward(self, x):
        return x + sum(layer(x)[0] for layer in self.layers)


def _summed(overrides):
    from tests.megatron_env import make_config, moe_layer

    config = make_config(1, **GPU, **overrides)
    return _Summed(torch.nn.ModuleList([moe_layer(config, experts="grouped", seed=70 + i) for i in range(LAYERS)]))


def _relative_error(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("mode", _modes(), ids=lambda m: m.name)
def test_every_mode_against_blocking_with_its_syncs_and_runahead(megatron, mode):
    """Outputs, input and parameter gradients of 4 steps (fresh inputs; the first calibrates) against
    blocking: bitwise for megatron-ext's modes, within bf16 rounding for stock Megatron. The modes
    the mode table declares host-free run their later steps under the sync guard and run ahead of a
    sleeping GPU; the others make the host wait."""
    from megatron_ext.tooling.sync import count_host_syncs, forbid_host_sync, runahead_probe

    blocking = _summed(FLEX)
    stack = _summed(mode.overrides)
    copy_weights(blocking, stack)
    inputs = _inputs(4)
    wrap = lambda layer, x: layer(x)  # noqa: E731
    expected = run_steps(blocking, inputs, wrap)
    actual = run_steps(stack, inputs[:1], wrap)
    if mode.host_free:
        with forbid_host_sync():
            actual += run_steps(stack, inputs[1:], wrap)
    else:
        with count_host_syncs() as syncs:
            actual += run_steps(stack, inputs[1:], wrap)
        assert syncs.count >= LAYERS * (len(inputs) - 1), f"{mode.name}: expected the host to read counts every step"
    for step, ((out_a, dx_a, g_a), (out_b, dx_b, g_b)) in enumerate(zip(expected, actual)):
        pairs = [("output", out_a, out_b), ("input grad", dx_a, dx_b)]
        pairs += [(f"grad {name}", g_a[name], g_b[name]) for name in g_a]
        for what, a, b in pairs:
            if mode.equality == "bitwise":
                assert torch.equal(a, b), f"{mode.name} step {step}: {what} differs from blocking"
            else:
                error = _relative_error(b, a)
                assert error <= 3e-2, f"{mode.name} step {step}: {what} relative error {error:.3g}"
    probe = runahead_probe(lambda: run_steps(stack, inputs[:1], wrap))
    print(f"\n{mode.name}: {probe}")
    assert probe.waited == (not mode.host_free), probe
