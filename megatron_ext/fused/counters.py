"""The bookkeeping of one non-blocking dispatch in one launch: `record_dispatch`.

After a capacity-mode dispatch the layer's device counters learn what it did: whether it overflowed
(added to the overflow count), how many rows it filled (a running maximum), with expert budgets the
most rows one expert received (a running maximum), and, when Megatron's MoE metrics are logged, the
rows over the capacity added into the layer's entry of Megatron's metric tensor. As separate torch
ops that is six to eight launches per dispatch, each a few microseconds of the host's time in an
eager step the host already bounds; here it is one, and it writes a flag that is 1 when the dispatch
did not overflow, for the caller's `torch._assert_async`. It can also write the experts' offsets
(the inclusive cumulative rows per expert that grouped GEMMs take), which the experts would
otherwise compute in two more launches: `attach_offsets` keeps them on the dispatch's counts.

The sum and the product are rounded as torch rounds them (int64 sum; float32 product, then float32
add, not contracted into a fused multiply-add), so the metric is bit for bit what the torch ops give.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_ext.fused.common import _next_pow2, triton

if triton is not None:
    import triton.language as tl

    @triton.jit(do_not_specialize=["metric_index", "rows_limit", "L"])  # one compile whatever the layer
    def _record_dispatch_kernel(
        flag_ptr,
        budget_flag_ptr,
        counts_ptr,
        overflows_ptr,
        rows_used_ptr,
        expert_rows_used_ptr,
        not_overflowed_ptr,
        metric_ptr,
        metric_index,
        reciprocal,
        offsets_ptr,
        rows_limit,
        L,
        L_P2: tl.constexpr,
        HAS_BUDGET: tl.constexpr,
        HAS_METRIC: tl.constexpr,
        HAS_OFFSETS: tl.constexpr,
    ):
        experts = tl.arange(0, L_P2)
        counts = tl.load(counts_ptr + experts, mask=experts < L, other=0).to(tl.int64)
        rows = tl.sum(counts, axis=0)
        if HAS_OFFSETS:
            ends = tl.minimum(tl.cumsum(counts, axis=0), rows_limit)
            tl.store(offsets_ptr + experts, ends.to(tl.int32), mask=experts < L)
        flag = tl.load(flag_ptr).to(tl.int64)
        if HAS_BUDGET:
            flag = tl.maximum(flag, tl.load(budget_flag_ptr).to(tl.int64))
            largest = tl.max(counts, axis=0)
            tl.store(expert_rows_used_ptr, tl.maximum(tl.load(expert_rows_used_ptr), largest))
        tl.store(overflows_ptr, tl.load(overflows_ptr) + flag)
        tl.store(rows_used_ptr, tl.maximum(tl.load(rows_used_ptr), rows))
        tl.store(not_overflowed_ptr, flag == 0)
        if HAS_METRIC:
            use = rows.to(tl.float32) * reciprocal
            tl.store(metric_ptr + metric_index, tl.load(metric_ptr + metric_index) + use)


def record_dispatch(
    flag: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    overflows: torch.Tensor,
    rows_used: torch.Tensor,
    not_overflowed: torch.Tensor,
    *,
    budget_flag: Optional[torch.Tensor] = None,
    expert_rows_used: Optional[torch.Tensor] = None,
    metric: Optional[torch.Tensor] = None,
    metric_index: int = 0,
    reciprocal: float = 0.0,
    offsets_limit: Optional[int] = None,
) -> Optional[torch.Tensor]:
    """One launch, in place: `overflows += max(flag, budget_flag)`; `rows_used = max(rows_used, n)`
    with n = sum(tokens_per_expert); with `budget_flag`, `expert_rows_used = max(it,
    max(tokens_per_expert))`; `not_overflowed[0] = (max(flag, budget_flag) == 0)`; with `metric`,
    `metric[metric_index] += float32(n) * reciprocal`. With `offsets_limit`, returns the experts'
    offsets too: `[L]` int32, the inclusive cumulative rows per expert clamped to it, what grouped
    GEMMs take (`attach_offsets` hands them to the experts).

    Args:
        flag: the dispatch's one-element overflow flag (bool or an integer type; its value is added).
        tokens_per_expert: `[L]` integer rows per local expert, contiguous.
        overflows, rows_used, expert_rows_used: int64 one-element counters.
        not_overflowed: a one-element bool tensor.
        budget_flag: a one-element integer flag of the expert budgets (None: no budgets).
        metric: a contiguous float32 tensor (Megatron's per-layer metric values) and the index
            `metric_index` of the element to add to; `reciprocal` is taken as a float32.
    """
    if (budget_flag is None) != (expert_rows_used is None):
        raise ValueError("fused.record_dispatch: budget_flag and expert_rows_used come together")
    if tokens_per_expert.dim() != 1 or not tokens_per_expert.is_contiguous():
        raise ValueError(f"fused.record_dispatch: tokens_per_expert must be contiguous [L]; got {tokens_per_expert}")
    if metric is not None and not (metric.dtype == torch.float32 and 0 <= metric_index < metric.numel()):
        raise ValueError(f"fused.record_dispatch: metric must be float32 with an element {metric_index}; got {metric}")
    # The counters' dtypes (int64) are the caller's (`DeviceCounters`): not checked per dispatch.
    num_local = tokens_per_expert.numel()
    offsets = None
    if offsets_limit is not None:
        offsets = torch.empty(num_local, dtype=torch.int32, device=tokens_per_expert.device)
    _record_dispatch_kernel[(1,)](
        flag,
        budget_flag if budget_flag is not None else flag,  # not read without budgets
        tokens_per_expert,
        overflows,
        rows_used,
        expert_rows_used if expert_rows_used is not None else rows_used,
        not_overflowed,
        metric if metric is not None else overflows,  # not read without the metric
        metric_index,
        reciprocal,
        offsets if offsets is not None else rows_used,  # not written without offsets
        offsets_limit or 0,
        num_local,
        L_P2=_next_pow2(max(num_local, 1)),
        HAS_BUDGET=budget_flag is not None,
        HAS_METRIC=metric is not None,
        HAS_OFFSETS=offsets is not None,
        enable_fp_fusion=False,  # the product rounded, then the sum: as torch's two ops
    )
    return offsets


# The attribute of a dispatch's `tokens_per_expert` that holds (rows, offsets) for the experts.
_OFFSETS = "_megatron_ext_expert_offsets"


def attach_offsets(tokens_per_expert: torch.Tensor, rows: int, offsets: torch.Tensor) -> None:
    """Keep `offsets` (from `record_dispatch`, clamped to `rows`) on the dispatch's counts, for the
    experts that receive those counts with `rows` rows: they skip computing them (two launches).
    Kept as the tensor's attribute, so they go when the counts go."""
    setattr(tokens_per_expert, _OFFSETS, (rows, offsets))


def forget_offsets(tokens_per_expert: torch.Tensor) -> None:
    """Drop offsets kept on these counts: a buffer may hand out the same counts tensor again, refilled
    by a dispatch that made no offsets (a blocking one), whose rows could equal the earlier capacity."""
    if hasattr(tokens_per_expert, _OFFSETS):
        delattr(tokens_per_expert, _OFFSETS)


def attached_offsets(tokens_per_expert: torch.Tensor, rows: int) -> Optional[torch.Tensor]:
    """The offsets `attach_offsets` kept on these counts for `rows` rows, or None."""
    kept = getattr(tokens_per_expert, _OFFSETS, None)
    return kept[1] if kept is not None and kept[0] == rows else None
