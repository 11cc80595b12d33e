"""One way to run a function on every rank: under torchrun, or on ranks spawned here.

The bench, the round trip and the tests all call `run_on_ranks`. Under torchrun (RANK and
WORLD_SIZE set) this process is one rank and joins the launcher's process group; otherwise
`world_size` processes are spawned, meeting through a file. NCCL ranks use one GPU each (the
local rank's, or the spawned rank's).
"""

from __future__ import annotations

import datetime
import multiprocessing.util
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def this_rank() -> int:
    """This process's rank under torchrun; 0 (the parent of spawned ranks) otherwise."""
    return int(os.environ["RANK"]) if under_torchrun() else 0


def _call(fn: Callable[..., Any], args: tuple, rank: int, world_size: int) -> None:
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def _spawned(rank, world_size, init_file, backend, timeout_s, fn, args) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timeout
    )
    _call(fn, args, rank, world_size)
    # Every outcome is on disk now. Leave without the interpreter's teardown: on 2-core CI machines
    # it aborted now and then in a C++ thread destructor ("terminate called without an active
    # exception", no Python frame) after the work had finished and been saved. What
    # multiprocessing does at exit still runs (its finalizers release semaphores and stop the
    # Manager processes a rank started, e.g. Megatron's checkpoint writer's).
    multiprocessing.util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 1800,
) -> None:
    """Call `fn(rank, world_size, *args)` on every rank, inside a process group made for the call.

    Under torchrun this process is the one rank it runs here (`world_size` is the launcher's).
    Spawned ranks: a rank's exception is raised here (torch's ProcessRaisedException, with the
    rank's traceback) once the others were stopped; `fn` must be importable (module level), and
    what it returns is dropped, so ranks report through files: a spawned rank ends with
    `os._exit(0)` once `fn` returned, without the interpreter's teardown.
    """
    if under_torchrun():
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        _call(fn, args, dist.get_rank(), dist.get_world_size())
        return
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        entry = (world_size, os.path.join(tmp, "init"), backend, timeout_s, fn, args)
        mp.spawn(_spawned, args=entry, nprocs=world_size, join=True)
