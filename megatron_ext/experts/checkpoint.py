"""GroupedMLP's checkpoints in the layouts of Megatron's other experts (`megatron_ext.experts`).

- Plain state dicts: `GroupedMLP` keeps each linear as one stacked tensor ([L, out, in]) and
  presents it as TE GroupedLinear's per-expert `weight{i}` / `bias{i}` (plus its empty
  `_extra_state`), so `TEGroupedMLP` checkpoints load into it and back; Megatron's local-spec
  `SequentialMLP` keys (`local_experts.{i}.linear_fcN.weight`) are renamed on load.
- Distributed checkpoints: `sharded_state_dict` writes the global `[num_experts, ...]` tensors
  that `TEGroupedMLP` and `SequentialMLP` write one expert at a time, so all three interchange.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional, Protocol

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.transformer.utils import make_sharded_object_for_checkpoint
from megatron.core.utils import get_pg_rank, get_pg_size


# What these functions read of the modules they serve, so that this module needs nothing of
# `megatron_ext.experts` (which imports it to register the hooks): `_ExpertLinear` and `GroupedMLP`
# there have these attributes.
class StackedLinear(Protocol):
    """One linear for all L local experts: `weight` [L, out, in] and `bias` [L, out] (or None)."""

    num_experts: int

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...

    def get_extra_state(self) -> torch.Tensor: ...


class StackedExperts(Protocol):
    """A layer's L local experts as two stacked linears, with its expert process groups."""

    num_local_experts: int
    linear_fc1: StackedLinear
    linear_fc2: StackedLinear
    ep_group: Any
    tp_group: Any
    expt_dp_group: Optional[Any]


def split_per_expert(module: StackedLinear, state_dict: dict, prefix: str, local_metadata) -> None:
    # Pop this module's own entries (the last ones written) and re-add them in TE's order.
    weight = state_dict.pop(prefix + "weight")
    bias = state_dict.pop(prefix + "bias", None)
    extra = state_dict.pop(prefix + "_extra_state")
    for i in range(module.num_experts):
        state_dict[f"{prefix}weight{i}"] = weight[i]
        if bias is not None:
            state_dict[f"{prefix}bias{i}"] = bias[i]
    state_dict[prefix + "_extra_state"] = extra


def stack_per_expert(module: StackedLinear, state_dict: dict, prefix: str, *_) -> None:
    for name in ("weight", "bias"):
        keys = [f"{prefix}{name}{i}" for i in range(module.num_experts)]
        if all(k in state_dict for k in keys):  # else leave them: load_state_dict reports what is amiss
            state_dict[prefix + name] = torch.stack([state_dict.pop(k) for k in keys])
    for i in range(1, module.num_experts):  # dist-checkpoint form of TE's per-expert extra state
        state_dict.pop(f"{prefix}_extra_state{i}", None)


def from_sequential_mlp(module: StackedExperts, state_dict: dict, prefix: str, *_) -> None:
    """Rename SequentialMLP's per-expert keys (Megatron's local spec, `local_experts.{i}.linear_fcN.weight`,
    what a run without capacity mode saves in `--ckpt-format torch`) to ours (`linear_fcN.weight{i}`),
    so such a checkpoint loads instead of being skipped by a non-strict load. (The distributed
    checkpoint formats need no renaming: both write the same global tensors.)"""
    for linear in ("linear_fc1", "linear_fc2"):
        renamed = False
        for i in range(module.num_local_experts):
            theirs = f"{prefix}local_experts.{i}.{linear}."
            for name in ("weight", "bias"):
                if theirs + name in state_dict:
                    state_dict[f"{prefix}{linear}.{name}{i}"] = state_dict.pop(theirs + name)
                    renamed = True
            state_dict.pop(theirs + "_extra_state", None)  # the parallel linears': nothing we keep
        if renamed:  # ours is ignored on load, but a strict load asks for it
            state_dict.setdefault(f"{prefix}{linear}._extra_state", None)


def sharded_state_dict(module: StackedExperts, prefix: str, sharded_offsets: tuple, metadata: dict | None):
    """Distributed-checkpoint entries in TEGroupedMLP's global layout.

    Each stacked parameter is one ShardedTensor: rows [r*L, (r+1)*L) of the global
    [num_experts, ...] tensor `{prefix}experts.linear_fcN.weight` that TEGroupedMLP and
    SequentialMLP write one expert at a time, so the checkpoints are interchangeable (the
    GLU halves TEGroupedMLP saves as two chunks are the same global rows). Per-expert
    `_extra_state` objects are written as TE writes them without fp8.
    """
    if (metadata or {}).get("singleton_local_shards"):
        raise NotImplementedError("GroupedMLP.sharded_state_dict: singleton_local_shards is not supported.")
    if module.expt_dp_group is None:
        raise ValueError("GroupedMLP.sharded_state_dict needs pg_collection.expt_dp (expert data parallel group).")
    ep_axis, ep_rank, ep_size = len(sharded_offsets), get_pg_rank(module.ep_group), get_pg_size(module.ep_group)
    L = module.num_local_experts
    # The writer of each shard: one per expert-data-parallel group (as TE's grouped linears).
    replica_id = (0, get_pg_rank(module.tp_group), get_pg_rank(module.expt_dp_group))
    entries = {}
    for name in ("linear_fc1", "linear_fc2"):
        linear, key = getattr(module, name), f"{prefix}experts.{name}."
        for pname, param in linear.named_parameters():
            entries[f"{prefix}{name}.{pname}"] = ShardedTensor.from_rank_offsets(
                key + pname,
                param,
                *sharded_offsets,
                (ep_axis, ep_rank, ep_size),
                replica_id=replica_id,
                prepend_axis_num=ep_axis,
            )
        for i in range(L):
            offsets = (*sharded_offsets, (ep_axis, ep_rank * L + i, ep_size * L))
            entries[f"{prefix}{name}._extra_state{i or ''}"] = make_sharded_object_for_checkpoint(
                linear.get_extra_state(), key + "_extra_state", offsets, replica_id=replica_id
            )
    return entries
