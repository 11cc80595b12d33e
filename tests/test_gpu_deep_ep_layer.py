"""Megatron-Core MoE layers dispatching through DeepEP's HybridEP kernels, on one GPU (NCCL, bf16).

Skipped, with the reason, where `deep_ep.HybridEPBuffer` does not import. A stack of MoE layers with
`--moe-hybridep-implementation deep_ep` in capacity mode (factors 1.0, 1.5, 2.0; equal counts,
their device check, the reused all-gather buffer; MoE, full and moe_act recompute) against the same
stack dispatching blocking on deep_ep (recomputed alike), and against the torch implementation's
blocking dispatch:
outputs, input and parameter gradients bit for bit. After calibration the equal-count modes run
under the sync guard and run ahead of a sleeping GPU. A too-small capacity stops the process on the
device with the layer's message.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.options import deep_ep_import_error
from tests.megatron_env import FLEX, assert_same_steps, copy_weights, run_steps
from tests.test_gpu_moe_layer import GPU, HIDDEN

pytestmark = pytest.mark.gpu

LAYERS, TOKENS = 2, 1024  # the layers of test_gpu_moe_layer (GPU), fewer of them, on fewer tokens
DEEP_EP = dict(FLEX, moe_hybridep_implementation="deep_ep")
TORCH = dict(FLEX, moe_hybridep_implementation="torch")
EQUAL = dict(moe_hybridep_equal_token_counts=True)
MOE_RECOMPUTE = dict(recompute_granularity="selective", recompute_modules=["moe"])
MOE_ACT = dict(moe_grouped_gemm=True, recompute_granularity="selective", recompute_modules=["moe_act"])

# name -> (capacity factor, config overrides, wrap: None or "full" (checkpoint each layer))
VARIANTS = {
    "capacity-1.0+equal": (1.0, EQUAL, None),
    "capacity-1.5": (1.5, {}, None),
    "capacity-1.5+equal+check": (1.5, dict(EQUAL, moe_hybridep_verify_equal_token_counts=True), None),
    "capacity-1.5+equal+reuse": (1.5, dict(EQUAL, moe_hybridep_reuse_allgather_buffer=True), None),
    "capacity-2.0+equal+reuse": (2.0, dict(EQUAL, moe_hybridep_reuse_allgather_buffer=True), None),
    "capacity-1.5+equal+moe-recompute": (1.5, dict(EQUAL, **MOE_RECOMPUTE), None),
    "capacity-1.5+equal+full-recompute": (1.5, EQUAL, "full"),
    "capacity-1.5+equal+moe_act-recompute": (1.5, dict(EQUAL, **MOE_ACT), None),
}


@pytest.fixture(scope="module", autouse=True)
def _needs_deep_ep():
    missing = deep_ep_import_error()
    if missing is not None:
        pytest.skip(f"deep_ep's HybridEPBuffer does not import: {missing}")


class _Summed(torch.nn.Module):
    """x + the sum of the layers on x (routing in one layer never depends on another's output)."""

    def __init__(self, layers, wrap=None):
        super().__init__()
        self.layers = layers
        self.wrap = wrap

    def forward(self, x):
        if self.wrap == "full":  # what full recompute does to a transformer layer
            from megatron.core import tensor_parallel

            return x + sum(tensor_parallel.checkpoint(lambda h, m=m: m(h)[0], False, x) for m in self.layers)
        return x + sum(layer(x)[0] for layer in self.layers)


def _stack(overrides, wrap=None):
    from tests.megatron_env import make_config, moe_layer

    experts = "spec" if overrides.get("moe_grouped_gemm") else "grouped"  # moe_act: Megatron's spec, swapped
    config = make_config(1, **GPU, **overrides)
    layers = [moe_layer(config, experts=experts, seed=70 + i) for i in range(LAYERS)]
    return _Summed(torch.nn.ModuleList(layers), wrap)


def _inputs(steps, repeat_first=False):
    generator = torch.Generator(device="cuda").manual_seed(3)
    shape = (TOKENS, 1, HIDDEN)
    first = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    rest = [torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator) for _ in range(steps - 1)]
    # Capacity factor 1.0 leaves no room above the calibrated rows: later steps feed the same tokens.
    return [first] * steps if repeat_first else [first, *rest]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_deep_ep_capacity_mode_equals_blocking(megatron, variant):
    from megatron_ext.tooling.sync import forbid_host_sync, runahead_probe

    factor, overrides, wrap = VARIANTS[variant]
    # The reference recomputes as the variant does: a checkpoint changes the order in which the
    # input's gradient sums its parts (x, and each layer), which rounds differently in bf16.
    recompute = MOE_RECOMPUTE if overrides.get("recompute_modules") == ["moe"] else {}
    blocking_deep_ep = _stack(dict(DEEP_EP, **recompute), wrap)
    blocking_torch = _stack(dict(TORCH, **recompute), wrap)
    stack = _stack(dict(DEEP_EP, moe_hybridep_capacity_factor=factor, **overrides), wrap)
    copy_weights(blocking_deep_ep, blocking_torch)
    copy_weights(blocking_deep_ep, stack)
    inputs = _inputs(4, repeat_first=factor == 1.0)

    expected = run_steps(blocking_deep_ep, inputs)
    assert_same_steps(run_steps(blocking_torch, inputs), expected, "deep_ep blocking against torch blocking")
    actual = run_steps(stack, inputs[:1])  # calibration
    if overrides.get("moe_hybridep_equal_token_counts"):
        with forbid_host_sync():
            actual += run_steps(stack, inputs[1:])
    else:
        actual += run_steps(stack, inputs[1:])
    torch.cuda.synchronize()
    assert_same_steps(expected, actual, f"deep_ep {variant} against deep_ep blocking")

    for layer in stack.layers:
        manager = layer.token_dispatcher.capacity_manager
        assert manager.stats.calibrations == 1, manager.stats
        assert manager.stats.non_blocking_dispatches >= len(inputs) - 1, manager.stats
        assert int(manager.overflows) == 0
    if overrides.get("moe_hybridep_equal_token_counts"):
        probe = runahead_probe(lambda: run_steps(stack, inputs[:1]))
        print(f"\ndeep_ep {variant}: {probe}")
        assert not probe.waited, probe


