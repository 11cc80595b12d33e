"""Logging that reads well in a job of many ranks: what is the same on every rank is said once.

megatron-ext logs through `logging.getLogger(__name__)` in each module (children of the
`megatron_ext` logger) and never configures handlers itself, except for the bench's `--verbose`.
"""

from __future__ import annotations

import logging
import os


def first_rank() -> bool:
    """Whether this process is the job's first rank: torch.distributed's rank once it is initialised,
    else the launcher's (`RANK` from torchrun, `SLURM_PROCID` under srun); True when none is known."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    for name in ("RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name]) == 0
    return True


def once_per_job(level: int) -> int:
    """`level` on the job's first rank, DEBUG elsewhere: for lines every rank would say alike."""
    return level if first_rank() else logging.DEBUG


def log_with_rank_prefix(rank: int, level: int = logging.INFO) -> None:
    """Send megatron-ext's records at `level` and above to stderr, each line prefixed with the rank."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(name)s: %(message)s"))
    package = logging.getLogger(__name__.rpartition(".")[0])
    package.addHandler(handler)
    package.setLevel(level)
    package.propagate = False  # one line per record, not one more through the root logger


def once_per_group(level: int, group) -> int:
    """`level` on `group`'s first rank, DEBUG on its others: for lines every rank of a group says alike."""
    import torch.distributed as dist

    return level if dist.get_rank(group) == 0 else logging.DEBUG
