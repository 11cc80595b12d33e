"""Megatron's training loop at one model shape, run by run, side by side.

    python -m megatron_ext.tooling.train_shapes --profile-start S DIR SHAPE [--json OUT]

reads what `.ci/gpu-suite train-shapes` leaves in DIR for SHAPE: each run's log
(`train-SHAPE-RUN.log`) and, where it was profiled, its trace
(`prof-SHAPE-RUN/torch_profile/rank-0.json.gz`, Megatron's `--profile --use-pytorch-profiler`
from iteration S). Prints a markdown table: per run, whether its losses and grad norms equal the
blocking run's at every iteration, the median ms per iteration over the iterations after the first
`SKIP_ITERS` and before the profiled ones, tokens/s, the GPU-busy ms per iteration (profiled), the
step's time over its GPU-busy time (above 1: the GPU waited for the host), the host's
synchronisations per iteration, its peak memory, and the time against the blocking and the stock
runs; then the GPU time per kernel category of every run, and the largest kernels of each.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Optional

from megatron_ext.tooling import loop_profile
from megatron_ext.tooling.train_logs import SKIP_ITERS, first_difference, parse_log, step_ms, tokens_per_step_and_gpus

PEAK = re.compile(r"peak GPU memory allocated (\d+) MiB")
REFERENCE, STOCK = "blocking", "stock"


def run_names(directory: Path, shape: str) -> list[str]:
    """The runs logged for `shape` in `directory`, in the order they ran (by file time)."""
    logs = sorted(directory.glob(f"train-{shape}-*.log"), key=lambda p: p.stat().st_mtime)
    return [p.stem.removeprefix(f"train-{shape}-") for p in logs]


def run_record(directory: Path, shape: str, name: str, profile_start: Optional[int]) -> dict[str, Any]:
    text = (directory / f"train-{shape}-{name}.log").read_text(errors="replace")
    iterations = parse_log(text)
    times = step_ms(iterations, SKIP_ITERS, profile_start)  # the profiled iterations run slower
    ms = statistics.median(times) if times else None
    tokens = tokens_per_step_and_gpus(text)
    peaks = [int(m) for m in PEAK.findall(text)]
    trace = directory / f"prof-{shape}-{name}" / "torch_profile" / "rank-0.json.gz"
    profile = loop_profile.summarize(loop_profile.load(trace)) if trace.is_file() else None
    return {
        "run": name,
        "iterations": iterations,
        "ms": ms,
        "tokens_per_s": tokens[0] / (ms / 1e3) / tokens[1] if ms and tokens else None,
        "peak_mib": max(peaks) if peaks else None,
        "profile": profile,
    }


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _num(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def report(directory: Path, shape: str, profile_start: Optional[int]) -> tuple[str, dict[str, Any]]:
    """(markdown, JSON record) of `shape`'s runs in `directory`."""
    names = run_names(directory, shape)
    if not names:
        raise FileNotFoundError(f"no train-{shape}-*.log in {directory}")
    records = {name: run_record(directory, shape, name, profile_start) for name in names}
    reference = records.get(REFERENCE)
    stock = records.get(STOCK)
    lines = [
        f"| run | iterations | losses, grad norms against {REFERENCE} | ms/iteration | tokens/s | GPU busy "
        "ms/iteration | step / GPU busy | host syncs/iteration | peak memory GiB | against blocking "
        "| against stock | memory against blocking |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in records.items():
        if reference is None or name == REFERENCE:
            same = "reference" if name == REFERENCE else "-"
        else:
            diff = first_difference(reference["iterations"], r["iterations"])
            same = "identical" if diff is None else f"differs: {diff}"
        p = r["profile"]
        busy = p["gpu_busy_ms"] if p else None
        lines.append(
            f"| {name} | {len(r['iterations'])} | {same} | {_num(r['ms'], '.1f')} | {_num(r['tokens_per_s'], ',.0f')} "
            f"| {_num(busy, '.1f')} | {_ratio(r['ms'], busy)} | {_num(p and p['host_waits'], '.0f')} "
            f"| {_num(r['peak_mib'] and r['peak_mib'] / 1024, '.1f')} "
            f"| {_ratio(r['ms'], reference and reference['ms'])} | {_ratio(r['ms'], stock and stock['ms'])} "
            f"| {_ratio(r['peak_mib'], reference and reference['peak_mib'])} |"
        )
    profiled = {name: r["profile"] for name, r in records.items() if r["profile"]}
    if profiled:
        categories = list(dict.fromkeys(c for p in profiled.values() for c in p["categories"]))
        lines += [
            "",
            "GPU ms per iteration by kernel category (profiled iterations):",
            "",
            "| category | " + " | ".join(profiled) + " |",
            "| --- | " + " | ".join("---" for _ in profiled) + " |",
        ]
        for c in categories:
            cells = [_num(p["categories"].get(c, {}).get("ms"), ".2f") for p in profiled.values()]
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        lines.append(
            "| host: launches / syncs / blocked ms | "
            + " | ".join(
                f"{p['launches']:.0f} / {p['host_waits']:.0f} / {p['host_wait_ms']:.1f}" for p in profiled.values()
            )
            + " |"
        )
        lines.append(
            "| GPU idle ms: forward and backward / step end | "
            + " | ".join(
                f"{p['gpu_idle_forward_backward_ms']:.1f} / {p['gpu_idle_step_end_ms']:.1f}" for p in profiled.values()
            )
            + " |"
        )
    record = {
        "shape": shape,
        "profile_start": profile_start,
        "skip_iterations": SKIP_ITERS,
        "runs": {
            name: {k: v for k, v in r.items() if k != "iterations"} | {"iterations_logged": len(r["iterations"])}
            for name, r in records.items()
        },
    }
    return "\n".join(lines), record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_ext.tooling.train_shapes",
        description="One shape's training runs (.ci/gpu-suite train-shapes) side by side: a markdown table.",
    )
    parser.add_argument("directory", type=Path, help="where the runs' logs and traces are")
    parser.add_argument("shape", help="the shape's name, as in the logs' names (train-SHAPE-RUN.log)")
    parser.add_argument(
        "--profile-start", type=int, default=None, help="the first profiled iteration: the median stops before it"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures, every kernel's too, here")
    args = parser.parse_args(argv)
    try:
        text, record = report(args.directory, args.shape, args.profile_start)
    except FileNotFoundError as exc:
        parser.error(str(exc))
    print(text)
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
