"""A dispatch/combine round trip of the PyTorch HybridEP buffer across ranks, checked and timed.

    python -m megatron_ext.tooling.roundtrip                 # 4 CPU ranks on gloo (spawned)
    torchrun --nproc-per-node 8 -m megatron_ext.tooling.roundtrip --backend nccl   # one rank per GPU

Each rank routes random tokens (top-k of E experts), then runs the blocking dispatch and a
non-blocking one sized to ceil(rows x factor), the latter under `forbid_host_sync()`. It checks
that combine(dispatch(x)) gives each token x times the number of its experts, that the
non-blocking rows, counts and combine equal the blocking ones bitwise with the overflow flag 0,
and that too small a capacity raises the flag. It prints the bytes each mode sent and, with two
ranks or more, the bandwidth of dispatch and of combine: the bytes a rank sends to the other ranks,
each counted once, over the median time of the call (CUDA events with nccl, the host clock with
gloo), next to a plain `all_to_all_single` of as many bytes and NVLink's 450 GB/s per direction.

With nccl it also times each call on the GPU and on the host (the GPU idle before each call), for
this buffer and, where it imports, for deep_ep's HybridEPBuffer on the same inputs, next to a
plain device copy of the dispatched rows' bytes: on one GPU nothing crosses ranks, and the copy is
the least the data path can cost.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from megatron_ext.hybridep.autograd import dispatch_with_capacity
from megatron_ext.options import TRANSPORTS, capacity_factor_argument
from megatron_ext.tooling.ranks import run_on_ranks, this_rank, under_torchrun
from megatron_ext.tooling.timing import cuda_ms


def _parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m megatron_ext.tooling.roundtrip", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=4, help="ranks to spawn when not under torchrun (default 4)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="gloo on CPU (default) or nccl on GPUs")
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank (default 512)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    p.add_argument("--experts", type=int, default=16, help="experts in all (default 16; divisible by ranks)")
    p.add_argument("--topk", type=int, default=4, help="experts per token (default 4)")
    p.add_argument("--pad-multiple", type=int, default=None, help="pad each expert's rows to this multiple")
    p.add_argument(
        "--capacity-factor",
        type=capacity_factor_argument,
        default=1.5,
        help="non-blocking capacity = ceil(rows x factor)",
    )
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="auto",
        help="how the non-blocking dispatch moves tokens (--moe-hybridep-transport; default auto)",
    )
    p.add_argument("--iters", type=int, default=5, help="timed dispatches per mode (default 5)")
    args = p.parse_args(argv)
    if not 1 <= args.topk <= args.experts:
        p.error(f"--topk {args.topk} must be between 1 and --experts ({args.experts})")
    return args


def _host_ms(fn, iters: int, idle_gpu: bool = False) -> float:
    """Median host time of `fn()`, back to back, or each started with the GPU idle (`idle_gpu`: no
    wait for room in CUDA's launch queue)."""
    times = []
    for _ in range(iters):
        if idle_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    if idle_gpu:
        torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


NVLINK_GBPS = 450.0  # NVLink 4 (H100/H200 SXM): 450 GB/s per direction per GPU


def _device_ms(fn, iters: int, device: torch.device) -> float:
    """Median time of `fn()`: CUDA events around each call on a GPU, the host clock on CPU."""
    if device.type != "cuda":
        return _host_ms(fn, iters)
    return cuda_ms(fn, iters)


def _bandwidth_lines(rank, world_size, iters, device, buf, dispatch, capacity) -> list[str]:
    """Dispatch and combine GB/s per rank, blocking and non-blocking, against a raw all_to_all_single."""
    if world_size == 1:
        return [f"rank {rank}: one rank: nothing crosses ranks, no bandwidth to report"]
    lines = []
    for name, cap in (("blocking", None), ("non-blocking", capacity)):
        rows, _, _, _, handle = dispatch(cap)
        sent = buf.last_dispatch_traffic.total
        dispatch_ms = _device_ms(lambda cap=cap: dispatch(cap), iters, device)
        combine = lambda rows=rows, handle=handle: buf.combine_with_unpermute(hidden=rows, handle=handle)  # noqa: E731
        combine()
        returned = buf.last_combine_traffic.total
        combine_ms = _device_ms(combine, iters, device)
        raw_ms = _raw_all_to_all_ms(sent, world_size, iters, device)
        lines.append(
            f"rank {rank}: {name}: dispatch {sent} B in {dispatch_ms:.3f} ms = {_gbps(sent, dispatch_ms)}, "
            f"combine {returned} B in {combine_ms:.3f} ms = {_gbps(returned, combine_ms)}; all_to_all_single of "
            f"the dispatch's bytes: {raw_ms:.3f} ms = {_gbps(sent, raw_ms)} (NVLink: {NVLINK_GBPS:.0f} GB/s per "
            "direction)"
        )
    return lines


def _dispatcher(buf, x, routing, probs, pad_multiple):
    """`dispatch(capacity=None)`: `buf`'s dispatch of these inputs, blocking without a capacity."""

    def dispatch(capacity=None):
        return dispatch_with_capacity(
            buf, capacity, hidden=x, routing_map=routing, probs=probs, pad_multiple=pad_multiple
        )

    return dispatch


def _deep_ep_buffer(args, num_local: int) -> dict:
    """{"deep_ep": a deep_ep HybridEPBuffer for these inputs} where deep_ep imports and takes the
    hidden size (below 128 its constructor aborts the process), else {}."""
    from megatron_ext.options import deep_ep_import_error, deep_ep_shape_error

    if deep_ep_import_error() is not None or deep_ep_shape_error(args.hidden) is not None:
        return {}
    from megatron_ext.hybridep.deep_ep_buffer import create_deep_ep_buffer

    return {
        "deep_ep": create_deep_ep_buffer(
            dist.group.WORLD, args.hidden, args.tokens, num_local, reuse_allgather_buffer=False
        )
    }


def _gpu_lines(rank, iters, device, buffers: dict, inputs) -> list[str]:
    """Per buffer and mode: the dispatch call's host ms (GPU idle before it), its GPU ms and the
    combine's GPU ms; then a device copy of the exact rows' bytes, the floor of the data path."""
    x, routing, probs, pm, capacity = inputs
    lines, exact_rows = [], None
    for name, buf in buffers.items():
        for mode, cap in (("blocking", None), ("non-blocking", capacity)):
            dispatch = functools.partial(_dispatcher(buf, x, routing, probs, pm), cap)
            rows, _, _, _, handle = dispatch()
            exact_rows = exact_rows or rows.shape[0]
            host = _host_ms(dispatch, iters, idle_gpu=True)
            dispatch_ms = _device_ms(dispatch, iters, device)
            combine_ms = _device_ms(
                lambda b=buf, r=rows, h=handle: b.combine_with_unpermute(hidden=r, handle=h), iters, device
            )
            lines.append(
                f"rank {rank}: {name:7s} {mode:12s}: dispatch call {host:.3f} ms on the host, {dispatch_ms:.3f} ms on "
                f"the GPU; combine {combine_ms:.3f} ms on the GPU"
            )
    src = torch.empty(exact_rows, x.shape[1], dtype=x.dtype, device=device)
    dst = torch.empty_like(src)
    copy_ms = _device_ms(lambda: dst.copy_(src), iters, device)
    nbytes = src.numel() * src.element_size()
    lines.append(
        f"rank {rank}: a device copy of the {exact_rows} exact rows ({nbytes / 2**20:.0f} MiB): {copy_ms:.3f} ms"
    )
    return lines


def _gbps(nbytes: int, ms: float) -> str:
    return f"{nbytes / ms / 1e6:.3g} GB/s" if ms > 0 else "-"


def _raw_all_to_all_ms(nbytes: int, world_size: int, iters: int, device: torch.device) -> float:
    """Median time of an all_to_all_single in which this rank sends `nbytes` to the other ranks,
    evenly (each rank's share is its own, so the receive sizes are gathered first)."""
    per_rank = -(-nbytes // (world_size - 1))
    shares = torch.empty(world_size, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(shares, torch.tensor([per_rank], device=device))
    incoming = shares.tolist()
    send = torch.ones(world_size * per_rank, dtype=torch.uint8, device=device)
    recv = torch.empty(sum(incoming), dtype=torch.uint8, device=device)

    def exchange():
        dist.all_to_all_single(recv, send, output_split_sizes=incoming, input_split_sizes=[per_rank] * world_size)

    return _device_ms(exchange, iters, device)


def _run(rank: int, world_size: int, args) -> tuple[list[str], list[str]]:
    """Returns (report lines, failures) of this rank."""
    from megatron_ext import fused
    from megatron_ext.capacity import capacity_from_rows
    from megatron_ext.hybridep import TorchHybridEPBuffer
    from megatron_ext.tooling.sync import forbid_host_sync

    device = torch.device("cuda", torch.cuda.current_device()) if args.backend == "nccl" else torch.device("cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    num_local = args.experts // world_size  # main() refused a count that does not divide
    gen = torch.Generator(device="cpu").manual_seed(rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(device=device, dtype=dtype)
    chosen = torch.rand(args.tokens, args.experts, generator=gen).topk(args.topk, dim=1).indices
    routing = torch.zeros(args.tokens, args.experts, dtype=torch.bool).scatter_(1, chosen, True).to(device)
    probs = (torch.rand(args.tokens, args.experts, generator=gen).to(device) * routing).float()
    buf = TorchHybridEPBuffer(
        dist.group.WORLD, args.hidden, args.tokens, num_local, reuse_allgather_buffer=True, transport=args.transport
    )
    pm = args.pad_multiple

    dispatch = _dispatcher(buf, x, routing, probs, pm)
    rows, row_probs, _, counts, handle = dispatch()
    blocking_traffic = buf.last_dispatch_traffic
    combined, _ = buf.combine_with_unpermute(hidden=rows, handle=handle)
    exact = rows.shape[0]
    local_max = torch.tensor([exact], device=device)
    dist.all_reduce(local_max, op=dist.ReduceOp.MAX)
    capacity = capacity_from_rows(int(local_max.item()), args.capacity_factor, pm)
    with forbid_host_sync():
        nb_rows, nb_probs, _, nb_counts, nb_handle = dispatch(capacity)
        nb_combined, _ = buf.combine_with_unpermute(hidden=nb_rows, handle=nb_handle)
    nb_traffic = buf.last_dispatch_traffic
    tight_capacity = exact // 2 // (pm or 1) * (pm or 1)
    tight = dispatch(tight_capacity)
    expected = (x.double() * routing.sum(1, keepdim=True)).to(dtype)

    failures = []

    def check(ok: bool, what: str):
        if not ok:
            failures.append(f"rank {rank}: {what}")

    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    check(torch.allclose(combined.double(), expected.double(), **tol), "combine(dispatch(x)) != x * experts per token")
    check(torch.equal(nb_rows[:exact], rows), "non-blocking rows != blocking rows")
    # Past the real rows: zeros on CPU; on a GPU the fused permute leaves them unwritten.
    check(fused.enabled_for(nb_rows) or not nb_rows[exact:].any(), "non-blocking padding rows are not zero")
    check(torch.equal(nb_probs[:exact], row_probs), "non-blocking probs != blocking probs")
    check(torch.equal(nb_counts, counts), "non-blocking tokens_per_expert != blocking")
    check(torch.equal(nb_combined, combined), "non-blocking combine != blocking combine")
    check(int(nb_handle.overflow_flag) == 0, "overflow flag set with enough capacity")
    check(int(tight[4].overflow_flag) == int(exact > tight_capacity), "overflow flag wrong with too little capacity")
    host_blocking = _host_ms(dispatch, args.iters)
    host_nb = _host_ms(lambda: dispatch(capacity), args.iters)
    bandwidth = _bandwidth_lines(rank, world_size, args.iters, device, buf, dispatch, capacity)
    if device.type == "cuda":
        inputs = (x, routing, probs, pm, capacity)
        bandwidth += _gpu_lines(rank, args.iters, device, {"torch": buf, **_deep_ep_buffer(args, num_local)}, inputs)
    lines = [
        f"rank {rank}: {exact} rows exact, capacity {capacity}; host ms per dispatch call: "
        f"blocking {host_blocking:.2f}, non-blocking {host_nb:.2f}",
        f"rank {rank}: bytes sent per dispatch (map + hidden + probs): blocking {blocking_traffic.total} "
        f"({blocking_traffic.routing_map} + {blocking_traffic.hidden} + {blocking_traffic.probs}), "
        f"non-blocking {nb_traffic.total} ({nb_traffic.routing_map} + {nb_traffic.hidden} + {nb_traffic.probs})",
        f"rank {rank}: non-blocking transport: "
        + (
            f"exact rows through {buf.non_blocking_transport}, {buf.symmetric_memory_bytes / 2**20:.0f} MiB of "
            "symmetric buffers"
            if buf.non_blocking_transport != "process_group"
            else "every token all-gathered on the group's collectives"
        ),
        *bandwidth,
    ]
    return lines, failures


def _report(rank, world_size, result) -> bool:
    """Print every rank's lines and failures on rank 0; True when no rank failed."""
    gathered = [None] * world_size
    dist.all_gather_object(gathered, result)
    if rank == 0:
        for lines, failures in gathered:
            print("\n".join(lines + [f"FAILED {f}" for f in failures]))
    return not any(failures for _, failures in gathered)


def _rank(rank, world_size, args, status_file):
    ok = _report(rank, world_size, _run(rank, world_size, args))
    if rank == this_rank():  # the rank that answers for this process: rank 0, or each under torchrun
        with open(status_file, "w") as f:
            f.write("ok" if ok else "failed")


def main(argv=None) -> int:
    args = _parse(argv)
    checked = (
        "combine(dispatch(x)) == x * experts per token; non-blocking (under forbid_host_sync) rows, probs, "
        "counts and combine == blocking, bitwise; overflow flag 0 with room, 1 with too little"
    )
    world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.world_size
    if args.experts % world_size:
        ranks = f"the {world_size} ranks" if under_torchrun() else f"--world-size {world_size}"
        print(f"--experts {args.experts} must be divisible by {ranks}", file=sys.stderr)
        return 2
    if this_rank() == 0:
        print(
            f"round trip on {world_size} {args.backend} ranks: T={args.tokens} H={args.hidden} E={args.experts} "
            f"top-{args.topk} {args.dtype}, capacity factor {args.capacity_factor}",
            flush=True,
        )
    with tempfile.TemporaryDirectory() as tmp:
        status = os.path.join(tmp, "status")
        run_on_ranks(_rank, world_size, args, status, backend=args.backend, timeout_s=120)
        ok = open(status).read() == "ok"
    if this_rank() == 0:
        print(("OK: " if ok else "FAILED: ") + checked)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
