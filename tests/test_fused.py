"""megatron_ext.fused: the Triton kernels against plain torch references, on fresh random inputs.

They run on a GPU (`gpu` mark) and, on CPU, under Triton's interpreter: `test_interpreter.py`
runs this file (and the fused paths of the experts and the buffer) with TRITON_INTERPRET=1.
Elsewhere the CPU cases skip. Rows at or past the device count n hold NaN, and indices there
point far out of range: a kernel that read them would poison its output or fault.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_ext import fused

DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            not fused.interpreting(), reason="CPU runs the kernels under TRITON_INTERPRET=1 (test_interpreter.py)"
        ),
    ),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
# (rows C, real rows n, width F): n = 0 and n = C, a width that is no power of two, and one wider
# than a kernel's column block (so it loops).
SHAPES = [(37, 29, 24), (16, 0, 8), (16, 16, 40), (9, 5, 1500)]
ACTIVATIONS = [(fused.SILU, F.silu), (fused.GELU, F.gelu)]


def _count(n: int, device: str, dtype=torch.int64) -> torch.Tensor:
    return torch.tensor([n], dtype=dtype, device=device)


def _poisoned(shape, n: int, gen, device, dtype=torch.float32) -> torch.Tensor:
    t = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    t[n:] = float("nan")
    return t.to(device)


def _reference(h, probs, gated, fn):
    if gated:
        gate, linear = h.chunk(2, dim=-1)
        return fn(gate) * linear * probs[:, None]
    return fn(h) * probs[:, None]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "C{}-n{}-F{}".format(*s))
@pytest.mark.parametrize("gated", [True, False], ids=["glu", "plain"])
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=["silu", "gelu"])
def test_activation_probs_forward_and_backward(device, shape, gated, activation):
    rows, n, width = shape
    code, fn = activation
    gen = torch.Generator().manual_seed(rows * 1000 + n + width + 7 * code + gated)
    h = _poisoned((rows, 2 * width if gated else width), n, gen, device)
    probs = _poisoned((rows,), n, gen, device).abs()
    grad = _poisoned((rows, width), n, gen, device)
    out = fused.activation_probs(h, probs, _count(n, device, torch.int32), gated=gated, activation=code)
    grad_h, grad_probs = fused.activation_probs_backward(
        grad, h, probs, _count(n, device), gated=gated, activation=code
    )

    ref_h = h[:n].double().requires_grad_()
    ref_probs = probs[:n].double().requires_grad_()
    ref = _reference(ref_h, ref_probs, gated, fn)
    ref.backward(grad[:n].double())
    assert out.shape == (rows, width) and grad_h.shape == h.shape and grad_probs.shape == (rows,)
    torch.testing.assert_close(out[:n].double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_h[:n].double(), ref_h.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_probs[:n].double(), ref_probs.grad, rtol=1e-5, atol=1e-5)
    assert not grad_probs[n:].any(), "grad_probs past n must be zero"


@pytest.mark.parametrize("device", DEVICES)
def test_activation_probs_in_bf16_rounds_once_from_float32(device):
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(64, 2 * 48, generator=gen).to(device=device, dtype=torch.bfloat16)
    probs = torch.rand(64, generator=gen).to(device)
    out = fused.activation_probs(h, probs, _count(64, device), gated=True, activation=fused.SILU)
    assert out.dtype == torch.bfloat16
    exact = _reference(h.double(), probs.double(), True, F.silu)
    # One rounding of the float32 result (Triton's interpreter truncates, a GPU rounds to nearest).
    torch.testing.assert_close(out.double(), exact, rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, n, width", [(50, 31, 24), (8, 0, 16), (12, 12, 2000)])
def test_gather_rows_copies_the_first_n_rows_exactly(device, dtype, rows, n, width):
    gen = torch.Generator().manual_seed(rows + n + width)
    src = torch.randn(20, width, generator=gen).to(device=device, dtype=dtype)
    index = torch.randint(0, 20, (rows,), generator=gen)
    out = fused.gather_rows(src, index.to(device), _count(n, device))
    assert out.shape == (rows, width) and out.dtype == dtype
    assert torch.equal(out[:n], src[index[:n].to(device)])
    given = torch.full((rows, width), 7.0, dtype=dtype, device=device)  # real rows past n: still unwritten
    fused.gather_rows(src, index.to(device), _count(n, device), out=given)
    assert torch.equal(given[:n], out[:n]) and bool((given[n:] == 7.0).all()), "rows past n were written"


@pytest.mark.parametrize("device", DEVICES)
def test_gather_rows_reads_an_index_past_the_source_as_a_zero_row(device):
    gen = torch.Generator().manual_seed(3)
    src = torch.randn(20, 24, generator=gen).to(device=device, dtype=torch.bfloat16)
    index = torch.tensor([3, 20, 7, 10**6, 19, 20])  # 20 and beyond: padding rows
    out = fused.gather_rows(src, index.to(device), _count(6, device))
    assert torch.equal(out[[0, 2, 4]], src[[3, 7, 19]])
    assert torch.equal(out[[1, 3, 5]], torch.zeros(3, 24, dtype=torch.bfloat16, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("table_width", [5, 8])  # 8: a column slice [:, :5] of a wider buffer
def test_gather_rows_and_values_gives_every_rows_value_and_zero_past_the_table(device, table_width):
    """The probs of a dispatch ride with its rows: a value for every row, past n too (0 for a
    padding or spare row's code), read through the table's row stride."""
    gen = torch.Generator().manual_seed(4 + table_width)
    src = torch.randn(20, 24, generator=gen).to(device=device, dtype=torch.bfloat16)
    index = torch.randint(0, 21, (3000,), generator=gen)  # 20: a padding row
    n = 1700
    wide = torch.randn(7, table_width, generator=gen)
    table = wide[:, :5]
    codes = torch.randint(0, 45, (3000,), generator=gen)  # 35 and beyond: past the table
    expected = torch.where(codes < 35, table.flatten()[codes.clamp(max=34)], 0.0)
    index[n:] = 5  # a real row: the rows past n must still not be written
    out = torch.full((3000, 24), 7.0, dtype=torch.bfloat16, device=device)
    rows, values = fused.gather_rows_and_values(
        src, index.to(device), _count(n, device), wide.to(device)[:, :5], codes.to(device), out=out
    )
    assert rows is out
    assert torch.equal(values.cpu(), expected)
    padded_src = torch.cat([src.cpu(), torch.zeros(1, 24, dtype=torch.bfloat16)])
    assert torch.equal(rows[:n].cpu(), padded_src[index[:n]])
    assert bool((rows[n:] == 7.0).all()), "rows past n were written"
    assert values.shape == (3000,) and values.dtype == torch.float32


def test_gather_rows_and_values_refuses_a_table_it_cannot_read():
    src, index, n = torch.zeros(4, 8), torch.zeros(6, dtype=torch.int64), torch.tensor([2])
    with pytest.raises(ValueError, match="contiguous columns and one code per row"):
        fused.gather_rows_and_values(src, index, n, torch.zeros(5, 3).t(), torch.zeros(6, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"one code per row \(6\)"):
        fused.gather_rows_and_values(src, index, n, torch.zeros(3, 5), torch.zeros(5, dtype=torch.int64))


def _layout_reference(local_map, capacity, pad, slot_of_token):
    """The permuted layout by a loop: per expert, its tokens in ascending order, then padding rows
    up to a multiple of `pad`; rows past `capacity` dropped. Returns (row slot or None per row,
    expert per row, padded counts, total)."""
    slots, experts, counts = [], [], []
    for e in range(local_map.shape[1]):
        tokens = local_map[:, e].nonzero().flatten().tolist()
        padded = -(-len(tokens) // pad) * pad
        slots += [int(slot_of_token[t]) for t in tokens] + [None] * (padded - len(tokens))
        experts += [e] * padded
        counts.append(padded)
    return slots[:capacity], experts[:capacity], counts, len(slots)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "tokens, experts, local, offset, topk, pad, factor",
    [
        (37, 8, 4, 0, 2, None, 1.5),  # room to spare
        (300, 16, 8, 8, 3, 16, 0.6),  # the last rank's experts, truncated
        (513, 64, 64, 0, 8, 128, 1.0),  # every expert local, exactly full, padding 128
        (100, 12, 3, 6, 1, None, 0.5),  # three experts of the middle rank, top-1
        (64, 8, 8, 0, 8, 4, 1.2),  # every token to every expert
        (4500, 64, 64, 0, 2, 16, 1.0),  # more token blocks than the kernel sums at once
    ],
)
@pytest.mark.parametrize(
    "blocking, bounded", [(False, False), (True, False), (True, True)], ids=["all-slots", "received-slots", "bounded"]
)
def test_dispatch_layout_places_rows_as_the_loop_reference(
    device, tokens, experts, local, offset, topk, pad, factor, blocking, bounded
):
    """`bounded`: received slots numbered within a bound of one slot per token (an exact
    non-blocking dispatch's W x T), whose unused rows of the slot table must read -1."""
    gen = torch.Generator().manual_seed(tokens + experts + topk + blocking)
    chosen = torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices
    gathered = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, chosen, True)
    gathered[tokens // 3] = False  # a token with no expert anywhere
    local_map = gathered[:, offset : offset + local]  # a column slice, as the buffer passes it
    if blocking:  # slots of the tokens that have a local expert, in ascending order
        received = local_map.any(dim=1)
        slot_of_token, num_slots = torch.cumsum(received, dim=0) - 1, int(received.sum())
        num_slots = tokens if bounded else num_slots
    else:
        slot_of_token, num_slots = torch.arange(tokens), tokens
    total = sum(-(-int(c) // (pad or 1)) * (pad or 1) for c in local_map.sum(dim=0))
    capacity = int(total * factor) // (pad or 1) * (pad or 1)
    slots, row_experts, padded, total = _layout_reference(local_map, capacity, pad or 1, slot_of_token)

    on_device = local_map.to(device) if device == "cpu" else gathered.to(device)[:, offset : offset + local]
    layout = fused.dispatch_layout(
        on_device,
        fused.block_counts(on_device),
        capacity,
        pad,
        num_slots,
        slot_of_token.to(device) if blocking else None,
        spare_slots=bounded,
    )
    filled = len(slots)
    expected_slot = [num_slots if s is None else s for s in slots] + [num_slots] * (capacity - filled)
    expected_code = [num_slots * local if s is None else s * local + e for s, e in zip(slots, row_experts)]
    expected_code += [num_slots * local] * (capacity - filled)
    assert layout.row_slot.cpu().tolist() == expected_slot
    assert layout.row_code.cpu().tolist() == expected_code
    ends = torch.tensor(padded).cumsum(0)
    assert (
        layout.tokens_per_expert.cpu().tolist()
        == (ends.clamp(max=capacity) - (ends - torch.tensor(padded)).clamp(max=capacity)).tolist()
    )
    assert int(layout.overflow) == int(total > capacity)
    assert int(layout.real_rows) == min(total, capacity)
    table = torch.full((num_slots, local), -1, dtype=torch.int32)
    for row, (s, e) in enumerate(zip(slots, row_experts)):
        if s is not None:
            table[s, e] = row
    assert torch.equal(layout.slot_rows.cpu(), table)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slots, experts, width", [(13, 4, 24), (5, 1, 8), (9, 6, 1100), (0, 3, 8)])
def test_sum_rows_per_slot_adds_in_table_order_in_float32(device, slots, experts, width):
    gen = torch.Generator().manual_seed(slots * 31 + experts + width)
    rows = torch.randn(40, width, generator=gen).to(torch.bfloat16)
    table = torch.randint(0, 40, (slots, experts), generator=gen, dtype=torch.int32)
    table[torch.rand(slots, experts, generator=gen) < 0.4] = -1
    listed = torch.zeros(40, dtype=torch.bool)
    listed[table[table >= 0].long()] = True
    rows[~listed] = float("nan")  # rows no slot names are never read
    expected = torch.zeros(slots, width)
    for s in range(slots):
        for e in range(experts):  # sequential float32 sums, in table order
            if table[s, e] >= 0:
                expected[s] += rows[table[s, e]].float()
    out = fused.sum_rows_per_slot(rows.to(device), table.to(device), torch.float32)
    assert out.shape == (slots, width)
    assert torch.equal(out.cpu(), expected)
    low = fused.sum_rows_per_slot(rows.to(device), table.to(device), torch.bfloat16)
    torch.testing.assert_close(low.cpu().float(), expected, rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slots, experts, width", [(13, 4, 24), (5, 1, 8), (9, 6, 1100), (0, 3, 8)])
def test_sum_rows_per_slot_and_values_gives_each_slots_values_by_expert(device, slots, experts, width):
    """The probs of a combine ride with its sums: values[table[s, e]], 0 where the entry is -1,
    written through a wider buffer's row stride (the exact transport's send buffer)."""
    gen = torch.Generator().manual_seed(slots * 7 + experts + width)
    rows = torch.randn(40, width, generator=gen).to(torch.bfloat16)
    table = torch.randint(0, 40, (slots, experts), generator=gen, dtype=torch.int32)
    table[torch.rand(slots, experts, generator=gen) < 0.4] = -1
    values = torch.rand(40, generator=gen)
    expected = torch.where(table >= 0, values[table.long().clamp(min=0)], 0.0)
    wide = torch.full((slots + 2, experts + 3), 7.0, device=device)
    sums, by_slot = fused.sum_rows_per_slot_and_values(
        rows.to(device), table.to(device), torch.float32, values.to(device), values_out=wide[:, :experts]
    )
    assert torch.equal(by_slot[:slots].cpu(), expected)
    assert bool((wide[:, experts:] == 7.0).all()) and bool((wide[slots:] == 7.0).all()), "wrote past the slots"
    assert torch.equal(sums.cpu(), fused.sum_rows_per_slot(rows.to(device), table.to(device), torch.float32).cpu())
    _, fresh = fused.sum_rows_per_slot_and_values(rows.to(device), table.to(device), torch.float32, values.to(device))
    assert fresh.shape == (slots, experts) and torch.equal(fresh.cpu(), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("factor", [1.5, 0.6])  # 0.6: the tail truncated, its slots' entries -1
def test_combine_probs_by_slot_equal_a_scatter_over_a_real_layout(device, factor):
    """On a layout `dispatch_layout` made (padding, spare rows, bounded slots, truncation), the probs
    by slot equal what the torch path scatters: each row's prob at its (slot, expert), 0 elsewhere."""
    gen = torch.Generator().manual_seed(int(factor * 10))
    tokens, local, pad = 96, 6, 4
    chosen = torch.rand(tokens, 4 * local, generator=gen).topk(5, dim=1).indices
    local_map = torch.zeros(tokens, 4 * local, dtype=torch.bool).scatter_(1, chosen, True)[:, local : 2 * local]
    received = local_map.any(dim=1)
    slot_of_token = torch.cumsum(received, dim=0) - 1
    total = sum(-(-int(c) // pad) * pad for c in local_map.sum(dim=0))
    capacity = int(total * factor) // pad * pad
    on_device = local_map.to(device)
    layout = fused.dispatch_layout(
        on_device, fused.block_counts(on_device), capacity, pad, tokens, slot_of_token.to(device), spare_slots=True
    )
    probs = torch.rand(capacity, generator=gen)
    rows = torch.randn(capacity, 8, generator=gen)
    scattered = torch.zeros(tokens + 1, local)  # the torch path: row codes into a table, one spare slot
    scattered.view(-1)[layout.row_code.cpu()] = probs
    _, by_slot = fused.sum_rows_per_slot_and_values(rows.to(device), layout.slot_rows, torch.float32, probs.to(device))
    assert torch.equal(by_slot.cpu(), scattered[:tokens])
    if factor < 1:
        assert int(layout.overflow.cpu()) == 1 and bool((layout.slot_rows.cpu() == -1).any())


def test_sum_rows_per_slot_and_values_refuses_values_it_cannot_take():
    rows, table = torch.zeros(6, 8), torch.zeros(3, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"`values` must be \[6\] \(one per row\)"):
        fused.sum_rows_per_slot_and_values(rows, table, torch.float32, torch.zeros(5))
    with pytest.raises(ValueError, match="contiguous columns"):
        fused.sum_rows_per_slot_and_values(rows, table, torch.float32, torch.zeros(6), values_out=torch.zeros(2, 3).t())
    with pytest.raises(ValueError, match="rows apart"):  # overlapping rows: programs would race
        fused.sum_rows_per_slot_and_values(
            rows, table, torch.float32, torch.zeros(6), values_out=torch.zeros(1, 2).expand(3, 2)
        )


@pytest.mark.parametrize("device", DEVICES)
def test_gather_rows_and_sum_rows_per_slot_write_into_a_given_buffer(device):
    """`out=`: the exact transport's send buffers, larger than one call's rows; the rows past those
    the call writes keep what they held."""
    gen = torch.Generator().manual_seed(5)
    src = torch.randn(20, 24, generator=gen).to(device=device, dtype=torch.bfloat16)
    index = torch.randint(0, 20, (12,), generator=gen).to(device)
    out = torch.full((30, 24), 7.0, dtype=torch.bfloat16, device=device)
    assert fused.gather_rows(src, index, _count(9, device), out=out) is out
    assert torch.equal(out[:9], src[index[:9]])
    assert bool((out[9:] == 7.0).all()), "rows past n were written"
    wide = torch.full((14, 40), 7.0, dtype=torch.bfloat16, device=device)  # the exact transport's probs buffer
    fused.gather_rows(src, index, _count(9, device), out=wide[:, :24])
    assert torch.equal(wide[:9, :24], src[index[:9]])
    assert bool((wide[9:] == 7.0).all()) and bool((wide[:, 24:] == 7.0).all()), "wrote past the rows or columns"

    table = torch.tensor([[0, -1], [3, 5], [-1, -1]], dtype=torch.int32, device=device)
    sums = torch.full((8, 24), 7.0, dtype=torch.float32, device=device)
    assert fused.sum_rows_per_slot(src, table, torch.float32, out=sums) is sums
    expected = torch.stack([src[0].float(), src[3].float() + src[5].float(), torch.zeros(24, device=device)])
    assert torch.equal(sums[:3], expected)
    assert bool((sums[3:] == 7.0).all()), "rows past the table were written"

    with pytest.raises(
        ValueError, match=r"`out` must be a \[>= 12, 24\] torch.bfloat16 tensor with contiguous columns"
    ):
        fused.gather_rows(src, index, _count(9, device), out=out.float())
    with pytest.raises(ValueError, match="with contiguous columns"):
        fused.gather_rows(src, index, _count(9, device), out=out.t().contiguous().t())
    with pytest.raises(ValueError, match=r"`out` must be a contiguous \[>= 3, 24\] torch.float32 tensor"):
        fused.sum_rows_per_slot(src, table, torch.float32, out=sums[:2])


def test_count_must_be_a_one_element_integer_tensor_on_the_device():
    h, probs = torch.zeros(4, 8), torch.zeros(4)
    for bad in (torch.tensor([1.0]), torch.tensor([1, 2]), torch.tensor(3.5)):
        with pytest.raises(ValueError, match="one-element integer tensor"):
            fused.activation_probs(h, probs, bad, gated=True, activation=fused.SILU)


def test_activation_codes_name_only_what_the_kernels_compute():
    assert fused.activation_code(F.silu) == fused.SILU and fused.activation_code(F.gelu) == fused.GELU
    assert fused.activation_code(F.relu) is None and fused.activation_code(lambda t: t) is None


def test_enabled_for_cuda_or_the_interpreter_only():
    assert fused.enabled_for(torch.zeros(1)) == fused.interpreting()


def test_host_sizes_match_tritons():
    """The plain-int `_cdiv` and `_next_pow2` that size launches give what Triton's own give."""
    for n in range(1, 5000):
        assert fused._next_pow2(n) == fused.triton.next_power_of_2(n), n
        for d in (1, 3, 16, 1024):
            assert fused._cdiv(n, d) == fused.triton.cdiv(n, d), (n, d)
    assert fused._next_pow2(0) == 1 and fused._cdiv(0, 4) == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("experts", [1, 6, 64, 130])
@pytest.mark.parametrize("flag_dtype", [torch.bool, torch.int32])
@pytest.mark.parametrize("budget", [False, True], ids=["capacity", "budget"])
def test_record_dispatch_updates_the_counters_and_metric_as_torchs_ops_do(device, experts, flag_dtype, budget):
    """Three dispatches in a row, each against the torch ops the kernel replaces: the overflow count
    (the flag's value added), the running maxima, the not-overflowed flag, and the metric bit for bit
    (the float32 product, then the float32 add)."""
    from megatron_ext.capacity import capacity_reciprocal

    gen = torch.Generator().manual_seed(experts * 10 + budget + (flag_dtype is torch.bool))
    counters = {k: torch.randint(0, 50, (), generator=gen).to(device) for k in ("overflows", "rows_used", "expert")}
    not_overflowed = torch.zeros(1, dtype=torch.bool, device=device)
    metric = torch.rand(4, generator=gen).to(device)
    expected = {k: v.clone() for k, v in counters.items()}
    expected_metric = metric.clone()
    capacity = int(torch.randint(50, 9000, (), generator=gen))
    for step in range(3):
        counts = torch.randint(0, 300, (experts,), generator=gen, dtype=torch.int64)
        counts = counts.to(torch.int32) if step == 1 else counts  # deep_ep's int32 counts, and int64
        raised = (0, 1, 2)[step] if flag_dtype is torch.int32 else step % 2
        flag = torch.tensor([raised], dtype=flag_dtype)
        budget_flag = torch.tensor([step == 2], dtype=torch.int32)
        limit = int(counts.sum()) - 7 if step == 0 else 10**6  # clamped at the first dispatch
        offsets = fused.record_dispatch(
            flag.to(device),
            counts.to(device),
            counters["overflows"],
            counters["rows_used"],
            not_overflowed,
            budget_flag=budget_flag.to(device) if budget else None,
            expert_rows_used=counters["expert"] if budget else None,
            metric=metric,
            metric_index=step + 1,
            reciprocal=capacity_reciprocal(capacity),
            offsets_limit=limit,
        )
        expected_offsets = torch.cumsum(counts, 0, dtype=torch.int32).clamp_(max=limit)
        assert offsets.dtype == torch.int32 and torch.equal(offsets.cpu(), expected_offsets), step
        overflow = torch.maximum(flag.to(torch.int64), budget_flag.to(torch.int64)) if budget else flag.to(torch.int64)
        expected["overflows"] += overflow.reshape(())
        rows = counts.sum()
        expected["rows_used"] = torch.maximum(expected["rows_used"], rows.to(device))
        if budget:
            expected["expert"] = torch.maximum(expected["expert"], counts.max().to(torch.int64).to(device))
        expected_metric[step + 1] += rows.to(device) * capacity_reciprocal(capacity)
        for name, value in counters.items():
            assert torch.equal(value, expected[name]), (name, step)
        assert bool(not_overflowed) == (int(overflow) == 0), step
        assert torch.equal(metric, expected_metric), step
    assert counters["overflows"].dtype == torch.int64 and not_overflowed.dtype == torch.bool


@pytest.mark.parametrize("device", DEVICES)
def test_record_dispatch_without_a_metric_leaves_it_alone_and_refuses_half_a_budget(device):
    counters = [torch.zeros((), dtype=torch.int64, device=device) for _ in range(3)]
    not_overflowed = torch.ones(1, dtype=torch.bool, device=device)
    flag = torch.tensor([1], dtype=torch.int32, device=device)
    counts = torch.tensor([3, 4], device=device)
    assert fused.record_dispatch(flag, counts, counters[0], counters[1], not_overflowed) is None  # no offsets asked
    assert [int(c) for c in counters] == [1, 7, 0] and not bool(not_overflowed)  # expert_rows_used untouched
    with pytest.raises(ValueError, match="budget_flag and expert_rows_used"):
        fused.record_dispatch(flag, counts, counters[0], counters[1], not_overflowed, budget_flag=flag)
    with pytest.raises(ValueError, match="metric must be float32 with an element 4"):
        fused.record_dispatch(
            flag, counts, *counters[:2], not_overflowed, metric=torch.zeros(4, device=device), metric_index=4
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("budget", [False, True], ids=["capacity", "budget"])
def test_a_layers_dispatch_bookkeeping_is_one_kernel_with_the_torch_paths_results(
    gloo_group, monkeypatch, device, budget
):
    """A capacity-mode layer's bookkeeping after a non-blocking dispatch, fused (one
    `record_dispatch`, the assert with the fail policy) and through torch's ops: the same counters
    and the same capacity-use values in Megatron's metric tracker, bit for bit; an overflow asserts."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from megatron_ext.capacity import budget as budgets
    from megatron_ext.capacity import policy
    from megatron_ext.capacity.policy import CAPACITY_USE_METRIC, DeviceCounters
    from megatron_ext.dispatcher import HybridEPCapacityManager
    from megatron_ext.options import validate
    from tests.megatron_env import FLEX, make_config

    config = make_config(1, **FLEX, moe_hybridep_capacity_factor=1.5, num_layers=2)
    manager = HybridEPCapacityManager(gloo_group, 8, 8, config, validate(config), "torch")
    manager.capacity, manager.expert_budget, manager.log_metrics = 96, 20, True
    layer = type("Layer", (), {"layer_number": 2})()  # held: the manager keeps a weak reference
    manager.bind_layer(layer)
    tracker = get_moe_metrics_tracker()
    gen = torch.Generator().manual_seed(5 + budget)
    dispatches = [torch.randint(0, 11, (8,), generator=gen).to(device) for _ in range(3)]
    dispatches[0][3] = 11

    def run(fused_path: bool):
        tracker.metrics.pop(CAPACITY_USE_METRIC, None)
        monkeypatch.setattr(fused, "enabled_for", lambda t: fused_path)
        counters = DeviceCounters.zeros(torch.device(device))
        for tokens_per_expert in dispatches:
            budget_map = budgets.budget_map(tokens_per_expert, manager.capacity, 10) if budget else None
            handle = (None,) * 10 + (torch.zeros(1, dtype=torch.int32, device=device),)
            manager._record_dispatch(handle, tokens_per_expert, counters, budget_map)
        return counters, tracker.metrics[CAPACITY_USE_METRIC].values.clone()

    manager.record_overflow = True  # the rerun policy: a budget overflow is counted, not asserted
    expected_counters, expected_values = run(fused_path=False)
    launches = []
    record = fused.record_dispatch
    monkeypatch.setattr(fused, "record_dispatch", lambda *a, **k: launches.append(1) or record(*a, **k))
    monkeypatch.setattr(policy.CapacityPolicy, "_assert_no_overflow", None)  # the torch path: not taken
    monkeypatch.setattr(policy.CapacityPolicy, "_record_capacity_use", None)
    counters, values = run(fused_path=True)
    assert len(launches) == len(dispatches)
    for tokens_per_expert in dispatches:  # the experts' offsets, made in the same launch (not with budgets)
        kept = fused.attached_offsets(tokens_per_expert, manager.capacity)
        if budget:
            assert kept is None
        else:
            assert torch.equal(kept, torch.cumsum(tokens_per_expert, 0, dtype=torch.int32).clamp_(max=96))
            assert fused.attached_offsets(tokens_per_expert, manager.capacity + 4) is None  # other rows: not these
    for name in ("overflows", "rows_used", "expert_rows_used"):
        assert torch.equal(getattr(counters, name), getattr(expected_counters, name)), name
    assert (int(counters.overflows) > 0) == budget  # a budget of 10 rows: the first dispatch's 11 overflow it
    assert torch.equal(values, expected_values) and values[1] > 0 and values[0] == 0  # layer 2's entry only
    if not budget:  # the fail policy: an overflow stops on the device, with the layer's message
        manager.record_overflow = False
        handle = (None,) * 10 + (torch.ones(1, dtype=torch.int32, device=device),)
        with pytest.raises(RuntimeError):
            manager._record_dispatch(handle, dispatches[0], counters)
            torch.cuda.synchronize() if device == "cuda" else None


@pytest.mark.parametrize("device", DEVICES)
def test_counts_a_buffer_hands_out_again_lose_the_offsets_of_an_earlier_dispatch(gloo_group, monkeypatch, device):
    """A buffer may return the same counts tensor from every dispatch. A blocking dispatch (which
    makes no offsets) whose rows equal the earlier capacity must leave no offsets on it: the experts
    would split its rows by the earlier dispatch's."""
    from megatron_ext import dispatcher as dispatcher_module
    from megatron_ext.dispatcher import HybridEPCapacityManager
    from megatron_ext.options import validate
    from tests.megatron_env import FLEX, make_config

    config = make_config(1, **FLEX, moe_hybridep_capacity_factor=1.5)
    manager = HybridEPCapacityManager(gloo_group, 4, 4, config, validate(config), "torch")
    manager.capacity = 12
    counts = torch.tensor([3, 0, 5, 1], device=device)  # the buffer's one counts tensor
    flag = torch.zeros(1, dtype=torch.int32, device=device)

    def dispatch(buffer, hidden, routing_map, probs, *, num_permuted_tokens, **_):
        rows = 12 if num_permuted_tokens is None else num_permuted_tokens  # blocking: 12 rows, as the capacity
        return torch.zeros(rows, hidden.shape[1], device=device), None, counts, (None,) * 10 + (flag,)

    monkeypatch.setattr(dispatcher_module.autograd, "dispatch", dispatch)
    monkeypatch.setattr(manager, "_buffer", lambda hidden, tokens: None)
    hidden = torch.zeros(8, 16, device=device)
    routing_map = torch.zeros(8, 4, dtype=torch.bool, device=device)
    manager.setup_metadata(routing_map, torch.zeros(8, 4, device=device))
    manager.dispatch(hidden)  # non-blocking at the capacity: offsets made
    assert torch.equal(fused.attached_offsets(counts, 12), torch.tensor([3, 3, 8, 9], dtype=torch.int32, device=device))
    manager._inflight = None
    manager.force_blocking = True
    manager.setup_metadata(routing_map, torch.zeros(8, 4, device=device))
    manager.dispatch(hidden)  # blocking, 12 rows
    assert fused.attached_offsets(counts, 12) is None
