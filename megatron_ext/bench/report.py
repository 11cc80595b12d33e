"""The bench's results across ranks: one row per mode, a table, JSON and a plot."""

from __future__ import annotations

import json
import math
import statistics
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from megatron_ext.bench.modes import BLOCKING, STOCK, STOCK_TE, Mode

_STATUS_ORDER = ("ok", "skipped", "differs", "failed")


def worst_by_tensor(errors: list[dict[str, float]]) -> dict[str, float]:
    """Each tensor's largest error over `errors` (rounds, ranks), in the order first seen."""
    worst: dict[str, float] = {}
    for by_tensor in errors:
        for name, error in by_tensor.items():
            worst[name] = max(worst.get(name, 0.0), error)
    return worst


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
    worst = max(per_rank, key=lambda r: r["max_rel_error"])  # the rank whose error the row reports
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
        equal_to_blocking=equality,  # against `checked_against` (blocking, for every mode but the fp8 ones)
        checked_against=mode.reference,
        max_rel_error=worst["max_rel_error"],
        worst_error_at=worst["worst_error_at"],
        step_rel_errors=[max(errors) for errors in zip(*(r["step_rel_errors"] for r in per_rank))],
        tensor_rel_errors=worst_by_tensor([r["tensor_rel_errors"] for r in per_rank]),
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
        routing_map_bytes_sent_per_dispatch=_mean([r.get("routing_map_bytes_sent_per_dispatch") for r in per_rank]),
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


def skipped(rows: list[dict]) -> list[tuple[list[str], str]]:
    """The skipped modes grouped by their reason, in table order: [(names, reason)]."""
    groups: dict[str, list[str]] = {}
    for r in rows:
        if r["status"] == "skipped":
            groups.setdefault(r["detail"] or "no reason given", []).append(r["name"])
    return [(names, reason) for reason, names in groups.items()]


def nothing_compared(rows: list[dict]) -> Optional[str]:
    """Why nothing was checked against the reference when no mode besides blocking ran (each one
    skipped, or none selected): a run that compared nothing proves nothing. None when one ran."""
    others = [r for r in rows if r["name"] != BLOCKING]
    if any(r["status"] != "skipped" for r in others):
        return None
    why = "; ".join(f"{', '.join(names)} skipped ({reason})" for names, reason in skipped(others))
    return f"no mode besides the reference ran: {why or 'no other mode was selected'}; nothing was compared"


# ---------------------------------------------------------------------------------- the table

WIDTH = 120  # the default table's widest line: a terminal's width
CPU_NOTE = "CPU ranks (gloo): times show the code runs, not its speed; measure on GPUs"
SHARED_GPU_NOTE = (
    "ranks sharing a GPU (gloo stages CUDA tensors through host memory): times show the code runs, not its speed"
)


def speed_note(placement) -> Optional[str]:
    """Why this run's times are no speed figures (`megatron_ext.tooling.ranks.Placement`), or None."""
    if placement.device == "cpu":
        return CPU_NOTE
    return SHARED_GPU_NOTE if placement.shares_gpus else None


EXPLAIN_HINT = "--explain: what each column means"
_BOTH, _GPU, _CPU = frozenset({"cpu", "gpu"}), frozenset({"gpu"}), frozenset({"cpu"})


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
    """'capacity min-max/rows used max' over the layers, '-' outside capacity mode."""
    capacities, used = row.get("capacities") or [], row.get("rows_used") or []
    if not capacities:
        return "-"
    span = f"{min(capacities)}" if min(capacities) == max(capacities) else f"{min(capacities)}-{max(capacities)}"
    return f"{span}/{max(used)}" if used else span


def _ran_ahead(runahead: Optional[dict]) -> str:
    if runahead is None:
        return "-"
    if runahead["ran_ahead"]:
        return "step"
    if runahead["rounds"] > 1 and runahead["rounds_ran_ahead"] > 0:
        return f"{runahead['rounds_ran_ahead']}/{runahead['rounds']} rounds"
    if runahead["dispatches_ahead"] is None:  # a graph replay: its dispatches are not seen
        return "no"
    return f"{runahead['dispatches_ahead']}/{runahead['dispatches']} disp."


