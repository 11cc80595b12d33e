"""Capacity-mode overflow recovery in Megatron's training loop (`megatron_ext.training.recovery`), on 1 and
2 spawned gloo ranks with real Megatron MoE layers.

The step function stands in for Megatron's `forward_backward_func`: it runs the step's
micro-batches through the layer and accumulates their gradients. The reference is the same layer,
same weights, with blocking dispatches.
"""

from __future__ import annotations

import pytest
import torch

from tests.megatron_env import FLEX, copy_weights, make_config, megatron_check_tests, moe_layer, on_gpu, step_inputs

HIDDEN = 16
WORLD_SIZES = (1, 2)
MICROBATCHES = 2


def _forward_backward(*, model, data_iterator, num_microbatches, forward_only=False, **_):
    """Megatron's schedule in miniature: the losses of `num_microbatches` micro-batches."""
    layer = model[0]
    losses = []
    for _ in range(num_microbatches):
        x = next(data_iterator).detach().requires_grad_(True)  # as in a model: recompute needs it
        out = layer(x)[0]
        loss = (out * torch.linspace(-1.0, 1.0, out.numel(), device=out.device).view_as(out)).sum()
        if not forward_only:
            loss.backward()
        losses.append(loss.detach())
    return losses


def _step(layer, batches, wrapper=None):
    """One training step: gradients zeroed, the micro-batches run; returns (losses, gradients)."""
    layer.zero_grad(set_to_none=True)
    func = wrapper or _forward_backward
    losses = func(model=[layer], data_iterator=iter(batches), num_microbatches=len(batches), forward_only=False)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return losses, grads


def _layers(world, **options):
    capacity = moe_layer(make_config(world, **FLEX, moe_hybridep_capacity_factor=1.5, **options), experts="grouped")
    blocking = moe_layer(make_config(world, **FLEX), experts="grouped", seed=9)
    copy_weights(capacity, blocking)
    return capacity, blocking, capacity.token_dispatcher.capacity_manager


def _assert_use(use, rows, capacity):
    """`use` is rows / capacity, to float32's rounding (one last-bit step either way)."""
    expected = torch.tensor(int(rows) / capacity, dtype=torch.float32)
    torch.testing.assert_close(use.cpu(), expected, rtol=2.5e-7, atol=0)


