"""Where each routed token lands in one rank's dispatch output (the HybridEP permuted layout).

Pure tensor functions: no communication and no host read of a device value. The blocking and
the non-blocking dispatch both place rows through `expert_layout`, which is why their rows are
bitwise equal wherever both exist.

The layout, for a rank that owns L local experts: for each local expert e in order, the tokens routed to e in ascending global index, then zero
rows up to a multiple of `pad_multiple`; segments back to back; only the first `num_rows` rows
exist (non-blocking dispatch truncates the tail, last expert first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class ExpertLayout:
    """The output rows of one dispatch on one rank.

    row_slot: `[num_rows]` int64, the receive slot each output row is read from; `dump_slot`
        (an all-zero slot) for padding rows and rows past the padded total.
    row_expert: `[num_rows]` int64, the local expert of each output row (0 where `row_slot`
        is `dump_slot`).
    tokens_per_expert: `[L]` int64, padded segment lengths, truncated to `num_rows`.
    overflow: `[1]` int32, 1 when the padded total exceeds `num_rows`.
    padded_total: `[]` int64, the padded total before truncation (device value).
    """

    row_slot: torch.Tensor
    row_expert: torch.Tensor
    tokens_per_expert: torch.Tensor
    overflow: torch.Tensor
    padded_total: torch.Tensor


def round_up(x: torch.Tensor, multiple: Optional[int]) -> torch.Tensor:
    """Round every element of an integer tensor up to a multiple of `multiple` (None: as is)."""
    if multiple is None or multiple == 1:
        return x
    return (x + multiple - 1) // multiple * multiple


def padded_counts(local_map: torch.Tensor, pad_multiple: Optional[int]) -> torch.Tensor:
    """`[L]` int64 padded token counts of the local experts, from a `[N, L]` Boolean map."""
    return round_up(local_map.sum(dim=0, dtype=torch.int64), pad_multiple)


def expert_layout(
    local_map: torch.Tensor,
    slot_of_token: Optional[torch.Tensor],
    dump_slot: int,
    num_rows: int,
    pad_multiple: Optional[int],
) -> ExpertLayout:
    """Place the routed (token, local expert) pairs into `num_rows` output rows.

    Args:
        local_map: `[N, L]` bool, the gathered routing map restricted to this rank's experts; row
            g is the token with global index g (source_rank * T + t).
        slot_of_token: `[N]` int64, where token g sits in the receive buffer; None means slot g.
            Only entries of tokens routed to this rank are read.
        dump_slot: the index of an all-zero receive slot, read by padding rows.
        num_rows: host integer, the number of output rows (exact total or a capacity).
        pad_multiple: pad each expert's segment to a multiple of this (None: no padding).
    """
    num_tokens, num_local = local_map.shape
    device = local_map.device
    counts = padded_counts(local_map, pad_multiple)
    ends = torch.cumsum(counts, dim=0)
    starts = ends - counts
    # Position of each routed pair: its expert's segment start plus its rank among that
    # expert's tokens (ascending global index, as cumsum runs down the column).
    rank_in_expert = torch.cumsum(local_map, dim=0, dtype=torch.int32) - 1
    position = starts.unsqueeze(0) + rank_in_expert
    keep = local_map & (position < num_rows)
    # Pairs that are not routed or fall past num_rows all land in one spare row, cut off below.
    position = torch.where(keep, position, num_rows).reshape(-1)

    if slot_of_token is None:
        slot_of_token = torch.arange(num_tokens, device=device)
    row_slot = torch.full((num_rows + 1,), dump_slot, dtype=torch.int64, device=device)
    row_slot.scatter_(0, position, slot_of_token.unsqueeze(1).expand(num_tokens, num_local).reshape(-1))
    row_expert = torch.zeros(num_rows + 1, dtype=torch.int64, device=device)
    experts = torch.arange(num_local, device=device).unsqueeze(0).expand(num_tokens, num_local)
    row_expert.scatter_(0, position, experts.reshape(-1))
    # Drop the spare row; padding rows were never written and still read the dump slot.
    row_slot = row_slot[:num_rows]
    row_expert = row_expert[:num_rows]

    tokens_per_expert = ends.clamp(max=num_rows) - starts.clamp(max=num_rows)
    padded_total = ends[-1] if num_local else torch.zeros((), dtype=torch.int64, device=device)
    overflow = (padded_total > num_rows).to(torch.int32).reshape(1)
    return ExpertLayout(row_slot, row_expert, tokens_per_expert, overflow, padded_total)
