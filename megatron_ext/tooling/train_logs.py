"""Megatron training logs read and compared iteration by iteration.

    python -m megatron_ext.tooling.train_logs blocking.log capacity.log graphed.log

Prints a markdown table: per log, the iterations logged, whether the lm loss, load-balancing loss
and grad norm equal the first log's at every iteration (as printed), else the first difference
and how far the lm loss strayed (the mean and largest distance over the iterations both
logged, and the means of the last 10 of them, the run's against the first log's), the median
time per iteration after the first 10 and the first iteration's time (the compile and calibration
work a run pays once: `--moe-hybridep-warm-up` moves some of it before the loop),
tokens/s/GPU from Megatron's argument listing,
the means of megatron-ext's capacity-use metrics (over ranks, and the largest rank's), and the
steps re-run after an overflow and the capacity growths megatron-ext logged.
`examples/compare_modes.py` (blocking against capacity mode) reads its logs with the same
functions.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

COMPARED = ("lm loss", "load_balancing_loss", "grad norm")  # as printed by Megatron's training log
CAPACITY_USE = "hybridep_capacity_use"
CAPACITY_USE_MAX = "hybridep_capacity_use_max"
SKIP_ITERS = 10
STEP_MS = "elapsed time per iteration (ms)"
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|")
FIELD = re.compile(r"\|\s*([^|:]+?):\s*([^|]+?)\s*(?=\|)")
RERUN = re.compile(r"run again with blocking dispatches \(re-run (\d+)\)")
GROWTH = re.compile(r"megatron-ext: (MoE layer \d+): capacity (\d+) -> (\d+) \(")
ARGUMENT = re.compile(r"^\s+(\w+) \.+ (\S+)\s*$", re.MULTILINE)  # a line of Megatron's argument listing


def arguments(text: str) -> dict[str, str]:
    """{name: value as printed} of Megatron's argument listing (values without spaces), if printed."""
    return dict(ARGUMENT.findall(text))


def tokens_per_step_and_gpus(text: str) -> tuple[int, int] | None:
    """(global batch x sequence length, world size) from Megatron's argument listing, if printed."""
    found = {k: int(v) for k, v in arguments(text).items() if v.isdigit()}
    if {"seq_length", "global_batch_size", "world_size"} <= found.keys():
        return found["seq_length"] * found["global_batch_size"], found["world_size"]
    return None


def profiled_from(text: str) -> tuple[bool, int | None]:
    """From Megatron's argument listing: (whether it lists the profiler's arguments, the first
    profiled iteration or None where `--profile` is off). (False, None) for a log without them."""
    found = arguments(text)
    if "profile" not in found:
        return False, None
    if found["profile"] != "True":
        return True, None
    return True, int(found["profile_step_start"]) if found.get("profile_step_start", "").isdigit() else None


def parse_log(text: str) -> dict[int, dict[str, str]]:
    """{iteration: {field: value as printed}} from Megatron's per-iteration log lines."""
    iterations = {}
    for line in text.splitlines():
        found = ITERATION.search(line)
        if found:
            fields = {name.strip(): value for name, value in FIELD.findall(line[found.start() :])}
            iterations[int(found.group(1))] = fields
    return iterations


def step_ms(iterations: dict[int, dict[str, str]], skip: int, stop: int | None = None) -> list[float]:
    """Megatron's elapsed time per iteration (ms), for the iterations after `skip` (and before `stop`)."""
    return [
        float(f[STEP_MS])
        for i, f in sorted(iterations.items())
        if i > skip and (stop is None or i < stop) and STEP_MS in f
    ]


def reruns_and_growths(text: str) -> tuple[int, int]:
    """(steps re-run after an overflow, capacity growths) that megatron-ext logged (first rank's
    lines; a growth logged once per EP group)."""
    return len(set(RERUN.findall(text))), len(set(GROWTH.findall(text)))


def first_difference(reference: dict, other: dict) -> str | None:
    """The first logged iteration and value (of `COMPARED`) where `other` differs, among the
    iterations both logged; else, if they logged different iterations, how (a run stopped early is
    no match, but says how far it agreed); None if identical. Two runs that logged nothing are not
    called identical."""
    if not other:
        return "no iterations logged (see the run's log for why)"
    if not reference:
        return "the reference logged no iterations"
    common = sorted(reference.keys() & other.keys())
    iteration = first_differing_iteration(reference, other)
    if iteration is not None:
        name = next(n for n in COMPARED if reference[iteration].get(n) != other[iteration].get(n))
        return f"iteration {iteration}: {name} {reference[iteration].get(name)} against {other[iteration].get(name)}"
    if sorted(reference) != sorted(other):
        return (
            f"logged iterations differ: {len(reference)} against {len(other)} "
            f"(the same at the {len(common)} both logged)"
        )
    return None


