"""Host constants: CPU tensors made on the host and never written by a kernel.

Reading one waits for no device, so the sync guard (`megatron_ext.tooling.sync`) lets it be read
even on a CPU-only run, where every other host read counts as one that would stall a GPU. The
dispatcher marks the per-expert row budgets of static expert splits this way.
"""

from __future__ import annotations

import torch

_MARK = "_megatron_ext_host_constant"


def host_constant(tensor: torch.Tensor) -> torch.Tensor:
    """Mark a CPU tensor as a host constant (its reads wait for no device); returns it."""
    if tensor.device.type != "cpu":
        raise ValueError(f"host_constant() takes a CPU tensor, not one on {tensor.device}")
    setattr(tensor, _MARK, True)
    return tensor


def is_host_constant(value: object) -> bool:
    """`value` is a tensor marked by `host_constant()` (a view of one, or anything computed from one, is not)."""
    return isinstance(value, torch.Tensor) and getattr(value, _MARK, False)
