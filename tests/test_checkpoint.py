"""Checkpoints across capacity mode, on 1 and 2 spawned gloo ranks (expert-parallel across them).

- A distributed checkpoint (Megatron's `dist_checkpointing`, the `torch_dist` format) written by a
  run without capacity mode (Megatron's local spec: SequentialMLP, one module per expert) loads into
  a run with capacity mode (megatron-ext's GroupedMLP, experts stacked), and back; every expert's
  weights arrive bitwise, and the two layers then compute the same thing.
- A plain `state_dict()` of SequentialMLP (`--ckpt-format torch`) loads into GroupedMLP, strictly.
- A run resumed from a checkpoint in capacity mode learns its capacities again (with a log line
  saying so) and its steps equal those of the run that went on without stopping, bitwise.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from tests.distributed import assert_ok, results_fixture
from tests.megatron_env import (
    FLEX,
    assert_same_steps,
    make_config,
    moe_layer,
    run_megatron_checks,
    run_steps,
    step_inputs,
)

WORLD_SIZES = (1, 2)
PREFIX = "decoder.layers.0.mlp."
CAPACITY = dict(FLEX, moe_hybridep_capacity_factor=1.5)


def _sharded(layer):
    return layer.sharded_state_dict(prefix=PREFIX)


def _save(layer, directory):
    from megatron.core import dist_checkpointing

    os.makedirs(directory, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(_sharded(layer), directory)


def _load(layer, directory):
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(_sharded(layer), directory)
    layer.load_state_dict({k.removeprefix(PREFIX): v for k, v in loaded.items()}, strict=True)


def _expert_weights(layer) -> dict[str, list[torch.Tensor]]:
    """Each local expert's fc1/fc2 weights, whichever experts module the layer has."""
    experts = layer.experts
    if hasattr(experts, "local_experts"):  # SequentialMLP
        return {n: [getattr(e, n).weight for e in experts.local_experts] for n in ("linear_fc1", "linear_fc2")}
    return {n: list(getattr(experts, n).weight) for n in ("linear_fc1", "linear_fc2")}  # GroupedMLP


def _assert_same_weights(a, b):
    wa, wb = _expert_weights(a), _expert_weights(b)
    for name in wa:
        assert len(wa[name]) == len(wb[name])
        for i, (x, y) in enumerate(zip(wa[name], wb[name], strict=True)):
            assert torch.equal(x, y), f"expert {i} {name} differs"
    assert torch.equal(a.router.weight, b.router.weight), "router"


def _assert_same_function(a, b, rank):
    inputs = step_inputs(rank, 2, 24, 16, seed=31)
    for (out_a, dx_a, _), (out_b, dx_b, _) in zip(run_steps(a, inputs), run_steps(b, inputs), strict=True):
        torch.testing.assert_close(out_b, out_a, rtol=1e-5, atol=1e-6)  # per-expert GEMMs against grouped ones
        torch.testing.assert_close(dx_b, dx_a, rtol=1e-5, atol=1e-6)


def dist_checkpoint_sequential_mlp_to_grouped_mlp_and_back(rank, world, directory):
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_ext.experts import GroupedMLP

    plain = moe_layer(make_config(world, **FLEX), experts="spec", seed=3)
    capacity = moe_layer(make_config(world, **CAPACITY), experts="spec", seed=4)  # the same spec, swapped
    assert isinstance(plain.experts, SequentialMLP) and isinstance(capacity.experts, GroupedMLP)
    _save(plain, os.path.join(directory, "sequential"))
    _load(capacity, os.path.join(directory, "sequential"))
    _assert_same_weights(plain, capacity)
    _assert_same_function(plain, capacity, rank)

    capacity = moe_layer(make_config(world, **CAPACITY), experts="spec", seed=5)
    back = moe_layer(make_config(world, **FLEX), experts="spec", seed=6)
    _save(capacity, os.path.join(directory, "grouped"))
    _load(back, os.path.join(directory, "grouped"))
    _assert_same_weights(capacity, back)


def plain_state_dict_of_sequential_mlp_loads_strictly(rank, world, directory):
    plain = moe_layer(make_config(world, **FLEX, add_bias_linear=True), experts="spec", seed=7)
    capacity = moe_layer(make_config(world, **CAPACITY, add_bias_linear=True), experts="spec", seed=8)
    assert any(".local_experts." in k for k in plain.state_dict())
    capacity.load_state_dict(plain.state_dict(), strict=True)
    _assert_same_weights(plain, capacity)
    for i, expert in enumerate(plain.experts.local_experts):
        assert torch.equal(capacity.experts.linear_fc1.bias[i], expert.linear_fc1.bias)
        assert torch.equal(capacity.experts.linear_fc2.bias[i], expert.linear_fc2.bias)


def _sgd(layer, lr=0.5):
    """One SGD step; the gradients of replicated parameters (the router) are averaged over the
    ranks as data parallelism would, so every replica stays the one the checkpoint holds."""
    world = torch.distributed.get_world_size()
    with torch.no_grad():
        for p in layer.parameters():
            if p.grad is None:
                continue
            if getattr(p, "allreduce", True) and world > 1:  # expert weights are marked allreduce=False
                torch.distributed.all_reduce(p.grad)
                p.grad /= world
            p -= lr * p.grad


def _train(layer, inputs):
    results = []
    for x in inputs:
        results += run_steps(layer, [x])
        _sgd(layer)
    return results


def resumed_run_relearns_capacity_and_equals_the_continued_run(rank, world, directory):
    from megatron_ext.training import recovery

    inputs = step_inputs(rank, 4, 32, 16, seed=41)
    continued = moe_layer(make_config(world, **CAPACITY), experts="grouped", seed=12)
    _train(continued, inputs[:2])
    _save(continued, os.path.join(directory, "resume"))
    expected = _train(continued, inputs[2:])

    resumed = moe_layer(make_config(world, **CAPACITY), experts="grouped", seed=13)
    _load(resumed, os.path.join(directory, "resume"))
    manager = resumed.token_dispatcher.capacity_manager
    assert manager.capacity is None, "a fresh layer has no capacity until it calibrates"

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    recovery.logger.addHandler(handler)
    recovery.logger.setLevel(logging.INFO)
    real = recovery._resumed_iteration
    recovery._resumed_iteration = lambda: 2
    try:
        recovery._say_capacities_are_relearned([manager])
    finally:
        recovery._resumed_iteration = real
        recovery.logger.removeHandler(handler)
    messages = [r.getMessage() for r in records]
    if rank == 0:
        assert len(messages) == 1 and "resumed at iteration 2" in messages[0], messages
    else:
        assert messages == [], "only the first rank says it"

    actual = _train(resumed, inputs[2:])
    assert manager.stats.calibrations == 1 and manager.capacity is not None
    assert_same_steps(expected, actual, "after resuming:")


CHECKS = (
    dist_checkpoint_sequential_mlp_to_grouped_mlp_and_back,
    plain_state_dict_of_sequential_mlp_loads_strictly,
    resumed_run_relearns_capacity_and_equals_the_continued_run,
)


def _worker(rank, world_size, out_dir):
    # Megatron's checkpoint writer waits for the GPU before it copies tensors; CPU ranks have none.
    torch.cuda.synchronize = lambda *args, **kwargs: None
    run_megatron_checks(rank, world_size, out_dir, CHECKS, lambda check: (os.path.join(out_dir, check.__name__),))


results = results_fixture(_worker, WORLD_SIZES)


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_checkpoint(results, check):
    _, outcomes = results
    assert_ok(outcomes, check)