@pytest.mark.parametrize(
    "gradient_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["fp8-format-e4m3", "fp8-format-hybrid"]
)
def test_deep_ep_fp8_dispatch_equals_the_torch_implementations(megatron, monkeypatch, gradient_dtype):
    """--moe-hybridep-fp8-dispatch on deep_ep (its 1-byte kernels, the forward's tokens and the
    backward's gradients in fp8 with their scales: e4m3, or e5m2 as under --fp8-format hybrid),
    blocking and in capacity mode without a host read, against the torch implementation's fp8
    dispatch: bit for bit, forward and backward; and not what the bf16 dispatch gives."""
    from megatron_ext import options
    from megatron_ext.hybridep import fp8
    from megatron_ext.tooling.sync import forbid_host_sync

    # Refused without TE's blockwise recipe, whose fp8 experts these bf16 ones stand in for; the
    # gradients go in the format's gradient dtype.
    monkeypatch.setattr(options, "_check_fp8_dispatch", lambda config, opts: None)
    monkeypatch.setattr(fp8, "gradient_dtype", lambda fmt: gradient_dtype)
    in_fp8 = dict(moe_hybridep_fp8_dispatch=True)
    reference = _stack(dict(TORCH, **in_fp8))
    blocking = _stack(dict(DEEP_EP, **in_fp8))
    capacity = _stack(dict(DEEP_EP, **in_fp8, moe_hybridep_capacity_factor=1.5, **EQUAL))
    bf16 = _stack(DEEP_EP)
    for stack in (blocking, capacity, bf16):
        copy_weights(reference, stack)
    inputs = _inputs(3)

    expected = run_steps(reference, inputs)
    assert_same_steps(expected, run_steps(blocking, inputs), "deep_ep fp8 blocking against torch fp8 blocking")
    actual = run_steps(capacity, inputs[:1])  # calibration
    with forbid_host_sync():
        actual += run_steps(capacity, inputs[1:])
    torch.cuda.synchronize()
    assert_same_steps(expected, actual, "deep_ep fp8 capacity 1.5 + equal against torch fp8 blocking")
    assert all(layer.token_dispatcher.capacity_manager.implementation == "deep_ep" for layer in capacity.layers)
    assert not torch.equal(run_steps(bf16, inputs[:1])[0][0], expected[0][0])


def test_deep_ep_blocking_makes_the_host_wait(megatron):
    from megatron_ext.tooling.sync import runahead_probe

    stack = _stack(DEEP_EP)
    inputs = _inputs(1)
    probe = runahead_probe(lambda: run_steps(stack, inputs))
    assert probe.waited, probe


def test_deep_ep_overflow_stops_on_the_device_with_the_layers_message():
    from tests.megatron_env import overflow_on_the_device

    overflow_on_the_device(dict(GPU, **DEEP_EP), TOKENS, HIDDEN, capacity=16, port=29534)
