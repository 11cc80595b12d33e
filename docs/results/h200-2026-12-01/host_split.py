"""Where the host time of one non-blocking TorchHybridEPBuffer dispatch call goes, part by part
(one H200, one NCCL rank, the large bench's shape). Every loop runs behind a GPU sleep, so no
launch waits for the GPU: the times are the host's own. Run from the repository root with
PYTHONPATH=.: `python docs/results/h200-2026-12-01/host_split.py`. Prints microseconds per call
of the whole dispatch and of each part it is made of, then a cProfile of whole calls.

A record of the fifth session: it times parts of that session's tree (2568dee), among them
`fused.gather_values`, which 0.1.0.dev6 removed; run it against that tree (`PYTHONPATH=.baseline`
with `git archive 2568dee megatron_ext | tar -x -C .baseline`). host_calls.py times whole calls
of any tree."""

import cProfile
import os
import pstats
import time

import torch
import torch.distributed as dist

from megatron_ext import fused
from megatron_ext.hybridep import TorchHybridEPBuffer

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29578", RANK="0", WORLD_SIZE="1")
torch.cuda.set_device(0)
dist.init_process_group("nccl")
T, H, E, K = 8192, 4096, 64, 8
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
chosen = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices
routing = torch.zeros(T, E, dtype=torch.bool, device="cuda").scatter_(1, chosen, True)
probs = torch.rand(T, E, device="cuda", generator=g) * routing
buf = TorchHybridEPBuffer(dist.group.WORLD, H, T, E, reuse_allgather_buffer=True)
capacity = T * K * 3 // 2
ITERS = 100


def dispatch():
    return buf.dispatch_with_permute(
        hidden=x, routing_map=routing, probs=probs, num_permuted_tokens=capacity, non_blocking=True
    )


def host_us(fn, iters=ITERS):
    """Mean host microseconds of fn() with the GPU busy (a sleep queued first)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(0.2 * 1.98e9))  # ~200 ms of GPU work ahead of the loop
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    us = (time.perf_counter() - start) * 1e6 / iters
    torch.cuda.synchronize()
    return us


rows, row_probs, _, _, handle = dispatch()
local_map = buf.routing_map_gather(routing)
counts = fused.block_counts(local_map)
layout = fused.dispatch_layout(local_map, counts, capacity, None, T)
table = probs.view(T, 1, E).transpose(0, 1).reshape(T, E)
empty_kernel_args = dict(C=1, S=1, BLOCK=1024)
parts = {
    "whole dispatch call (non-blocking)": dispatch,
    "routing-map gather (W=1)": lambda: buf.routing_map_gather(routing),
    "argument checks (_resolve_routing)": lambda: buf._resolve_routing(x, routing, probs, None, None, None, None),
    "block_counts (1 launch + 1 empty)": lambda: fused.block_counts(local_map),
    "dispatch_layout (1 launch + 6 empty)": lambda: fused.dispatch_layout(local_map, counts, capacity, None, T),
    "gather_rows (1 launch + 1 empty)": lambda: fused.gather_rows(x, layout.row_slot, layout.real_rows),
    "gather_values (1 launch + 1 empty)": lambda: fused.gather_values(table, layout.row_code),
    "_move_rows": lambda: buf._move_rows(x, probs, handle),
    "one torch.empty(capacity, int64)": lambda: torch.empty(capacity, dtype=torch.int64, device="cuda"),
    "six torch.empty": lambda: [torch.empty(capacity, dtype=torch.int64, device="cuda") for _ in range(6)],
    "one torch.empty + 6 views of it": lambda: [
        t[i * 10 : (i + 1) * 10] for t in [torch.empty(capacity, dtype=torch.int64, device="cuda")] for i in range(6)
    ],
    "_gather_values_kernel launch alone": lambda: fused._gather_values_kernel[(1,)](
        table, layout.row_code, row_probs, **empty_kernel_args
    ),
    "local_map column slice": lambda: local_map[:, 0:E],
    "torch.cuda.current_stream()": torch.cuda.current_stream,
}
for name, fn in parts.items():
    print(f"{host_us(fn):8.1f} us  {name}")

profile = cProfile.Profile()
torch.cuda._sleep(int(0.3 * 1.98e9))
profile.enable()
for _ in range(ITERS):
    dispatch()
profile.disable()
torch.cuda.synchronize()
pstats.Stats(profile).sort_stats("tottime").print_stats(22)
dist.destroy_process_group()
