"""Megatron's training loop at one model shape, run by run, side by side.

    python -m megatron_ext.tooling.train_shapes [--profile-start S] DIR SHAPE [--json OUT]

reads what `.ci/gpu-suite train-shapes` leaves in DIR for SHAPE: each run's log
(`train-SHAPE-RUN.log`), or why it was skipped (`train-SHAPE-RUN.skipped`), and, where it was
profiled, its trace (`prof-SHAPE-RUN/torch_profile/rank-0.json.gz`, Megatron's `--profile
--use-pytorch-profiler` from the iteration its log's argument listing names, else S); `--runs` names
the runs (default: every log of SHAPE).
Prints a markdown table: per run, whether its losses and grad norms equal the blocking run's at
every iteration, else from which iteration they differ and their largest relative deviation from
it (the stock run's deviation, on other kernels, is the yardstick for any run on other kernels),
the median ms per iteration over the iterations after the first
`SKIP_ITERS` and before the profiled ones, tokens/s, the GPU-busy ms per iteration (profiled), the
step's time over its GPU-busy time (above 1: the GPU waited for the host), the host's
synchronisations per iteration, its peak memory, and the time against the blocking and the stock
runs; where runs differ from blocking, their mean losses over four spans of the iterations against
blocking's (whether the curves stay together); then the GPU time per kernel category of every run,
and the largest kernels of each. The
JSON record carries a `setup` object: the card, the versions of megatron-core, Transformer Engine
and deep_ep, the HybridEP implementation megatron-ext's runs used, the layers (`te` or `local`),
micro-batches, sequence length and the repository's commit.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from megatron_ext.tooling import loop_profile
from megatron_ext.tooling.train_logs import (
    SKIP_ITERS,
    first_difference,
    first_differing_iteration,
    parse_log,
    profiled_from,
    relative_deviation,
    step_ms,
    tokens_per_step_and_gpus,
)

PEAK = re.compile(r"peak GPU memory allocated (\d+) MiB")
REFERENCE, STOCK = "blocking", "stock"
CURVE_WINDOWS = 4  # spans of the iterations over which loss_curves compares mean losses


def run_names(directory: Path, shape: str) -> list[str]:
    """The runs logged for `shape` in `directory`, in the order they ran (by file time)."""
    logs = sorted(directory.glob(f"train-{shape}-*.log"), key=lambda p: p.stat().st_mtime)
    return [p.stem.removeprefix(f"train-{shape}-") for p in logs]


def _version(*distributions: str) -> Optional[str]:
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def setup(layers: str, micro_batches: Optional[int], sequence: Optional[int]) -> dict[str, Any]:
    """What ran the runs: this machine's card and packages, and the loop's settings as given."""
    import torch

    # MEGATRON_EXT_COMMIT first: a copy of a working tree may carry git metadata older than its files.
    commit = os.environ.get("MEGATRON_EXT_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = None
    return {
        "card": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "megatron_core": _version("megatron-core", "megatron_core"),
        "transformer_engine": _version("transformer-engine", "transformer_engine"),
        "deep_ep": _version("deep-ep", "deep_ep"),
        # What --moe-hybridep-implementation auto picks for megatron-ext's runs.
        "implementation": "deep_ep" if importlib.util.find_spec("deep_ep") else "torch",
        "layers": layers,
        "micro_batches": micro_batches,
        "sequence": sequence,
        "commit": commit,
    }


def compare(reference: Optional[dict], name: str, iterations: dict) -> Any:
    """A run's losses and grad norms against the reference's: "reference", "identical", or where and
    how far they part ({"first_difference": ..., "lm loss": largest relative deviation, "grad norm": ...})."""
    if name == REFERENCE:
        return "reference"
    if reference is None:
        return None
    diff = first_difference(reference, iterations)
    if diff is None:
        return "identical"
    return {"first_difference": diff, "from_iteration": first_differing_iteration(reference, iterations)} | (
        relative_deviation(reference, iterations)
    )


def _series(iterations: dict, key: str) -> dict[int, Optional[float]]:
    """{iteration: value} of one logged field, for the record's curves."""
    return {i: float(f[key]) if key in f else None for i, f in sorted(iterations.items())}


def _losses_cell(losses: Any, yardstick: Any) -> str:
    if losses is None:
        return "-"
    if isinstance(losses, str):
        return losses
    loss, norm = losses["lm loss"], losses["grad norm"]
    if loss is None:
        return f"differs: {losses['first_difference']}"
    first = losses["from_iteration"]
    cell = f"differs from iteration {first}: lm loss {loss:.1e}, grad norm {norm:.1e} (largest relative)"
    if isinstance(yardstick, dict) and yardstick is not losses and yardstick["lm loss"] is not None:
        within = loss <= yardstick["lm loss"] and norm <= yardstick["grad norm"]
        cell += ", within stock's" if within else ", beyond stock's"
    return cell


