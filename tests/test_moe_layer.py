"""Real Megatron-Core MoE layers with megatron-ext's patch, on 1, 2 and 4 spawned gloo ranks.

One spawn per world size runs every check (each builds its layers from Megatron's own layer spec
and config, runs several forward/backward steps on fresh per-rank inputs, so routing changes
every step) and records "ok" or the failure; the tests below read the records. Within a check
every rank runs the same collectives before asserting, so a failure cannot leave ranks out of step.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from megatron_ext import fused
from tests.distributed import assert_ok, results_fixture
from tests.megatron_env import (
    BASE,
    FLEX,
    copy_weights,
    make_config,
    moe_layer,
    run_megatron_checks,
    run_steps,
    step_inputs,
)

WORLD_SIZES = (1, 2, 4)
HIDDEN = 16
DEEP_EP_HIDDEN = 128


def _manager(layer):
    return layer.token_dispatcher.capacity_manager


def _assert_same(expected, actual, exact=True):
    """Outputs, input gradients and parameter gradients of two runs, step by step."""
    assert len(expected) == len(actual)
    for step, ((out_a, dx_a, g_a), (out_b, dx_b, g_b)) in enumerate(zip(expected, actual)):
        pairs = [("output", out_a, out_b), ("input grad", dx_a, dx_b)]
        assert g_a.keys() == g_b.keys(), (sorted(g_a), sorted(g_b))
        pairs += [(f"grad {name}", g_a[name], g_b[name]) for name in g_a]
        for what, a, b in pairs:
            if exact:
                assert torch.equal(a, b), f"step {step}: {what} differs by {(a - b).abs().max()}"
            elif a.dtype == torch.bfloat16:  # GPU ranks: another summation order, in bf16
                error = float((b.float() - a.float()).norm() / a.float().norm().clamp_min(1e-30))
                assert error <= 3e-2, f"step {step}: {what}: relative error {error:.3g} > 3e-2"
            else:
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"step {step}: {what}")


# --------------------------------------------------------------------------- checks


def dispatcher_is_ours_with_flags(rank, world):
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_ext.dispatcher import HybridEPCapacityManager, HybridEPTokenDispatcher
    from megatron_ext.experts import GroupedMLP

    layer = moe_layer(make_config(world, **FLEX, moe_hybridep_capacity_factor=1.5))
    assert type(layer.token_dispatcher) is HybridEPTokenDispatcher and layer.token_dispatcher.uses_megatron_ext
    assert isinstance(_manager(layer), HybridEPCapacityManager)
    assert _manager(layer).name == "MoE layer 1"
    assert isinstance(layer.experts, GroupedMLP), type(layer.experts)  # SequentialMLP reads counts on the host
    blocking = moe_layer(make_config(world, **FLEX))
    assert isinstance(blocking.experts, SequentialMLP)  # only capacity mode swaps the experts


def no_flags_equal_stock_alltoall(rank, world):
    stock = moe_layer(make_config(world, moe_token_dispatcher_type="alltoall"))
    ours = moe_layer(make_config(world, **FLEX), seed=99)
    copy_weights(stock, ours)
    assert ours.token_dispatcher.uses_megatron_ext  # no deep_ep here: hybridep runs on the torch buffer
    inputs = step_inputs(rank, 3, 24, HIDDEN, seed=1)
    _assert_same(run_steps(stock, inputs), run_steps(ours, inputs), exact=False)


def blocking_backward_reads_nothing(rank, world):
    """The blocking dispatch reads its counts once, in the forward; its backward reuses them."""
    from megatron_ext.tooling.sync import count_host_syncs, forbid_host_sync

    layer = moe_layer(make_config(world, **FLEX), experts="grouped")
    x = step_inputs(rank, 1, 32, HIDDEN, seed=9)[0].requires_grad_(True)
    with count_host_syncs() as forward:
        out = layer(x)[0]
    with forbid_host_sync():
        out.sum().backward()
    assert forward.count == 1 and "tolist" in forward.events[0].what, forward.events


def _capacity_equals_blocking(rank, world, factor, static):
    from megatron_ext.capacity import capacity_from_rows
    from megatron_ext.tooling.sync import forbid_host_sync

    inputs = step_inputs(rank, 4, 32, HIDDEN, seed=2)
    if static:  # factor 1.0 leaves no room for routing drift: keep the calibration batch
        inputs = [inputs[0]] * len(inputs)
    blocking = moe_layer(make_config(world, **FLEX), experts="grouped")
    capacity = moe_layer(make_config(world, **FLEX, moe_hybridep_capacity_factor=factor), experts="grouped", seed=7)
    copy_weights(blocking, capacity)
    expected = run_steps(blocking, inputs)
    actual = run_steps(capacity, inputs[:1])
    with forbid_host_sync():
        actual += run_steps(capacity, inputs[1:])
    manager = _manager(capacity)
    local_rows = [None] * world
    dist.all_gather_object(local_rows, manager.local_calibration_rows)
    _assert_same(expected, actual)
    assert manager.stats.calibrations == 1 and manager.stats.blocking_dispatches == 1
    assert manager.stats.non_blocking_dispatches == len(inputs) - 1
    assert manager.calibrated_rows == max(local_rows)  # the EP-group maximum
    assert manager.capacity == capacity_from_rows(max(local_rows), factor) and manager.capacity % 4 == 0


def capacity_1_0_equals_blocking(rank, world):
    _capacity_equals_blocking(rank, world, 1.0, static=True)


def capacity_1_5_equals_blocking(rank, world):
    _capacity_equals_blocking(rank, world, 1.5, static=False)


def capacity_2_0_equals_blocking(rank, world):
    _capacity_equals_blocking(rank, world, 2.0, static=False)


def too_small_capacity_fails_loudly(rank, world):
    from megatron_ext.tooling.sync import forbid_host_sync

    layer = moe_layer(make_config(world, **FLEX, moe_hybridep_capacity_factor=1.0), experts="grouped")
    inputs = step_inputs(rank, 2, 32, HIDDEN, seed=3)
    run_steps(layer, inputs[:1])
    manager = _manager(layer)
    assert manager.local_calibration_rows > 4  # so every rank overflows below, none waits for the others
    manager.capacity = 4  # as if routing had drifted far past the calibrated count
    with pytest.raises(RuntimeError) as caught, forbid_host_sync():  # checked on the device, not read
        run_steps(layer, inputs[1:])
    message = str(caught.value)
    for part in ("MoE layer 1", "capacity of 4 rows", "--moe-hybridep-capacity-factor", "truncated", "policy rerun"):
        assert part in message, message
    assert len(message) < 255, message  # CUDA's _assert_async refuses longer messages


def equal_token_counts_skip_the_all_reduce(rank, world):
    from megatron_ext.bench.counters import count_collectives
    from megatron_ext.tooling.sync import forbid_host_sync

    inputs = step_inputs(rank, 3, 30, HIDDEN, seed=4)  # 30 tokens: padded to 64 for HybridEP
    blocking = moe_layer(make_config(world, **FLEX), experts="grouped")
    equal = moe_layer(
        make_config(world, **FLEX, moe_hybridep_equal_token_counts=True, moe_hybridep_capacity_factor=1.5),
        experts="grouped",
        seed=8,
    )
    padded = moe_layer(make_config(world, **FLEX, moe_hybridep_pad_uneven_dispatch_inputs=True), experts="grouped")
    copy_weights(blocking, equal)
    copy_weights(blocking, padded)
    expected = run_steps(blocking, inputs)
    actual = run_steps(equal, inputs[:1])
    with count_collectives() as equal_calls, forbid_host_sync():
        actual += run_steps(equal, inputs[1:])
    with count_collectives() as padded_calls:
        padded_results = run_steps(padded, inputs)
    _assert_same(expected, actual)
    _assert_same(expected, padded_results)
    assert equal_calls.all_reduces == 0, equal_calls
    assert padded_calls.all_reduces == len(inputs), padded_calls  # Megatron's way: one per dispatch
    assert _manager(equal).routing_map.shape[0] == 64


def verify_catches_unequal_counts(rank, world):
    from megatron_ext.bench.counters import count_collectives
    from megatron_ext.tooling.sync import forbid_host_sync

    equal = dict(moe_hybridep_equal_token_counts=True, moe_hybridep_verify_equal_token_counts=True)
    layer = moe_layer(make_config(world, **FLEX, **equal, moe_hybridep_capacity_factor=1.5), experts="grouped")
    inputs = step_inputs(rank, 2, 30, HIDDEN, seed=5)
    run_steps(layer, inputs[:1])  # calibration
    with count_collectives() as calls, forbid_host_sync():  # the check reads nothing on the host
        run_steps(layer, inputs[1:])  # equal counts pass
    assert calls.all_reduces == 1, calls  # the check's one all-reduce per dispatch
    if world == 1:
        return
    with pytest.raises(RuntimeError, match="hold different token counts") as caught:
        run_steps(layer, step_inputs(rank, 1, 30 + rank, HIDDEN, seed=5))
    assert "--moe-hybridep-pad-uneven-dispatch-inputs" in str(caught.value) and len(str(caught.value)) < 255


def _recompute_same_gradients(rank, world, recompute):
    from megatron.core import tensor_parallel

    inputs = step_inputs(rank, 3, 32, HIDDEN, seed=6)
    capacity = dict(**FLEX, moe_hybridep_capacity_factor=1.5)
    plain = moe_layer(make_config(world, **capacity), experts="grouped")
    if recompute == "moe":
        config = make_config(world, **capacity, recompute_granularity="selective", recompute_modules=["moe"])
        wrap = None
    else:  # what full recompute does to a transformer layer
        config = make_config(world, **capacity)

        def wrap(layer, x):
            return tensor_parallel.checkpoint(lambda h: layer(h)[0], False, x)

    recomputed = moe_layer(config, experts="grouped", seed=9)
    copy_weights(plain, recomputed)
    expected = run_steps(plain, inputs)
    actual = run_steps(recomputed, inputs, wrap=wrap)
    _assert_same(expected, actual)
    stats = _manager(recomputed).stats
    # The calibration forward ran without grad and was replayed blocking; the rest at capacity.
    assert stats.blocking_dispatches == 2 and stats.non_blocking_dispatches == 2 * (len(inputs) - 1), stats


def exact_transport_equals_blocking(rank, world):
    """--moe-hybridep-transport nvshmem in a Megatron MoE layer, its exchange stood in on CPU ranks
    (`tests.device_splits.SlabExchange`): capacity mode sends exact rows with no host read, bitwise
    equal to blocking, through MoE recompute too."""
    import megatron_ext.hybridep.torch_buffer as torch_buffer
    from megatron_ext.tooling.sync import forbid_host_sync
    from tests.device_splits import SlabExchange

    chosen = torch_buffer.choose_exchange
    torch_buffer.choose_exchange = lambda group, transport, row_bytes: SlabExchange(group)
    try:
        inputs = step_inputs(rank, 3, 32, HIDDEN, seed=13)
        exact = dict(**FLEX, moe_hybridep_capacity_factor=1.5, moe_hybridep_transport="nvshmem")
        recompute = dict(recompute_granularity="selective", recompute_modules=["moe"])
        blocking = moe_layer(make_config(world, **FLEX), experts="grouped")
        layer = moe_layer(make_config(world, **exact, **recompute), experts="grouped", seed=7)
        copy_weights(blocking, layer)
        expected = run_steps(blocking, inputs)
        actual = run_steps(layer, inputs[:1])
        with forbid_host_sync():
            actual += run_steps(layer, inputs[1:])
    finally:
        torch_buffer.choose_exchange = chosen
    _assert_same(expected, actual)
    buffer = _manager(layer).last_buffer
    assert buffer.non_blocking_transport == "slabs", buffer.non_blocking_transport
    assert _manager(layer).stats.non_blocking_dispatches == 2 * (len(inputs) - 1)  # forwards and their replays


def moe_recompute_same_gradients(rank, world):
    _recompute_same_gradients(rank, world, "moe")


def full_recompute_same_gradients(rank, world):
    _recompute_same_gradients(rank, world, "full")


def moe_act_recompute_kept_in_capacity_mode(rank, world):
    """--recompute-modules moe_act survives the swap to GroupedMLP: the same results, recomputed."""
    from megatron_ext.experts import GroupedMLP

    capacity = dict(**FLEX, moe_hybridep_capacity_factor=1.5)
    moe_act = dict(moe_grouped_gemm=True, recompute_granularity="selective", recompute_modules=["moe_act"])
    plain = moe_layer(make_config(world, **capacity), experts="grouped")
    recomputed = moe_layer(make_config(world, **capacity, **moe_act), seed=9)  # Megatron's spec, swapped
    assert isinstance(recomputed.experts, GroupedMLP) and recomputed.experts.activation_recompute
    copy_weights(plain, recomputed)
    inputs = step_inputs(rank, 3, 32, HIDDEN, seed=11)
    _assert_same(run_steps(plain, inputs), run_steps(recomputed, inputs))


def reuse_allgather_buffer(rank, world):
    from megatron_ext.hybridep.buffers import release_buffers

    release_buffers()
    inputs = step_inputs(rank, 3, 32, HIDDEN, seed=7)
    fresh = moe_layer(make_config(world, **FLEX), experts="grouped")
    reused = moe_layer(make_config(world, **FLEX, moe_hybridep_reuse_allgather_buffer=True), experts="grouped")
    copy_weights(fresh, reused)
    _assert_same(run_steps(fresh, inputs), run_steps(reused, inputs))
    fresh_stats = _manager(fresh).last_buffer.routing_map_gather.stats
    reused_stats = _manager(reused).last_buffer.routing_map_gather.stats
    allocations = 0 if world == 1 else len(inputs)  # one rank's gather returns its own map
    assert fresh_stats.gathers == len(inputs) and fresh_stats.allocations == allocations
    assert reused_stats.gathers == len(inputs) and reused_stats.allocations == min(1, allocations)


def compact_routing_equals_dense(rank, world):
    """--moe-hybridep-compact-routing in Megatron MoE layers (auto: the torch implementation), blocking
    and in capacity mode with equal counts and reuse (no host read): bitwise the dense gather's
    results, E / (2k) fewer routing-map bytes sent, the reused buffers allocated once."""
    from megatron_ext.hybridep.buffers import release_buffers
    from megatron_ext.hybridep.torch_buffer.allgather import release_shared_routing_map_buffers
    from megatron_ext.tooling.sync import forbid_host_sync

    release_buffers()
    release_shared_routing_map_buffers()
    inputs = step_inputs(rank, 2, 32, HIDDEN, seed=14)  # the calibration, then a non-blocking step
    compact = dict(**FLEX, moe_hybridep_compact_routing=True)
    capacity = dict(moe_hybridep_capacity_factor=1.5, moe_hybridep_equal_token_counts=True)
    dense = moe_layer(make_config(world, **FLEX), experts="grouped")
    blocking = moe_layer(make_config(world, **compact), experts="grouped", seed=7)
    reused = moe_layer(
        make_config(world, **compact, **capacity, moe_hybridep_reuse_allgather_buffer=True), experts="grouped", seed=8
    )
    copy_weights(dense, blocking)
    copy_weights(dense, reused)
    expected = run_steps(dense, inputs)
    _assert_same(expected, run_steps(blocking, inputs))
    actual = run_steps(reused, inputs[:1])
    with forbid_host_sync():
        actual += run_steps(reused, inputs[1:])
    _assert_same(expected, actual)
    experts, topk = BASE["num_moe_experts"], BASE["moe_router_topk"]
    layers = dict(dense=dense, blocking=blocking, reused=reused)
    sent = {name: _manager(layer).last_buffer.routing_map_gather.stats for name, layer in layers.items()}
    assert _manager(reused).implementation == _manager(blocking).implementation == "torch"
    assert sent["dense"].last_bytes_sent == (world - 1) * 32 * experts, sent["dense"]
    assert sent["blocking"].last_bytes_sent == (world - 1) * 32 * topk * 2, sent["blocking"]  # int16 indices
    assert sent["reused"].last_bytes_sent == (world - 1) * 64 * topk * 2, sent["reused"]  # 32 tokens padded to 64
    assert sent["blocking"].last_bytes_sent * experts == sent["dense"].last_bytes_sent * 2 * topk
    # The indices and the map they expand to: one allocation each, for every dispatch (one rank: none).
    assert (sent["reused"].gathers, sent["reused"].allocations) == (len(inputs), 0 if world == 1 else 2), sent["reused"]
    assert sent["blocking"].allocations == (0 if world == 1 else 2 * len(inputs)), sent["blocking"]


class _QuantizedGradient(torch.autograd.Function):
    """Identity forward; the gradient quantized in 1 x 128 blocks of `fp8_dtype` and dequantized."""

    @staticmethod
    def forward(ctx, x, fp8_dtype):
        ctx.fp8_dtype = fp8_dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        from megatron_ext.hybridep import fp8

        data, scale_inv = fp8.quantize(grad.reshape(-1, grad.shape[-1]), ctx.fp8_dtype)
        return fp8.dequantize(data, scale_inv, grad.dtype, ctx.fp8_dtype).view_as(grad), None


def fp8_dispatch_equals_dispatching_quantized_tokens(rank, world):
    """--moe-hybridep-fp8-dispatch in real MoE layers, blocking and in capacity mode (no host read):
    bitwise the results of the plain dispatch fed the tokens quantized and dequantized in 1 x 128
    blocks of e4m3, and the combine's backward fed the gradients quantized and dequantized likewise
    in the recipe's gradient format (e4m3 for --fp8-format e4m3, e5m2 for hybrid), each
    quantization's gradient passed straight through, forward and backward; both dispatches send
    H + H/32 bytes a row instead of the layer dtype's."""
    from megatron_ext import options
    from megatron_ext.hybridep import fp8
    from megatron_ext.hybridep.buffers import release_buffers
    from megatron_ext.tooling.sync import forbid_host_sync

    release_buffers()
    hidden = fp8.BLOCK * 2
    wide = dict(**FLEX, hidden_size=hidden, moe_hybridep_implementation="torch")
    capacity = dict(moe_hybridep_capacity_factor=1.5, moe_hybridep_equal_token_counts=True)
    inputs = step_inputs(rank, 2, 32, hidden, seed=21)  # a calibration, then a non-blocking step

    def layer(in_fp8, gradient_format="e4m3", **flags):
        # The option is refused without --fp8-recipe blockwise (TE's fp8 experts), which a CPU
        # lacks, and the gradients' format is the recipe's --fp8-format: both are set here, around
        # megatron-ext's bf16 experts.
        check, gradient_dtype = options._check_fp8_dispatch, fp8.gradient_dtype
        options._check_fp8_dispatch = lambda config, opts: None
        fp8.gradient_dtype = lambda fmt: gradient_dtype(gradient_format)
        try:
            return moe_layer(make_config(world, **wide, **flags, moe_hybridep_fp8_dispatch=in_fp8), "grouped", 31)
        finally:
            options._check_fp8_dispatch, fp8.gradient_dtype = check, gradient_dtype

    def quantized(plain, gradient_dtype=None):
        """`plain` dispatching quantized tokens, and, with `gradient_dtype`, combining into a
        quantized gradient."""
        manager = _manager(plain)
        dispatch, combine = manager.dispatch, manager.combine

        def dispatch_quantized(hidden_states, *args, **kwargs):
            data, scale_inv = fp8.quantize(hidden_states.detach())
            qdq = fp8.dequantize(data, scale_inv, hidden_states.dtype)
            straight_through = qdq + (hidden_states - hidden_states.detach())  # qdq's values, hidden's gradient
            return dispatch(straight_through, *args, **kwargs)

        def combine_quantized(*args, **kwargs):
            return _QuantizedGradient.apply(combine(*args, **kwargs), gradient_dtype)

        manager.dispatch = dispatch_quantized
        if gradient_dtype is not None:
            manager.combine = combine_quantized
        return plain

    cases = [("e4m3", {}), ("e4m3", capacity), ("hybrid", capacity)]
    for gradient_format, flags in cases:
        grad_dtype = fp8.gradient_dtype(gradient_format)
        reference = quantized(layer(False, **flags), grad_dtype)
        ours = layer(True, gradient_format, **flags)
        assert _manager(ours).options.fp8_dispatch and not _manager(reference).options.fp8_dispatch
        assert _manager(ours).grad_fp8 == grad_dtype
        expected = run_steps(reference, inputs)
        actual = run_steps(ours, inputs[:1])
        with forbid_host_sync() if flags else contextlib.nullcontext():
            actual += run_steps(ours, inputs[1:])
        _assert_same(expected, actual)
        if world > 1 and not flags:  # blocking: exact rows, so the bytes compare row for row
            # The forward's dispatch; the backward's (the combine's) moves as many rows alike.
            sent, sent_plain = [
                (layer_(inputs[0]), _manager(layer_).last_buffer.last_dispatch_traffic)[1]
                for layer_ in (ours, reference)
            ]
            dtype_bytes = inputs[0].element_size()
            assert sent.hidden > 0 and sent.hidden * hidden * dtype_bytes == sent_plain.hidden * fp8.wire_bytes_per_row(
                hidden
            ), (sent, sent_plain)
        release_buffers()
    # The same results come neither from dispatching the tokens unquantized, nor from dispatching
    # the gradients unquantized or in e4m3 (the last case's expected gradients are e5m2's).
    plain = layer(False)  # the same seed: the same weights
    assert not torch.equal(run_steps(plain, inputs[:1])[0][0], expected[0][0])
    weight = next(name for name in expected[0][2] if "linear_fc2" in name)
    for other in (None, torch.float8_e4m3fn):
        grads = run_steps(quantized(layer(False, **capacity), other), inputs[:1])[0][2]
        assert not torch.equal(grads[weight], expected[0][2][weight]), (other, weight)


