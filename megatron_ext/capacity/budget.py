"""Static expert splits (`--moe-hybridep-static-expert-splits`): capacity mode's rows laid out with
a fixed row budget per local expert, so that experts which split their rows by counts on the host
get counts that are host constants.

A capacity-mode dispatch returns each local expert's rows back to back (segment lengths on the
device) in `capacity` rows. Experts that take the counts on the device (megatron-ext's
`GroupedMLP`, Transformer Engine's op-fuser experts) read them as they are. Experts that split on
the host (Megatron's `TEGroupedMLP` without the op fuser, which fp8 with delayed scaling needs, and
`SequentialMLP`) would read the counts, a host synchronisation per layer. With a budget B per
expert, expert e's rows move to slots [e * B, e * B + count_e), the rest of its B slots are zero
rows (zero probability), and the experts get the counts [B] * L, known on the host since the
calibration: no read. An expert with more than B rows overflows like a capacity, on the device.

Pure tensor functions of fixed shapes (capturable in a CUDA graph); no host read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BudgetMap:
    """Where each row goes between one dispatch's layout and the budget layout.

    slot_source: `[L * B]` int64, the dispatch row each budget slot takes (`capacity`: none, a zero row).
    row_slot: `[capacity]` int64, the budget slot each dispatch row goes to (`L * B`: none).
    overflow: `[1]` int32, 1 when some expert has more rows than the budget (its tail is cut).
    """

    slot_source: torch.Tensor
    row_slot: torch.Tensor
    overflow: torch.Tensor


def budget_map(tokens_per_expert: torch.Tensor, capacity: int, budget: int) -> BudgetMap:
    """The map for a dispatch whose `[L]` segment lengths (on the device) fill `capacity` rows."""
    counts = tokens_per_expert.to(torch.int64)
    num_local, device = counts.shape[0], counts.device
    ends = torch.cumsum(counts, dim=0)
    starts = ends - counts
    offset = torch.arange(budget, dtype=torch.int64, device=device)
    source = starts.unsqueeze(1) + offset.unsqueeze(0)  # [L, B]
    slot_source = torch.where(offset.unsqueeze(0) < counts.unsqueeze(1), source, capacity).view(-1)
    row = torch.arange(capacity, dtype=torch.int64, device=device)
    expert = torch.searchsorted(ends, row, right=True)  # L for rows past the last segment
    owner = expert.clamp(max=num_local - 1)
    within = row - starts[owner]
    kept = expert.lt(num_local).logical_and_(within.lt(budget))
    row_slot = torch.where(kept, owner * budget + within, num_local * budget)
    overflow = counts.gt(budget).any().to(torch.int32).reshape(1)
    return BudgetMap(slot_source, row_slot, overflow)


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows of `x` at `index`; zero rows where `index` is `len(x)`."""
    rows = x.shape[0]
    out = x.index_select(0, index.clamp(max=max(rows - 1, 0))) if rows else x.new_zeros((index.shape[0], *x.shape[1:]))
    missing = index.eq(rows).view(-1, *([1] * (x.dim() - 1)))
    return out.masked_fill(missing, 0)


class _Relayout(torch.autograd.Function):
    """`x` re-laid out by `index` (rows of `x`; `len(x)`: a zero row). `inverse` maps the output's
    rows back (its length: none): the two are inverse on the rows they keep, so the gradient is
    the same gather the other way, with no scatter."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return _take(x, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return _take(grad, inverse), None, None


def to_budget(rows: torch.Tensor, plan: BudgetMap) -> torch.Tensor:
    """A dispatch's `[capacity, ...]` rows (or probs) in the budget layout: `[L * B, ...]`."""
    return _Relayout.apply(rows, plan.slot_source, plan.row_slot)


def from_budget(rows: torch.Tensor, plan: BudgetMap) -> torch.Tensor:
    """Expert outputs in the budget layout, `[L * B, ...]`, back in the dispatch's `[capacity, ...]`."""
    return _Relayout.apply(rows, plan.row_slot, plan.slot_source)