def relative_deviation(reference: dict, other: dict) -> dict[str, float | None]:
    """The largest |other - reference| / |reference| of the lm loss and of the grad norm over the
    iterations both logged ({"lm loss": ..., "grad norm": ...}; None where they share no value):
    how far a run on other kernels strays from the reference, as one number each."""
    deviation: dict[str, float | None] = {}
    for key in (COMPARED[0], COMPARED[2]):
        gaps = [
            abs(float(other[i][key]) - float(reference[i][key])) / max(abs(float(reference[i][key])), 1e-30)
            for i in sorted(reference.keys() & other.keys())
            if key in reference[i] and key in other[i]
        ]
        deviation[key] = max(gaps) if gaps else None
    return deviation


def first_differing_iteration(reference: dict, other: dict) -> int | None:
    """The first iteration both logged where a value of `COMPARED` differs, or None."""
    for iteration in sorted(reference.keys() & other.keys()):
        if any(reference[iteration].get(name) != other[iteration].get(name) for name in COMPARED):
            return iteration
    return None


def loss_distance(reference: dict, other: dict, last: int = 10) -> str | None:
    """How far `other`'s lm loss is from `reference`'s over the iterations both logged: the mean and
    the largest distance, and the means of the last `last` of those iterations (other's, then
    reference's); None when they share no iteration with a loss."""
    key = COMPARED[0]
    common = [i for i in sorted(reference.keys() & other.keys()) if key in reference[i] and key in other[i]]
    if not common:
        return None
    ours, theirs = ([float(log[i][key]) for i in common] for log in (other, reference))
    gaps = [abs(a - b) for a, b in zip(ours, theirs)]
    tail = min(last, len(common))
    return (
        f"{key} apart by {statistics.mean(gaps):.4f} on average, {max(gaps):.4f} at most; last {tail} iterations' "
        f"mean {statistics.mean(ours[-tail:]):.4f} against {statistics.mean(theirs[-tail:]):.4f}"
    )


def table(logs: dict[str, str]) -> str:
    """The markdown table of `logs` ({name: log text}), each compared with the first."""
    parsed = {name: parse_log(text) for name, text in logs.items()}
    reference_name, reference = next(iter(parsed.items()))
    lines = [
        f"| run | iterations | {', '.join(COMPARED)} against {reference_name} | ms/iteration (median after "
        f"{SKIP_ITERS}) | first iteration ms | tokens/s/GPU | {CAPACITY_USE} (mean) | {CAPACITY_USE_MAX} (mean) "
        "| re-runs | capacity growths |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, iterations in parsed.items():
        times = step_ms(iterations, SKIP_ITERS)
        ms = statistics.median(times) if times else None
        first = iterations[min(iterations)].get(STEP_MS, "-") if iterations else "-"
        shape = tokens_per_step_and_gpus(logs[name])
        rate = f"{shape[0] / (ms / 1e3) / shape[1]:,.0f}" if ms and shape else "-"
        uses = [[float(v[key]) for v in iterations.values() if key in v] for key in (CAPACITY_USE, CAPACITY_USE_MAX)]
        diff = first_difference(reference, iterations)
        if name == reference_name:
            same = "reference"
        elif diff is None:
            same = "identical"
        else:
            distance = loss_distance(reference, iterations)
            same = f"differs: {diff}" + (f" ({distance})" if distance else "")
        reruns, growths = reruns_and_growths(logs[name])
        lines.append(
            f"| {name} | {len(iterations)} | {same} | {'-' if ms is None else f'{ms:.1f}'} | {first} | {rate} "
            + "".join(f"| {f'{statistics.mean(use):.3f}' if use else '-'} " for use in uses)
            + f"| {reruns} | {growths} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_ext.tooling.train_logs",
        description="Megatron training logs compared iteration by iteration with the first one (a markdown table).",
    )
    parser.add_argument("logs", nargs="+", type=Path, metavar="LOG", help="a training log; the first is the reference")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.logs if not p.is_file()]
    if missing:
        parser.error(f"no such log: {', '.join(missing)}")
    print(table({p.stem.removeprefix("train-"): p.read_text(errors="replace") for p in args.logs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