def _vs_blocking(row: dict) -> str:
    if row["status"] == "failed":
        return "failed"
    if row["name"] == BLOCKING:
        return "reference"
    equal = row["equal_to_blocking"] or "-"
    if equal in ("close", "differs") and row["max_rel_error"]:
        return f"{equal} {row['max_rel_error']:.0e}"  # one digit here; the JSON has the number
    return equal


def _overflows(row: dict) -> str:
    overflows = _fmt(row["overflows"], "d")
    return f"{overflows} ({row['reruns']} re-run)" if row.get("reruns") else overflows


@dataclass(frozen=True)
class Column:
    """One column of the table.

    meaning: what `--explain` (and docs/bench.md) says of it; {steps}, {check_steps}, {rounds} and
    {clock} are filled in from the run. devices: where it has numbers ('cpu', 'gpu'). default:
    where the table shows it without --wide. keep: the higher, the later it is dropped when the
    default table would be wider than WIDTH (it stays in --wide and in the JSON).
    """

    header: str
    cell: Callable[[dict], str]
    meaning: str
    devices: frozenset = _BOTH
    default: frozenset = _BOTH
    keep: int = 0
    repeated_only: bool = False


COLUMNS = (
    Column("mode", lambda r: r["name"], "the dispatch mode; its flags are listed under 'modes' below.", keep=99),
    Column(
        "vs blocking",
        _vs_blocking,
        "outputs, input gradients and every parameter gradient of {check_steps} steps against blocking's (the "
        "reference; for the fp8 modes, against blocking+te+fp8's): 'bitwise', 'close E' (a mode that sums in "
        "another order, within the tolerance; E: the largest relative error), 'differs E' (the run fails), "
        "or 'failed'. A mode that cannot run here has no row: a line under the table names it and why. The "
        "JSON names the step and tensor of E "
        "(worst_error_at), each step's largest (step_rel_errors) and each tensor's (tensor_rel_errors).",
        keep=98,
    ),
    Column(
        "step ms",
        lambda r: _fmt(r["step_ms"], ".2f"),
        "median of {steps} timed forward+backward steps{rounds} ({clock}), slowest rank.",
        keep=97,
    ),
    Column(
        "rounds ms",
        lambda r: _spread(r["round_step_ms"]),
        "the lowest and highest round's median step ms (--repeat); the rounds run every mode in turn, so "
        "drift in the machine's speed reaches every mode.",
        keep=90,
        repeated_only=True,
    ),
    Column(
        "GPU ms",
        lambda r: _fmt(r.get("gpu_busy_ms"), ".2f"),
        "the time the GPU was busy (a kernel, copy or memset running; overlaps counted once) in one more step "
        "profiled with torch.profiler, slowest rank, lowest round; a collective's kernel counts while it waits "
        "for the other ranks.",
        devices=_GPU,
        default=frozenset(),
    ),
    Column(
        "x GPU",
        lambda r: _fmt(r.get("step_vs_gpu"), ".2f"),
        "step ms over GPU ms: near 1 the GPU sets the pace; 1.5: the GPU idles a third of the step, waiting "
        "for the host's launches or syncs.",
        devices=_GPU,
        keep=80,
    ),
    Column(
        "x stock",
        lambda r: _fmt(r["step_vs_stock"], ".2f"),
        "step ms over stock Megatron's with the same experts (megatron+te for the TE rows).",
        default=_GPU,  # on CPU a ratio of times that are no performance figures
        keep=94,
    ),
    Column(
        "disp host ms",
        lambda r: _fmt(r["dispatch_host_ms"], ".3f"),
        "host time of one forward dispatch call (MoELayer.preprocess + dispatch), median, slowest rank.",
        default=frozenset(),
    ),
    Column(
        "syncs",
        lambda r: _fmt(r["host_syncs_per_step"], "d"),
        "host reads of device values in one step, counted by megatron_ext.tooling.sync.count_host_syncs "
        "(the most any rank made).",
        keep=96,
    ),
    Column(
        "all-reduces",
        lambda r: _fmt(r["all_reduces_per_step"], "d"),
        "all-reduces launched in one step (the most any rank made).",
        default=_CPU,
        keep=70,
    ),
    Column(
        "ran ahead",
        lambda r: _ran_ahead(r["runahead"]),
        "'step' when the host enqueued a whole step while the GPU slept (megatron_ext.tooling.sync."
        "runahead_probe); 'N/M rounds': it did so in N of M rounds; else how many of the step's forward "
        "dispatches it got past before the GPU woke ('N/M disp.'; 'no' for a graph replay, whose dispatches "
        "are not seen). CUDA's launch queue holds about 1,000 kernels: a step that launches more stops the "
        "host when the queue is full, sync or not; a blocking dispatch stops it at the first layer.",
        devices=_GPU,
        keep=85,
    ),
    Column(
        "peak mem",
        lambda r: _bytes(r["peak_step_memory_bytes"]),
        "the largest rank's peak allocation during a step, above its start with the last step's gradients "
        "freed (activations, this step's gradients, transients).",
        devices=_GPU,
        keep=60,
    ),
    Column(
        "fwd held",
        lambda r: _bytes(r.get("forward_memory_bytes")),
        "what the forward left allocated for the backward (largest rank).",
        devices=_GPU,
        default=frozenset(),
    ),
    Column(
        "cap/used",
        _capacity,
        "capacity-mode rows per dispatch (min-max over the layers) / the most rows any dispatch filled (max "
        "over layers, steps and ranks): the padding paid for is the difference ('-': not capacity mode).",
        default=_CPU,
        keep=65,
    ),
    Column(
        "map alloc",
        lambda r: _bytes(r["routing_map_bytes_allocated_per_step"]),
        "routing-map all-gather bytes allocated per step and rank ('-': no such gather, or not visible).",
        default=_CPU,
        keep=62,
    ),
    Column(
        "map sent",
        lambda r: _bytes(r.get("routing_map_bytes_sent_per_dispatch")),
        "routing-map bytes a rank's all-gather sends other ranks per dispatch: (W-1) x T x E Booleans, or with "
        "compact routing (W-1) x T x top-k int16 indices, E / (2 top-k) times fewer ('-': no such gather, or "
        "not visible).",
        default=frozenset(),
    ),
    Column(
        "sent/disp",
        lambda r: _bytes(r["bytes_sent_per_dispatch"]),
        "bytes a rank hands collectives for other ranks in one forward dispatch ('-': not visible).",
        default=frozenset(),
    ),
    Column(
        "overflows",
        _overflows,
        "non-blocking dispatches that needed more rows than their capacity, over the layers and ranks ('-': "
        "not capacity mode); '(N re-run)': steps the overflow re-run policy ran again, blocking.",
        keep=50,
    ),
)


