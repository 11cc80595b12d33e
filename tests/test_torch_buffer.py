"""The PyTorch HybridEP buffer against the dense reference, on 1, 2 and 4 spawned gloo ranks (and,
through `tests/test_gpu_ranks.py`, on one NCCL rank per GPU).

One spawn per world size runs every case; each rank records, per check, "ok" or the failure,
and the tests below read those records. Inside a case every rank runs the same collectives
before any assertion, so a failing check cannot leave the ranks out of step.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.distributed as dist

from megatron_ext import fused
from tests import reference
from tests.distributed import Checks, assert_ok, results_fixture

WORLD_SIZES = (1, 2, 4)
# (tokens per rank, experts, top-k, pad_multiple, hidden dtype, expert 0 left empty)
CASES = (
    (12, 8, 1, None, torch.float32, False),
    (24, 16, 8, 4, torch.bfloat16, False),
    (9, 8, 2, 16, torch.float32, True),
    (32, 16, 4, None, torch.bfloat16, True),
    (5, 8, 3, 4, torch.float32, False),
    (16, 8, 8, 4, torch.float32, False),
    (20, 8, 2, 256, torch.bfloat16, False),  # fp8 with TE's op-fuser experts: Megatron pads experts to 256 rows
)
HIDDEN = 16
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=3e-2)}


def _round_up(x, m):
    return x if m is None else -(-x // m) * m


def _round_down(x, m):
    return x if m is None else x // m * m


def _forward_backward(buf, x, m, p, rank, weights, num_local, capacity, pad_multiple, traffic=True):
    """dispatch -> per-row weighting by the dispatched probs -> combine -> loss -> backward
    (`traffic`: read the dispatch's bytes, a host read after an exact non-blocking dispatch)."""
    from megatron_ext.hybridep import combine, dispatch, overflow_flag

    x = x.clone().requires_grad_()
    p = p.clone().requires_grad_()
    rows, row_probs, counts, handle = dispatch(
        buf, x, m, p, num_local_experts=num_local, num_permuted_tokens=capacity, pad_multiple=pad_multiple
    )
    traffic = getattr(buf, "last_dispatch_traffic", None) if traffic else None  # deep_ep's buffer counts none
    weighted = rows * row_probs.unsqueeze(1).to(rows.dtype)
    out = combine(buf, weighted, handle, num_permuted_tokens=capacity, pad_multiple=pad_multiple)
    (out.float() * weights[rank]).sum().backward()
    return dict(
        rows=rows.detach(),
        row_probs=row_probs.detach(),
        counts=counts,
        flag=overflow_flag(handle),
        traffic=traffic,
        out=out.detach(),
        grad_x=x.grad,
        grad_p=p.grad,
        handle=handle,
    )


def _reference_forward_backward(hidden, maps, probs, weights, world_size, pad_multiple):
    xs = [h.double().requires_grad_() for h in hidden]
    ps = [p.double().requires_grad_() for p in probs]
    dispatched = reference.dispatch(xs, maps, ps, world_size, pad_multiple)
    weighted = [rows * row_probs.unsqueeze(1) for rows, row_probs, _ in dispatched]
    outs = reference.combine(weighted, maps, world_size, pad_multiple)
    sum((o * w.cpu().double()).sum() for o, w in zip(outs, weights)).backward()  # the reference runs on CPU
    return dispatched, outs, [x.grad for x in xs], [p.grad for p in ps]


def _device():
    """The rank's device: its GPU on GPU ranks, else the CPU."""
    from megatron_ext.tooling.ranks import rank_device

    return rank_device()


def _cpu(result):
    """A _forward_backward result with its tensors on the CPU, for comparison with the reference."""
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in result.items()}


def _run_checks(checks, functions, values):
    """Run each check function, passing it the values its parameters name (as pytest passes fixtures)."""
    for check in functions:
        checks.run(check.__name__, _call_with, check, values)


def _call_with(check, values):
    check(**{name: values[name] for name in inspect.signature(check).parameters})


# ------------------------------------------------------------------ checks of one case


