"""`megatron_ext.training.warmup`: every MoE layer's buffer built and dispatch run before the first step,
on 1 and 2 spawned gloo ranks, and the training patch that calls it before Megatron's `train`."""

from __future__ import annotations

import types

import pytest

from tests.megatron_env import (
    FLEX,
    assert_same_steps,
    copy_weights,
    make_config,
    megatron_check_tests,
    moe_layer,
    run_steps,
    step_inputs,
)

WORLD_SIZES = (1, 2)
TOKENS = 40  # not a multiple of 64: equal counts pad it to 64


def _manager(layer):
    return layer.token_dispatcher.capacity_manager


def warm_up_builds_the_buffer_and_changes_no_layer_state(rank, world):
    """The buffer a step would build exists after the warm-up, and the step reuses it; the layer
    has not calibrated, counted or dispatched anything of its own; two layers of the same shape
    are warmed once; the steps that follow equal those of a layer never warmed, bitwise."""
    from megatron_ext.hybridep import buffers
    from megatron_ext.training.warmup import warm_up

    buffers.release_buffers()
    flags = dict(**FLEX, moe_hybridep_capacity_factor=1.5, moe_hybridep_equal_token_counts=True)
    cold, warm, twin = (moe_layer(make_config(world, **flags), experts="grouped") for _ in range(3))
    copy_weights(cold, warm)
    assert warm_up([warm, twin], TOKENS) == 1  # one buffer and set of kernels serves both
    assert len(buffers._BUFFERS) == 1
    ((built, hidden, tokens),) = buffers._BUFFERS.values()
    assert (hidden, tokens) == (16, 64), (hidden, tokens)  # the equal-count padding of 40 tokens
    gather = built.routing_map_gather.stats.gathers
    assert gather == 2, gather  # the blocking dispatch and the non-blocking one ran
    manager = _manager(warm)
    assert manager.capacity is None and manager.counters is None and manager.last_buffer is None
    assert manager.stats.blocking_dispatches == manager.stats.non_blocking_dispatches == 0
    inputs = step_inputs(rank, 3, TOKENS, 16, seed=31)
    expected = run_steps(cold, inputs)
    buffers.release_buffers()  # the warmed layer's buffer comes from its warm-up, the cold one's did not
    assert warm_up(warm, TOKENS) == 1
    (built,) = [entry[0] for entry in buffers._BUFFERS.values()]
    assert_same_steps(expected, run_steps(warm, inputs), "warmed")
    assert manager.last_buffer is built  # the steps took the warmed buffer, not a new one
    assert manager.stats.blocking_dispatches >= 1 and manager.capacity is not None


def warm_up_refuses_no_tokens(rank, world):
    from megatron_ext.training.warmup import warm_up

    with pytest.raises(ValueError, match="num_tokens must be a positive number"):
        warm_up(moe_layer(make_config(world, **FLEX)), 0)


def blocking_layers_are_warmed_too(rank, world):
    from megatron_ext.hybridep import buffers
    from megatron_ext.training.warmup import warm_up

    buffers.release_buffers()
    layer = moe_layer(make_config(world, **FLEX))  # no deep_ep here: megatron-ext's torch buffer
    assert warm_up(layer, TOKENS) == 1
    (built,) = [entry[0] for entry in buffers._BUFFERS.values()]
    assert built.routing_map_gather.stats.gathers == 1  # blocking only
    inputs = step_inputs(rank, 1, TOKENS, 16, seed=32)
    run_steps(layer, inputs)
    assert _manager(layer).last_buffer is built


def deep_ep_is_warmed_blocking_only(rank, world):
    """deep_ep compiles its non-blocking kernels per capacity, which the calibration decides: its
    warm-up in capacity mode runs the blocking dispatch alone (deep_ep stood in by our buffer)."""
    import sys

    from megatron_ext.hybridep import TorchHybridEPBuffer, buffers
    from megatron_ext.training.warmup import warm_up

    class StandIn(TorchHybridEPBuffer):
        pass

    buffers.release_buffers()
    sys.modules["deep_ep"] = types.SimpleNamespace(HybridEPBuffer=StandIn)
    try:
        flags = dict(**FLEX, hidden_size=128, moe_hybridep_capacity_factor=1.5, moe_hybridep_implementation="deep_ep")
        assert warm_up(moe_layer(make_config(world, **flags), experts="grouped"), TOKENS) == 1
    finally:
        del sys.modules["deep_ep"]
    ((built, _, _),) = buffers._BUFFERS.values()
    assert type(built) is StandIn and built.routing_map_gather.stats.gathers == 1


