"""The bench's results across ranks: one row per mode, a table, JSON and a plot."""

from __future__ import annotations

import json
import math
import statistics
from typing import Any, Optional

from megatron_ext.bench.modes import BLOCKING, STOCK, STOCK_TE, Mode

_STATUS_ORDER = ("ok", "skipped", "differs", "failed")


def _median(values: list[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def _worst(values: list[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _mean(values: list[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def aggregate(mode: Mode, per_rank: list[dict]) -> dict[str, Any]:
    """One mode's row from every rank's `ModeResult.to_dict()`.

    Times are the slowest rank's median (the step waits for it), syncs and all-reduces the most
    any rank made, bytes the mean per rank, memory the largest rank's peak.
    """
    status = max((r["status"] for r in per_rank), key=_STATUS_ORDER.index)
    detail = next((r["detail"] for r in per_rank if r["status"] == status and r["detail"]), "")
    equalities = {r["equality"] for r in per_rank}
    equality = next((e for e in ("differs", "close", "bitwise") if e in equalities), "")
    runaheads = [r["runahead"] for r in per_rank if r["runahead"]]
    first = per_rank[0]
    rounds = [max(times) for times in zip(*(r["round_step_ms"] for r in per_rank))]  # slowest rank per round
    probed_rounds = len(first["ran_ahead_rounds"])
    rounds_ran_ahead = min(sum(r["ran_ahead_rounds"]) for r in per_rank)  # on every rank
    # None where no dispatch is seen from Python (a graph replay).
    ahead = [d for r in per_rank for d in r["dispatches_ahead_rounds"] if d is not None]
    return dict(
        name=mode.name,
        summary=mode.summary,
        experts=mode.experts,
        graph=mode.graph,
        flags=list(mode.flags),
        status=status,
        detail=detail,
        equal_to_blocking=equality,
        max_rel_error=max(r["max_rel_error"] for r in per_rank),
        step_ms=_worst([_median(r["step_ms"]) for r in per_rank]),
        round_step_ms=rounds,
        host_step_ms=_worst([_median(r["host_step_ms"]) for r in per_rank]),
        gpu_busy_ms=_worst([r.get("gpu_busy_ms") for r in per_rank]),
        dispatch_host_ms=_worst([_median(r["dispatch_host_ms"]) for r in per_rank]),
        host_syncs_per_step=_worst([r["host_syncs_per_step"] for r in per_rank]),
        sync_examples=first["sync_examples"],
        all_reduces_per_step=_worst([r["all_reduces_per_step"] for r in per_rank]),
        bytes_sent_per_step=_mean([r["bytes_sent_per_step"] for r in per_rank]),
        bytes_sent_per_dispatch=_mean([r["bytes_sent_per_dispatch"] for r in per_rank]),
        routing_map_bytes_allocated_per_step=_mean([r["routing_map_bytes_allocated_per_step"] for r in per_rank]),
        peak_step_memory_bytes=_worst([r["peak_step_memory_bytes"] for r in per_rank]),
        forward_memory_bytes=_worst([r.get("forward_memory_bytes") for r in per_rank]),
        blocking_dispatches_per_step=first["blocking_dispatches_per_step"],
        non_blocking_dispatches_per_step=first["non_blocking_dispatches_per_step"],
        capacities=first["capacities"],
        rows_used=[max(used) for used in zip(*(r.get("rows_used") or [] for r in per_rank))],
        overflows=None if first["overflows"] is None else sum(r["overflows"] or 0 for r in per_rank),
        reruns=first.get("reruns"),  # decided by one all-reduce: the same on every rank
        resizes=first.get("resizes"),
        runahead=None
        if not runaheads
        else dict(
            ran_ahead=rounds_ran_ahead == probed_rounds,
            rounds_ran_ahead=rounds_ran_ahead,
            rounds=probed_rounds,
            dispatches_ahead=min(ahead) if ahead else None,
            dispatches=runaheads[0]["dispatches"],
            host_idle_ms=max(r["host_idle_ms"] for r in runaheads),
            host_behind_sleep_ms=max(r["host_behind_sleep_ms"] for r in runaheads),
            gpu_sleep_ms=min(r["gpu_sleep_ms"] for r in runaheads),
        ),
        per_rank=per_rank,
    )


def add_ratios(rows: list[dict]) -> None:
    """`step_vs_stock`: each mode's step time over stock Megatron's with the same family of experts
    (`megatron` for megatron-ext's GroupedMLP, `megatron+te` for TE's); None without that row.
    `step_vs_gpu`: the step time over the GPU's busy time in a step (None without both): near 1 the
    GPU sets the pace; above it the GPU idles for that share of the step, waiting on the host."""
    stock = {r["experts"]: r["step_ms"] for r in rows if r["name"] in (STOCK, STOCK_TE) and r["step_ms"]}
    for row in rows:
        family = "grouped" if row["experts"] == "grouped" else "te"
        row["step_vs_stock"] = row["step_ms"] / stock[family] if stock.get(family) and row["step_ms"] else None
        busy = row.get("gpu_busy_ms")
        row["step_vs_gpu"] = row["step_ms"] / busy if busy and row["step_ms"] else None


def failures(rows: list[dict]) -> list[str]:
    return [f"{r['name']}: {r['status']}: {r['detail']}" for r in rows if r["status"] in ("differs", "failed")]


def _fmt(value, spec: str, none: str = "-") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return none
    return format(value, spec)


def _bytes(value: Optional[float]) -> str:
    if value is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def _spread(rounds: list[float]) -> str:
    return f"{min(rounds):.2f}-{max(rounds):.2f}" if len(rounds) > 1 else "-"


def _capacity(row: dict) -> str:
    """'capacity min-max / rows used max' over the layers, '-' outside capacity mode."""
    capacities, used = row.get("capacities") or [], row.get("rows_used") or []
    if not capacities:
        return "-"
    span = f"{min(capacities)}" if min(capacities) == max(capacities) else f"{min(capacities)}-{max(capacities)}"
    return f"{span} / {max(used)}" if used else span


def _ran_ahead(runahead: Optional[dict]) -> str:
    if runahead is None:
        return "-"
    if runahead["ran_ahead"]:
        return "step"
    if runahead["rounds"] > 1 and runahead["rounds_ran_ahead"] > 0:
        return f"step in {runahead['rounds_ran_ahead']}/{runahead['rounds']} rounds"
    if runahead["dispatches_ahead"] is None:  # a graph replay: its dispatches are not seen
        return "no"
    return f"{runahead['dispatches_ahead']}/{runahead['dispatches']} disp."


def table(rows: list[dict], cuda: bool, wide: bool = False) -> str:
    """The table; `wide` adds the columns the default leaves to the JSON (held after fwd, sent/dispatch),
    so that the GPU columns (GPU ms, step/GPU) fit in the width the table had before them."""
    repeated = any(len(r.get("round_step_ms") or []) > 1 for r in rows)
    header = ["mode", "vs blocking", "step ms"] + (["round medians"] if repeated else [])
    header += ["GPU ms", "step/GPU"] if cuda else []
    header += ["x stock", "dispatch host ms", "syncs/step", "all-reduces/step"]
    if cuda:
        header += ["ran ahead", "peak step mem"] + (["held after fwd"] if wide else [])
    header += ["capacity / used", "map alloc/step"] + (["sent/dispatch"] if wide else []) + ["overflows"]
    lines = []
    for r in rows:
        if r["status"] == "skipped":
            lines.append([r["name"], "skipped"] + [""] * (len(header) - 2))
            continue
        if r["status"] == "failed":
            equal = "failed"
        elif r["name"] == BLOCKING:
            equal = "reference"
        else:
            equal = r["equal_to_blocking"]
        if equal not in ("bitwise", "reference", "failed") and r["max_rel_error"]:
            equal = f"{equal} ({r['max_rel_error']:.1e})"
        cells = [
            r["name"],
            equal,
            _fmt(r["step_ms"], ".2f"),
            *([_spread(r["round_step_ms"])] if repeated else []),
            *([_fmt(r.get("gpu_busy_ms"), ".2f"), _fmt(r.get("step_vs_gpu"), ".2f")] if cuda else []),
            _fmt(r["step_vs_stock"], ".2f"),
            _fmt(r["dispatch_host_ms"], ".3f"),
            _fmt(r["host_syncs_per_step"], "d"),
            _fmt(r["all_reduces_per_step"], "d"),
        ]
        if cuda:
            cells.append(_ran_ahead(r["runahead"]))
            cells.append(_bytes(r["peak_step_memory_bytes"]))
            if wide:
                cells.append(_bytes(r.get("forward_memory_bytes")))
        cells.append(_capacity(r))
        cells.append(_bytes(r["routing_map_bytes_allocated_per_step"]))
        if wide:
            cells.append(_bytes(r["bytes_sent_per_dispatch"]))
        overflows = _fmt(r["overflows"], "d")
        if r.get("reruns"):
            overflows += f" ({r['reruns']} re-run)"
        cells += [overflows]
        lines.append(cells)
    widths = [max(len(str(row[i])) for row in [header, *lines]) for i in range(len(header))]
    render = [
        "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in [header, *lines]
    ]
    render.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(render)


def legend(rows: list[dict], cuda: bool, sizes, wide: bool = False) -> str:
    clock = "CUDA events" if cuda else "the host clock"
    rounds = f" in each of {sizes.repeat} rounds" if sizes.repeat > 1 else ""
    lines = [
        f"step ms: median of {sizes.steps} timed forward+backward steps{rounds} ({clock}), slowest rank; x stock: "
        "over stock Megatron's with the same experts (megatron+te for the TE rows).",
    ]
    if cuda:
        lines.append(
            "GPU ms: the time the GPU was busy (a kernel, copy or memset running; overlaps counted once) in one more "
            "step profiled with torch.profiler, slowest rank, lowest round; a collective's kernel counts while it "
            "waits for the other ranks. step/GPU: step ms over it: near 1 the GPU sets the pace; 1.5: the GPU "
            "idles a third of the step, waiting for the host's launches or syncs."
        )
    lines += [
        "dispatch host ms: host time of one forward dispatch call (MoELayer.preprocess + dispatch), median, slowest "
        "rank.",
        "syncs/step: host reads of device values in one step, counted by megatron_ext.tooling.sync.count_host_syncs.",
    ]
    if not cuda:
        lines.append(
            "On CPU the ranks share a few cores, so times say little about a GPU; the counts (syncs, all-reduces, "
            "bytes, allocations) and the checks carry over."
        )
    if sizes.repeat > 1:
        lines.append(
            "round medians: the lowest and highest round's median; the rounds run every mode in turn, so drift in "
            "the machine's speed reaches every mode."
        )
    if cuda:
        lines.append(
            "ran ahead: 'step' when the host enqueued a whole step while the GPU slept (megatron_ext.tooling.sync."
            "runahead_probe); else how many of the step's forward dispatches it got past before the GPU woke. CUDA's "
            "launch queue holds about 1,000 kernels: a step that launches more stops the host when the queue is "
            "full, sync or not; a blocking dispatch stops it at the first layer."
        )
        lines.append(
            "peak step mem: the largest rank's peak allocation during a step, above its start with the last "
            "step's gradients freed (activations, this step's gradients, transients)"
            + ("; held after fwd: what the forward left allocated for the backward." if wide else ".")
        )
    lines.append(
        "capacity / used: capacity-mode rows per dispatch (min-max over the layers) / the most rows any "
        "dispatch filled (max over layers, steps and ranks): the padding paid for is the difference."
    )
    lines.append(
        "map alloc/step: routing-map all-gather bytes allocated per step and rank ('-': no such gather, or not "
        "visible)."
    )
    if wide:
        lines.append(
            "sent/dispatch: bytes a rank hands collectives for other ranks in one forward dispatch ('-': not visible)."
        )
    else:
        lines.append(f"--wide adds {'held after fwd and ' if cuda else ''}sent/dispatch (the JSON always has them).")
    if any(r.get("graph") and r["status"] not in ("skipped", "failed") for r in rows):
        lines.append(
            "+graph: every step after the capture is one replay of a CUDA graph, which runs no Python: what is "
            "counted at Python calls (dispatch host ms, all-reduces, bytes, map alloc) reads '-', syncs/step counts "
            "the replay's (none can happen), and peak step mem is the capture's (the graph's pool keeps it)."
        )
    lines.append("modes:")
    for r in rows:
        lines.append(f"  {r['name']}: {r['summary']}")
        lines.append("      " + " ".join(r["flags"]))
        if r["detail"]:
            lines.append("      " + r["detail"])
    return "\n".join(lines)


def write_json(path: str, report: dict) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


def write_plot(path: str, rows: list[dict], title: str) -> None:
    """A PNG: step time and host syncs per step, one bar per mode that ran."""
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if r["status"] != "skipped" and r["step_ms"] is not None]
    names = [r["name"] for r in ran]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.5 * len(ran) + 2), sharey=True)
    steps = left.barh(names, [r["step_ms"] for r in ran], color="tab:blue")
    left.bar_label(steps, fmt="%.2f", padding=2, fontsize=8)
    left.set_xlabel("step time, ms (median)")
    syncs = right.barh(names, [r["host_syncs_per_step"] or 0 for r in ran], color="tab:red")
    right.bar_label(syncs, fmt="%d", padding=2, fontsize=8)
    right.set_xlabel("host synchronisations per step")
    left.invert_yaxis()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