def _assert_same_step(expected, actual):
    (losses_a, grads_a), (losses_b, grads_b) = expected, actual
    assert all(torch.equal(a, b) for a, b in zip(losses_a, losses_b, strict=True)), (losses_a, losses_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


def overflow_reruns_the_step_blocking_and_grows_the_capacity(rank, world, replays=0, **options):
    from megatron_ext.capacity import capacity_from_rows
    from megatron_ext.training.recovery import OverflowRerun

    layer, blocking, manager = _layers(world, **options)
    runner = OverflowRerun(_forward_backward)
    inputs = step_inputs(rank, 1 + 2 * MICROBATCHES, 32, HIDDEN, seed=5)
    calibration, step, later = inputs[:1], inputs[1 : 1 + MICROBATCHES], inputs[1 + MICROBATCHES :]
    _step(layer, calibration, runner)  # calibrates
    _step(blocking, calibration)
    manager.capacity = 4  # as if routing had drifted far past the calibrated rows: every rank overflows
    blocking_dispatches = manager.stats.blocking_dispatches

    rerun = _step(layer, step, runner)
    _assert_same_step(_step(blocking, step), rerun)  # the kept step is the blocking one: no truncated rows
    assert runner.reruns == 1
    # the re-run's dispatches were blocking, one per micro-batch (and per recompute replay)
    assert manager.stats.blocking_dispatches - blocking_dispatches == MICROBATCHES * (1 + replays)
    local = torch.tensor([manager.blocking_rows_max], device="cuda" if on_gpu() else "cpu")
    torch.distributed.all_reduce(local, op=torch.distributed.ReduceOp.MAX)
    assert manager.capacity == capacity_from_rows(int(local), 1.5, None) > 4
    assert not manager.record_overflow and not manager.force_blocking  # nothing left switched on

    non_blocking = manager.stats.non_blocking_dispatches
    _assert_same_step(_step(blocking, later), _step(layer, later, runner))
    assert runner.reruns == 1, "a step within the grown capacity was re-run"
    assert manager.stats.non_blocking_dispatches - non_blocking == MICROBATCHES * (1 + replays)  # capacity mode again


class _DelayedScaled(torch.nn.Module):
    """`layer` behind a Transformer Engine module under fp8 delayed scaling, in miniature: it rounds
    its input on a grid set by the scale that earlier forwards' amaxes made, then records its own
    amax and remakes the scale in `fp8_meta`, in place, as TE does after an fp8 forward. Its
    state is made by its first forward, as TE makes it."""

    def __init__(self, layer):
        super().__init__()
        self.layer, self.config, self.fp8_meta = layer, layer.config, {}

    def forward(self, x):
        if "scaling_fwd" not in self.fp8_meta:
            self.fp8_meta["scaling_fwd"] = _meta(torch.ones(1, device=x.device), torch.zeros(2, 1, device=x.device))
        meta = self.fp8_meta["scaling_fwd"]
        grid = 1 / (8 * meta.scale)
        # in x's dtype (the float32 scale would promote a bf16 x, which TE's router GEMM refuses on a GPU)
        rounded = (torch.round(x.float() / grid) * grid).to(x.dtype)
        x = x + (rounded - x).detach()  # the gradient passes straight through
        with torch.no_grad():
            meta.amax_history.copy_(torch.roll(meta.amax_history, 1, 0))
            meta.amax_history[0] = x.abs().amax()
            meta.scale.copy_(1 / meta.amax_history.amax(0).clamp(min=1e-3))
        return self.layer(x)


def _meta(scale, amax_history):
    import types

    return types.SimpleNamespace(scale=scale, amax_history=amax_history)


def delayed_scaling_is_put_back_before_a_rerun(rank, world):
    """An overflowed step recorded amaxes and remade its scales before it was discarded: its re-run
    starts from the scales the step began with, so the kept step, the step after it and the state
    they leave equal the blocking run's, bitwise."""
    from megatron_ext.training.recovery import OverflowRerun

    layer, blocking, manager = _layers(world)
    model, reference = _DelayedScaled(layer), _DelayedScaled(blocking)
    runner = OverflowRerun(_forward_backward)
    inputs = step_inputs(rank, 1 + 2 * MICROBATCHES, 32, HIDDEN, seed=23)
    calibration, step, later = inputs[:1], inputs[1 : 1 + MICROBATCHES], inputs[1 + MICROBATCHES :]
    _assert_same_step(_step(reference, calibration), _step(model, calibration, runner))
    manager.capacity = 4  # every rank overflows
    _assert_same_step(_step(reference, step), _step(model, step, runner))
    assert runner.reruns == 1
    _assert_same_step(_step(reference, later), _step(model, later, runner))
    ours, theirs = model.fp8_meta["scaling_fwd"], reference.fp8_meta["scaling_fwd"]
    assert torch.equal(ours.scale, theirs.scale) and torch.equal(ours.amax_history, theirs.amax_history)


def recompute_replays_across_the_rerun_and_the_growth(rank, world):
    """With Megatron's MoE recompute, the backward replays each forward: the overflowed forward is
    discarded with its replays, the re-run's forwards are replayed blocking as they ran, and the
    next step's forwards and replays use the grown capacity. Every kept step equals blocking's."""
    overflow_reruns_the_step_blocking_and_grows_the_capacity(
        rank, world, replays=1, recompute_granularity="selective", recompute_modules=["moe"]
    )


def no_overflow_no_rerun(rank, world):
    from megatron_ext.training.recovery import OverflowRerun

    layer, blocking, manager = _layers(world)
    runner = OverflowRerun(_forward_backward)
    inputs = step_inputs(rank, 1 + MICROBATCHES, 32, HIDDEN, seed=6)
    for batches in (inputs[:1], inputs[1:]):
        _assert_same_step(_step(blocking, batches), _step(layer, batches, runner))
    assert runner.reruns == 0 and manager.stats.non_blocking_dispatches == MICROBATCHES


def thin_headroom_grows_the_capacity_before_an_overflow(rank, world):
    from megatron_ext.training.recovery import OverflowRerun

    layer, blocking, manager = _layers(world)
    runner = OverflowRerun(_forward_backward)
    batches = step_inputs(rank, 1, 32, HIDDEN, seed=8)
    _step(layer, batches, runner)  # calibrates on these tokens
    _step(blocking, batches)
    calibrated, learned = manager.calibrated_rows, manager.capacity
    assert calibrated > 8
    # As if the layer had been calibrated on 8 rows fewer, with 4 rows of room left: the same
    # tokens again fit (no overflow) but fill more than half of the room above the calibration.
    manager.calibrated_rows, manager.capacity = calibrated - 8, calibrated + 4
    _assert_same_step(_step(blocking, batches), _step(layer, batches, runner))
    assert (runner.reruns, runner.resizes) == (0, 1)
    assert manager.capacity == learned  # ceil(the EP-group max of the rows used x 1.5), aligned


def capacity_use_goes_to_megatrons_moe_metrics(rank, world):
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from megatron_ext.dispatcher import CAPACITY_USE_MAX_METRIC, CAPACITY_USE_METRIC
    from megatron_ext.training.recovery import OverflowRerun

    layer, _, manager = _layers(world)
    runner = OverflowRerun(_forward_backward)
    batches = step_inputs(rank, 2, 32, HIDDEN, seed=9)
    _step(layer, batches[:1], runner)  # calibrates: nothing recorded (no capacity yet)
    tracker = get_moe_metrics_tracker()
    assert manager.layer_number == 1 and manager.log_metrics
    tracker.clear()
    _step(layer, batches[1:], runner)
    recorded = tracker.metrics[CAPACITY_USE_METRIC].values
    assert recorded.shape == (1,)
    _assert_use(recorded[0], manager.rows_used, manager.capacity)  # the step's one dispatch
    # The largest use on any rank, once per step (times its micro-batches: Megatron's report divides)
    import torch.distributed as dist

    uses = [None] * world
    dist.all_gather_object(uses, float(recorded[0]))
    largest = tracker.metrics[CAPACITY_USE_MAX_METRIC].values
    assert largest.shape == (1,) and float(largest[0]) == max(uses) * len(batches[1:]), (largest, uses)
    tracker.clear()


def capacity_use_max_is_the_largest_recorded_use_to_the_bit(rank, world):
    """The step's largest use (the step check's one reduction over the layers and ranks) equals the
    largest use a dispatch recorded, bit for bit, at a capacity where rows / capacity rounds apart
    from rows x (1 / capacity): computed one way in one place and the other way in the other, a rank's
    own use could exceed the maximum (CUDA divides a tensor by a host number through its reciprocal,
    and a tensor by a tensor exactly)."""
    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from megatron_ext.capacity import capacity_alignment, capacity_reciprocal
    from megatron_ext.dispatcher import CAPACITY_USE_MAX_METRIC, CAPACITY_USE_METRIC
    from megatron_ext.training.recovery import OverflowRerun

    layer, _, manager = _layers(world)
    runner = OverflowRerun(_forward_backward)
    batch = step_inputs(rank, 1, 24, HIDDEN, seed=21)  # rows not a power of two (those multiply exactly)
    _step(layer, batch, runner)  # calibrates
    _step(layer, batch, runner)  # the rows this batch uses, at the learned capacity
    rows = [None] * world
    dist.all_gather_object(rows, int(manager.rows_used))
    largest_rows = torch.tensor(float(max(rows)))
    # The first aligned capacity, from the learned one up (no overflow, no growth: the rows stay at or
    # below the calibrated ones), at which the two ways of computing the largest use differ.
    step = capacity_alignment(manager.pad_multiple)
    for capacity in range(manager.capacity, manager.capacity + 1000 * step, step):
        if not torch.equal(largest_rows / capacity, largest_rows * capacity_reciprocal(capacity)):
            break  # (on CPU both are what they say: a division, and a product)
    else:
        raise AssertionError(f"no capacity from {manager.capacity} rounds {max(rows)} rows apart")
    manager.capacity = capacity
    tracker = get_moe_metrics_tracker()
    tracker.clear()
    _step(layer, batch, runner)
    assert runner.reruns == 0 and runner.resizes == 0 and manager.capacity == capacity
    recorded = tracker.metrics[CAPACITY_USE_METRIC].values[0]
    _assert_use(recorded, manager.rows_used, capacity)
    uses = [None] * world
    dist.all_gather_object(uses, float(recorded))
    largest = tracker.metrics[CAPACITY_USE_MAX_METRIC].values[0]
    assert float(largest) == max(uses) and float(recorded) <= float(largest), (largest, uses)
    tracker.clear()


def calibration_is_logged_once_per_ep_group(rank, world):
    import logging

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger, handler = logging.getLogger("megatron_ext"), Keep(level=logging.DEBUG)
    logger.addHandler(handler)
    previous = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        layer, _, _ = _layers(world)
        _step(layer, step_inputs(rank, 1, 32, HIDDEN, seed=10))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
    calibrations = [r for r in records if "calibrated" in r.getMessage()]
    assert len(calibrations) == 1, [r.getMessage() for r in calibrations]
    assert calibrations[0].levelno == (logging.INFO if rank == 0 else logging.DEBUG)


def fail_policy_stops_on_the_device(rank, world):
    from megatron_ext.training.recovery import OverflowRerun

    layer, _, manager = _layers(world, moe_hybridep_overflow_policy="fail")
    runner = OverflowRerun(_forward_backward)
    inputs = step_inputs(rank, 2, 32, HIDDEN, seed=7)
    _step(layer, inputs[:1], runner)
    manager.capacity = 4
    with pytest.raises(RuntimeError, match="--moe-hybridep-capacity-factor"):
        _step(layer, inputs[1:], runner)
    assert runner.reruns == 0


def routing_shift_mid_training_is_survived_bitwise(rank, world):
    """Fault injection: from step 3 on, every token is pushed towards experts 0 and 1 (on the first
    rank, or the first two), as a router drifting during training would. The run goes on; every step
    it keeps equals blocking's bitwise; the shifted step overflows on the first rank (and on any
    other whose rows outgrew its capacity), is re-run once, and its layer's capacity grows; the
    capacity-use metric shows the overflow (above 1) and then the room again (at most 1); each step
    reads the host once, except the re-run step and the growth after it."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from megatron_ext.dispatcher import CAPACITY_USE_METRIC
    from megatron_ext.tooling.sync import count_host_syncs
    from megatron_ext.training.recovery import OverflowRerun

    layer, blocking, manager = _layers(world)
    runner = OverflowRerun(_forward_backward)
    inputs = step_inputs(rank, 2 + 3 * MICROBATCHES, 32, HIDDEN, seed=12)
    router = layer.router.weight.detach()
    push = 4.0 * (router[0] / router[0].norm() + router[1] / router[1].norm())
    shifted = [x + push.to(x.dtype).view(1, 1, -1) for x in inputs[2:]]
    steps = [inputs[:1], inputs[1:2]] + [shifted[i : i + MICROBATCHES] for i in range(0, len(shifted), MICROBATCHES)]
    tracker = get_moe_metrics_tracker()
    capacities, reads, use = [], [], []
    for batches in steps:
        tracker.clear()
        with count_host_syncs() as syncs:
            actual = _step(layer, batches, runner)
        reads.append(syncs.count)
        _assert_same_step(_step(blocking, batches), actual)
        capacities.append(manager.capacity)
        recorded = tracker.metrics[CAPACITY_USE_METRIC].values if CAPACITY_USE_METRIC in tracker.metrics else None
        # The tracker sums a layer's micro-batches (Megatron's report divides by their number).
        use.append(None if recorded is None or recorded.numel() == 0 else float(recorded.max()) / len(batches))
    tracker.clear()
    counts = manager.tokens_per_expert.float()
    assert counts[:2].sum() >= 0.5 * counts.sum() or rank != 0, "the push did not move the tokens"
    if world == 1:  # one rank receives every row however they are routed: nothing to outgrow
        assert runner.reruns == 0 and capacities[1:] == [capacities[1]] * (len(steps) - 1), capacities
        assert reads[1:] == [1] * (len(steps) - 1), reads
        return
    assert runner.reruns == 1, runner.reruns
    assert capacities[2] > capacities[1] and capacities[3] == capacities[2], capacities
    assert use[3] <= 1.0, use  # room again after the growth
    if rank == 0:  # the rank that received every row: its rows outgrew the capacity in the re-run
        assert use[2] > 1.0, use
    assert reads[1] == 1 and reads[3] == 1, reads  # the step's one read, none per layer
    assert manager.stats.calibrations == 2  # the calibration and the growth, on every rank alike
    # Which ranks overflow depends on where the pushed experts live (at 8 ranks one expert each, and
    # a rank whose expert the push also favours can outgrow its rows too): a rank counts an overflow
    # exactly when its rows outgrew its capacity.
    assert (int(manager.overflows) >= 1) == (use[2] > 1.0), (int(manager.overflows), use)


def counters_are_written_in_place_and_nothing_keeps_autograd_history(rank, world):
    """What a replayed CUDA graph must update lives in the tensors made at calibration (the overflow
    policy reads those, never a tensor rebound by Python), and no tensor the manager keeps past a
    step carries autograd history (it would tie a captured backward to an earlier step's stream)."""
    from megatron_ext.training.recovery import OverflowRerun

    layer, blocking, manager = _layers(world)
    runner = OverflowRerun(_forward_backward)
    inputs = step_inputs(rank, 3, 32, HIDDEN, seed=13)
    _step(layer, inputs[:1], runner)  # calibrates
    counters = manager.counters
    storage = (counters.rows_used.data_ptr(), counters.overflows.data_ptr())
    assert int(counters.rows_used) == 0 and int(counters.overflows) == 0
    _step(layer, inputs[1:2], runner)
    assert int(manager.rows_used) == int(manager.tokens_per_expert.sum()) > 0  # the step's one dispatch
    manager.capacity = 4  # every rank overflows
    _assert_same_step(_step(blocking, inputs[2:]), _step(layer, inputs[2:], runner))
    assert runner.reruns == 1 and int(manager.overflows) == 1
    assert manager.counters is counters
    assert (counters.rows_used.data_ptr(), counters.overflows.data_ptr()) == storage
    kept = {name: value for name, value in vars(manager).items() if isinstance(value, torch.Tensor)}
    assert manager.token_probs is None and manager.dispatched_probs is None
    assert not [name for name, value in kept.items() if value.requires_grad or value.grad_fn is not None], kept


def host_work_under_capture_is_refused_by_name(rank, world):
    """During a CUDA graph capture a blocking dispatch (calibration), growing the capacity and the
    uneven-count pad raise GraphCaptureError saying why; a calibrated layer's dispatch runs. (No GPU
    here: the capture is simulated by `megatron_ext.capacity.policy.capturing`, the one place the refusals ask.)"""
    from megatron_ext.capacity import policy as dispatcher
    from megatron_ext.dispatcher import GraphCaptureError

    layer, _, manager = _layers(world, moe_hybridep_equal_token_counts=True)
    padded, _, padded_manager = _layers(world, moe_hybridep_pad_uneven_dispatch_inputs=True)
    inputs = step_inputs(rank, 2, 32, HIDDEN, seed=14)
    real = dispatcher.capturing
    dispatcher.capturing = lambda: True
    try:
        with pytest.raises(GraphCaptureError, match="a blocking dispatch .* --cuda-graph-warmup-steps >= 1"):
            _step(layer, inputs[:1])
        assert manager.capacity is None
        with pytest.raises(GraphCaptureError, match="--moe-hybridep-pad-uneven-dispatch-inputs"):
            _step(padded, inputs[:1])
        assert padded_manager.stats.token_count_all_reduces == 0
        dispatcher.capturing = real
        _step(layer, inputs[:1])  # calibrates, eagerly
        dispatcher.capturing = lambda: True
        _step(layer, inputs[1:])  # non-blocking: nothing to refuse
        assert manager.stats.non_blocking_dispatches == 1
        with pytest.raises(GraphCaptureError, match="growing the capacity"):
            manager.grow_capacity(10_000, "a test")
    finally:
        dispatcher.capturing = real


def capacity_use_follows_a_layer_numbered_after_it_was_built(rank, world):
    """Megatron numbers a model's MoE layers after building them (TransformerLayer calls
    set_layer_number): the manager's name and its metric row follow that number."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from megatron_ext.bench.stack import experts_spec
    from megatron_ext.dispatcher import CAPACITY_USE_MAX_METRIC, CAPACITY_USE_METRIC
    from megatron_ext.training.recovery import OverflowRerun

    config = make_config(world, **FLEX, num_layers=4, moe_hybridep_capacity_factor=1.5)
    torch.manual_seed(3)
    layer = MoELayer(config, submodules=experts_spec("grouped", config.num_moe_experts))
    layer = layer.cuda() if on_gpu() else layer
    manager = layer.token_dispatcher.capacity_manager
    assert manager.layer_number is None and manager.name.startswith("MoE layer #")
    layer.set_layer_number(3)
    assert manager.layer_number == 3 and manager.name == "MoE layer 3"
    runner = OverflowRerun(_forward_backward)
    batches = step_inputs(rank, 2, 32, HIDDEN, seed=15)
    _step(layer, batches[:1], runner)
    tracker = get_moe_metrics_tracker()
    for metric in (CAPACITY_USE_METRIC, CAPACITY_USE_MAX_METRIC):
        tracker.metrics.pop(metric, None)  # made by other checks, for a model of one layer
    _step(layer, batches[1:], runner)
    recorded = tracker.metrics.pop(CAPACITY_USE_METRIC).values
    assert recorded.shape == (4,) and float(recorded[2]) > 0 and float(recorded.sum()) == float(recorded[2])
    _assert_use(recorded[2], manager.rows_used, manager.capacity)
    largest = tracker.metrics.pop(CAPACITY_USE_MAX_METRIC).values  # in the same row
    assert largest.shape == (4,) and float(largest[2]) >= float(recorded[2])
    assert float(largest.sum()) == float(largest[2])


class _StandInFullGraph:
    """Megatron's FullCudaGraphWrapper in miniature, for CPU ranks: the interface megatron-ext's
    full-iteration graph uses. Its 'replay' is the step function run as it is."""

    curr_iteration = {"training": 0, "validation": 0}

    def __init__(self, forward_backward_func, cuda_graph_warmup_steps=1, use_single_mempool=False):
        self.forward_backward_func = forward_backward_func
        self.cuda_graph_warmup_steps = cuda_graph_warmup_steps
        self.use_single_mempool = use_single_mempool
        self.calls = []

    def __call__(self, **kwargs):
        self.calls.append("graph")
        type(self).curr_iteration["training"] += 1
        return self.forward_backward_func(**kwargs)

    def reset_cuda_graph(self, stage=None):
        self.calls.append("reset")
        type(self).curr_iteration.update(training=0, validation=0)


def full_iteration_graph_keeps_the_policy_outside(rank, world):
    """Built around the overflow policy (as Megatron's training loop builds it), the full-iteration
    graph holds the plain step function and the policy holds the graph: an overflow re-runs the step
    eagerly (not through the graph) and blocking, grows the capacity, and drops the graph, to be
    captured again after one eager step."""
    from megatron_ext.training.recovery import OverflowRerun, full_iteration_graph

    layer, blocking, manager = _layers(world)
    rerun = OverflowRerun(_forward_backward)
    graph = full_iteration_graph(_StandInFullGraph)(rerun, cuda_graph_warmup_steps=3)
    assert graph.forward_backward_func is _forward_backward and graph.overflow_rerun is rerun
    inputs = step_inputs(rank, 1 + MICROBATCHES, 32, HIDDEN, seed=16)
    _step(layer, inputs[:1], graph)
    _step(blocking, inputs[:1])
    manager.capacity = 4
    _assert_same_step(_step(blocking, inputs[1:]), _step(layer, inputs[1:], graph))
    assert rerun.reruns == 1 and graph.calls == ["graph", "graph", "reset"]
    assert _StandInFullGraph.curr_iteration["training"] == 2  # the next step eager, the one after captured
    assert manager.capacity > 4
    plain = full_iteration_graph(_StandInFullGraph)(_forward_backward)  # no policy: Megatron's wrapper as it is
    assert plain.overflow_rerun is None and plain.forward_backward_func is _forward_backward


def per_layer_graphs_rerun_eagerly_and_are_captured_again(rank, world):
    """With Megatron's per-layer graphs holding the dispatch (`--cuda-graph-impl local`), an
    overflowed step's re-run deletes the graphs, runs blocking while the schedule's capture at its
    end is skipped (a blocking dispatch cannot be captured), and deletes what it recorded, so the
    next step records and is captured at its end; a capacity grown for thin headroom deletes them
    too. Megatron's graph functions are stand-ins here (CPU ranks); the schedule's capture goes
    through megatron-ext's patch of it."""
    import megatron.core.transformer.cuda_graphs as cuda_graphs

    from megatron_ext import patches
    from megatron_ext.training import recovery

    layer, blocking, manager = _layers(world)
    layer.config.cuda_graph_impl = "local"  # read per step by the policy; the layer was built without graphs
    # A graph manager as Megatron's modules hold them (made without its __init__, which needs CUDA),
    # with a runner of a captured graph: Megatron's delete leaves such runners in place, so the
    # drop must make the manager forget them, or nothing would record and be captured again.
    graphs = cuda_graphs.CudaGraphManager.__new__(cuda_graphs.CudaGraphManager)
    torch.nn.Module.__init__(graphs)
    layer.stand_in_graph_manager = graphs  # not `cudagraph_manager`, which would route the layer's calls

    def captured_runner():
        graphs.cudagraph_runners, graphs.custom_cudagraphs_lookup_table = ["runner"], {"key": "runner"}

    captured_runner()
    events = []
    capture = patches._create_cudagraphs(lambda: events.append("capture"))

    def schedule(**kwargs):  # Megatron's schedule ends by capturing what the step recorded
        losses = _forward_backward(**kwargs)
        capture()
        return losses

    real_delete = cuda_graphs.delete_cuda_graphs
    cuda_graphs.delete_cuda_graphs = lambda: events.append("delete")
    try:
        runner = recovery.OverflowRerun(schedule)
        inputs = step_inputs(rank, 1 + MICROBATCHES, 32, HIDDEN, seed=19)
        _step(layer, inputs[:1], runner)  # calibrates; captured at the step's end
        _step(blocking, inputs[:1])
        assert events == ["capture"]
        calibrated = manager.calibrated_rows
        manager.calibrated_rows, manager.capacity = calibrated - 8, calibrated + 4  # thin headroom, as above
        _assert_same_step(_step(blocking, inputs[:1]), _step(layer, inputs[:1], runner))
        assert events == ["capture", "capture", "delete"] and (runner.reruns, runner.resizes) == (0, 1)
        assert graphs.cudagraph_runners == [] and not graphs.custom_cudagraphs_lookup_table
        captured_runner()
        events.clear()
        manager.capacity = 4
        _assert_same_step(_step(blocking, inputs[1:]), _step(layer, inputs[1:], runner))
        # The overflowed step (its capture: a no-op in Megatron once graphs exist), then the re-run
        # between two deletions, without a capture.
        assert events == ["capture", "delete", "delete"], events
        assert runner.reruns == 1 and manager.capacity > 4 and not recovery.capture_paused()
        assert graphs.cudagraph_runners == [] and not graphs.custom_cudagraphs_lookup_table
        layer.config.cuda_graph_impl = "none"  # without graphs: nothing deleted, the re-run's capture not skipped
        events.clear()
        manager.capacity = 4
        _assert_same_step(_step(blocking, inputs[1:]), _step(layer, inputs[1:], runner))
        assert events == ["capture", "capture"] and runner.reruns == 2
    finally:
        cuda_graphs.delete_cuda_graphs = real_delete


def a_rerun_that_runs_no_blocking_dispatch_stops_the_job(rank, world):
    """A re-run that replayed a graph (its layers ran no blocking dispatch) would train on the
    truncated tokens of the overflow it re-runs: it stops with an error naming the layer."""
    from megatron_ext.training.recovery import OverflowRerun

    layer, _, manager = _layers(world)
    calls = []

    def step(**kwargs):
        calls.append(len(calls))
        if len(calls) == 3:  # the re-run, as a replay: no dispatch in Python
            return ["replayed"]
        return _forward_backward(**kwargs)

    runner = OverflowRerun(step)
    inputs = step_inputs(rank, 2, 32, HIDDEN, seed=23)
    _step(layer, inputs[:1], runner)  # calibrates
    manager.capacity = 4
    with pytest.raises(RuntimeError, match=f"ran no blocking dispatch in {manager.name}: a CUDA graph replayed"):
        _step(layer, inputs[1:], runner)
    assert len(calls) == 3 and not manager.force_blocking and not manager.record_overflow


def megatron_graph_warmup_leaves_the_overflow_check_and_counters_alone(rank, world):
    """Megatron runs a graphed module eagerly on stand-in inputs before capturing it (zeros for its
    per-layer graphs, ones in Transformer Engine's capture helper): every token routes alike, so
    with expert parallelism some rank receives more rows than a real step sends it. Such a warm-up
    neither stops at the overflow check nor counts rows or overflows; the same step outside a
    warm-up does overflow (at 2 ranks), which is what the check is there for."""
    import torch.distributed as dist
    from megatron.core.transformer import cuda_graphs

    layer, _, manager = _layers(world)
    inputs = step_inputs(rank, 1, 32, HIDDEN, seed=29)
    _step(layer, inputs)  # calibrates
    stand_in = [torch.zeros_like(inputs[0])]
    overflows, rows = manager.overflows.clone(), manager.rows_used.clone()
    cuda_graphs._set_warmup_start()
    try:
        _step(layer, stand_in)  # the fail policy: an overflow counted here would stop on the device
    finally:
        cuda_graphs._set_warmup_end()
    assert torch.equal(manager.overflows, overflows) and torch.equal(manager.rows_used, rows)
    assert manager.stats.non_blocking_dispatches == 1
    manager.record_overflow = True
    try:
        _step(layer, stand_in)
    finally:
        manager.record_overflow = False
    overflowed = (manager.overflows - overflows).reshape(1).clone()
    dist.all_reduce(overflowed)
    assert int(overflowed) > 0 if world > 1 else int(overflowed) == 0, (world, int(overflowed))


CHECKS = (
    megatron_graph_warmup_leaves_the_overflow_check_and_counters_alone,
    a_rerun_that_runs_no_blocking_dispatch_stops_the_job,
    per_layer_graphs_rerun_eagerly_and_are_captured_again,
    routing_shift_mid_training_is_survived_bitwise,
    counters_are_written_in_place_and_nothing_keeps_autograd_history,
    host_work_under_capture_is_refused_by_name,
    capacity_use_follows_a_layer_numbered_after_it_was_built,
    full_iteration_graph_keeps_the_policy_outside,
    overflow_reruns_the_step_blocking_and_grows_the_capacity,
    delayed_scaling_is_put_back_before_a_rerun,
    recompute_replays_across_the_rerun_and_the_growth,
    no_overflow_no_rerun,
    thin_headroom_grows_the_capacity_before_an_overflow,
    capacity_use_goes_to_megatrons_moe_metrics,
    capacity_use_max_is_the_largest_recorded_use_to_the_bit,
    calibration_is_logged_once_per_ep_group,
    fail_policy_stops_on_the_device,
)


results, test_recovery = megatron_check_tests(CHECKS, WORLD_SIZES)


def test_the_patch_wraps_the_schedule_of_megatrons_training_loop():
    from megatron.core import full_cuda_graph
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import cuda_graphs

    import megatron_ext.patches as patches
    from megatron_ext.training.recovery import OverflowRerun

    with patches.patched(dispatcher=False, experts=False, arguments=False, training=True) as done:
        import megatron.training.training as training

        assert done == [
            "megatron.training.training.get_forward_backward_func",
            "megatron.training.training.FullCudaGraphWrapper",
            "megatron.core.transformer.moe.moe_logging.MoEMetricsTracker.report",
            "megatron.core.pipeline_parallel.schedules.create_cudagraphs",
            "megatron.training.training.train",
        ]
        # What the schedules call at a step's end to capture per-layer graphs, skipped in a re-run.
        assert schedules.create_cudagraphs.__wrapped__ is cuda_graphs.create_cudagraphs
        func = training.get_forward_backward_func(pp_size=1)
        assert isinstance(func, OverflowRerun)
        assert func.forward_backward_func is schedules.forward_backward_no_pipelining
        # Megatron's own wrapper underneath (building one needs CUDA: the GPU tests do), its
        # class-level graph record shared, as train_step reads it.
        assert issubclass(training.FullCudaGraphWrapper, full_cuda_graph.FullCudaGraphWrapper)
        assert training.FullCudaGraphWrapper.cuda_graph is full_cuda_graph.FullCudaGraphWrapper.cuda_graph
    assert training.get_forward_backward_func(pp_size=1) is schedules.forward_backward_no_pipelining
    assert schedules.create_cudagraphs is cuda_graphs.create_cudagraphs


def test_delayed_scaling_state_is_kept_and_put_back():
    """Kept: each module's scales and amax histories as they were; a module without them yet (before
    its first fp8 step) gets TE's initial state back; modules without fp8 state are left alone."""
    from megatron_ext.training.recovery import DelayedScalingState

    made_later, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    made_later.fp8_meta = {}
    module = torch.nn.Linear(2, 2)
    module.fp8_meta = {
        "scaling_fwd": _meta(torch.rand(3), torch.rand(4, 3)),
        "scaling_bwd": _meta(torch.rand(2), torch.rand(4, 2)),
    }
    before = {key: (meta.scale.clone(), meta.amax_history.clone()) for key, meta in module.fp8_meta.items()}
    state = DelayedScalingState([torch.nn.Sequential(module, made_later, other)])
    assert state.modules == [module, made_later]
    state.keep()
    for meta in module.fp8_meta.values():  # what a step does to them, in place
        meta.scale.mul_(3)
        meta.amax_history.add_(1)
    made_later.fp8_meta["scaling_fwd"] = _meta(torch.full((2,), 5.0), torch.full((4, 2), 7.0))
    state.restore()
    for key, meta in module.fp8_meta.items():
        assert torch.equal(meta.scale, before[key][0]) and torch.equal(meta.amax_history, before[key][1]), key
    fresh = made_later.fp8_meta["scaling_fwd"]
    assert torch.equal(fresh.scale, torch.ones(2)) and torch.equal(fresh.amax_history, torch.zeros(4, 2))
    state.keep()  # the next step keeps the state it starts from, the made one included
    fresh.scale.fill_(9.0)
    state.restore()
    assert torch.equal(fresh.scale, torch.ones(2))


def test_recipe_states_without_delayed_scaling_are_left_alone():
    """Current-scaling and blockwise recipes keep no scales between steps: their recipe states
    (TE's Float8CurrentScalingRecipeState, Float8BlockScalingRecipeState) have no scale or amax
    history, and keeping or putting back a step leaves them as they are (a training run with
    --fp8-recipe blockwise stopped at its first kept step with an AttributeError before)."""
    import types

    from megatron_ext.training.recovery import DelayedScalingState

    blockwise, made_later = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    state_object = types.SimpleNamespace(dtype="e4m3")
    blockwise.fp8_meta = {"scaling_fwd": state_object, "scaling_bwd": state_object}
    made_later.fp8_meta = {}
    state = DelayedScalingState([torch.nn.Sequential(blockwise, made_later)])
    state.keep()
    made_later.fp8_meta["scaling_fwd"] = types.SimpleNamespace(dtype="e4m3")  # made by the step
    state.restore()
    assert blockwise.fp8_meta["scaling_fwd"] is state_object and vars(state_object) == {"dtype": "e4m3"}
    assert vars(made_later.fp8_meta["scaling_fwd"]) == {"dtype": "e4m3"}


@pytest.mark.parametrize("single_mempool", [True, False], ids=["single-mempool", "pool-per-capture"])
def test_dropped_full_iteration_graphs_are_captured_again_into_a_new_pool(single_mempool, monkeypatch):
    """With --cuda-graph-use-single-mempool (Megatron's default) every capture names one pool handle
    per process, and PyTorch's allocator stops a capture into a pool whose graphs are all deleted
    (an internal assert, seen on an H200 at the first re-capture in a training run): dropping the
    graphs forgets the handle, so the next capture makes a new pool."""
    from megatron.core import full_cuda_graph

    from megatron_ext.training.recovery import drop_graphs

    handle = (0, 12345)
    monkeypatch.setattr(full_cuda_graph, "_shared_graph_pool", handle)
    graph = _StandInFullGraph(_forward_backward, cuda_graph_warmup_steps=3, use_single_mempool=single_mempool)
    drop_graphs(graph)
    assert graph.calls == ["reset"] and _StandInFullGraph.curr_iteration["training"] == 2
    if single_mempool:
        assert full_cuda_graph._shared_graph_pool is None
        assert full_cuda_graph.get_shared_graph_pool() != handle  # what the next capture names
    else:
        assert full_cuda_graph._shared_graph_pool == handle  # Megatron makes a new pool per capture itself


@pytest.mark.parametrize(
    "config",
    [
        dict(moe_hybridep_capacity_factor=None),
        dict(moe_hybridep_capacity_factor=1.5, moe_hybridep_overflow_policy="fail"),
    ],
    ids=["no-capacity-mode", "fail-policy"],
)
def test_without_the_rerun_policy_the_step_passes_through(config):
    import types

    from megatron_ext.training.recovery import OverflowRerun

    seen = {}

    def inner(**kwargs):
        seen.update(kwargs)
        return "losses"

    module = torch.nn.Linear(2, 2)
    module.config = types.SimpleNamespace(**config)
    data = iter([1, 2])
    assert OverflowRerun(inner)(model=[module], data_iterator=data, num_microbatches=2) == "losses"
    assert seen["data_iterator"] is data  # not read ahead, not copied


@pytest.mark.parametrize("on", [True, False])
def test_the_moe_metrics_report_names_capacity_use_in_capacity_mode(on, monkeypatch):
    from megatron_ext.dispatcher import CAPACITY_USE_MAX_METRIC, CAPACITY_USE_METRIC
    from megatron_ext.patches import _moe_metrics_report
    from megatron_ext.training import recovery

    seen = []
    report = _moe_metrics_report(lambda self, track_names=None, **kwargs: seen.append(track_names))
    monkeypatch.setattr(recovery, "_capacity_metrics", on)
    report(None, track_names=["load_balancing_loss"], iteration=3)
    report(None, track_names=None)  # None: Megatron reports every metric, ours among them
    ours = [CAPACITY_USE_METRIC, CAPACITY_USE_MAX_METRIC]
    expected = ["load_balancing_loss", *ours] if on else ["load_balancing_loss"]
    assert seen == [expected, None]


class _Counted(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the operators run under it (each a kernel launch on a GPU)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


class _Layer:
    """What StepCheck reads of a capacity-mode dispatch manager."""

    def __init__(self, number: int, capacity: int, calibrated_rows: int):
        from megatron_ext.dispatcher import DeviceCounters

        self.counters = DeviceCounters.zeros(torch.device("cpu"))
        self.layer_number, self.capacity, self.calibrated_rows = number, capacity, calibrated_rows

    overflows = property(lambda self: self.counters.overflows)
    rows_used = property(lambda self: self.counters.rows_used)
    expert_rows_used = property(lambda self: self.counters.expert_rows_used)

    def headroom_threshold(self):
        return self.calibrated_rows + (self.capacity - self.calibrated_rows) // 2

    def budget_headroom_threshold(self):
        return None


def _step_check(layers: list, model_layers: int):
    from megatron_ext.training.recovery import StepCheck

    check = StepCheck(layers)
    for layer in layers:  # a step: each layer's rows, and layer 2 overflows
        layer.counters.rows_used.fill_(10 * layer.layer_number)
        layer.counters.overflows.add_(1 if layer.layer_number == 2 else 0)
    return check.read(model_layers)


def _checked_step(count: int) -> tuple[int, tuple]:
    """The operators one StepCheck (made and read) runs for `count` layers, and what it read."""
    # Layer n (numbered 2n, one stage of a model of 2 x count layers) had an overflow before the step.
    layers = [_Layer(2 * n, capacity=100 * n, calibrated_rows=50 * n) for n in range(1, count + 1)]
    for layer in layers:
        layer.counters.overflows.fill_(3)
    _step_check(layers, 2 * count)  # makes the limits' device tensors, kept for later steps
    for layer in layers:
        layer.counters.overflows.fill_(3)
    with _Counted() as counted:
        read = _step_check(layers, 2 * count)
    return counted.ops - 2 * count, read  # less the stand-in step's fill_ and add_ per layer


def test_the_step_check_reads_every_layer_in_a_fixed_number_of_launches(monkeypatch):
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, op=None, group=None: None)  # one rank
    few, (overflowed, thin, uses) = _checked_step(2)
    many, (overflowed_8, thin_8, uses_8) = _checked_step(8)
    assert few == many, "the step check's launches must not grow with the layer count"
    # Only layer 2's count grew in the step; layer 2n filled 20n of 100n rows (threshold 75n): not thin.
    assert overflowed and overflowed_8 and not thin and not thin_8
    for count, got in ((2, uses), (8, uses_8)):
        expected = torch.zeros(2 * count)
        expected[1::2] = 0.2  # layer 2n: 20n rows of 100n; odd-numbered layers are another stage's
        torch.testing.assert_close(got, expected)


def test_the_step_check_sees_thin_headroom_and_counts_before_the_step_as_old(monkeypatch):
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, op=None, group=None: None)
    layers = [_Layer(1, capacity=100, calibrated_rows=50), _Layer(2, capacity=100, calibrated_rows=10)]
    layers[1].counters.overflows.fill_(5)  # overflowed in an earlier step: not this one's
    overflowed, thin, _ = _step_check(layers[:1] + [_Layer(3, 100, 90)], 3)
    assert not overflowed and not thin  # layer 3 filled 30 rows, below its 95
    from megatron_ext.training.recovery import StepCheck

    check = StepCheck(layers)
    layers[1].counters.rows_used.fill_(56)  # above 10 + 90 // 2 = 55
    assert check.read(2)[1]
    assert not check.read(2)[0]


def test_the_steps_largest_use_goes_to_megatrons_metric_in_one_launch_for_this_ranks_layers():
    """`_record_largest_use`: each of this rank's layers gets uses[layer - 1] x the micro-batch count
    (which Megatron's report divides by) and the other stages' layers 0, in one launch whatever the
    layer count once the scale is made."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from megatron_ext.dispatcher import CAPACITY_USE_MAX_METRIC
    from megatron_ext.training.recovery import _record_largest_use

    class Counted(torch.utils._python_dispatch.TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    tracker = get_moe_metrics_tracker()
    tracker.metrics.pop(CAPACITY_USE_MAX_METRIC, None)
    layers = [_Layer(n, capacity=100 * n, calibrated_rows=50 * n) for n in (2, 3, 5)]  # this stage's layers
    for layer in layers:
        layer.log_metrics = True
    layers[2].capacity = None  # not calibrated before the step: records nothing
    uses = torch.rand(6, generator=torch.Generator().manual_seed(3))
    _record_largest_use(layers, uses, 6)  # makes Megatron's entry and the scale
    tracker.clear()
    with Counted() as counted:
        _record_largest_use(layers, uses, 6)
    assert counted.ops == ["addcmul_"]
    values = tracker.metrics.pop(CAPACITY_USE_MAX_METRIC).values
    expected = torch.zeros(6)
    expected[[1, 2]] = uses[[1, 2]] * 6  # bit for bit the product torch rounds
    assert torch.equal(values, expected)


def test_a_metric_entry_that_does_not_fit_megatron_exts_kernels_is_refused_by_name():
    """The metric values megatron-ext adds into in place are made by Megatron's `record` when missing
    (zeros, one per layer); an entry of another size or dtype under the name is refused, naming it."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from megatron_ext.capacity.policy import megatron_metric_values

    tracker = get_moe_metrics_tracker()
    made = megatron_metric_values("megatron_ext_test_metric", torch.device("cpu"), 3)
    assert torch.equal(made, torch.zeros(3)) and tracker.metrics["megatron_ext_test_metric"].values is made
    assert megatron_metric_values("megatron_ext_test_metric", torch.device("cpu"), 3) is made  # kept, not remade
    with pytest.raises(RuntimeError, match="'megatron_ext_test_metric' holds .* expected float32 values of its 4"):
        megatron_metric_values("megatron_ext_test_metric", torch.device("cpu"), 4)
    tracker.metrics.pop("megatron_ext_test_metric")
