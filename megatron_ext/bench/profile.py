"""Where a mode's GPU time and memory go: a kernel table and a memory breakdown per mode.

    python -m megatron_ext.bench.profile --size large --modes blocking,capacity+equal --out profile/

One CUDA GPU, one rank, the bench's stack (same weights and inputs in every mode). Per mode, after
warm-up steps (the first calibrates capacity mode):
* `torch.profiler` over `--steps` steps: GPU time per kernel name, per step;
* `torch.cuda.memory._record_memory_history` over one step: the allocations alive at the step's
  peak, grouped by the line of megatron-ext or Megatron that made them, and the snapshot itself
  (`memory-MODE.pickle.gz`, `+` in MODE as `_`; gunzip it for https://pytorch.org/memory_viz). A `+graph` mode's
  memory is recorded over its capture (what the graph's pool holds for a step); its kernels are
  its eager twin's, so it has no kernel table here (the bench's GPU ms column times its replay).
Then the kernels whose time differs most between the first mode and each other one.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import gzip
import os
import pickle
import sys
from collections.abc import Iterator

import torch

from megatron_ext.bench.counters import kernel_times
from megatron_ext.bench.sizes import SIZE_FIELDS, SizedParser, fill_sizes
from megatron_ext.options import STATIC_SPLITS_FP8_RECIPES


@contextlib.contextmanager
def one_gpu_rank(seed: int = 0) -> Iterator[torch.device]:
    """A one-rank NCCL group on GPU 0 with Megatron's parallel state and megatron-ext's patch."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import megatron_ext.patches

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(seed)
    applied = megatron_ext.patches.apply(training=False)  # no training loop here
    try:
        yield torch.device("cuda")
    finally:
        megatron_ext.patches.revert(applied)
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def size_arguments(prog: str, description: str, extra: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """A parser with the bench's stack-size flags (same names and defaults, --size too) and `extra`
    of its flags; what it parses has the sizes filled in, as the bench's does."""
    from megatron_ext.bench.cli import parser as bench_parser

    p = SizedParser(prog=prog, description=description)
    wanted = {"size", *SIZE_FIELDS, "modes", *extra}
    for action in bench_parser()._actions:
        if action.dest in wanted:
            p._add_action(action)
    return p


def sizes_from(args):
    """The bench's `Sizes` for `args`, bf16, the bench's defaults for everything else (sizes left
    None in `args` from its --size, as the bench fills them)."""
    from megatron_ext.bench.cli import parser as bench_parser
    from megatron_ext.bench.cli import sizes_of

    size = getattr(args, "size", None)
    full = bench_parser().parse_args(["--size", size] if size else [])
    vars(full).update(vars(args), dtype="bf16")
    return sizes_of(fill_sizes(full))


def _step(stack, x, weights):
    inp = x.detach().requires_grad_(True)
    stack.zero_grad(set_to_none=True)
    (stack(inp).float() * weights).sum().backward()


def _origin(frames: list[dict]) -> str:
    """The innermost frame in megatron-ext or Megatron-Core (else the innermost Python frame)."""
    for frame in frames:
        name = frame.get("filename", "")
        for marker in ("megatron_ext/", "megatron/core/"):
            if marker in name:
                return f"{marker}{name.split(marker, 1)[1]}:{frame.get('line')} ({frame.get('name')})"
    for frame in frames:
        if frame.get("filename", "").endswith(".py"):
            return f"{frame['filename']}:{frame.get('line')} ({frame.get('name')})"
    return "(no Python frame)"


def memory_at_peak(snapshot: dict) -> tuple[int, dict[str, int]]:
    """(peak bytes, bytes alive at the peak by origin) over the allocations the trace recorded."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for trace in snapshot["device_traces"]:
        for event in trace:
            if event["action"] == "alloc":
                live[event["addr"]] = (event["size"], _origin(event.get("frames", [])))
                total += event["size"]
                if total > peak:
                    peak, at_peak = total, dict(live)
            elif event["action"] == "free_completed" and event["addr"] in live:
                total -= live.pop(event["addr"])[0]
    by_origin: dict[str, int] = collections.defaultdict(int)
    for size, origin in at_peak.values():
        by_origin[origin] += size
    return peak, dict(by_origin)


def record_memory(step, path: str) -> dict:
    """The allocator's trace over `step()`, also written to `path` (gzipped pickle)."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    with gzip.open(path, "wb") as f:
        pickle.dump(snapshot, f)
    return snapshot


def _mib(n: float) -> str:
    return f"{n / 2**20:9.1f} MiB"


def parser() -> argparse.ArgumentParser:
    """The profile's flags: the bench's sizes, modes, capacity factor, seed and deep_ep SM count, and its own."""
    p = size_arguments(
        "python -m megatron_ext.bench.profile", __doc__.split("\n\n")[0], ("capacity_factor", "seed", "deep_ep_num_sms")
    )
    p.add_argument("--steps", type=int, default=2, help="profiled steps per mode (default 2)")
    p.add_argument("--warmup", type=int, default=3, help="steps before profiling (default 3)")
    p.add_argument("--out", default="profile", help="folder for the tables and snapshots (default profile/)")
    p.add_argument("--top", type=int, default=25, help="rows per table (default 25)")
    p.add_argument(
        "--fp8-recipe",
        choices=STATIC_SPLITS_FP8_RECIPES,
        default=None,
        help="make the bench's fp8 modes selectable, in this recipe (GPU with Transformer Engine)",
    )
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (it profiles GPU kernels)")
    from megatron_ext.bench.modes import mode_names, select
    from megatron_ext.bench.stack import MoEStack, make_inputs, megatron_config

    try:
        modes = list(select(mode_names(args.modes), args.capacity_factor, args.fp8_recipe))
    except ValueError as error:
        p.error(str(error))
    os.makedirs(args.out, exist_ok=True)
    sizes = sizes_from(args)
    report: list[str] = []
    say = lambda line="": (print(line, flush=True), report.append(line))  # noqa: E731
    times: dict[str, dict[str, float]] = {}
    with one_gpu_rank(args.seed) as device:
        x = make_inputs(sizes, 0, 1, device)[0]
        weights = torch.linspace(-1.0, 1.0, x.numel(), device=device).view(x.shape)
        say(f"{torch.cuda.get_device_name()}: {sizes}")
        for mode in modes:
            torch.manual_seed(args.seed)
            try:
                stack = MoEStack(megatron_config(sizes, 1, device, mode), args.layers, mode.experts).to(device)
                step = functools.partial(_step, stack, x, weights)
                for _ in range(args.warmup):
                    step()
                if mode.graph:
                    from megatron_ext.bench.graphed import GraphedStep

                    step = functools.partial(GraphedStep, stack, x, weights)  # the capture
                else:
                    times[mode.name] = kernel_times(step, args.steps)
                snapshot_file = f"memory-{mode.name.replace('+', '_')}.pickle.gz"
                snapshot = record_memory(step, os.path.join(args.out, snapshot_file))
            except Exception as exc:  # a mode that cannot run here (deep_ep, TE) is reported, not fatal
                say(f"\n## {mode.name}: not profiled: {type(exc).__name__}: {exc}")
                continue
            finally:
                stack = step = None
                torch.cuda.empty_cache()
            if mode.graph:
                say(f"\n## {mode.name}: memory of its capture (its kernels are those of its eager twin)")
            else:
                total = sum(times[mode.name].values())
                say(f"\n## {mode.name}: {total:.2f} ms of GPU operations per step")
                for name, ms in sorted(times[mode.name].items(), key=lambda kv: -kv[1])[: args.top]:
                    say(f"{ms:9.3f} ms  {ms / total:6.1%}  {name[:110]}")
            peak, by_origin = memory_at_peak(snapshot)
            say(f"allocated during the step, alive at its peak: {_mib(peak)}")
            for origin, size in sorted(by_origin.items(), key=lambda kv: -kv[1])[: args.top]:
                say(f"  {_mib(size)}  {origin}")
    names = list(times)
    for other in names[1:]:
        base, cmp = times[names[0]], times[other]
        diff = {k: cmp.get(k, 0.0) - base.get(k, 0.0) for k in set(base) | set(cmp)}
        say(f"\n## {other} minus {names[0]}: {sum(cmp.values()) - sum(base.values()):+.2f} ms per step; largest:")
        for name, ms in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[: args.top]:
            say(f"{ms:+9.3f} ms  {name[:110]}")
    with open(os.path.join(args.out, "profile.txt"), "w") as f:
        f.write("\n".join(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
