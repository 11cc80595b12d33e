"""Megatron-Core MoE layers on CPU ranks (gloo): for the bench and the tests, never for training.

Megatron's MoE layer assumes CUDA in places that have nothing to do with what the bench and the
tests measure; `use_cpu_ranks()` stands them in, in this process, with CPU equivalents:
* streams and events (`torch.cuda.Stream/Event/current_stream/stream`): one CPU "stream", so
  waits and synchronisations are no-ops;
* `torch.cuda.current_device()`: "cpu";
* `moe_utils.maybe_move_tensor_to_cpu`, which only converts CUDA tensors, so the alltoall
  dispatcher's split sizes would stay tensors: converted to numpy as it asks;
* the CUDA RNG state that activation checkpointing saves and restores: nothing to save on CPU
  (Megatron still saves and restores the CPU RNG state).

Call it only in processes whose MoE layers run on CPU: it replaces the CUDA stream API for the
whole process.
"""

from __future__ import annotations

import contextlib

import torch


def _nothing(*args, **kwargs) -> None:
    """A CPU rank's stream and event calls: nothing to record, wait for or synchronise."""


class _Event:
    __init__ = record = wait = synchronize = _nothing


class _Stream:
    __init__ = wait_stream = wait_event = synchronize = _nothing

    def record_event(self, *args, **kwargs):
        return _Event()


def _to_host(tensor, as_numpy=False, record_stream=False):
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def use_cpu_ranks() -> None:
    """Stand in Megatron's CUDA-only streams, device query, host copy and CUDA RNG state (this process)."""
    torch.cuda.Stream = _Stream
    torch.cuda.Event = _Event
    torch.cuda.current_stream = lambda *args, **kwargs: _Stream()
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    moe_utils.maybe_move_tensor_to_cpu = _to_host
    token_dispatcher.maybe_move_tensor_to_cpu = _to_host
    random._get_cuda_rng_state = lambda *args, **kwargs: None
    random._set_cuda_rng_state = lambda *args, **kwargs: None