def _device(cuda: bool) -> str:
    return "gpu" if cuda else "cpu"


def _present(rows: list[dict], cuda: bool) -> list[Column]:
    """Every column that has numbers in this run (the --wide table)."""
    repeated = any(len(r.get("round_step_ms") or []) > 1 for r in rows)
    return [c for c in COLUMNS if _device(cuda) in c.devices and (repeated or not c.repeated_only)]


def _render(rows: list[dict], columns: list[Column]) -> list[str]:
    """The table's lines: a row per mode that ran (the skipped ones are named under it, with why)."""
    header = [c.header for c in columns]
    lines = [[c.cell(r) for c in columns] for r in rows if r["status"] != "skipped"]
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(columns))]
    render = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
        for row in [header, *lines]
    ]
    render.insert(1, "  ".join("-" * w for w in widths))
    return render


def columns(rows: list[dict], cuda: bool, wide: bool = False, width: int = WIDTH) -> list[Column]:
    """The table's columns: with `wide` every one with numbers; else the default ones, those kept
    least dropped one by one while the table would be wider than `width`."""
    present = _present(rows, cuda)
    if wide:
        return present
    shown = [c for c in present if _device(cuda) in c.default]
    while len(shown) > 2 and max(len(line) for line in _render(rows, shown)) > width:
        shown.remove(min(shown[2:], key=lambda c: c.keep))  # mode and vs blocking stay
    return shown


def table(rows: list[dict], cuda: bool, wide: bool = False, width: int = WIDTH) -> str:
    """The table of the modes that ran: the default columns no wider than `width` (a terminal);
    `wide` adds the rest (the JSON has every number, and every mode, either way)."""
    return "\n".join(_render(rows, columns(rows, cuda, wide, width)))