def bytes_sent_are_exact_blocking_and_allgather_nonblocking(
    m, num_tokens, world_size, num_local, num_experts, rank, x, blocking, roomy_run
):
    from megatron_ext.hybridep import Traffic

    # Rows this rank sends to other ranks: one per (token, other rank owning one of its experts).
    owners = m.view(num_tokens, world_size, num_local).any(dim=2)
    to_others = int(owners.sum() - owners[:, rank].sum())
    row_bytes, map_bytes = HIDDEN * x.element_size(), (world_size - 1) * num_tokens * num_experts
    assert blocking["traffic"] == Traffic(map_bytes, to_others * row_bytes, to_others * num_local * 4)
    others = (world_size - 1) * num_tokens
    assert roomy_run["traffic"] == Traffic(map_bytes, others * row_bytes, others * num_local * 4)


def dispatch_matches_reference(blocking, ref_rows, ref_row_probs, ref_counts, dtype):
    assert torch.equal(blocking["rows"], ref_rows.to(dtype)), "dispatched rows differ from the reference"
    assert torch.equal(blocking["row_probs"], ref_row_probs.float()), "dispatched probs differ"
    assert torch.equal(blocking["counts"], ref_counts), f"{blocking['counts']} != {ref_counts}"
    assert int(blocking["flag"]) == 0, "blocking dispatch set the overflow flag"


def combine_matches_reference(blocking, ref_out, rank, tol):
    torch.testing.assert_close(blocking["out"].double(), ref_out[rank], **tol)


def gradients_match_reference(blocking, ref_grad_x, ref_grad_p, rank, tol):
    torch.testing.assert_close(blocking["grad_x"].double(), ref_grad_x[rank], **tol)
    torch.testing.assert_close(blocking["grad_p"].double(), ref_grad_p[rank], **tol)


def nonblocking_with_room_is_bitwise_blocking(roomy_run, roomy, blocking, exact_rows, fused_path):
    rows = roomy_run["rows"]
    assert rows.shape[0] == roomy, f"{rows.shape[0]} rows, capacity {roomy}"
    assert torch.equal(rows[:exact_rows], blocking["rows"]), "rows differ from blocking"
    if not fused_path:  # the fused permute leaves them unwritten (nothing reads them)
        assert not rows[exact_rows:].any(), "rows past the padded total are not zero"
    assert torch.equal(roomy_run["row_probs"][:exact_rows], blocking["row_probs"])
    assert not roomy_run["row_probs"][exact_rows:].any()
    assert torch.equal(roomy_run["counts"], blocking["counts"])
    assert int(roomy_run["flag"]) == 0, "overflow flag set with enough capacity"
    for key in ("out", "grad_x", "grad_p"):
        assert torch.equal(roomy_run[key], blocking[key]), f"{key} differs from blocking"


def too_little_capacity_flags_and_drops_the_tail(tight_run, tight, exact_rows, blocking, expected_truncated):
    assert int(tight_run["flag"]) == int(exact_rows > tight), f"flag {int(tight_run['flag'])}, {exact_rows} > {tight}"
    assert torch.equal(tight_run["rows"], blocking["rows"][:tight]), "kept rows are not the blocking head"
    assert torch.equal(tight_run["row_probs"], blocking["row_probs"][:tight])
    ends = torch.cumsum(blocking["counts"], 0)
    expected_counts = ends.clamp(max=tight) - (ends - blocking["counts"]).clamp(max=tight)
    assert torch.equal(tight_run["counts"], expected_counts), f"{tight_run['counts']} != {expected_counts}"
    assert torch.equal(tight_run["out"], expected_truncated), "combine of truncated rows is not the blocking head's"


def compact_routing_is_bitwise_dense_with_e_over_2k_fewer_map_bytes(
    compact_blocking, compact_roomy, blocking, roomy_run, exact_rows, world_size, num_tokens, num_experts, topk
):
    for mode, compact, dense in (("blocking", compact_blocking, blocking), ("non-blocking", compact_roomy, roomy_run)):
        assert torch.equal(compact["rows"][:exact_rows], dense["rows"][:exact_rows]), f"{mode}: rows differ"
        for key in ("row_probs", "counts", "flag", "out", "grad_x", "grad_p"):
            assert torch.equal(compact[key], dense[key]), f"{mode}: {key} differs from the dense gather's"
        # int16 indices, T x k per rank to each other rank, against T x E Booleans.
        assert compact["traffic"].routing_map == (world_size - 1) * num_tokens * topk * 2, compact["traffic"]
        assert dense["traffic"].routing_map == (world_size - 1) * num_tokens * num_experts, dense["traffic"]
        assert compact["traffic"].routing_map * num_experts == dense["traffic"].routing_map * 2 * topk
        assert (compact["traffic"].hidden, compact["traffic"].probs) == (
            dense["traffic"].hidden,
            dense["traffic"].probs,
        )


