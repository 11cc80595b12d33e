"""Compare Megatron training logs run by run: per-iteration losses, grad norm, speed.

    python -m megatron_ext.tooling.train_logs blocking.log capacity.log graphed.log

Reads each log's iteration lines (`iteration N/ M | ... | lm loss: ... | grad norm: ... |`) and
prints a markdown table: per run, the iterations logged, whether every logged value equals the
first run's at every iteration (exactly, as printed), the first iteration that differs, the median
time per iteration after the first 10, tokens/s from that, and the capacity-use metric's mean.
"""

from __future__ import annotations

import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*\d+\s*\|(.*)")
_FIELD = re.compile(r"([A-Za-z_][A-Za-z_ ()/-]*?):\s*([-+0-9.eE]+|nan|inf)\s*(?:\||$)")
_ARG = re.compile(r"^\s*(seq_length|global_batch_size)\s*\.+\s*(\d+)", re.MULTILINE)
COMPARED = ("lm loss", "load_balancing_loss", "grad norm")
TIME = "elapsed time per iteration (ms)"
CAPACITY_USE = "hybridep_capacity_use"


@dataclass
class Run:
    name: str
    values: dict[int, dict[str, str]] = field(default_factory=dict)
    tokens_per_iteration: int | None = None


def read(path: Path) -> Run:
    text = path.read_text(errors="replace")
    run = Run(path.stem.removeprefix("train-"))
    for line in text.splitlines():
        match = _ITERATION.search(line)
        if match:
            fields = {name.strip(): value for name, value in _FIELD.findall(match.group(2) + "|")}
            run.values[int(match.group(1))] = fields
    args = dict(_ARG.findall(text))
    if len(args) == 2:
        run.tokens_per_iteration = int(args["seq_length"]) * int(args["global_batch_size"])
    return run


def first_difference(run: Run, reference: Run) -> int | str | None:
    """The first iteration whose compared values differ from the reference's; None when none do."""
    for iteration in sorted(reference.values):
        if iteration not in run.values:
            return f"{iteration} (missing)"
        mine, theirs = run.values[iteration], reference.values[iteration]
        if any(mine.get(name) != theirs.get(name) for name in COMPARED if name in theirs):
            return iteration
    return None


def table(runs: list[Run]) -> str:
    reference = runs[0]
    lines = [
        f"| run | iterations | {', '.join(COMPARED)} equal to {reference.name} | ms/iteration (median after 10) "
        f"| tokens/s | {CAPACITY_USE} (mean) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        times = [float(v[TIME]) for i, v in sorted(run.values.items()) if i > 10 and TIME in v]
        ms = statistics.median(times) if times else None
        rate = run.tokens_per_iteration / ms * 1e3 if ms and run.tokens_per_iteration else None
        use = [float(v[CAPACITY_USE]) for v in run.values.values() if CAPACITY_USE in v]
        differs = first_difference(run, reference)
        same = "reference" if run is reference else ("every iteration" if differs is None else f"no: from {differs}")
        lines.append(
            f"| {run.name} | {len(run.values)} | {same} | {'-' if ms is None else f'{ms:.1f}'} "
            f"| {'-' if rate is None else f'{rate:,.0f}'} | {'-' if not use else f'{statistics.mean(use):.3f}'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    print(table([read(p) for p in paths]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