def deep_ep_buffer_through_the_same_path(rank, world):
    """deep_ep's HybridEPBuffer, stood in by a subclass of ours that records its arguments."""
    import sys
    import types

    from megatron_ext.hybridep import TorchHybridEPBuffer

    made = []

    class RecordingBuffer(TorchHybridEPBuffer):
        def __init__(self, **kwargs):
            made.append(kwargs)
            super().__init__(**kwargs)

    sys.modules["deep_ep"] = types.SimpleNamespace(HybridEPBuffer=RecordingBuffer)
    wide = dict(hidden_size=DEEP_EP_HIDDEN)  # deep_ep's buffer takes hidden sizes of 128 and more
    try:
        # No megatron-ext option and deep_ep importable: Megatron's own manager, untouched (it
        # then fails as stock Megatron does here, where its fused_a2a found no HybridEP).
        with pytest.raises(ImportError, match="HybridEP is not installed"):
            moe_layer(make_config(world, **FLEX, **wide))
        # At a hidden size where deep_ep's constructor would abort the process, auto takes ours.
        assert _manager(moe_layer(make_config(world, **FLEX))).implementation == "torch"
        capacity = dict(**FLEX, **wide, moe_hybridep_capacity_factor=1.5)
        ours = moe_layer(make_config(world, **capacity, moe_hybridep_implementation="torch"), experts="grouped")
        # Megatron's tuning flags reach deep_ep's constructor (the torch buffer ignores them).
        tuned = dict(
            moe_flex_dispatcher_num_sms=24, moe_hybridep_num_blocks_permute=8, moe_hybridep_num_sms_preprocessing=64
        )
        deep_ep = moe_layer(
            make_config(world, **capacity, **tuned, moe_hybridep_reuse_allgather_buffer=True), experts="grouped"
        )
        copy_weights(ours, deep_ep)
        inputs = step_inputs(rank, 3, 32, DEEP_EP_HIDDEN, seed=8)
        _assert_same(run_steps(ours, inputs), run_steps(deep_ep, inputs))
    finally:
        del sys.modules["deep_ep"]
    assert _manager(deep_ep).implementation == "deep_ep" and _manager(ours).implementation == "torch"
    assert type(_manager(deep_ep).last_buffer) is RecordingBuffer
    assert type(_manager(ours).last_buffer) is TorchHybridEPBuffer
    # one node, a 32 x 8-byte routing map per rank: deep_ep's persistent all-gather buffer serves
    assert made[-1]["enable_custom_allgather"] is True, made
    tuning = {k: made[-1].get(k) for k in ("num_sms_dispatch_api", "num_sms_combine_api", "num_sms_preprocessing_api")}
    assert tuning == dict(num_sms_dispatch_api=24, num_sms_combine_api=24, num_sms_preprocessing_api=64), made
    assert made[-1].get("num_blocks_permute") == 8 and "num_blocks_unpermute" not in made[-1], made


