"""The pure layout function, against hand-worked examples."""

import torch

from megatron_ext.hybridep.layout import expert_layout, round_up

# 5 tokens, 2 local experts: expert 0 gets tokens 1, 3, 4; expert 1 gets tokens 0, 3.
MAP = torch.tensor([[0, 1], [1, 0], [0, 0], [1, 1], [1, 0]], dtype=torch.bool)
DUMP = 99


def test_exact_layout_without_padding():
    layout = expert_layout(MAP, None, DUMP, 5, None)
    assert layout.row_slot.tolist() == [1, 3, 4, 0, 3]
    assert layout.row_expert.tolist() == [0, 0, 0, 1, 1]
    assert layout.tokens_per_expert.tolist() == [3, 2]
    assert layout.overflow.tolist() == [0] and int(layout.padded_total) == 5


def test_padding_rows_read_the_dump_slot():
    layout = expert_layout(MAP, None, DUMP, 8, 4)
    assert layout.row_slot.tolist() == [1, 3, 4, DUMP, 0, 3, DUMP, DUMP]
    assert layout.tokens_per_expert.tolist() == [4, 4]


def test_capacity_beyond_total_leaves_dump_rows():
    layout = expert_layout(MAP, None, DUMP, 12, 4)
    assert layout.row_slot.tolist()[8:] == [DUMP] * 4
    assert layout.tokens_per_expert.tolist() == [4, 4] and layout.overflow.tolist() == [0]


def test_truncation_drops_the_tail_last_expert_first():
    layout = expert_layout(MAP, None, DUMP, 4, None)
    assert layout.row_slot.tolist() == [1, 3, 4, 0]
    assert layout.tokens_per_expert.tolist() == [3, 1]
    assert layout.overflow.tolist() == [1] and int(layout.padded_total) == 5
    layout = expert_layout(MAP, None, DUMP, 2, None)
    assert layout.row_slot.tolist() == [1, 3] and layout.tokens_per_expert.tolist() == [2, 0]


def test_slots_map_tokens_to_receive_positions():
    slots = torch.tensor([10, 11, 12, 13, 14])
    layout = expert_layout(MAP, slots, DUMP, 5, None)
    assert layout.row_slot.tolist() == [11, 13, 14, 10, 13]


def test_round_up():
    assert round_up(torch.tensor([0, 1, 4, 5]), 4).tolist() == [0, 4, 4, 8]
    assert round_up(torch.tensor([3]), None).tolist() == [3]
