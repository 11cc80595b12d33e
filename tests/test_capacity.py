"""The sizing rules of capacity mode and equal token counts (pure functions)."""

from __future__ import annotations

import math

import pytest

from megatron_ext.capacity import (
    capacity_alignment,
    capacity_from_rows,
    capacity_reciprocal,
    equal_count_padding,
    round_up,
)


@pytest.mark.parametrize(("value", "multiple", "expected"), [(0, 4, 0), (1, 4, 4), (4, 4, 4), (5, 4, 8), (65, 64, 128)])
def test_round_up(value, multiple, expected):
    assert round_up(value, multiple) == expected


def test_alignment_is_four_and_pad_multiple():
    assert capacity_alignment(None) == 4
    assert capacity_alignment(16) == 16
    assert capacity_alignment(6) == 12
    assert capacity_alignment(256) == 256


@pytest.mark.parametrize(
    ("rows", "factor", "pad_multiple", "expected"),
    [
        (100, 1.0, None, 100),  # exact: no room, aligned already
        (101, 1.0, None, 104),  # aligned up to 4
        (100, 1.1, None, 112),  # 110 exactly (not 110.00000000000001 -> 111), then 112
        (33152, 1.5, None, 49728),  # the seed's calibration: 33152 rows x 1.5
        (100, 1.5, 16, 160),  # 150 aligned to lcm(4, 16)
        (0, 2.0, None, 4),  # never below one alignment unit
        (7, 2.0, 6, 24),  # 14 aligned to lcm(4, 6) = 12
    ],
)
def test_capacity_from_rows(rows, factor, pad_multiple, expected):
    assert capacity_from_rows(rows, factor, pad_multiple) == expected


def test_capacity_covers_the_rows_for_random_inputs():
    import random

    generator = random.Random(0)
    for _ in range(1000):
        rows, factor = generator.randrange(0, 10**6), 1.0 + generator.random() * 3
        pad = generator.choice([None, 8, 16, 32])
        capacity = capacity_from_rows(rows, factor, pad)
        assert capacity >= rows * factor - 1e-6 and capacity % capacity_alignment(pad) == 0
        assert capacity - capacity_alignment(pad) < max(math.ceil(rows * factor), 1)


@pytest.mark.parametrize("factor", [0.5, 0.999, float("nan"), float("inf")])
def test_capacity_refuses_factors_that_drop_tokens(factor):
    with pytest.raises(ValueError, match="factor"):
        capacity_from_rows(10, factor)


def test_capacity_reciprocal_is_one_over_the_capacity_in_float32():
    import numpy as np

    for capacity in (1, 3, 4, 96, 100, 4097, 123_456, 2**20 + 12):
        got = capacity_reciprocal(capacity)
        assert got == float(np.float32(got)), capacity  # a float32 value: a device multiply takes it as it is
        assert got == float(np.float32(1) / np.float32(capacity)), capacity  # float32's own division
    with pytest.raises(ValueError, match="capacity_reciprocal: `capacity` must be >= 1; got 0"):
        capacity_reciprocal(0)


def test_equal_count_padding_aligns_the_local_count():
    assert equal_count_padding(30, 64) == 64
    assert equal_count_padding(64, 64) == 64
    assert equal_count_padding(8192, 64) == 8192
    assert equal_count_padding(8193, 64) == 8256


def test_token_alignment_is_megatrons():
    from megatron.core.transformer.moe.fused_a2a import HYBRIDEP_TOKEN_ALIGNMENT

    from megatron_ext.dispatcher import TOKEN_ALIGNMENT

    assert TOKEN_ALIGNMENT == HYBRIDEP_TOKEN_ALIGNMENT


def _quantization_config(**fields):
    from types import SimpleNamespace

    defaults = dict(use_transformer_engine_op_fuser=False, fp8=None, fp8_recipe="delayed", fp4=None, fp4_recipe=None)
    return SimpleNamespace(**{**defaults, **fields})


@pytest.mark.parametrize(
    ("fields", "megatron_019", "megatron_020"),
    [
        (dict(), None, None),  # bf16, no alignment asked
        (dict(use_transformer_engine_op_fuser=True), None, 256),  # 0.19 pads in fp8/fp4 only
        (dict(use_transformer_engine_op_fuser=True, fp8="e4m3"), 256, 256),
    ],
    ids=["bf16", "op-fuser-bf16", "op-fuser-fp8"],
)
def test_experts_rows_are_padded_as_megatrons_own_hybridep_manager_pads_them(
    monkeypatch, fields, megatron_019, megatron_020
):
    import megatron_ext.dispatcher as dispatcher
    from megatron_ext.dispatcher import expert_pad_multiple

    # The alignment Megatron's experts ask for, as both lines compute it for these configs (the
    # installed release's own reads fields the other line's config lacks).
    monkeypatch.setattr(
        dispatcher,
        "get_align_size_for_quantization",
        lambda config: 256 if config.use_transformer_engine_op_fuser else (16 if config.fp8 else 0),
    )
    # A config of the 0.19 line has no moe_use_grouped_tensor; one of the 0.20 line has it.
    assert expert_pad_multiple(_quantization_config(**fields)) == megatron_019
    assert expert_pad_multiple(_quantization_config(moe_use_grouped_tensor=False, **fields)) == megatron_020


def test_grouped_tensor_experts_get_rows_padded_to_256_where_megatron_has_them():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.dispatcher import expert_pad_multiple

    if "moe_use_grouped_tensor" not in TransformerConfig.__dataclass_fields__:
        pytest.skip("this megatron-core has no --moe-use-grouped-tensor (added in the 0.20 line)")
    assert expert_pad_multiple(_quantization_config(moe_use_grouped_tensor=True)) == 256
