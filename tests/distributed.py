"""Run a function on W spawned CPU ranks with a gloo process group (one spawn, many cases)."""

from __future__ import annotations

import os
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, world_size, init_file, fn, args):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args) -> None:
    """Call fn(rank, world_size, *args) on `world_size` processes; re-raise the first failure.

    `fn` must be importable (a module-level function of a test module).
    """
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(world_size, os.path.join(tmp, "init"), fn, args), nprocs=world_size, join=True)
