"""Where a training iteration's time goes, read from a torch profiler trace of Megatron's loop.

Megatron's `--profile --use-pytorch-profiler --profile-step-start S --profile-step-end E` writes a
Chrome trace of iterations S..E-1 (`<tensorboard dir>/../torch_profile/rank-N.json.gz`), each
opened by a `ProfilerStep#` annotation. `summarize(trace)` reads one into per-iteration figures:

* `gpu_busy_ms`: the union of the GPU's kernel, copy and memset intervals (time the GPU had work),
* `wall_ms`: the host's time per profiled iteration (the profiler slows the host: compare
  `gpu_busy_ms` with the unprofiled iterations' time, not with this),
* `host_wait_ms` and `host_waits`: the host's time blocked in CUDA synchronisations (stream, event,
  device; what `.item()`, `.tolist()` and a blocking dispatch wait in) and how many it made,
* `launches`: kernel and graph launches the host made,
* `gpu_idle_forward_backward_ms`, `gpu_idle_step_end_ms`: the GPU's idle time within the steps, until
  the host has issued forward and backward (where the dispatch's waits are) and after (Megatron's
  step end: the optimizer, the logging). Profiled iterations run the host slower than others: where
  the host sets the pace, these are larger than in an unprofiled iteration,
* `kernels`: per kernel name, its category, calls and milliseconds per iteration, largest first;
  `categories`: the same summed by category (`CATEGORIES`, from the kernel's name),
* `copies`: the GPU's memory copies grouped by kind, size (MiB), the host call that issued them
  (`cudaMemcpyAsync`, or `cudaGraphLaunch` for a copy inside a graph) and the host ops around that
  call (outermost > innermost, e.g. autograd's node > `aten::copy_`): calls and ms per iteration,
  largest first. A copy's op names who made it, which a kernel table cannot,
* `host` (only for a trace with Python call stacks: Megatron's `--pytorch-profiler-collect-callstack`):
  the host's Python time per iteration by the package that spends it (`host_packages`: a frame's
  own time goes to its package, or, for torch's and Python's frames, to the nearest caller's; threads
  that run none of these packages are left out),
  `waiting_for_backward_ms` (the main thread blocked while autograd's thread runs the backward),
  `children_past_parents_ms` (frames whose recorded callees outlast them get no time of their own;
  the excess, which the packages' times then count twice, is this; 0 in a consistent trace),
  and megatron-ext's entry points (`megatron_ext_calls`: calls and inclusive ms per iteration).
  Recording every Python call slows the host several times over: read these as shares.

    python -m megatron_ext.tooling.loop_profile TRACE.json.gz   # a markdown summary
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def _named_patterns(*pairs: tuple[str, str]) -> tuple[tuple[str, re.Pattern], ...]:
    """(name, compiled pattern) pairs, matched in order: the first match wins."""
    return tuple((name, re.compile(pattern)) for name, pattern in pairs)


# Kernel categories by name, first match wins. Names are the profiler's (demangled CUDA names).
CATEGORIES = _named_patterns(
    ("NCCL", r"nccl"),
    ("grouped GEMM (experts)", r"GroupProblemShape|[Gg]rouped_?[Gg]emm|grouped_mm|prepare_grouped"),
    ("megatron-ext dispatch (Triton)", r"_gather_rows|_block_counts|_layout_kernel|_sum_rows_per_slot"),
    ("megatron-ext activation (Triton)", r"_activation_probs"),
    ("GEMM (attention, router, output)", r"nvjet|gemm|Gemm|xmma|cutlass|cublas|sm90_"),
    ("attention softmax", r"[Ss]oft[Mm]ax|flash|fmha"),
    ("optimizer", r"multi_tensor|[Aa]dam|_foreach|fused_adam"),
    ("sort, scan, top-k (routing, permute)", r"sort|[Ss]can|topk|TopK|cumsum|bucketize|radix|Radix"),
    ("index, scatter, gather", r"index|[Ss]catter|[Gg]ather|masked|nonzero"),
    ("copy, memset", r"^Memcpy|^Memset|^memcpy|copy|Copy|fill|Fill"),
    ("reduction", r"reduce|[Rr]eduction"),
    ("elementwise", r"elementwise|[Vv]ectorized|unrolled|pointwise|triton_"),
)
OTHER = "other"
GPU_EVENTS = {"kernel", "gpu_memcpy", "gpu_memset"}
# CUDA runtime and driver calls in which the host waits for the GPU.
SYNC_CALLS = re.compile(r"^(cuda|cu)(Stream|Event|Device|Ctx)Synchronize")
LAUNCH_CALLS = re.compile(r"^(cuda|cu)(LaunchKernel|LaunchKernelEx|GraphLaunch|LaunchCooperativeKernel)")
STEP = re.compile(r"^ProfilerStep#(\d+)$")
# Host events that belong to a step's forward and backward: autograd's backward functions, and the
# launch of a CUDA graph (a full-iteration graph holds forward and backward; the optimizer is eager).
FORWARD_BACKWARD = re.compile(r"^autograd::engine::evaluate_function|^cudaGraphLaunch")
# The packages host time is charged to, by a Python frame's file (`path(line): function`), first match
# wins; torch's, Python's and built-in frames are charged to their nearest caller among these.
HOST_PACKAGES = _named_patterns(
    ("megatron-ext", r"megatron_ext/"),
    ("megatron-core", r"megatron/core/"),
    ("megatron training loop", r"megatron/training/|pretrain_\w+\.py"),
    ("transformer-engine", r"transformer_engine/"),
    ("deep_ep", r"deep_ep/"),
    ("triton", r"triton/"),
)
UNCHARGED = "torch and Python, called by none of these"
RUN_BACKWARD = re.compile(r"run_backward")


def category(kernel: str) -> str:
    for name, pattern in CATEGORIES:
        if pattern.search(kernel):
            return name
    return OTHER


def short_name(kernel: str, width: int = 90) -> str:
    """A kernel's name without `void `, its template arguments and parameter list, cut to `width`."""
    name = kernel.removeprefix("void ")
    out, depth = [], 0
    for ch in name:
        if ch in "<(":
            if depth == 0:
                out.append("<>" if ch == "<" else "")
            depth += 1
        elif ch in ">)":
            depth = max(depth - 1, 0)
        elif depth == 0:
            out.append(ch)
    text = "".join(out).strip() or name
    return text if len(text) <= width else text[: width - 3] + "..."


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    """The total length, in ms, of the union of [start, end) intervals given in µs."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total / 1e3


def _idle_split(steps: list[dict], gpu: list[dict], marks: list[dict]) -> tuple[float, float]:
    """The GPU's idle ms within the steps, summed, split at the end of each step's forward and
    backward on the host: the end of its last `marks` event (autograd's backward functions, or the
    launch of a graph that holds the step); a step without one counts as all forward and backward."""
    before = after = 0.0
    for step in steps:
        start, end = float(step["ts"]), float(step["ts"]) + float(step["dur"])
        cut = max(
            (float(m["ts"]) + float(m["dur"]) for m in marks if start <= float(m["ts"]) <= end),
            default=end,
        )
        busy = sorted(
            (max(float(e["ts"]), start), min(float(e["ts"]) + float(e["dur"]), end))
            for e in gpu
            if float(e["ts"]) < end and float(e["ts"]) + float(e["dur"]) > start
        )
        cursor = start
        for a, b in busy + [(end, end)]:
            if a > cursor:
                head = max(0.0, min(a, cut) - cursor)
                before += head
                after += (a - cursor) - head
            cursor = max(cursor, b)
    return before / 1e3, after / 1e3


def _package(frame: str) -> str | None:
    for name, pattern in HOST_PACKAGES:
        if pattern.search(frame):
            return name
    return None


def host_time(events: list[dict[str, Any]], steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The host's Python time per iteration by package, and megatron-ext's entry points, over the
    profiled `steps` (see the module's docstring); None for a trace without Python frames."""
    first = min(float(s["ts"]) for s in steps)
    last = max(float(s["ts"]) + float(s["dur"]) for s in steps)
    frames = {
        e["args"]["Python id"]: e
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") == "python_function"
        and "Python id" in e.get("args", {})
        and first <= float(e["ts"]) < last
    }
    if not frames:
        return None
    children_us: dict[int, float] = defaultdict(float)
    for e in frames.values():
        children_us[e["args"].get("Python parent id")] += float(e["dur"])
    owners: dict[int, str] = {}

    def owner(pid: Any) -> str:
        """The package `pid`'s frame is charged to (iterative: stacks outgrow the recursion limit)."""
        chain, charged = [], UNCHARGED
        while pid in frames:
            if pid in owners:
                charged = owners[pid]
                break
            found = _package(str(frames[pid]["name"]))
            if found is not None:
                owners[pid] = charged = found
                break
            chain.append(pid)
            pid = frames[pid]["args"].get("Python parent id")
        owners.update((link, charged) for link in chain)
        return charged

    # Threads that run none of these packages (the profiler's, data loaders', watchdogs', mostly
    # waiting the whole step) are left out: their time is no work of the step's.
    working = {(e.get("pid"), e.get("tid")) for pid, e in frames.items() if owner(pid) != UNCHARGED}
    packages: dict[str, float] = defaultdict(float)
    waiting = overlapping = 0.0
    calls: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for pid, e in frames.items():
        if (e.get("pid"), e.get("tid")) not in working:
            continue
        name = str(e["name"])
        own = float(e["dur"]) - children_us[pid]
        if own < 0:  # its children, as recorded, outlast it: no time of its own, and the excess told
            overlapping += -own
            own = 0.0
        if RUN_BACKWARD.search(name):
            waiting += own
            continue
        packages[owner(pid)] += own
        if _package(name) == "megatron-ext" and owner(e["args"].get("Python parent id")) != "megatron-ext":
            entry = calls[name[name.find("megatron_ext/") :]]
            entry[0] += 1
            entry[1] += float(e["dur"])
    iterations = len(steps)
    per = 1e3 * iterations
    return {
        "host_packages": {k: v / per for k, v in sorted(packages.items(), key=lambda kv: -kv[1])},
        "waiting_for_backward_ms": waiting / per,
        "children_past_parents_ms": overlapping / per,
        "megatron_ext_calls": sorted(
            ({"function": name, "calls": n / iterations, "ms": us / per} for name, (n, us) in calls.items()),
            key=lambda c: -c["ms"],
        ),
    }


