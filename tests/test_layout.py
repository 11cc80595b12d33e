"""The pure layout function, against hand-worked examples.

A row's code is g * L + e (token g, local expert e); padding rows and rows past the padded
total carry N * L (a token that does not exist)."""

import torch

from megatron_ext.hybridep.torch_buffer.layout import expert_layout, round_up

# 5 tokens, 2 local experts: expert 0 gets tokens 1, 3, 4; expert 1 gets tokens 0, 3.
MAP = torch.tensor([[0, 1], [1, 0], [0, 0], [1, 1], [1, 0]], dtype=torch.bool)
PAD = 5 * 2


def rows(*pairs):
    """Codes of (token, expert) pairs; None for a padding row."""
    return [PAD if p is None else p[0] * 2 + p[1] for p in pairs]


def test_exact_layout_without_padding():
    layout = expert_layout(MAP, 5, None)
    assert layout.row_code.tolist() == rows((1, 0), (3, 0), (4, 0), (0, 1), (3, 1))
    assert layout.tokens_per_expert.tolist() == [3, 2]
    assert layout.overflow.tolist() == [0]


def test_padding_rows_carry_the_missing_token():
    layout = expert_layout(MAP, 8, 4)
    assert layout.row_code.tolist() == rows((1, 0), (3, 0), (4, 0), None, (0, 1), (3, 1), None, None)
    assert layout.tokens_per_expert.tolist() == [4, 4]


def test_capacity_beyond_total_leaves_padding_rows():
    layout = expert_layout(MAP, 12, 4)
    assert layout.row_code.tolist()[8:] == [PAD] * 4
    assert layout.tokens_per_expert.tolist() == [4, 4] and layout.overflow.tolist() == [0]


def test_truncation_drops_the_tail_last_expert_first():
    layout = expert_layout(MAP, 4, None)
    assert layout.row_code.tolist() == rows((1, 0), (3, 0), (4, 0), (0, 1))
    assert layout.tokens_per_expert.tolist() == [3, 1]
    assert layout.overflow.tolist() == [1]
    layout = expert_layout(MAP, 2, None)
    assert layout.row_code.tolist() == rows((1, 0), (3, 0)) and layout.tokens_per_expert.tolist() == [2, 0]
    assert layout.overflow.tolist() == [1]


def test_empty_capacity_and_empty_map():
    layout = expert_layout(MAP, 0, 4)
    assert layout.row_code.tolist() == [] and layout.tokens_per_expert.tolist() == [0, 0]
    assert layout.overflow.tolist() == [1]
    layout = expert_layout(torch.zeros(3, 2, dtype=torch.bool), 0, None)
    assert layout.overflow.tolist() == [0] and layout.tokens_per_expert.tolist() == [0, 0]


def test_round_up():
    assert round_up(torch.tensor([0, 1, 4, 5]), 4).tolist() == [0, 4, 4, 8]
    assert round_up(torch.tensor([3]), None).tolist() == [3]
