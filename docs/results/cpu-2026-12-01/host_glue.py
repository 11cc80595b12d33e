"""The Python glue of one non-blocking TorchHybridEPBuffer dispatch and one combine with probs, on
CPU, with the fused path taken and its Triton launches recorded instead of run: what the host
spends in megatron-ext's own code and torch's CPU-side calls, without CUDA's launch and allocation
costs (which only a GPU machine measures). For comparing two trees on a machine without a GPU:
`PYTHONPATH=TREE python docs/results/cpu-2026-12-01/host_glue.py LABEL`, alternately.

With ORDER (`host_glue.py LABEL ORDER`, ORDER "01" or "10"): the dispatch call of two buffers in one
process instead, timed in that order of their routing-map reuse setting (0 without, 1 with), each
one's first output kept alive. On the H200 (seventh session, host_calls.py) the second buffer, built
with reuse, timed 1.6x the first, though at one rank both run the same code; this asks whether the
Python side shows it (two_buffers.log).

One gloo rank, one torch thread, T 1024, H 256, E 64, top-8, capacity 1.5 x the routed rows.
Prints the median and the lowest of 7 loops of 500 calls (microseconds of the process's CPU time
per call: a shared VM's stolen time does not count)."""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from megatron_ext import fused
from megatron_ext.hybridep import TorchHybridEPBuffer

LABEL = sys.argv[1] if len(sys.argv) > 1 else "tree"
torch.set_num_threads(1)


class _Recorded:
    """Stands in for a kernel: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


for name in [n for n, v in vars(fused).items() if type(v).__name__ == "JITFunction"]:
    setattr(fused, name, _Recorded())
fused.enabled_for = lambda t: True

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29581", RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
T, H, E, K = 1024, 256, 64, 8
gen = torch.Generator().manual_seed(0)
x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
routing = torch.zeros(T, E, dtype=torch.bool).scatter_(1, torch.rand(T, E, generator=gen).topk(K, dim=1).indices, True)
probs = torch.rand(T, E, generator=gen) * routing
capacity = T * K * 3 // 2


def timed(fn, name, label=LABEL):
    """Print the median and the lowest of 7 loops of 500 calls of fn, after 50 unmeasured."""
    for _ in range(50):
        fn()
    means = []
    for _ in range(7):
        start = time.process_time()
        for _ in range(500):
            fn()
        means.append((time.process_time() - start) * 1e6 / 500)
    print(f"{label:9s} {statistics.median(means):7.1f} us median {min(means):7.1f} lowest  {name}")


def dispatcher(buf):
    return lambda: buf.dispatch_with_permute(
        hidden=x, routing_map=routing, probs=probs, num_permuted_tokens=capacity, non_blocking=True
    )


if len(sys.argv) > 2:  # two buffers, in ORDER of their reuse setting
    kept = []
    for reuse in sys.argv[2]:
        dispatch = dispatcher(TorchHybridEPBuffer(dist.group.WORLD, H, T, E, reuse_allgather_buffer=reuse == "1"))
        kept.append(dispatch())
        timed(dispatch, f"non-blocking dispatch, reuse={reuse}, order {sys.argv[2]}")
    dist.destroy_process_group()
    sys.exit()

buf = TorchHybridEPBuffer(dist.group.WORLD, H, T, E, reuse_allgather_buffer=True)
dispatch = dispatcher(buf)
rows, row_probs, _, _, handle = dispatch()
# No kernel ran, so the layout's tables hold what the allocator left: valid indices instead, for
# the torch operations that index with them (2568dee's combine scatters the probs by them).
handle.row_prob_index.zero_()
for name, fn in {
    "non-blocking dispatch": dispatch,
    "combine with probs": lambda: buf.combine_with_unpermute(hidden=rows, probs=row_probs, handle=handle),
}.items():
    timed(fn, name)
dist.destroy_process_group()