def warm_up_before_training_reads_megatrons_shape(rank, world):
    """With --moe-hybridep-warm-up, the training patch's hook warms at --seq-length x
    --micro-batch-size tokens per rank (split over SP's TP ranks and CP); without it, nothing."""
    from megatron.training import global_vars

    from megatron_ext.hybridep import buffers
    from megatron_ext.training.warmup import tokens_per_rank, warm_up_before_training

    buffers.release_buffers()
    global_vars._GLOBAL_ARGS = types.SimpleNamespace(seq_length=24, micro_batch_size=2)
    try:
        assert warm_up_before_training([moe_layer(make_config(world, **FLEX))]) == 0
        assert not buffers._BUFFERS
        assert warm_up_before_training([moe_layer(make_config(world, **FLEX, moe_hybridep_warm_up=True))]) == 1
        ((_, _, tokens),) = buffers._BUFFERS.values()
        assert tokens == 48, tokens
    finally:
        global_vars._GLOBAL_ARGS = None
    config = types.SimpleNamespace(context_parallel_size=2, sequence_parallel=True, tensor_model_parallel_size=2)
    assert tokens_per_rank(config, 4096, 2) == 2048


def kernel_cache_on_the_torch_implementation_says_it_keeps_nothing(rank, world):
    """--moe-hybridep-kernel-cache with the torch implementation (a launch template may set it for
    every job): accepted, the first rank logs that it has no effect, and the warm-up writes nothing."""
    import logging
    import tempfile
    from pathlib import Path

    from megatron_ext.training.warmup import warm_up

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("megatron_ext.dispatcher")
    logger.addHandler(handler)
    previous = logger.level
    logger.setLevel(logging.INFO)
    folder = Path(tempfile.mkdtemp()) / "kernels"
    try:
        layer = moe_layer(
            make_config(world, **FLEX, moe_hybridep_implementation="torch", moe_hybridep_kernel_cache=str(folder))
        )
        assert warm_up(layer, TOKENS) == 1
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
    named = [m for m in said if "--moe-hybridep-kernel-cache" in m]
    if rank == 0:
        assert len(named) == 1 and "no effect here" in named[0], said
    else:
        assert named == [], said  # DEBUG on the other ranks
    assert not folder.exists(), "the torch implementation stored kernels"


CHECKS = (
    warm_up_builds_the_buffer_and_changes_no_layer_state,
    kernel_cache_on_the_torch_implementation_says_it_keeps_nothing,
    warm_up_refuses_no_tokens,
    blocking_layers_are_warmed_too,
    deep_ep_is_warmed_blocking_only,
    warm_up_before_training_reads_megatrons_shape,
)


results, test_warmup = megatron_check_tests(CHECKS, WORLD_SIZES)


def test_the_training_patch_warms_up_before_megatrons_train(monkeypatch):
    """The patch's `train` calls the warm-up with the model, then Megatron's `train` with every
    argument as given."""
    import megatron_ext.training.warmup
    from megatron_ext.patches import _train

    calls = []
    monkeypatch.setattr(
        megatron_ext.training.warmup, "warm_up_before_training", lambda model: calls.append(("warm", model))
    )
    train = _train(lambda *args, **kwargs: calls.append(("train", args, kwargs)) or "done")
    assert train("step", ["chunk"], "optimizer", pg_collection=None) == "done"
    assert calls == [("warm", ["chunk"]), ("train", ("step", ["chunk"], "optimizer"), {"pg_collection": None})]


def test_tokens_per_rank_without_sequence_parallelism():
    from megatron_ext.training.warmup import tokens_per_rank

    config = types.SimpleNamespace(context_parallel_size=1, sequence_parallel=False, tensor_model_parallel_size=4)
    assert tokens_per_rank(config, 1024, 3) == 3072
