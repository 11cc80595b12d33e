"""Host microseconds of one TorchHybridEPBuffer call, through the public API only, so that two
trees can be compared side by side: run it once per tree, alternately, from the repository root:
`PYTHONPATH=TREE python docs/results/h200-2026-12-01/host_calls.py LABEL [ORDER]`.

One H200, one NCCL rank, the large bench's shape (T 8192, H 4096, E 64, top-8, bf16, capacity
1.5 x the routed rows). Each loop runs behind a GPU sleep, so no launch waits for the GPU: the
times are the host's own. Prints, per call, the median and the lowest of 5 loops of 100 calls
(microseconds per call). ORDER: the buffers' reuse settings in the order they are timed, "01"
(the default: without reuse, then with it) or "10". At one rank both take the same code (the
routing-map "gather" returns the map), yet in the seventh session the second buffer's first call
timed 1.6x the first's; timing both orders tells the order from the setting."""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import megatron_ext
from megatron_ext.hybridep import TorchHybridEPBuffer

LABEL = sys.argv[1] if len(sys.argv) > 1 else "tree"
ORDER = [bool(int(c)) for c in (sys.argv[2] if len(sys.argv) > 2 else "01")]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29579", RANK="0", WORLD_SIZE="1")
torch.cuda.set_device(0)
dist.init_process_group("nccl")
T, H, E, K = 8192, 4096, 64, 8
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
chosen = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices
routing = torch.zeros(T, E, dtype=torch.bool, device="cuda").scatter_(1, chosen, True)
probs = torch.rand(T, E, device="cuda", generator=g) * routing
capacity = T * K * 3 // 2
ITERS, LOOPS = 100, 5


def host_us(fn):
    """(median, lowest) over LOOPS loops of the mean host microseconds of fn(), the GPU busy."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    means = []
    for _ in range(LOOPS):
        torch.cuda._sleep(int(0.2 * 1.98e9))  # ~200 ms of GPU work ahead of the loop
        start = time.perf_counter()
        for _ in range(ITERS):
            fn()
        means.append((time.perf_counter() - start) * 1e6 / ITERS)
        torch.cuda.synchronize()
    return statistics.median(means), min(means)


def calls(buf):
    """The calls timed, on `buf`, after one blocking dispatch that gives the combine its rows."""

    def dispatch(cap=capacity, with_probs=True):
        return buf.dispatch_with_permute(
            hidden=x,
            routing_map=routing,
            probs=probs if with_probs else None,
            num_permuted_tokens=cap,
            non_blocking=cap is not None,
        )

    rows, row_probs, _, _, handle = dispatch()
    return {
        "non-blocking dispatch": dispatch,
        "non-blocking dispatch, no probs": lambda: dispatch(with_probs=False),
        "dispatch with a handle": lambda: buf.dispatch_with_permute(
            hidden=x, probs=probs, handle=handle, num_permuted_tokens=capacity, non_blocking=True
        ),
        "combine": lambda: buf.combine_with_unpermute(hidden=rows, probs=row_probs, handle=handle),
    }


for reuse in ORDER:
    for name, fn in calls(TorchHybridEPBuffer(dist.group.WORLD, H, T, E, reuse_allgather_buffer=reuse)).items():
        median, lowest = host_us(fn)
        print(f"{LABEL:9s} reuse={int(reuse)}  {median:7.1f} us median  {lowest:7.1f} lowest  {name}")
print(f"{LABEL}: megatron_ext from {os.path.dirname(megatron_ext.__file__)}")
dist.destroy_process_group()
