"""The overflow flag is read from every known HybridEP handle layout, and an unknown one is refused.

deep_ep's handles are stood in by tuples shaped as DeepEP's hybrid-ep branch builds them: 11
entries up to PR #744 (tested commit 94a9f8f), 12 after #744 (num_of_valid_tokens, an int, after
the flag) and after #746 (the int before the flag).
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.hybridep import TorchHybridEPBuffer, UnknownHandleLayoutError, dispatch, overflow_flag
from tests import reference


def _head() -> list:
    """Ten leading entries like deep_ep's: tensors and ints, none a one-element integer tensor."""
    return [torch.zeros(4, 8, dtype=torch.int32), torch.ones(16), 7, torch.zeros(3, 2), 12, 5, None, 3, True, 0.5]


def _flag(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int32)


@pytest.mark.parametrize("value", [0, 1])
def test_eleven_entries_flag_last(value):
    flag = _flag(value)
    handle = tuple(_head() + [flag])
    assert overflow_flag(handle) is flag


@pytest.mark.parametrize("value", [0, 1])
def test_twelve_entries_count_after_the_flag(value):  # DeepEP #744
    flag = _flag(value)
    handle = tuple(_head() + [flag, 4096])
    assert overflow_flag(handle) is flag


@pytest.mark.parametrize("value", [0, 1])
def test_twelve_entries_count_before_the_flag(value):  # DeepEP #746
    flag = _flag(value)
    handle = tuple(_head() + [4096, flag])
    assert overflow_flag(handle) is flag


def test_our_handle_by_name(gloo_group):
    gen = torch.Generator().manual_seed(3)
    hidden, maps, probs = reference.random_routing(gen, 1, 8, 4, 2, 16, torch.float32)
    buf = TorchHybridEPBuffer(gloo_group, 16, 8, 4)
    _, _, counts, handle = dispatch(buf, hidden[0], maps[0], probs[0], num_local_experts=4, num_permuted_tokens=4)
    assert overflow_flag(handle) is handle.overflow_flag
    assert int(overflow_flag(handle)) == 1  # 8 tokens x top-2 into 4 rows


@pytest.mark.parametrize(
    "tail",
    [
        [],  # 10 entries
        [torch.ones(1), 4096],  # a float where the flag should be
        [_flag(0), _flag(0)],  # two candidates: which is the flag is not known
        [4096, 4096],  # no flag at all
        [_flag(0), 4096, 1],  # 13 entries
    ],
    ids=["ten", "float", "two-flags", "no-flag", "thirteen"],
)
def test_unknown_layout_is_refused_with_the_fix(tail):
    with pytest.raises(UnknownHandleLayoutError) as err:
        overflow_flag(tuple(_head() + tail))
    message = str(err.value)
    for needle in ("overflow flag", "94a9f8f", "#744", "#746", "--moe-hybridep-implementation torch"):
        assert needle in message, (needle, message)
