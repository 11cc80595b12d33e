"""The overflow flag of a HybridEP handle, ours or deep_ep's, whatever the DeepEP version.

A non-blocking dispatch that needed more rows than it was given sets a one-element integer tensor
in its handle. Where that tensor sits has changed in DeepEP's `hybrid-ep` branch:

- up to DeepEP #744 (tested: 94a9f8f): 11 entries, the flag last (index 10);
- #744: `num_of_valid_tokens` (a Python int) appended after the flag: 12 entries, flag at 10;
- #746: that int moved in front of the flag: 12 entries, flag at 11, last again.

Megatron-Core 0.19.2 reads `handle[-1]`, which is the flag in two of the three. This module tells
them apart by what the entries are, and refuses a handle that matches none, instead of reading
some other tensor as the flag.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_ext.hybridep.torch_buffer import HybridEPHandle
from megatron_ext.options import DEEP_EP_TESTED_COMMIT


class UnknownHandleLayoutError(RuntimeError):
    """A deep_ep handle in which no known position holds the overflow flag."""


def _is_flag(entry: Any) -> bool:
    return (
        isinstance(entry, torch.Tensor)
        and entry.numel() == 1
        and not entry.is_floating_point()
        and entry.dtype is not torch.bool
    )


def _is_count(entry: Any) -> bool:
    return isinstance(entry, int) and not isinstance(entry, bool)


def overflow_flag(handle: Sequence[Any]) -> torch.Tensor:
    """The handle's one-element overflow flag tensor (nonzero: the dispatch was truncated)."""
    if isinstance(handle, HybridEPHandle):
        return handle.overflow_flag
    entries = len(handle)
    if entries == 11 and _is_flag(handle[10]):
        return handle[10]
    if entries == 12 and _is_flag(handle[10]) and _is_count(handle[11]):
        return handle[10]  # DeepEP #744
    if entries == 12 and _is_count(handle[10]) and _is_flag(handle[11]):
        return handle[11]  # DeepEP #746
    kinds = ", ".join(
        f"{i}: {tuple(e.shape)} {e.dtype}" if isinstance(e, torch.Tensor) else f"{i}: {type(e).__name__}"
        for i, e in enumerate(handle)
    )
    raise UnknownHandleLayoutError(
        f"megatron-ext cannot find the overflow flag in this deep_ep HybridEP handle of {entries} entries "
        f"({kinds}). Known layouts: 11 entries with the flag last (DeepEP hybrid-ep up to PR #744; tested at "
        f"{DEEP_EP_TESTED_COMMIT}), 12 entries with num_of_valid_tokens after the flag (#744) or before it "
        f"(#746). Install DeepEP's hybrid-ep branch at {DEEP_EP_TESTED_COMMIT}, or use "
        "--moe-hybridep-implementation torch."
    )
