"""Run a Megatron training script with several ranks sharing each GPU: a rehearsal, never training.

    torchrun --nproc-per-node 4 -m megatron_ext.tooling.shared_gpu --ranks-per-gpu 4 \\
        examples/pretrain_moe.py <Megatron flags> --distributed-backend gloo

NCCL refuses two ranks on one GPU, so the ranks meet on gloo, which stages CUDA tensors through
host memory: every GPU kernel and layout of W ranks runs on fewer GPUs, at no speed worth
measuring. Before the script runs, this module changes this process alone, in three ways:

- LOCAL_RANK becomes the GPU the rank shares (LOCAL_RANK // ranks per GPU): Megatron sets its
  device from LOCAL_RANK;
- point-to-point calls (`isend`, `irecv`, `send`, `recv`, and `batch_isend_irecv` through them:
  what pipeline schedules use) on CUDA tensors of a gloo group go through host copies, which
  gloo takes (it refuses CUDA tensors there: "writev ... Bad address");
- `all_reduce` with `ReduceOp.AVG` on a gloo group (which has no AVG) sums, then divides by the
  group's size;
- `torch.distributed._coalescing_manager` (Megatron's data-parallel gradient reduction) on a gloo
  group runs each collective in it at once, and to its end: gloo has no coalesced all-reduce of
  CUDA tensors. Installed before the script imports Megatron, which takes that name at import.

The product is unchanged: megatron-ext's dispatcher takes its device from its tensors and runs
on any process group.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from megatron_ext.tooling.ranks import Placement

BACKEND_FLAG = "--distributed-backend"


def _backend_of(argv: list[str]) -> Optional[str]:
    backend = None
    for i, arg in enumerate(argv):
        if arg == BACKEND_FLAG and i + 1 < len(argv):
            backend = argv[i + 1]
        elif arg.startswith(BACKEND_FLAG + "="):
            backend = arg.split("=", 1)[1]
    return backend


def _stages(tensor: torch.Tensor, group: Any) -> bool:
    """A CUDA tensor on a group whose backend is not NCCL: gloo's point-to-point needs host memory."""
    return tensor.is_cuda and dist.get_backend(group) != "nccl"


class StagedWork:
    """A point-to-point request whose tensor went through host memory: `wait()` waits for the
    host transfer, then (a receive) copies the host tensor into the CUDA one."""

    def __init__(self, work: Any, host: torch.Tensor, target: Optional[torch.Tensor] = None):
        self.work, self.host, self.target = work, host, target
        self._done = False

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            self.work.wait() if timeout is None else self.work.wait(timeout)
            if self.target is not None:
                with torch.no_grad():  # pipeline schedules receive into leaves that require grad
                    self.target.copy_(self.host)
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done or self.work.is_completed()


def _staged_p2p(isend: Callable, irecv: Callable, send: Callable, recv: Callable, stages=_stages) -> dict:
    """Replacements for the four point-to-point calls, staging CUDA tensors of non-NCCL groups."""

    def staged_isend(tensor, *args, **kwargs):
        group = _group_arg(args, kwargs, position=1)
        if not stages(tensor, group):
            return isend(tensor, *args, **kwargs)
        host = tensor.detach().to("cpu", copy=True)  # waits for the tensor: the send has its value
        return StagedWork(isend(host, *args, **kwargs), host)

    def staged_irecv(tensor, *args, **kwargs):
        group = _group_arg(args, kwargs, position=1)
        if not stages(tensor, group):
            return irecv(tensor, *args, **kwargs)
        host = torch.empty(tensor.shape, dtype=tensor.dtype)
        return StagedWork(irecv(host, *args, **kwargs), host, target=tensor)

    def staged_send(tensor, *args, **kwargs):
        if not stages(tensor, _group_arg(args, kwargs, position=1)):
            return send(tensor, *args, **kwargs)
        return send(tensor.detach().to("cpu", copy=True), *args, **kwargs)

    def staged_recv(tensor, *args, **kwargs):
        if not stages(tensor, _group_arg(args, kwargs, position=1)):
            return recv(tensor, *args, **kwargs)
        host = torch.empty(tensor.shape, dtype=tensor.dtype)
        source = recv(host, *args, **kwargs)
        with torch.no_grad():
            tensor.copy_(host)
        return source

    return dict(isend=staged_isend, irecv=staged_irecv, send=staged_send, recv=staged_recv)