def tensor_and_expert_parallel(rank, world):
    """TP 2 x EP 2 (sequence parallel, experts not tensor-parallel): capacity equals blocking."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1
    )
    try:
        layout = dict(
            tensor_model_parallel_size=2, expert_tensor_parallel_size=1, sequence_parallel=True, num_attention_heads=2
        )
        blocking = moe_layer(make_config(2, **FLEX, **layout), experts="grouped")
        capacity = moe_layer(make_config(2, **FLEX, **layout, moe_hybridep_capacity_factor=1.5), experts="grouped")
        copy_weights(blocking, capacity)
        inputs = step_inputs(rank, 3, 16, HIDDEN, seed=10)
        _assert_same(run_steps(blocking, inputs), run_steps(capacity, inputs))
        manager = _manager(capacity)
        assert manager.group.size() == 2 and manager.stats.non_blocking_dispatches == len(inputs) - 1
    finally:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(expert_model_parallel_size=world)


CHECKS = (
    dispatcher_is_ours_with_flags,
    no_flags_equal_stock_alltoall,
    blocking_backward_reads_nothing,
    capacity_1_0_equals_blocking,
    capacity_1_5_equals_blocking,
    capacity_2_0_equals_blocking,
    too_small_capacity_fails_loudly,
    equal_token_counts_skip_the_all_reduce,
    verify_catches_unequal_counts,
    moe_recompute_same_gradients,
    full_recompute_same_gradients,
    moe_act_recompute_kept_in_capacity_mode,
    exact_transport_equals_blocking,
    reuse_allgather_buffer,
    compact_routing_equals_dense,
    fp8_dispatch_equals_dispatching_quantized_tokens,
    deep_ep_buffer_through_the_same_path,
    tensor_and_expert_parallel,
)


FOUR_RANKS_ONLY = {tensor_and_expert_parallel.__name__}
# The exact path runs where the fused kernels do (on CPU: under Triton's interpreter) and 2+ ranks.
FUSED_AND_RANKS_ONLY = {exact_transport_equals_blocking.__name__}


def _worker(rank, world_size, out_dir, names=None):
    """Run the checks named (default: all) on this rank and save their outcomes."""
    wanted = [c for c in CHECKS if (names is None or c.__name__ in names)]
    fused_ranks = world_size > 1 and fused.enabled_for(torch.empty(0))
    wanted = [c for c in wanted if c.__name__ not in FUSED_AND_RANKS_ONLY or fused_ranks]
    run_megatron_checks(
        rank, world_size, out_dir, [c for c in wanted if c.__name__ not in FOUR_RANKS_ONLY or world_size == 4]
    )


results = results_fixture(_worker, WORLD_SIZES)


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_moe_layer(results, check):
    world_size, outcomes = results
    if check in FOUR_RANKS_ONLY and world_size != 4:
        pytest.skip("needs 4 ranks")
    if check in FUSED_AND_RANKS_ONLY and (world_size == 1 or not fused.enabled_for(torch.empty(0))):
        pytest.skip(
            "needs 2+ ranks and the fused kernels (tests/test_interpreter.py runs it under Triton's interpreter)"
        )
    assert_ok(outcomes, check)
