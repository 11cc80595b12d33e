"""Where each routed token lands in one rank's dispatch output (the HybridEP permuted layout).

Pure tensor functions: no communication and no host read of a device value. The blocking and
the non-blocking dispatch both place rows through `expert_layout`, which is why their rows are
bitwise equal wherever both exist.

The layout, for a rank that owns L local experts: for each local expert e in order, the tokens
routed to e in ascending global index, then zero rows up to a multiple of `pad_multiple`;
segments back to back, in an output of `capacity` rows: a capacity above the padded total leaves
spare rows at the end, one below it truncates the tail, last expert first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class ExpertLayout:
    """The output rows of one dispatch on one rank.

    row_code: `[capacity]` int64, `g * L + e` for the row holding token g for local expert e, and
        `N * L` (token N, which does not exist) for padding rows and rows past the padded total.
    tokens_per_expert: `[L]` int64, padded segment lengths, truncated to `capacity`.
    overflow: `[1]` int32, 1 when the padded total exceeds `capacity`.
    """

    row_code: torch.Tensor
    tokens_per_expert: torch.Tensor
    overflow: torch.Tensor


def round_up(x: torch.Tensor, multiple: Optional[int]) -> torch.Tensor:
    """Round every element of an integer tensor up to a multiple of `multiple` (None: as is)."""
    if multiple is None or multiple == 1:
        return x
    return (x + (multiple - 1)).div_(multiple, rounding_mode="floor").mul_(multiple)


def padded_counts(local_map: torch.Tensor, pad_multiple: Optional[int]) -> torch.Tensor:
    """`[L]` int64 padded token counts of the local experts, from a `[N, L]` Boolean map."""
    return round_up(local_map.sum(dim=0, dtype=torch.int64), pad_multiple)


def expert_layout(
    local_map: torch.Tensor,
    capacity: int,
    pad_multiple: Optional[int],
    counts: Optional[torch.Tensor] = None,
) -> ExpertLayout:
    """Place the routed (token, local expert) pairs of `local_map` into `capacity` output rows.

    Args:
        local_map: `[N, L]` bool, the gathered routing map restricted to this rank's experts; row
            g is the token with global index g (source_rank * T + t).
        capacity: host integer, the number of output rows: a dispatch's capacity, or the exact
            padded total for a blocking dispatch sized to its rows.
        pad_multiple: pad each expert's segment to a multiple of this (None: no padding).
        counts: `padded_counts(local_map, pad_multiple)` when the caller has it already.
    """
    num_tokens, num_local = local_map.shape
    if counts is None:
        counts = padded_counts(local_map, pad_multiple)
    ends = torch.cumsum(counts, dim=0)
    # Row of each routed pair: its expert's segment start plus its rank among that expert's
    # tokens (ascending global index). Expert-major [L, N], so the scan runs along contiguous
    # memory: CUDA's scan down the columns of [N, L] took 1.6 ms per layer on the H200 at
    # N 8192, L 64 (13 % of the bench's step; docs/benchmarks.md).
    by_expert = local_map.t().contiguous()
    position = torch.cumsum(by_expert, dim=1, dtype=torch.int64)
    position += (ends - counts - 1).unsqueeze(1)
    # Pairs that are not routed or fall past the capacity all land in one spare row, cut off below.
    position.masked_fill_(position.ge(capacity).logical_or_(by_expert.logical_not()), capacity)
    device = local_map.device
    codes = torch.arange(num_tokens, device=device).mul_(num_local).unsqueeze(0) + torch.arange(
        num_local, device=device
    ).unsqueeze(1)  # [L, N]: g * L + e
    row_code = torch.full((capacity + 1,), num_tokens * num_local, dtype=torch.int64, device=device)
    row_code.scatter_(0, position.view(-1), codes.view(-1))
    tokens_per_expert = ends.clamp(max=capacity) - (ends - counts).clamp_(max=capacity)
    overflow = ends[-1:].gt(capacity).to(torch.int32)
    return ExpertLayout(row_code[:capacity], tokens_per_expert, overflow)