# fp8 dispatch (`use_fp8=True`): tokens quantized before the dispatch in blocks of this many
# columns (TE's 1 x 128 blocks, narrowed to the tests' hidden size), one float32 scale each.
FP8_BLOCK = 8
FP8_MAX = 448.0  # e4m3's largest value


def _quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An independent row-local quantizer: each 1 x FP8_BLOCK block scaled to e4m3's range.
    Returns (data [R, H] float8_e4m3fn, scale inverses [R, H / FP8_BLOCK] float32) on `rows`'
    device. Computed on the CPU: CUDA divides by a scalar through its reciprocal, a last bit
    apart from the CPU's division, and the checks compare quantizations made on either side."""
    blocks = rows.detach().cpu().float().reshape(rows.shape[0], -1, FP8_BLOCK)
    scale_inv = blocks.abs().amax(dim=2).clamp(min=1e-12) / FP8_MAX
    data = (blocks / scale_inv.unsqueeze(2)).to(torch.float8_e4m3fn)
    return data.reshape(rows.shape).to(rows.device), scale_inv.to(rows.device)


def _fp8_dispatch(buf, m, p, num_local, capacity, pad_multiple, traffic=True, **quantized):
    """One dispatch, plain (not differentiable), blocking without `capacity`: rows, scales, bytes
    (`traffic`: read them, a host read after an exact non-blocking dispatch)."""
    rows, _, scales, _, _ = buf.dispatch_with_permute(
        routing_map=m,
        probs=p,
        num_of_experts_per_rank=num_local,
        num_permuted_tokens=capacity,
        non_blocking=capacity is not None,
        pad_multiple=pad_multiple,
        **quantized,
    )
    return rows, scales, buf.last_dispatch_traffic if traffic else None


def _on_cpu(run: tuple) -> tuple:
    """An `_fp8_dispatch` result with its tensors on the CPU (a host read: after any guard)."""
    return tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in run)


def fp8_dispatch_moves_each_tokens_quantized_bytes_and_scales(fp8_runs, blocking, exact_rows, roomy, dtype):
    """Quantized before the dispatch, each row arrives as its token was quantized: its bytes and
    scales equal the same data dispatched as float32 (an exact copy of fp8 values), padding rows
    included, and the real rows equal quantizing the blocking dispatch's rows after it."""
    after_data, after_scales = _quantize_rows(blocking["rows"][:exact_rows])
    for mode, ((rows, scales, _), (as_float, float_scales, _)) in fp8_runs.items():
        assert rows.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32, (mode, rows.dtype)
        assert rows.shape[0] == scales.shape[0] == (exact_rows if mode == "blocking" else roomy), mode
        assert torch.equal(
            rows[:exact_rows].view(torch.uint8), as_float[:exact_rows].to(torch.float8_e4m3fn).view(torch.uint8)
        ), mode
        assert torch.equal(scales[:exact_rows], float_scales[:exact_rows]), mode
        real = blocking["rows"][:exact_rows].abs().sum(dim=1) != 0  # padding rows are zero rows
        assert torch.equal(rows[:exact_rows][real].view(torch.uint8), after_data[real].view(torch.uint8)), mode
        assert torch.equal(scales[:exact_rows][real], after_scales[real]), mode


