"""Does a second TorchHybridEPBuffer in one process, or the routing-map reuse setting, change the
Python side of a non-blocking dispatch call? On the H200 (seventh session, host_calls.py) the
second buffer, built with reuse, timed 1.6x the first; at one rank both run the same code. This
times the same glue as host_glue.py (launches recorded, not run; one gloo rank, one torch thread,
T 1024, H 256, E 64, top-8) for two buffers in the ORDER given ("01": without reuse, then with it;
"10": the other way round), each buffer's first dispatch output kept alive as host_calls.py does:
`python docs/results/cpu-2026-12-01/two_buffers.py ORDER`. Median and lowest of 7 loops of 500
calls, microseconds of process CPU time per call."""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from megatron_ext import fused
from megatron_ext.hybridep import TorchHybridEPBuffer

LABEL = sys.argv[1] if len(sys.argv) > 1 else "01"
ORDER = [bool(int(c)) for c in LABEL]
torch.set_num_threads(1)


class _Recorded:
    """Stands in for a kernel: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


for name in [n for n, v in vars(fused).items() if type(v).__name__ == "JITFunction"]:
    setattr(fused, name, _Recorded())
fused.enabled_for = lambda t: True

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29583", RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
T, H, E, K = 1024, 256, 64, 8
gen = torch.Generator().manual_seed(0)
x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
routing = torch.zeros(T, E, dtype=torch.bool).scatter_(1, torch.rand(T, E, generator=gen).topk(K, dim=1).indices, True)
probs = torch.rand(T, E, generator=gen) * routing
capacity = T * K * 3 // 2
kept = []
for reuse in ORDER:
    buf = TorchHybridEPBuffer(dist.group.WORLD, H, T, E, reuse_allgather_buffer=reuse)

    def dispatch(buf=buf):
        return buf.dispatch_with_permute(
            hidden=x, routing_map=routing, probs=probs, num_permuted_tokens=capacity, non_blocking=True
        )

    kept.append(dispatch())
    for _ in range(50):
        dispatch()
    means = []
    for _ in range(7):
        start = time.process_time()
        for _ in range(500):
            dispatch()
        means.append((time.process_time() - start) * 1e6 / 500)
    print(f"order {LABEL}  reuse={int(reuse)}  {statistics.median(means):7.1f} us median  {min(means):7.1f} lowest")
dist.destroy_process_group()
