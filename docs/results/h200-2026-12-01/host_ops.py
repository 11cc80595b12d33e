"""What one dispatch call of TorchHybridEPBuffer launches and where its host time goes (one H200,
one NCCL rank, the large bench's shape). Run from the repository root with PYTHONPATH=.:
`python docs/results/h200-2026-12-01/host_ops.py`. Prints, per mode, the host ms of the call (GPU
idle before it), the CUDA operations it launched, and the ops with the most host time."""

import os
import time

import torch
import torch.distributed as dist

from megatron_ext.hybridep import TorchHybridEPBuffer

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29577", RANK="0", WORLD_SIZE="1")
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


def call(cap, pad=None):
    return buf.dispatch_with_permute(
        hidden=x,
        routing_map=routing,
        probs=probs,
        num_permuted_tokens=cap,
        non_blocking=cap is not None,
        pad_multiple=pad,
    )


for name, cap in (("blocking", None), ("non-blocking", capacity)):
    for _ in range(5):
        rows, _, _, _, handle = call(cap)
        buf.combine_with_unpermute(hidden=rows, handle=handle)
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call(cap)
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    times.sort()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        rows, _, _, _, handle = call(cap)
        torch.cuda.synchronize()
    kernels = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())
    print(f"=== {name}: dispatch call host ms median {times[10]:.3f} (min {times[0]:.3f}); {kernels} GPU ops")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50))
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        buf.combine_with_unpermute(hidden=rows, handle=handle)
        torch.cuda.synchronize()
    kernels = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())
    print(f"=== {name} combine: {kernels} GPU ops")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=50))
dist.destroy_process_group()