def _curve_windows(iterations: list[int], windows: int) -> list[list[int]]:
    """`iterations` cut into `windows` runs of consecutive ones, as even in length as they go."""
    size, extra = divmod(len(iterations), windows)
    cuts, start = [], 0
    for w in range(windows):
        end = start + size + (w < extra)
        cuts.append(iterations[start:end])
        start = end
    return cuts


def loss_curves(runs: dict[str, dict], windows: int = CURVE_WINDOWS) -> list[str]:
    """Whether the curves stay together, where a run's losses part from blocking's: the mean lm loss
    over each of `windows` spans of blocking's iterations, blocking's and, for every run that
    differs, its own against it (relative). Nothing when no run differs or blocking logged fewer
    than two iterations a span. Reads the record's series, so a record read back from JSON (string
    keys) gives the same table."""
    reference = runs.get(REFERENCE)
    differing = {name: r for name, r in runs.items() if isinstance(r.get("losses"), dict)}
    if reference is None or not differing:
        return []

    def series(run: dict) -> dict[int, float]:
        return {int(i): v for i, v in (run.get("lm_loss") or {}).items() if v is not None}

    ours = series(reference)
    if len(ours) < 2 * windows:
        return []
    spans = _curve_windows(sorted(ours), windows)
    means = [statistics.fmean(ours[i] for i in span) for span in spans]
    lines = [
        "",
        f"Mean lm loss over {len(spans)} equal spans of the iterations: {REFERENCE}'s, and each run that "
        "differs against it (do the curves stay together):",
        "",
        "| run | " + " | ".join(f"iterations {span[0]}-{span[-1]}" for span in spans) + " |",
        "| --- | " + " | ".join("---" for _ in spans) + " |",
        f"| {REFERENCE} | " + " | ".join(f"{m:.4f}" for m in means) + " |",
    ]
    for name, run in differing.items():
        theirs = series(run)
        cells = [
            f"{statistics.fmean(theirs[i] for i in span) / mean - 1:+.2%}"
            if mean and all(i in theirs for i in span)
            else "-"
            for span, mean in zip(spans, means)
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def run_record(directory: Path, shape: str, name: str, profile_start: Optional[int]) -> dict[str, Any]:
    """One run's figures. The profiled iterations run slower, so the median stops before the first:
    the one the run's own argument listing names (runs of one table may have run for different
    numbers of iterations), else `profile_start`."""
    text = (directory / f"train-{shape}-{name}.log").read_text(errors="replace")
    iterations = parse_log(text)
    listed, start = profiled_from(text)
    if not listed:
        start = profile_start
    times = step_ms(iterations, SKIP_ITERS, start)
    ms = statistics.median(times) if times else None
    tokens = tokens_per_step_and_gpus(text)
    peaks = [int(m) for m in PEAK.findall(text)]
    trace = directory / f"prof-{shape}-{name}" / "torch_profile" / "rank-0.json.gz"
    profile = loop_profile.summarize(loop_profile.load(trace)) if trace.is_file() else None
    return {
        "run": name,
        "iterations": iterations,
        "profile_start": start,
        "ms": ms,
        "tokens_per_s": tokens[0] / (ms / 1e3) / tokens[1] if ms and tokens else None,
        "peak_mib": max(peaks) if peaks else None,
        "profile": profile,
    }


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _num(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def report(
    directory: Path,
    shape: str,
    profile_start: Optional[int],
    runs: Optional[list[str]] = None,
    run_setup: Optional[dict[str, Any]] = None,
) -> tuple[str, dict[str, Any]]:
    """(markdown, JSON record) of `shape`'s runs in `directory` (`runs`, or every run logged)."""
    names = run_names(directory, shape) if runs is None else list(runs)
    skipped = {}
    for name in names:
        note = directory / f"train-{shape}-{name}.skipped"
        if note.is_file() and not (directory / f"train-{shape}-{name}.log").is_file():
            skipped[name] = note.read_text().strip()
    names = [name for name in names if name not in skipped]
    missing = [name for name in names if not (directory / f"train-{shape}-{name}.log").is_file()]
    if not names or missing:
        raise FileNotFoundError(f"no train-{shape}-{(missing or ['*'])[0]}.log in {directory}")
    records = {name: run_record(directory, shape, name, profile_start) for name in names}
    reference = records.get(REFERENCE)
    for name, r in records.items():
        r["losses"] = compare(reference and reference["iterations"], name, r["iterations"])
    record = {
        "setup": run_setup,
        "shape": shape,
        "profile_start": profile_start,
        "skip_iterations": SKIP_ITERS,
        "runs": {
            name: {k: v for k, v in r.items() if k != "iterations"}
            | {"iterations_logged": len(r["iterations"])}
            | {key.replace(" ", "_"): _series(r["iterations"], key) for key in ("lm loss", "grad norm")}
            for name, r in records.items()
        }
        | {name: {"run": name, "status": "skipped", "why": why} for name, why in skipped.items()},
    }
    return markdown(record), record


def markdown(record: dict[str, Any]) -> str:
    """The markdown tables of a record (`report`'s, or one read back from its JSON)."""
    runs = {name: r for name, r in record["runs"].items() if r.get("status") != "skipped"}
    skipped = {name: r["why"] for name, r in record["runs"].items() if r.get("status") == "skipped"}
    reference, stock = runs.get(REFERENCE), runs.get(STOCK)
    yardstick = stock and stock["losses"]
    lines = [
        f"| run | iterations | losses, grad norms against {REFERENCE} | ms/iteration | tokens/s | GPU busy "
        "ms/iteration | step / GPU busy | host syncs/iteration | peak memory GiB | against blocking "
        "| against stock | memory against blocking |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in runs.items():
        same = _losses_cell(r["losses"], yardstick)
        p = r["profile"]
        busy = p["gpu_busy_ms"] if p else None
        lines.append(
            f"| {name} | {r['iterations_logged']} | {same} | {_num(r['ms'], '.1f')} "
            f"| {_num(r['tokens_per_s'], ',.0f')} "
            f"| {_num(busy, '.1f')} | {_ratio(r['ms'], busy)} | {_num(p and p['host_waits'], '.0f')} "
            f"| {_num(r['peak_mib'] and r['peak_mib'] / 1024, '.1f')} "
            f"| {_ratio(r['ms'], reference and reference['ms'])} | {_ratio(r['ms'], stock and stock['ms'])} "
            f"| {_ratio(r['peak_mib'], reference and reference['peak_mib'])} |"
        )
    lines += loss_curves(runs)
    profiled = {name: r["profile"] for name, r in runs.items() if r["profile"]}
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
        hosts = {name: p.get("host") for name, p in profiled.items()}
        if any(hosts.values()):  # traces with Python call stacks (HOST_STACKS=1)
            packages = list(dict.fromkeys(k for h in hosts.values() if h for k in h["host_packages"]))
            # Beside the packages: the wait for autograd's thread, and the callees' time past their
            # callers' that the packages count twice (not recorded before the clamp: "-").
            extra = {
                "waiting for backward": "waiting_for_backward_ms",
                "callees past callers": "children_past_parents_ms",
            }
            for row in packages + list(extra):
                cells = [
                    _num(h and (h.get(extra[row]) if row in extra else h["host_packages"].get(row)), ".1f")
                    for h in hosts.values()
                ]
                lines.append(f"| host Python ms (with call stacks): {row} | " + " | ".join(cells) + " |")
    lines += [f"\nskipped {name}: {why}" for name, why in skipped.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_ext.tooling.train_shapes",
        description="One shape's training runs (.ci/gpu-suite train-shapes) side by side: a markdown table.",
    )
    parser.add_argument("directory", type=Path, nargs="?", help="where the runs' logs and traces are")
    parser.add_argument("shape", nargs="?", help="the shape's name, as in the logs' names (train-SHAPE-RUN.log)")
    parser.add_argument(
        "--from-json", type=Path, default=None, help="print the tables of a record this wrote (--json) instead"
    )
    parser.add_argument(
        "--profile-start",
        type=int,
        default=None,
        help="the first profiled iteration, for logs without Megatron's argument listing (a run's own "
        "listing names it): the median stops before it",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures, every kernel's too, here")
    parser.add_argument("--runs", nargs="+", default=None, help="the runs, in order (default: every log of SHAPE)")
    parser.add_argument("--layers", choices=("te", "local"), default="local", help="the layers the runs trained")
    parser.add_argument("--micro-batches", type=int, default=None, help="micro-batches a step, for the setup record")
    parser.add_argument("--sequence", type=int, default=None, help="sequence length, for the setup record")
    args = parser.parse_args(argv)
    if args.from_json is not None:
        if args.directory is not None or args.json is not None:
            parser.error("--from-json prints a record's tables: give no DIR, SHAPE or --json with it")
        if not args.from_json.is_file():
            parser.error(f"--from-json: no such record: {args.from_json}")
        print(markdown(json.loads(args.from_json.read_text())))
        return 0
    if args.directory is None or args.shape is None:
        parser.error("give DIR and SHAPE (or --from-json RECORD)")
    try:
        text, record = report(
            args.directory,
            args.shape,
            args.profile_start,
            args.runs,
            setup(args.layers, args.micro_batches, args.sequence),
        )
    except FileNotFoundError as exc:
        parser.error(str(exc))
    print(text)
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