def skipped_lines(rows: list[dict], width: int = WIDTH) -> list[str]:
    """'skipped: names (reason)' per reason, wrapped to `width`."""
    return [
        line
        for names, reason in skipped(rows)
        for line in _wrap(f"skipped: {', '.join(names)} ({reason})", width, indent="    ")
    ]


def hint(rows: list[dict], cuda: bool, wide: bool = False, width: int = WIDTH) -> str:
    """The lines under the table in place of the legend: what --wide adds, and --explain."""
    shown = columns(rows, cuda, wide, width)
    more = [c.header for c in _present(rows, cuda) if c not in shown]
    if not more:
        return EXPLAIN_HINT
    line = f"--wide adds {', '.join(more)} (the JSON has every number)"
    if len(line) > width:
        line = f"--wide adds {len(more)} columns (the JSON has every number)"
    return f"{line}\n{EXPLAIN_HINT}"


def _wrap(text: str, width: int, indent: str = "  ") -> list[str]:
    # Mode names and flags stay whole (no breaks at '-' or inside a word).
    return textwrap.wrap(text, width, subsequent_indent=indent, break_on_hyphens=False, break_long_words=False) or [""]


def legend(rows: list[dict], cuda: bool, sizes, width: int = WIDTH) -> str:
    """What each column means (`--explain`; docs/bench.md has the same), then every mode's flags."""
    filled = dict(
        steps=sizes.steps,
        check_steps=sizes.check_steps,
        rounds=f" in each of {sizes.repeat} rounds" if sizes.repeat > 1 else "",
        clock="CUDA events" if cuda else "the host clock",
    )
    default = columns(rows, cuda)
    lines = ["columns (those marked --wide: with --wide only; the JSON has every number):"]
    for c in _present(rows, cuda):
        wide_only = "" if c in default else " (--wide)"
        lines += _wrap(f"  {c.header}{wide_only}: {c.meaning.format(**filled)}", width, indent="      ")
    if not cuda:
        lines += _wrap(
            "On CPU the ranks share a few cores, so times say little about a GPU; the counts (syncs, all-reduces, "
            "bytes, allocations) and the checks carry over.",
            width,
        )
    if any(r.get("graph") and r["status"] not in ("skipped", "failed") for r in rows):
        lines += _wrap(
            "+graph: every step after the capture is one replay of a CUDA graph, which runs no Python: what is "
            "counted at Python calls (disp host ms, all-reduces, bytes, map alloc, map sent) reads '-', syncs counts "
            "the replay's (none can happen), and peak mem is the capture's (the graph's pool keeps it).",
            width,
        )
    lines.append("modes:")
    for r in rows:
        lines += _wrap(f"  {r['name']}: {r['summary']}", width, indent="      ")
        lines += _wrap("      " + " ".join(r["flags"]), width, indent="      ")
        if r["detail"]:
            lines += _wrap("      " + r["detail"], width, indent="      ")
    return "\n".join(lines)


def write_json(path: str, report: dict) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


def plot_figure(rows: list[dict], title: str, note: Optional[str] = None):
    """The plot's figure: step time and host syncs per step, one bar per mode that ran; `note`
    (CPU_NOTE on CPU ranks) under the title. The caller closes it."""
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if r["status"] != "skipped" and r["step_ms"] is not None]
    names = [r["name"] for r in ran]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.5 * len(ran) + 2.4), sharey=True)
    steps = left.barh(names, [r["step_ms"] for r in ran], color="tab:blue")
    left.bar_label(steps, fmt="%.2f", padding=2, fontsize=8)
    left.set_xlabel("step time, ms (median)")
    syncs = right.barh(names, [r["host_syncs_per_step"] or 0 for r in ran], color="tab:red")
    right.bar_label(syncs, fmt="%d", padding=2, fontsize=8)
    right.set_xlabel("host synchronisations per step")
    left.invert_yaxis()
    fig.suptitle(title if note is None else f"{title}\n{note}", fontsize=9)
    fig.tight_layout()
    return fig


def write_plot(path: str, rows: list[dict], title: str, note: Optional[str] = None) -> None:
    """A PNG of `plot_figure`."""
    import matplotlib.pyplot as plt

    fig = plot_figure(rows, title, note)
    fig.savefig(path, dpi=120)
    plt.close(fig)
