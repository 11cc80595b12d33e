"""How large a capacity-mode dispatch is, and what an overflow does.

Here: the sizing rules. Beside them: what a capacity-mode layer decides (`policy.py`: calibration,
growth, the overflow check, metrics), static expert splits (`budget.py`: the fixed-budget layout
and its maps), and CPU tensors whose reads wait for no device (`host_constant.py`).

Sizing rules for capacity-mode dispatch and for padding token counts. Pure functions.

Capacity mode sizes every non-blocking dispatch of a MoE layer to one host integer, its
capacity, learned once from a blocking calibration dispatch:

    capacity = align(ceil(max over the EP group of rows_r x factor))

where rows_r is the number of rows rank r's calibration dispatch produced (padded per expert) and
`align` rounds up to a multiple of `capacity_alignment(pad_multiple)`. The product is computed
exactly on the decimal value of the factor (1.1 x 100 is 110, not 111), and the capacity is never
below one alignment unit, so a layer calibrated on a batch that routed nothing still runs.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction
from typing import Optional

from megatron_ext.options import check_capacity_factor

# HybridEP's permute buffers are sized in groups of 4 rows.
CAPACITY_ALIGNMENT = 4


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= `value` (`value` >= 0, `multiple` >= 1)."""
    if multiple < 1:
        raise ValueError(f"round_up: `multiple` must be >= 1; got {multiple}.")
    return -(-value // multiple) * multiple


def capacity_alignment(pad_multiple: Optional[int]) -> int:
    """What a capacity must be a multiple of: 4 and the per-expert `pad_multiple` (fp8/fp4)."""
    return math.lcm(CAPACITY_ALIGNMENT, pad_multiple or 1)


def sized_rows(rows: int, factor: float, alignment: int, name: str) -> int:
    """`ceil(rows x factor)` (exact on the factor's decimal value) rounded up to `alignment`, at
    least one `alignment`: the rule of a capacity and of a static expert budget. `name`: the caller,
    for errors."""
    if rows < 0:
        raise ValueError(f"{name}: `rows` must be >= 0; got {rows}.")
    check_capacity_factor(factor, f"{name}: `factor`")
    scaled = math.ceil(rows * Fraction(str(factor)))
    return max(round_up(scaled, alignment), alignment)


def capacity_from_rows(rows: int, factor: float, pad_multiple: Optional[int] = None) -> int:
    """Capacity for a layer whose largest calibration dispatch in the EP group made `rows` rows.

    `ceil(rows x factor)` rounded up to `capacity_alignment(pad_multiple)`, at least one unit.
    """
    return sized_rows(rows, factor, capacity_alignment(pad_multiple), "capacity_from_rows")


def budget_from_rows(largest: int, factor: float, pad_multiple: Optional[int] = None) -> int:
    """Static expert splits: each local expert's row budget when the EP group's largest calibrated
    expert segment has `largest` rows: the capacity's rule, aligned to the per-expert padding only."""
    return sized_rows(largest, factor, pad_multiple or 1, "budget_from_rows")


def half_headroom(calibrated: int, size: int) -> int:
    """Rows above which a capacity (or a budget) sized from `calibrated` rows to `size` has used half
    of its room: where megatron-ext's overflow policy grows it before an overflow."""
    return calibrated + (size - calibrated) // 2


def capacity_reciprocal(capacity: int) -> float:
    """1 / `capacity` rounded to float32. A layer's capacity use is rows x this, in float32, wherever
    it is computed: a dispatch's metric (a tensor times a host number) and the step check's largest
    use (a tensor of these, one per layer) then give equal values for equal rows. Dividing instead
    would not: CUDA divides a tensor by a host number as a multiply by its reciprocal, and a tensor
    by a tensor exactly, so the two could differ in the last bit and a rank's use exceed the maximum."""
    if capacity < 1:
        raise ValueError(f"capacity_reciprocal: `capacity` must be >= 1; got {capacity}.")
    return struct.unpack("f", struct.pack("f", 1.0 / capacity))[0]


def equal_count_padding(num_tokens: int, alignment: int) -> int:
    """Token count every rank pads to when all ranks declare the same count: the local one, aligned.

    With equal counts the EP-group maximum is the local count, so no all-reduce is needed.
    """
    return round_up(num_tokens, alignment)