def _enclosing_ops(ops: list[dict[str, Any]], queries: list[tuple[Any, float, Any]]) -> dict[Any, str]:
    """For each (thread, time, key) query, the host ops that enclose that time on that thread, as
    "outermost > innermost" ("" where none). Ops on one thread nest, so one sweep per thread keeps
    the open ones on a stack."""
    by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in ops:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    found: dict[Any, str] = {}
    asked: dict[Any, list[tuple[float, Any]]] = defaultdict(list)
    for thread, t, key in queries:
        asked[thread].append((t, key))
    for thread, wanted in asked.items():
        started = sorted(by_thread.get(thread, []), key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack: list[tuple[float, str]] = []  # (end, name) of the ops open at the cursor
        i = 0
        for t, key in sorted(wanted, key=lambda q: q[0]):
            while i < len(started) and float(started[i]["ts"]) <= t:
                e = started[i]
                while stack and stack[-1][0] < float(e["ts"]):
                    stack.pop()
                stack.append((float(e["ts"]) + float(e["dur"]), str(e["name"])))
                i += 1
            while stack and stack[-1][0] < t:
                stack.pop()
            names = [name for end, name in stack if end >= t]
            found[key] = names[0] if len(names) == 1 else f"{names[0]} > {names[-1]}" if names else ""
    return found


def _copies(
    copies: list[dict[str, Any]], runtime: list[dict[str, Any]], ops: list[dict[str, Any]], iterations: int
) -> list[dict[str, Any]]:
    """The `copies` figure (see the module's docstring) of the trace's gpu_memcpy events."""
    issued = {e["args"]["correlation"]: e for e in runtime if "correlation" in e.get("args", {})}
    launches = {}
    for n, c in enumerate(copies):
        call = issued.get(c.get("args", {}).get("correlation"))
        if call is not None:
            launches[n] = call
    around = _enclosing_ops(ops, [((e.get("pid"), e.get("tid")), float(e["ts"]), n) for n, e in launches.items()])
    groups: dict[tuple[str, float, str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for n, c in enumerate(copies):
        call = launches.get(n)
        key = (
            str(c["name"]).split(" (")[0],
            round(float(c.get("args", {}).get("bytes", 0)) / 2**20, 1),
            str(call["name"]) if call is not None else "",
            around.get(n, ""),
        )
        groups[key][0] += 1
        groups[key][1] += float(c["dur"]) / 1e3
    return sorted(
        (
            {"kind": kind, "mib": mib, "issued_by": by, "ops": where, "calls": n / iterations, "ms": ms / iterations}
            for (kind, mib, by, where), (n, ms) in groups.items()
        ),
        key=lambda g: -g["ms"],
    )


def load(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-iteration figures of a trace's events (see the module's docstring)."""
    steps = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and STEP.match(str(e.get("name", "")))
    ]
    if not steps:
        raise ValueError("no ProfilerStep# annotation in the trace: not a trace of profiled iterations")
    iterations = len(steps)
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_EVENTS]
    busy = _union_ms([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu])
    # Categorised by the full name (a grouped GEMM says so in its template arguments), listed short.
    per_kernel: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for e in gpu:
        name = short_name(e["name"]) if e.get("cat") == "kernel" else e["name"].split(" ")[0]
        entry = per_kernel[(name, category(e["name"]))]
        entry[0] += 1
        entry[1] += float(e["dur"]) / 1e3
    runtime = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")]
    waits = [e for e in runtime if SYNC_CALLS.match(str(e.get("name", "")))]
    launches = sum(1 for e in runtime if LAUNCH_CALLS.match(str(e.get("name", ""))))
    kernels = sorted(
        (
            {"kernel": name, "category": kind, "calls": calls / iterations, "ms": ms / iterations}
            for (name, kind), (calls, ms) in per_kernel.items()
        ),
        key=lambda k: -k["ms"],
    )
    categories: dict[str, dict[str, float]] = {}
    for k in kernels:
        c = categories.setdefault(k["category"], {"calls": 0.0, "ms": 0.0})
        c["calls"] += k["calls"]
        c["ms"] += k["ms"]
    marks = [e for e in events if e.get("ph") == "X" and FORWARD_BACKWARD.match(str(e.get("name", "")))]
    ops = [
        e
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") in ("cpu_op", "user_annotation")
        and not STEP.match(str(e.get("name", "")))
    ]
    copies = _copies([e for e in gpu if e.get("cat") == "gpu_memcpy"], runtime, ops, iterations)
    idle_before, idle_after = _idle_split(steps, gpu, marks)
    host = host_time(events, steps)
    return {
        "iterations": iterations,
        "gpu_idle_forward_backward_ms": idle_before / iterations,
        "gpu_idle_step_end_ms": idle_after / iterations,
        "wall_ms": sum(float(s["dur"]) for s in steps) / 1e3 / iterations,
        "gpu_busy_ms": busy / iterations,
        "host_wait_ms": sum(float(e["dur"]) for e in waits) / 1e3 / iterations,
        "host_waits": len(waits) / iterations,
        "launches": launches / iterations,
        "categories": dict(sorted(categories.items(), key=lambda kv: -kv[1]["ms"])),
        "kernels": kernels,
        "copies": copies,
        **({"host": host} if host is not None else {}),
    }


def markdown(summary: dict[str, Any], top: int = 15) -> str:
    """A summary's figures, its categories and its `top` kernels as markdown."""
    lines = [
        f"{summary['iterations']} profiled iterations; per iteration: GPU busy {summary['gpu_busy_ms']:.2f} ms, "
        f"host wall {summary['wall_ms']:.2f} ms (profiled), host blocked in {summary['host_waits']:.0f} "
        f"synchronisations for {summary['host_wait_ms']:.2f} ms, {summary['launches']:.0f} launches; GPU idle "
        f"{summary['gpu_idle_forward_backward_ms']:.2f} ms in forward and backward, "
        f"{summary['gpu_idle_step_end_ms']:.2f} ms in the step's end",
        "",
        "| category | calls/iteration | GPU ms/iteration |",
        "| --- | --- | --- |",
        *(f"| {name} | {c['calls']:.0f} | {c['ms']:.2f} |" for name, c in summary["categories"].items()),
        "",
        "| kernel | category | calls/iteration | GPU ms/iteration |",
        "| --- | --- | --- | --- |",
        *(
            f"| `{k['kernel']}` | {k['category']} | {k['calls']:.0f} | {k['ms']:.3f} |"
            for k in summary["kernels"][:top]
        ),
    ]
    if summary.get("copies"):
        lines += [
            "",
            "| copy | MiB | issued by | host ops (outermost > innermost) | calls/iteration | GPU ms/iteration |",
            "| --- | --- | --- | --- | --- | --- |",
            *(
                f"| {c['kind']} | {c['mib']:.1f} | {c['issued_by']} | {c['ops']} | {c['calls']:.0f} | {c['ms']:.3f} |"
                for c in summary["copies"][:top]
            ),
        ]
    host = summary.get("host")
    if host is not None:
        lines += [
            "",
            f"Host Python time per iteration (profiled with call stacks, which slow the host; read as shares); "
            f"the main thread waited {host['waiting_for_backward_ms']:.2f} ms for autograd's backward thread; "
            f"callees outlasting their callers: {host['children_past_parents_ms']:.2f} ms, counted twice:",
            "",
            "| package | host ms/iteration |",
            "| --- | --- |",
            *(f"| {name} | {ms:.2f} |" for name, ms in host["host_packages"].items()),
            "",
            "| megatron-ext entry point | calls/iteration | host ms/iteration |",
            "| --- | --- | --- |",
            *(f"| `{c['function']}` | {c['calls']:.0f} | {c['ms']:.2f} |" for c in host["megatron_ext_calls"][:top]),
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_ext.tooling.loop_profile",
        description="Per-iteration GPU-busy time, host waits and kernels of a torch profiler trace of Megatron's loop.",
    )
    parser.add_argument("trace", type=Path, help="a Chrome trace (.json or .json.gz) with ProfilerStep# annotations")
    parser.add_argument("--top", type=int, default=15, help="kernels listed (default 15)")
    args = parser.parse_args(argv)
    if not args.trace.is_file():
        parser.error(f"no such trace: {args.trace}")
    print(markdown(summarize(load(args.trace)), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