def fp8_dispatch_sends_one_byte_per_element_and_the_scales(fp8_runs, blocking, roomy_run, x, dtype):
    """Bytes on the wire: each row H bytes of data and 4 per scale, against H x 2 in bf16 (and
    H x 4 in float32): (1 + 4 / FP8_BLOCK) / 2 of bf16's hidden bytes; routing map and probs unchanged."""
    for mode, dense in (("blocking", blocking), ("non-blocking", roomy_run)):
        traffic, expected = fp8_runs[mode][0][2], dense["traffic"]
        rows_sent = expected.hidden // (HIDDEN * x.element_size())
        assert traffic.hidden == rows_sent * (HIDDEN + 4 * HIDDEN // FP8_BLOCK), (mode, traffic, expected)
        assert (traffic.routing_map, traffic.probs) == (expected.routing_map, expected.probs), mode


CASE_CHECKS = (
    bytes_sent_are_exact_blocking_and_allgather_nonblocking,
    dispatch_matches_reference,
    combine_matches_reference,
    gradients_match_reference,
    nonblocking_with_room_is_bitwise_blocking,
    too_little_capacity_flags_and_drops_the_tail,
    fp8_dispatch_moves_each_tokens_quantized_bytes_and_scales,
    fp8_dispatch_sends_one_byte_per_element_and_the_scales,
)
# Compact routing changes the routing maps' gather alone, before any layout kernel: it runs in every
# case on the torch path and, where the fused kernels run (slow under Triton's interpreter), in this
# one (E / (2k) = 2, an expert left empty).
COMPACT_FUSED_CASE = 3


def _case(checks, rank, world_size, index, case):
    from megatron_ext.hybridep import TorchHybridEPBuffer
    from megatron_ext.tooling.sync import forbid_host_sync

    num_tokens, num_experts, topk, pad_multiple, dtype, empty_expert = case
    num_local = num_experts // world_size
    gen = torch.Generator().manual_seed(1000 * world_size + index)
    hidden, maps, probs = reference.random_routing(gen, world_size, num_tokens, num_experts, topk, HIDDEN, dtype)
    if empty_expert:
        for m, p in zip(maps, probs):
            m[:, 0] = False
            p[:, 0] = 0.0
    weights = [torch.randn(num_tokens, HIDDEN, generator=gen) for _ in range(world_size)]
    buf = TorchHybridEPBuffer(dist.group.WORLD, HIDDEN, num_tokens, num_local)
    device = _device()
    x, m, p = hidden[rank].to(device), maps[rank].to(device), probs[rank].to(device)
    fused_path = fused.enabled_for(x)
    weights = [w.to(device) for w in weights]

    # All collectives first, identical on every rank.
    blocking = _forward_backward(buf, x, m, p, rank, weights, num_local, None, pad_multiple)
    exact_rows = blocking["rows"].shape[0]
    roomy = _round_up(exact_rows + 5, pad_multiple)
    with forbid_host_sync():
        roomy_run = _forward_backward(buf, x, m, p, rank, weights, num_local, roomy, pad_multiple)
    tight = _round_down(exact_rows // 2, pad_multiple)
    tight_run = _forward_backward(buf, x, m, p, rank, weights, num_local, tight, pad_multiple)
    # The same dispatches with the maps gathered as top-k indices (--moe-hybridep-compact-routing).
    compact_runs = not fused_path or index == COMPACT_FUSED_CASE
    if compact_runs:
        compact = TorchHybridEPBuffer(dist.group.WORLD, HIDDEN, num_tokens, num_local, compact_routing_topk=topk)
        compact_blocking = _cpu(_forward_backward(compact, x, m, p, rank, weights, num_local, None, pad_multiple))
        with forbid_host_sync():
            compact_roomy = _forward_backward(compact, x, m, p, rank, weights, num_local, roomy, pad_multiple)
        compact_roomy = _cpu(compact_roomy)
    # The dispatch of tokens quantized before it (use_fp8), and of the same values as float32.
    data, scales = _quantize_rows(x)
    fp8_runs = {}
    for mode, capacity in (("blocking", None), ("non-blocking", roomy)):
        fp8 = _fp8_dispatch(
            buf, m, p, num_local, capacity, pad_multiple, hidden=data, use_fp8=True, scaling_factor=scales
        )
        as_float = _fp8_dispatch(buf, m, p, num_local, capacity, pad_multiple, hidden=data.float())
        float_scales = _fp8_dispatch(buf, m, p, num_local, capacity, pad_multiple, hidden=scales)
        fp8_runs[mode] = (_on_cpu(fp8), _on_cpu((as_float[0], float_scales[0], None)))
    # What combine must give for the truncated rows: the blocking combine with the tail zeroed.
    tail_zeroed = blocking["rows"] * blocking["row_probs"].unsqueeze(1).to(dtype)
    tail_zeroed[tight:] = 0
    expected_truncated, _ = buf.combine_with_unpermute(hidden=tail_zeroed, handle=blocking["handle"])
    expected_truncated = expected_truncated.cpu()
    blocking, roomy_run, tight_run = _cpu(blocking), _cpu(roomy_run), _cpu(tight_run)
    m = m.cpu()
    ref_dispatch, ref_out, ref_grad_x, ref_grad_p = _reference_forward_backward(
        hidden, maps, probs, weights, world_size, pad_multiple
    )
    ref_rows, ref_row_probs, ref_counts = ref_dispatch[rank]
    tol = TOLERANCE[dtype]
    _run_checks(checks, CASE_CHECKS, locals())
    if compact_runs:
        _run_checks(checks, (compact_routing_is_bitwise_dense_with_e_over_2k_fewer_map_bytes,), locals())
    if world_size > 1 and fused_path:
        _exact_case(checks, rank, world_size, locals())


# ------------------------------------------------------------------ exact rows, counts on the device


def exact_nonblocking_is_bitwise_blocking(exact_roomy, roomy, exact_rows, blocking):
    rows = exact_roomy["rows"]
    assert rows.shape[0] == roomy, f"{rows.shape[0]} rows, capacity {roomy}"
    assert torch.equal(rows[:exact_rows], blocking["rows"]), "rows differ from blocking"
    assert torch.equal(exact_roomy["row_probs"][:exact_rows], blocking["row_probs"])
    assert not exact_roomy["row_probs"][exact_rows:].any()
    assert torch.equal(exact_roomy["counts"], blocking["counts"]) and int(exact_roomy["flag"]) == 0
    for key in ("out", "grad_x", "grad_p"):
        assert torch.equal(exact_roomy[key], blocking[key]), f"{key} differs from blocking"


def exact_nonblocking_sends_the_blocking_bytes(exact_traffic, blocking, num_local):
    # The blocking rows, to the byte; their probs in rows padded to 8 floats (NVSHMEM's 32-byte rows).
    expected = blocking["traffic"]
    padded = expected.probs // (4 * num_local) * 4 * (-(-num_local // 8) * 8)
    assert (exact_traffic.routing_map, exact_traffic.hidden) == (expected.routing_map, expected.hidden), exact_traffic
    assert exact_traffic.probs == padded, f"{exact_traffic.probs} probs bytes, {padded} expected"


def exact_overflow_flags_and_drops_the_tail_as_the_allgather(exact_tight, tight_run):
    for key in ("rows", "row_probs", "counts", "flag", "out", "grad_x", "grad_p"):
        assert torch.equal(exact_tight[key], tight_run[key]), f"{key} differs from the all-gather's"


def exact_fp8_dispatch_equals_the_allgathers(exact_fp8, fp8_runs, exact_rows):
    """Quantized rows and their scales through the exact exchange (each payload its own buffers)
    arrive as the all-gather's do."""
    rows, scales, _ = exact_fp8
    expected_rows, expected_scales, _ = fp8_runs["non-blocking"][0]
    assert torch.equal(rows[:exact_rows].view(torch.uint8), expected_rows[:exact_rows].view(torch.uint8))
    assert torch.equal(scales[:exact_rows], expected_scales[:exact_rows])


def exact_calls_go_through_the_exchange(exchange_calls):
    # Two runs of 4 calls (dispatch, combine, and their backward) and one dispatch: a barrier each;
    # an exchange of rows each, and of probs where the call carries them (the dispatch, and the
    # combine that is the dispatch's backward): 2 + 1 + 1 + 2 per run, 2 for the dispatch.
    assert exchange_calls == (9, 14), exchange_calls


EXACT_CHECKS = (
    exact_nonblocking_is_bitwise_blocking,
    exact_nonblocking_sends_the_blocking_bytes,
    exact_overflow_flags_and_drops_the_tail_as_the_allgather,
    exact_calls_go_through_the_exchange,
    exact_fp8_dispatch_equals_the_allgathers,
)


def _slab_exchange(group):
    from tests.device_splits import SlabExchange

    return SlabExchange(group)


# The exchange `_exact_case` sends through: on CPU ranks a stand-in on the group's collectives;
# `tests/test_gpu_nvshmem.py` puts NVSHMEM's here.
EXACT_EXCHANGE = _slab_exchange


def _exact_case(checks, rank, world_size, case):
    """The case's non-blocking dispatches again, sending exact rows through an exchange that
    takes its counts on the device (`EXACT_EXCHANGE`), with no host read."""
    from megatron_ext.hybridep import TorchHybridEPBuffer
    from megatron_ext.tooling.sync import forbid_host_sync

    exchange = EXACT_EXCHANGE(dist.group.WORLD)
    buf = TorchHybridEPBuffer(dist.group.WORLD, HIDDEN, case["num_tokens"], case["num_local"], transport=exchange)
    args = [case[k] for k in ("x", "m", "p", "rank", "weights", "num_local")]
    x, m, p = (t.to(case["device"]) for t in (case["hidden"][rank], case["maps"][rank], case["probs"][rank]))
    args[:3] = x, m, p
    with forbid_host_sync():
        exact_roomy = _forward_backward(buf, *args, case["roomy"], case["pad_multiple"], traffic=False)
    exact_tight = _forward_backward(buf, *args, case["tight"], case["pad_multiple"], traffic=False)
    buf.dispatch_with_permute(
        hidden=x,
        routing_map=m,
        probs=p,
        num_permuted_tokens=case["roomy"],
        pad_multiple=case["pad_multiple"],
        non_blocking=True,
    )
    exact_traffic = buf.last_dispatch_traffic
    exchange_calls = (exchange.barriers, exchange.exchanges)
    data, scales = (t.to(case["device"]) for t in _quantize_rows(x))
    with forbid_host_sync():
        exact_fp8 = _fp8_dispatch(
            buf, m, p, case["num_local"], case["roomy"], case["pad_multiple"],
            traffic=False, hidden=data, use_fp8=True, scaling_factor=scales,
        )  # fmt: skip
    exact_fp8 = _on_cpu(exact_fp8)
    exact_roomy, exact_tight = _cpu(exact_roomy), _cpu(exact_tight)
    _run_checks(checks, EXACT_CHECKS, {**case, **locals()})


# ------------------------------------------------------------------ the sync guard


def guard_trips_on_blocking_dispatch(raised):
    assert raised is not None, "blocking dispatch ran under forbid_host_sync without raising"


def _guard_catches_blocking(checks, rank, world_size):
    """The guard is not vacuous: the blocking dispatch's host read trips it on every rank."""
    from megatron_ext.hybridep import TorchHybridEPBuffer
    from megatron_ext.tooling.sync import HostSyncError, forbid_host_sync

    buf = TorchHybridEPBuffer(dist.group.WORLD, HIDDEN, 8, 2)
    gen = torch.Generator().manual_seed(7)
    hidden, maps, probs = reference.random_routing(gen, world_size, 8, 2 * world_size, 1, HIDDEN, torch.float32)
    device = _device()
    x, m, p = hidden[rank].to(device), maps[rank].to(device), probs[rank].to(device)
    raised = None
    try:
        with forbid_host_sync():
            buf.dispatch_with_permute(hidden=x, routing_map=m, probs=p)
    except HostSyncError as exc:
        raised = exc
    except RuntimeError as exc:  # on a GPU, CUDA's sync-debug mode may name the wait first
        if "synchronizing CUDA operation" not in str(exc):
            raise
        raised = exc
    _run_checks(checks, (guard_trips_on_blocking_dispatch,), locals())


# ------------------------------------------------------------------ routing-map buffer reuse


def reuse_writes_the_same_storage(pointers, reused, second, map_bytes, world_size, map_pointers):
    if world_size == 1:  # one rank gathers nothing: its own map comes back, nothing is allocated
        assert pointers == map_pointers, "one rank's gather did not return its own map"
        assert (reused.routing_map_gather.stats.allocations, second.routing_map_gather.stats.allocations) == (0, 0)
        return
    assert len(set(pointers[:3])) == 1, f"repeated same-shape gathers moved: {pointers[:3]}"
    assert pointers[4] == pointers[3], "a smaller gather after growth did not reuse the grown buffer"
    stats = reused.routing_map_gather.stats
    assert (stats.gathers, stats.allocations) == (5, 2), f"{stats}: expected 5 gathers, 1 allocation + 1 growth"
    assert stats.bytes_allocated == map_bytes + 2 * map_bytes, stats
    assert second.routing_map_gather.stats.allocations == 0, "a second buffer on the group did not share storage"
    assert second.routing_map_gather.stats.last_data_ptr == pointers[-1]


def no_reuse_allocates_every_dispatch(fresh, map_bytes, world_size):
    stats = fresh.routing_map_gather.stats
    if world_size == 1:
        assert (stats.gathers, stats.allocations, stats.bytes_allocated) == (5, 0, 0), stats
        return
    assert (stats.gathers, stats.allocations) == (5, 5), stats
    assert stats.bytes_allocated == map_bytes * (3 + 2 + 0.5), stats


def reuse_does_not_change_results(outputs):
    for (rows_a, probs_a, counts_a), (rows_b, probs_b, counts_b) in outputs:
        real = int(counts_a.sum())  # rows past it are unwritten where the fused kernels run
        assert torch.equal(rows_a[:real], rows_b[:real]) and torch.equal(probs_a, probs_b)
        assert torch.equal(counts_a, counts_b)


def compact_reuse_writes_the_same_storage(
    compact_pointers, compact_outputs, outputs, compact, world_size, map_pointers
):
    for (rows_a, probs_a, counts_a), (_, (rows_b, probs_b, counts_b)) in zip(compact_outputs, outputs):
        real = int(counts_a.sum())
        assert torch.equal(rows_a[:real], rows_b[:real]) and torch.equal(probs_a, probs_b)
        assert torch.equal(counts_a, counts_b), "compact routing changed the counts"
    stats = compact.routing_map_gather.stats
    if world_size == 1:  # nothing gathered: the map itself, nothing allocated
        assert [p[0] for p in compact_pointers] == map_pointers and stats.allocations == 0, stats
        return
    # (expanded map, gathered indices) per dispatch: the same storage for the same shape, grown once at 32 tokens.
    assert len(set(compact_pointers[:3])) == 1, f"repeated same-shape gathers moved: {compact_pointers}"
    assert compact_pointers[4] == compact_pointers[3], "a smaller gather after growth did not reuse the grown buffers"
    num_experts = 4 * world_size
    first, grown = (world_size * t * (2 * 2 + num_experts) + 1 for t in (16, 32))  # int16 top-2, map + 1
    assert (stats.gathers, stats.allocations, stats.bytes_allocated) == (5, 4, first + grown), stats


REUSE_CHECKS = (
    reuse_writes_the_same_storage,
    no_reuse_allocates_every_dispatch,
    reuse_does_not_change_results,
    compact_reuse_writes_the_same_storage,
)


def _reuse(checks, rank, world_size):
    from megatron_ext.hybridep import TorchHybridEPBuffer, release_shared_routing_map_buffers
    from megatron_ext.hybridep.torch_buffer import allgather

    release_shared_routing_map_buffers()
    num_experts = 4 * world_size
    gen = torch.Generator().manual_seed(11)
    reused = TorchHybridEPBuffer(dist.group.WORLD, HIDDEN, 32, 4, reuse_allgather_buffer=True)
    second = TorchHybridEPBuffer(dist.group.WORLD, HIDDEN, 32, 4, enable_custom_allgather=True)
    fresh = TorchHybridEPBuffer(dist.group.WORLD, HIDDEN, 32, 4)
    pointers, outputs, map_pointers, inputs = [], [], [], []
    for num_tokens in (16, 16, 16, 32, 8):
        hidden, maps, probs = reference.random_routing(
            gen, world_size, num_tokens, num_experts, 2, HIDDEN, torch.float32
        )
        hidden, maps, probs = ([t.to(_device()) for t in ts] for ts in (hidden, maps, probs))
        results = []
        for buf in (reused, fresh):
            rows, row_probs, _, counts, _ = buf.dispatch_with_permute(
                hidden=hidden[rank],
                routing_map=maps[rank],
                probs=probs[rank],
                num_permuted_tokens=4 * num_tokens * 2,
                non_blocking=True,
            )
            results.append((rows, row_probs, counts))
        inputs.append((hidden, maps, probs))
        pointers.append(reused.routing_map_gather.stats.last_data_ptr)
        map_pointers.append(maps[rank].data_ptr())
        outputs.append(results)
    second.dispatch_with_permute(hidden=hidden[rank], routing_map=maps[rank], probs=probs[rank])
    map_bytes = world_size * num_experts * 16
    # Compact routing with reuse: its indices and the map they expand to, each in one storage per group.
    release_shared_routing_map_buffers()
    compact = TorchHybridEPBuffer(dist.group.WORLD, HIDDEN, 32, 4, reuse_allgather_buffer=True, compact_routing_topk=2)
    compact_pointers, compact_outputs = [], []
    for hidden, maps, probs in inputs:
        rows, row_probs, _, counts, _ = compact.dispatch_with_permute(
            hidden=hidden[rank],
            routing_map=maps[rank],
            probs=probs[rank],
            num_permuted_tokens=4 * maps[rank].shape[0] * 2,
            non_blocking=True,
        )
        indices = allgather._SHARED_INDICES.get((dist.group.WORLD, torch.int16))
        compact_pointers.append(
            (compact.routing_map_gather.stats.last_data_ptr, indices is not None and indices.data_ptr())
        )
        compact_outputs.append((rows, row_probs, counts))
    _run_checks(checks, REUSE_CHECKS, locals())


# ------------------------------------------------------------------ compact routing's device assert


def compact_routing_refuses_a_token_with_more_than_k_experts(raised, world_size):
    if world_size == 1:  # one rank gathers nothing, so nothing is compacted or lost
        assert raised is None, raised
        return
    assert raised is not None, "a row of 2 experts went through compact routing at top-1"
    assert "--moe-hybridep-compact-routing sends at most 1 experts per token" in raised, raised
    assert len(raised) < 255, raised  # CUDA's _assert_async refuses longer messages


def _compact_guard(checks, rank, world_size):
    """Every rank routes one token to 2 experts at top-1: the device assert after the gather
    stops each of them (on CPU `torch._assert_async` raises; on a GPU it ends the process, so
    this runs on CPU ranks only)."""
    from megatron_ext.hybridep import TorchHybridEPBuffer

    buf = TorchHybridEPBuffer(dist.group.WORLD, HIDDEN, 8, 2, compact_routing_topk=1)
    gen = torch.Generator().manual_seed(17)
    hidden, maps, probs = reference.random_routing(gen, world_size, 8, 2 * world_size, 1, HIDDEN, torch.float32)
    m = maps[rank].clone()
    m[3, :2] = True
    raised = None
    try:
        buf.dispatch_with_permute(hidden=hidden[rank], routing_map=m, probs=probs[rank] * m)
    except RuntimeError as exc:
        raised = str(exc)
    _run_checks(checks, (compact_routing_refuses_a_token_with_more_than_k_experts,), locals())


def _worker(rank, world_size, out_dir):
    checks = Checks()
    for index, case in enumerate(CASES):
        _case(checks, rank, world_size, index, case)
    _guard_catches_blocking(checks, rank, world_size)
    _reuse(checks, rank, world_size)
    if _device().type == "cpu":  # a device assert ends a GPU rank's process
        _compact_guard(checks, rank, world_size)
    checks.save(out_dir, rank)


results = results_fixture(_worker, WORLD_SIZES)

CHECKS = tuple(
    check.__name__
    for check in (
        *CASE_CHECKS,
        compact_routing_is_bitwise_dense_with_e_over_2k_fewer_map_bytes,
        guard_trips_on_blocking_dispatch,
        *REUSE_CHECKS,
    )
)


@pytest.mark.parametrize("check", CHECKS)
def test_buffer(results, check):
    _, outcomes = results
    assert_ok(outcomes, check)


def test_compact_routing_device_assert(results):
    _, outcomes = results
    assert_ok(outcomes, compact_routing_refuses_a_token_with_more_than_k_experts.__name__)


@pytest.mark.parametrize("check", [check.__name__ for check in EXACT_CHECKS])
def test_exact_nonblocking_path(results, check):
    world_size, outcomes = results
    if world_size == 1:
        pytest.skip("one rank exchanges nothing")
    if not fused.enabled_for(torch.empty(0)):
        pytest.skip(
            "the exact path runs the fused kernels: tests/test_interpreter.py runs it under Triton's interpreter"
        )
    assert_ok(outcomes, check)


def test_cases_cover_the_issue():
    """Top-k 1 to 8, pad_multiple None/4/16/256 (256: fp8 with TE's op-fuser experts), bf16 and
    fp32, an expert receiving nothing."""
    assert {c[2] for c in CASES} >= {1, 8}
    assert {c[3] for c in CASES} == {None, 4, 16, 256}
    assert {c[4] for c in CASES} == {torch.float32, torch.bfloat16}
    assert any(c[5] for c in CASES)
    assert all(c[1] % math.lcm(*WORLD_SIZES) == 0 for c in CASES)
