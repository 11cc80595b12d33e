"""How many GPU operations one step launches per mode, and how many CUDA's launch queue holds.

    python -m megatron_ext.bench.kernels --size small --modes megatron,blocking,capacity+equal

One CUDA GPU, one rank. A host that is free of syncs still stops once the launch queue is full,
so a step of more operations than the queue holds cannot be enqueued whole behind a busy GPU;
this says which side of that line a stack falls on (the bench's "ran ahead" column).
"""

from __future__ import annotations

import sys
import time

import torch


def launch_queue_depth(counts=(512, 768, 1000, 1024, 1536, 2048), sleep_ms: float = 200.0) -> list[tuple[int, float]]:
    """(kernels, host ms) for each count: tiny kernels queued behind a GPU sleep of `sleep_ms`."""
    x = torch.zeros(1, device="cuda")
    cycles = int(sleep_ms * 1e-3 * torch.cuda.get_device_properties(0).clock_rate * 1e3)
    torch.cuda._sleep(1000)  # load the sleep kernel before timing anything
    torch.cuda.synchronize()
    results = []
    for count in counts:
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        start = time.perf_counter()
        for _ in range(count):
            x.add_(1)
        results.append((count, (time.perf_counter() - start) * 1e3))
        torch.cuda.synchronize()
    return results


def ops_per_step(stack, x) -> int:
    """GPU operations (kernels, copies, memsets) the profiler sees in one forward+backward step."""

    def step():
        inp = x.detach().requires_grad_(True)
        stack(inp).float().sum().backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        step()
        torch.cuda.synchronize()
    return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in profile.events())


def main(argv=None) -> int:
    from megatron_ext.bench.profile import one_gpu_rank, size_arguments, sizes_from

    p = size_arguments("python -m megatron_ext.bench.kernels", __doc__.split("\n\n")[0])
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (it counts GPU operations)")

    from megatron_ext.bench.modes import mode_names, select
    from megatron_ext.bench.stack import MoEStack, make_inputs, megatron_config, te_import_error

    try:
        modes = select(mode_names(args.modes), 1.5)
    except ValueError as error:
        p.error(str(error))
    sizes = sizes_from(args)
    with one_gpu_rank() as device:
        x = make_inputs(sizes, 0, 1, device)[0]
        name = torch.cuda.get_device_name()
        print(f"{name}: tiny kernels queued behind a GPU sleep (host ms; about the sleep: the queue was full)")
        for count, host_ms in launch_queue_depth():
            print(f"  {count:5d} kernels: {host_ms:7.1f} ms")
        print(f"GPU operations in one forward+backward step, {args.layers} MoE layers:")
        te_error = te_import_error()
        for mode in modes:
            if mode.needs_deep_ep or (mode.needs_te and te_error) or mode.graph:  # a replay: its eager twin's ops
                continue
            stack = MoEStack(megatron_config(sizes, 1, device, mode), args.layers, mode.experts).to(device)
            ops = ops_per_step(stack, x)
            print(f"  {mode.name:22s} {ops:6d} ({ops / args.layers:.0f} per layer)")
            del stack
    return 0


if __name__ == "__main__":
    sys.exit(main())
