"""The shared buffers: one per group and arguments, and deep_ep's persistent all-gather only for
routing maps it accepts (a multiple of 16 bytes per rank), checked at every dispatch's count.

deep_ep is stood in by a module whose `HybridEPBuffer` records its constructor's arguments.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest

from megatron_ext.hybridep.buffers import get_buffer, release_buffers


class _RecordingBuffer:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class _BufferWithoutCustomGather:
    """A hybrid-ep build from before the persistent all-gather (its constructor lacks the argument)."""

    def __init__(self, group, hidden_dim, max_num_of_tokens_per_rank, num_local_experts, use_fp8=False):
        self.kwargs = dict(hidden_dim=hidden_dim, max_num_of_tokens_per_rank=max_num_of_tokens_per_rank)


@pytest.fixture
def group(gloo_group, monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", types.SimpleNamespace(HybridEPBuffer=_RecordingBuffer))
    release_buffers()
    yield gloo_group
    release_buffers()


def _get(group, num_tokens, reuse=True):
    return get_buffer(
        "deep_ep", group, hidden_dim=16, num_tokens=num_tokens, num_local_experts=4, reuse_allgather_buffer=reuse
    )


def test_persistent_gather_where_the_map_is_aligned(group):
    buffer = _get(group, 32)  # 32 tokens x 4 experts = 128 bytes
    assert buffer.kwargs["enable_custom_allgather"] is True
    assert buffer.kwargs["max_num_of_tokens_per_rank"] == 32
    assert _get(group, 32) is buffer and _get(group, 8) is buffer  # 8 x 4 = 32 bytes: aligned, served


def test_a_smaller_unaligned_count_falls_back_per_call(group, caplog):
    persistent = _get(group, 32)
    with caplog.at_level(logging.WARNING, logger="megatron_ext"):
        plain = _get(group, 3)  # 3 x 4 = 12 bytes: deep_ep would assert
        assert _get(group, 3) is plain
    assert plain is not persistent and "enable_custom_allgather" not in plain.kwargs
    warnings = [r.getMessage() for r in caplog.records if "plain all-gather" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once per count
    assert "3 x 4 bytes" in warnings[0] and "--moe-hybridep-reuse-allgather-buffer" in warnings[0]
    assert _get(group, 32) is persistent  # aligned counts go back to the persistent buffer


def test_unaligned_at_creation_uses_the_plain_gather(group):
    assert "enable_custom_allgather" not in _get(group, 5).kwargs


def test_without_reuse_never_the_persistent_gather(group):
    # Not passed at all: builds before the persistent all-gather refuse the keyword.
    assert "enable_custom_allgather" not in _get(group, 32, reuse=False).kwargs


def test_a_build_without_the_persistent_gather_gets_the_plain_one(group, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "deep_ep", types.SimpleNamespace(HybridEPBuffer=_BufferWithoutCustomGather))
    with caplog.at_level(logging.WARNING, logger="megatron_ext"):
        plain = _get(group, 32)  # aligned, on one node: only the build lacks it
    assert plain.kwargs["max_num_of_tokens_per_rank"] == 32 and "enable_custom_allgather" not in plain.kwargs
    assert any("this deep_ep build has no enable_custom_allgather" in r.getMessage() for r in caplog.records)
