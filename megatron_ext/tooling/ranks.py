"""One way to run a function on every rank: under torchrun, or on ranks spawned here.

The bench, the round trip and the tests all call `run_on_ranks`. Under torchrun (RANK and
WORLD_SIZE set) this process is one rank and joins the launcher's process group; otherwise
`world_size` processes are spawned, meeting through a file.

Where the ranks run is a `Placement`: CPU ranks on gloo; one rank per GPU on NCCL; or several
ranks sharing each GPU, on gloo with CUDA tensors (NCCL refuses two ranks on one device; gloo
stages CUDA tensors through host memory). The last is a rehearsal of expert parallelism on fewer
GPUs than ranks: every GPU kernel and layout of W ranks runs, but its times are not performance
figures, and a gloo collective waits on the host (the host-sync guard leaves that wait out:
`megatron_ext.tooling.sync`). The product never asks where it runs: it takes its device from the
tensors it is given.
"""

from __future__ import annotations

import datetime
import multiprocessing.util
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Placement:
    """Where each rank runs. device: 'cpu' or 'cuda'. ranks_per_gpu: ranks sharing one GPU (1:
    one rank per GPU, on NCCL; more: on gloo with CUDA tensors)."""

    device: str = "cpu"
    ranks_per_gpu: int = 1

    def __post_init__(self):
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"Placement.device must be 'cpu' or 'cuda', not {self.device!r}")
        if self.ranks_per_gpu < 1:
            raise ValueError(f"ranks per GPU must be at least 1, not {self.ranks_per_gpu}")
        if self.device == "cpu" and self.ranks_per_gpu != 1:
            raise ValueError("ranks per GPU is for CUDA ranks; CPU ranks are placed by the operating system")

    @property
    def shares_gpus(self) -> bool:
        return self.device == "cuda" and self.ranks_per_gpu > 1

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" and self.ranks_per_gpu == 1 else "gloo"

    def gpu(self, local_rank: int) -> int:
        """The GPU of the rank that is `local_rank` on its machine: ranks fill GPUs in order,
        `ranks_per_gpu` to each."""
        return local_rank // self.ranks_per_gpu

    def gpus_needed(self, ranks_on_this_machine: int) -> int:
        return -(-ranks_on_this_machine // self.ranks_per_gpu)

    def describe(self, world_size: int) -> str:
        """E.g. '4 gloo ranks on CPU', '8 NCCL ranks, one per GPU (NVIDIA H200)', '4 gloo ranks
        sharing 1 GPU (NVIDIA H200), 4 per GPU'."""
        if self.device == "cpu":
            return f"{world_size} gloo rank(s) on CPU"
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU visible"
        if not self.shares_gpus:
            return f"{world_size} NCCL rank(s), one per GPU ({name})"
        gpus = self.gpus_needed(world_size)
        return f"{world_size} gloo ranks sharing {gpus} GPU(s) ({name}), {self.ranks_per_gpu} per GPU"

    def check(self, world_size: int, gpus_visible: int) -> Optional[str]:
        """Why `world_size` spawned ranks cannot be placed so on this machine, or None."""
        if self.device == "cpu":
            return None
        needed = self.gpus_needed(world_size)
        if needed > gpus_visible:
            per = "one rank per GPU" if self.ranks_per_gpu == 1 else f"{self.ranks_per_gpu} ranks per GPU"
            return f"{world_size} ranks at {per} need {needed} GPU(s); {gpus_visible} visible"
        return None


CPU = Placement("cpu")
ONE_PER_GPU = Placement("cuda")

_placement: Optional[Placement] = None  # this process's, once it is a rank


def placement() -> Placement:
    """Where this rank runs (set when `run_on_ranks` made this process a rank; CPU otherwise)."""
    return _placement or CPU


def rank_device() -> torch.device:
    """This rank's device: its GPU (set by `run_on_ranks`), or the CPU."""
    if placement().device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def this_rank() -> int:
    """This process's rank under torchrun; 0 (the parent of spawned ranks) otherwise."""
    return int(os.environ["RANK"]) if under_torchrun() else 0


def become_rank(where: Optional[Placement], local_rank: int) -> Optional[Placement]:
    """Make this process a rank placed by `where` (its GPU set from `local_rank`); returns the
    placement it had (None: none), for a caller that makes a rank for a while (a test's group)."""
    global _placement
    previous, _placement = _placement, where
    if where is not None and where.device == "cuda":
        torch.cuda.set_device(where.gpu(local_rank))
    return previous


def _call(fn: Callable[..., Any], args: tuple, rank: int, world_size: int) -> None:
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def _spawned(rank, world_size, init_file, where, timeout_s, fn, args) -> None:
    become_rank(where, rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        where.backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timeout
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


def placement_of(backend: str) -> Placement:
    """The placement a backend name implied before placements existed: nccl, one rank per GPU;
    gloo, CPU ranks."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', not {backend!r}")
    return ONE_PER_GPU if backend == "nccl" else CPU


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: Optional[str] = None,
    where: Optional[Placement] = None,
    timeout_s: float = 1800,
    start_method: str = "spawn",
) -> None:
    """Call `fn(rank, world_size, *args)` on every rank, inside a process group made for the call.

    `where` places the ranks (default CPU ranks; `backend='nccl'` is short for one rank per GPU).
    Under torchrun this process is the one rank it runs here (`world_size` is the launcher's; its
    GPU from LOCAL_RANK). Spawned ranks: a rank's exception is raised here (torch's
    ProcessRaisedException, with the rank's traceback) once the others were stopped; `fn` must be
    importable (module level), and what it returns is dropped, so ranks report through files: a
    spawned rank ends with `os._exit(0)` once `fn` returned, without the interpreter's teardown.
    `start_method`: how ranks are started, "spawn" (a fresh interpreter each) or "forkserver" (forked
    from a server process that has imported the modules `multiprocessing.set_forkserver_preload`
    names: the tests start many groups of ranks, and so import torch and Megatron once).
    """
    if where is None:
        where = placement_of(backend or "gloo")
    elif backend is not None and backend != where.backend:
        raise ValueError(f"backend {backend!r} does not fit {where}: it runs on {where.backend}")
    if under_torchrun():
        become_rank(where, int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(where.backend, timeout=datetime.timedelta(seconds=timeout_s))
        _call(fn, args, dist.get_rank(), dist.get_world_size())
        return
    problem = where.check(world_size, torch.cuda.device_count() if where.device == "cuda" else 0)
    if problem is not None:
        raise ValueError(problem)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        entry = (world_size, os.path.join(tmp, "init"), where, timeout_s, fn, args)
        mp.start_processes(_spawned, args=entry, nprocs=world_size, join=True, start_method=start_method)