def _group_arg(args: tuple, kwargs: dict, position: int) -> Any:
    """The `group` argument of isend/irecv/send/recv(tensor, peer, group, ...) as called."""
    if "group" in kwargs:
        return kwargs["group"]
    return args[position] if len(args) > position else None


_block = threading.local()  # .immediate: inside a gloo group's stand-in coalescing block


def _immediate_coalescing(original: Callable) -> Callable:
    """`_coalescing_manager` for non-NCCL groups: a block whose collectives each run at once and to
    their end (`_averaging_all_reduce` reads the flag), so its manager has nothing left to wait for."""

    @contextlib.contextmanager
    def coalescing_manager(group=None, device=None, async_ops=False):
        if dist.get_backend(group) == "nccl":
            with original(group, device, async_ops) as cm:
                yield cm
            return
        previous, _block.immediate = getattr(_block, "immediate", False), True
        try:
            yield c10d._CoalescingManager()
        finally:
            _block.immediate = previous

    return coalescing_manager


def _averaging_all_reduce(all_reduce: Callable) -> Callable:
    def all_reduce_with_avg(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if getattr(_block, "immediate", False):
            async_op = False  # a stand-in coalescing block: done before the block ends
        if op != dist.ReduceOp.AVG or dist.get_backend(group) == "nccl":
            return all_reduce(tensor, op=op, group=group, async_op=async_op)
        work = all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
        size = dist.get_world_size(group)
        if async_op:
            work.wait()  # a rehearsal: the divide must follow the sum
        tensor.div_(size)
        return work

    return all_reduce_with_avg


_saved: dict[tuple[Any, str], Any] = {}


def install(stages=_stages) -> None:
    """Put the stand-ins in place, in torch.distributed and its c10d module (which P2POp checks
    its op against). Idempotent; `uninstall()` undoes it."""
    if _saved:
        return
    names = ("isend", "irecv", "send", "recv", "all_reduce", "_coalescing_manager")
    originals = {name: getattr(c10d, name) for name in names}
    replacements = _staged_p2p(originals["isend"], originals["irecv"], originals["send"], originals["recv"], stages)
    replacements["all_reduce"] = _averaging_all_reduce(originals["all_reduce"])
    replacements["_coalescing_manager"] = _immediate_coalescing(originals["_coalescing_manager"])
    for module in (c10d, dist):
        for name, replacement in replacements.items():
            _saved[(module, name)] = getattr(module, name)
            setattr(module, name, replacement)


def uninstall() -> None:
    for (module, name), original in _saved.items():
        setattr(module, name, original)
    _saved.clear()


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m megatron_ext.tooling.shared_gpu",
        description="Run a training script (under torchrun) with several ranks sharing each GPU, over gloo: "
        "a rehearsal of expert and pipeline parallelism on fewer GPUs than ranks, not a speed measurement.",
    )
    p.add_argument("--ranks-per-gpu", type=int, required=True, help="ranks sharing each GPU")
    p.add_argument("script", help="the training script, e.g. examples/pretrain_moe.py")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help=f"its flags (with {BACKEND_FLAG} gloo)")
    args = p.parse_args(argv)

    def refuse(message: str) -> NoReturn:  # one line, as a refused flag
        print(f"{p.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)

    if args.ranks_per_gpu < 1:
        refuse("--ranks-per-gpu must be at least 1")
    backend = _backend_of(args.script_args)
    if args.ranks_per_gpu > 1 and backend != "gloo":
        refuse(
            f"{args.ranks_per_gpu} ranks per GPU need {BACKEND_FLAG} gloo among the script's flags "
            f"(NCCL refuses two ranks on one GPU); found {backend or 'none (nccl)'}"
        )
    if "LOCAL_RANK" not in os.environ:
        refuse("run it under torchrun (LOCAL_RANK is not set)")
    local_rank = int(os.environ["LOCAL_RANK"])
    os.environ["LOCAL_RANK"] = str(Placement("cuda", args.ranks_per_gpu).gpu(local_rank))  # the GPU it shares
    install()
    sys.argv = [args.script, *args.script_args]
    runpy.run_path(args.script, run_name="__main__")


if __name__ == "__main__":
    main()
