"""megatron-ext-bench: its JSON at tiny sizes on spawned gloo ranks, its failures, its arguments and counters.

The full run checks the numbers the bench reports against what they must be, computed here
independently: host syncs and all-reduces per step from what each mode is documented to do, the
bytes of a non-blocking dispatch from the all-gather design, and the routing-map allocations
from the map's shape.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from megatron_ext.tooling.ranks import Placement
from tests.distributed import python_module, run_ranks

WORLD, LAYERS, TOKENS, HIDDEN, EXPERTS, TOPK, STEPS, ROUNDS = 2, 2, 64, 32, 8, 2, 2, 2  # E / (2 top-k) = 2
TINY = [
    "--layers", str(LAYERS), "--tokens", str(TOKENS), "--hidden", str(HIDDEN), "--ffn-hidden", "32",
    "--experts", str(EXPERTS), "--topk", str(TOPK), "--steps", str(STEPS), "--warmup", "0", "--no-progress",
]  # fmt: skip
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUR_MODES = (
    "blocking",
    "capacity+pad",
    "capacity+equal",
    "capacity+equal+check",
    "capacity+equal+reuse",
    "capacity+equal+rerun",
    "blocking+compact",
    "capacity+equal+reuse+compact",
)
DEEP_EP_MODES = ("deep_ep", "deep_ep+capacity+equal+reuse", "deep_ep+capacity+equal+reuse+rerun")
GRAPH_MODES = (  # GPU only: skipped here
    "capacity+equal+graph",
    "deep_ep+capacity+equal+reuse+graph",
    "capacity+equal+te+graph",
    "capacity+equal+static+te+graph",
)
HAS_DEEP_EP = importlib.util.find_spec("deep_ep") is not None


def _bench(*args, env=None, timeout=600):
    """The bench's command line; it spawns at most WORLD ranks (every call here runs 2)."""
    return python_module("megatron_ext.bench", *args, timeout=timeout, env=env, heavy=WORLD)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    outputs = ["--json", str(out / "b.json"), "--plot", str(out / "b.png")]
    # --size small with every size flag given: the flags win, and the JSON names the size.
    result = _bench("--size", "small", *TINY, "--world-size", str(WORLD), "--repeat", str(ROUNDS), *outputs)
    assert result.returncode == 0, result.stdout + result.stderr
    with open(out / "b.json") as f:
        report = json.load(f)
    return result.stdout, report, out / "b.png"


def _mode(report, name):
    return next(m for m in report["modes"] if m["name"] == name)


def test_every_mode_runs_and_equals_blocking(full_run):
    stdout, report, _ = full_run
    assert report["ok"] and report["failures"] == []
    assert report["world_size"] == WORLD and report["sizes"]["tokens"] == TOKENS
    assert report["sizes"]["size"] == "small" and report["sizes"]["layers"] == LAYERS
    assert f"size small: {LAYERS} MoE layers" in stdout
    names = [m["name"] for m in report["modes"]]
    te_modes = ["megatron+te", "blocking+te", "capacity+equal+te", GRAPH_MODES[2], "capacity+equal+static+te"]
    te_modes.append(GRAPH_MODES[3])
    ours = [*OUR_MODES[:3], GRAPH_MODES[0], *OUR_MODES[3:]]  # each +graph mode right after its eager twin
    deep_ep = [*DEEP_EP_MODES[:2], GRAPH_MODES[1], DEEP_EP_MODES[2]]
    assert names == ["megatron", *ours, *deep_ep, *te_modes]
    for name in OUR_MODES:
        assert _mode(report, name)["equal_to_blocking"] == "bitwise", name
        assert _mode(report, name)["status"] == "ok", name
    assert _mode(report, "megatron")["equal_to_blocking"] in ("bitwise", "close")
    if not HAS_DEEP_EP:
        for name in DEEP_EP_MODES:
            assert _mode(report, name)["status"] == "skipped" and "deep_ep" in _mode(report, name)["detail"]
    for name in [*te_modes[:3], te_modes[4]]:  # CPU ranks: TE's experts need a GPU
        assert _mode(report, name)["status"] == "skipped" and "CUDA GPU" in _mode(report, name)["detail"]
    for name in GRAPH_MODES:  # CPU ranks: skipped for the device, whatever is installed
        assert _mode(report, name)["status"] == "skipped", name
        assert _mode(report, name)["detail"] == "CUDA graphs need a GPU", name
        assert _mode(report, name)["graph"] is True and _mode(report, name)["gpu_busy_ms"] is None
    assert all(m["gpu_busy_ms"] is None and m["step_vs_gpu"] is None for m in report["modes"])  # CPU: no GPU time
    lines = stdout.splitlines()
    header = next(line for line in lines if line.startswith("mode "))
    assert "GPU ms" not in header and "x GPU" not in header and "ran ahead" not in header  # CPU: no GPU columns
    assert "sent/disp" not in header and "map alloc" in header and "rounds ms" in header  # sent/disp: --wide only
    # CPU ranks: said right above the table, that its times are no performance figures.
    assert (
        lines[lines.index(header) - 1] == "CPU ranks (gloo): times show the code runs, not its speed; measure on GPUs"
    )
    for name in names:
        assert name in stdout
    # (the line wraps at the terminal's width: compared with its whitespace collapsed)
    assert f"skipped: {', '.join(GRAPH_MODES)} (CUDA graphs need a GPU)" in " ".join(stdout.split())
    # The legend only with --explain; a one-line hint instead.
    assert "--explain: what each column means" in stdout and "modes:" not in lines and "columns (" not in stdout
    assert "OK: outputs and gradients equal blocking's" in stdout


def test_the_printed_table_has_a_row_per_mode_that_ran_and_a_line_per_reason_for_the_rest(full_run):
    stdout, report, _ = full_run
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("mode "))
    end = next(i for i in range(start, len(lines)) if not lines[i].strip() or lines[i].startswith("skipped: "))
    rows = _parse_table("\n".join(lines[start:end]))
    skipped = [m["name"] for m in report["modes"] if m["status"] == "skipped"]
    assert skipped and set(GRAPH_MODES) <= set(skipped)  # CPU ranks: the JSON keeps every mode
    assert list(rows) == [m["name"] for m in report["modes"] if m["status"] != "skipped"]
    assert not any("skipped" in row.values() for row in rows.values())
    reasons = " ".join(" ".join(lines[end:]).split()).split("skipped: ")[1:]  # lines wrap: whitespace collapsed
    assert len(reasons) == len({m["detail"] for m in report["modes"] if m["status"] == "skipped"})
    named = [name for line in reasons for name in line.split(" (", 1)[0].split(", ")]
    assert sorted(named) == sorted(skipped)  # each skipped mode named once, beside its reason


def test_the_printed_report_fits_120_columns(full_run):
    stdout, _, _ = full_run
    widest = max(stdout.splitlines(), key=len)
    assert len(widest) <= 120, widest


def test_host_syncs_and_all_reduces_per_step(full_run):
    _, report, _ = full_run
    syncs = {m["name"]: m["host_syncs_per_step"] for m in report["modes"]}
    reduces = {m["name"]: m["all_reduces_per_step"] for m in report["modes"]}
    assert syncs["blocking"] == LAYERS  # one count read per forward dispatch; its backward reads nothing
    assert syncs["capacity+pad"] == LAYERS and reduces["capacity+pad"] == LAYERS  # Megatron's pad: max + read
    for name in ("capacity+equal", "capacity+equal+check", "capacity+equal+reuse", "capacity+equal+reuse+compact"):
        assert syncs[name] == 0, (name, _mode(report, name)["sync_examples"])
    assert syncs["blocking+compact"] == LAYERS
    assert reduces["capacity+equal"] == 0 and reduces["capacity+equal+reuse"] == 0
    assert reduces["capacity+equal+check"] == LAYERS
    # The overflow re-run policy: one all-reduce and one host read per step, at its end; none per layer.
    assert syncs["capacity+equal+rerun"] == 1 and reduces["capacity+equal+rerun"] == 1
    assert syncs["megatron"] > 0


def test_the_modes_declared_host_free_are_those_whose_step_reads_nothing(full_run):
    """The mode table's `host_free` (what the GPU tests expect of each mode) against the syncs
    counted in every mode that ran here."""
    from megatron_ext.bench.modes import all_modes

    _, report, _ = full_run
    declared = {m.name: m.host_free for m in all_modes(1.5)}
    ran = [m for m in report["modes"] if m["status"] == "ok"]
    assert set(OUR_MODES) <= {m["name"] for m in ran}
    for mode in ran:
        assert (mode["host_syncs_per_step"] == 0) is declared[mode["name"]], (mode["name"], mode["sync_examples"])


@pytest.mark.parametrize("recipe", [None, "delayed", "tensorwise", "blockwise"])
def test_host_free_follows_each_modes_options(recipe):
    """Host-free: capacity mode with equal counts declared, no pad, no re-run policy (it reads one
    flag at the step's end), and experts that take device counts or host-constant budgets
    (TEGroupedMLP alone reads its counts on the host). A graph replays a host-free step."""
    from megatron_ext.bench.modes import all_modes

    modes = all_modes(1.5, recipe)
    for mode in modes:
        options = mode.overrides
        expected = (
            options.get("moe_hybridep_capacity_factor") is not None
            and options.get("moe_hybridep_equal_token_counts", False)
            and not options.get("moe_hybridep_pad_uneven_dispatch_inputs", False)
            and not mode.overflow_rerun
            and (mode.experts != "te" or options.get("moe_hybridep_static_expert_splits", False))
        )
        assert mode.host_free is expected, mode.name
        assert mode.host_free or not mode.graph, mode.name
    capacity_equal = [m.name for m in modes if m.name.startswith(("capacity+equal", "deep_ep+capacity+equal"))]
    reading = [n for n in capacity_equal if not {m.name: m for m in modes}[n].host_free]
    assert reading == ["capacity+equal+rerun", "deep_ep+capacity+equal+reuse+rerun"]


def test_capacity_modes_dispatch_non_blocking_after_calibration(full_run):
    _, report, _ = full_run
    for name in (n for n in OUR_MODES[1:] if n != "blocking+compact"):
        mode = _mode(report, name)
        assert (mode["blocking_dispatches_per_step"], mode["non_blocking_dispatches_per_step"]) == (0, LAYERS)
        per_rank = [r["capacities"] for r in mode["per_rank"]]
        assert len(per_rank[0]) == LAYERS and all(c == per_rank[0] for c in per_rank)  # the EP-group max
        assert mode["overflows"] == 0
    blocking = _mode(report, "blocking")
    assert (blocking["blocking_dispatches_per_step"], blocking["non_blocking_dispatches_per_step"]) == (LAYERS, 0)
    assert blocking["overflows"] is None


def test_bytes_and_routing_map_allocations(full_run):
    _, report, _ = full_run
    local = EXPERTS // WORLD
    # Non-blocking: the [T, E] map and the fp32 hidden states all-gathered, probs in equal [T, L] slabs.
    expected = (WORLD - 1) * TOKENS * (EXPERTS + HIDDEN * 4 + local * 4)
    for name in ("capacity+equal", "capacity+equal+reuse"):
        assert _mode(report, name)["bytes_sent_per_dispatch"] == expected, name
    blocking = _mode(report, "blocking")["bytes_sent_per_dispatch"]
    assert (WORLD - 1) * TOKENS * EXPERTS < blocking < expected  # exact all-to-all: only where routed
    map_bytes = WORLD * TOKENS * EXPERTS  # one fresh [W*T, E] Boolean map per forward dispatch
    assert _mode(report, "capacity+equal")["routing_map_bytes_allocated_per_step"] == LAYERS * map_bytes
    assert _mode(report, "blocking")["routing_map_bytes_allocated_per_step"] == LAYERS * map_bytes
    assert _mode(report, "capacity+equal+reuse")["routing_map_bytes_allocated_per_step"] == 0
    assert _mode(report, "megatron")["routing_map_bytes_allocated_per_step"] is None
    # Compact routing: int16 top-k indices instead of E Booleans per token, E / (2k) fewer bytes sent,
    # bitwise the same results (test_every_mode_runs_and_equals_blocking); with reuse nothing allocated.
    dense_sent, compact_sent = (WORLD - 1) * TOKENS * EXPERTS, (WORLD - 1) * TOKENS * TOPK * 2
    for name in ("blocking", "capacity+equal", "capacity+equal+reuse"):
        assert _mode(report, name)["routing_map_bytes_sent_per_dispatch"] == dense_sent, name
    for name in ("blocking+compact", "capacity+equal+reuse+compact"):
        assert _mode(report, name)["routing_map_bytes_sent_per_dispatch"] == compact_sent, name
    assert dense_sent == compact_sent * EXPERTS // (2 * TOPK) and EXPERTS > 2 * TOPK
    reused = _mode(report, "capacity+equal+reuse+compact")
    assert reused["routing_map_bytes_allocated_per_step"] == 0
    assert reused["bytes_sent_per_dispatch"] == expected - dense_sent + compact_sent
    assert _mode(report, "megatron")["routing_map_bytes_sent_per_dispatch"] is None


def test_micro_batches_accumulate_and_count_per_step(full_run, tmp_path):
    """--micro-batches 2: each step runs its layers' dispatches twice and sends twice the bytes,
    every mode still bitwise equal to blocking (each with the same micro-batches)."""
    _, single, _ = full_run
    modes = "capacity+equal,capacity+equal+rerun"
    result = _bench(*TINY, "--world-size", str(WORLD), "--micro-batches", "2", "--modes", modes,
                    "--json", str(tmp_path / "m.json"))  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "each step 2 micro-batches" in result.stdout
    with open(tmp_path / "m.json") as f:
        report = json.load(f)
    assert report["sizes"]["micro_batches"] == 2
    blocking, capacity = _mode(report, "blocking"), _mode(report, "capacity+equal")
    assert capacity["equal_to_blocking"] == "bitwise" == _mode(report, "capacity+equal+rerun")["equal_to_blocking"]
    assert blocking["host_syncs_per_step"] == 2 * LAYERS  # one count read per forward dispatch
    assert (blocking["blocking_dispatches_per_step"], capacity["non_blocking_dispatches_per_step"]) == (
        2 * LAYERS,
        2 * LAYERS,
    )
    for name in ("blocking", "capacity+equal"):
        assert _mode(report, name)["bytes_sent_per_step"] == 2 * _mode(single, name)["bytes_sent_per_step"], name
    # The overflow policy checks once per step, however many micro-batches it has.
    rerun = _mode(report, "capacity+equal+rerun")
    assert (rerun["host_syncs_per_step"], rerun["all_reduces_per_step"]) == (1, 1)


def test_timings_and_plot(full_run):
    _, report, png = full_run
    for mode in report["modes"]:
        if mode["status"] == "skipped":
            continue
        for rank in mode["per_rank"]:
            assert len(rank["step_ms"]) == STEPS * ROUNDS and all(t > 0 for t in rank["step_ms"])
            assert len(rank["dispatch_host_ms"]) == LAYERS * STEPS * ROUNDS  # forward dispatches only
            rounds = [rank["step_ms"][i * STEPS : (i + 1) * STEPS] for i in range(ROUNDS)]
            assert rank["round_step_ms"] == [statistics.median(r) for r in rounds]
        assert mode["step_ms"] == max(statistics.median(r["step_ms"]) for r in mode["per_rank"])  # slowest rank
        slowest = [max(r["round_step_ms"][i] for r in mode["per_rank"]) for i in range(ROUNDS)]
        assert mode["round_step_ms"] == slowest
    assert _mode(report, "megatron")["step_vs_stock"] == 1.0
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_overflow_stops_the_run_and_names_the_mode():
    # Capacity exactly the calibrated rows and skewed routing: a later step needs more rows.
    overflowing = ["--capacity-factor", "1.0", "--skew", "1", "--modes", "capacity+equal", "--steps", "3"]
    overflowing += ["--experts", "4"]  # 2 per rank: the skewed step outgrows the first's rows
    result = _bench(*TINY, "--world-size", "2", *overflowing)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAILED mode capacity+equal on rank" in result.stderr
    assert "dispatch overflowed its capacity" in result.stderr


DIFFERS = textwrap.dedent(
    """
    import sys
    from megatron_ext.bench import modes
    everything = modes.all_modes
    def with_a_wrong_mode(factor, fp8_recipe=None):
        wrong = modes.Mode("pre-softmax", "other routing probabilities: must differ", (),
                           dict(modes.FLEX, moe_hybridep_implementation="torch", moe_router_pre_softmax=True))
        return (*everything(factor, fp8_recipe), wrong)
    modes.all_modes = with_a_wrong_mode
    from megatron_ext.bench.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_mode_that_differs_fails_the_run_by_name():
    # One process as torchrun would start it, so the injected mode is seen by the rank.
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    env["MASTER_PORT"] = str(_free_port())
    result = subprocess.run(
        [sys.executable, "-c", DIFFERS, *TINY, "--modes", "pre-softmax"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAILED pre-softmax: differs: outputs/gradients differ from blocking on rank 0" in result.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--topk", "9", "--experts", "8"], "--topk 9 must be between 1 and --experts (8)"),
        (["--capacity-factor", "0.5"], "--capacity-factor 0.5 would drop tokens"),
        (["--experts", "6", "--world-size", "4"], "--experts 6 must be divisible by the 4 ranks"),
        (["--modes", "blocking,fast"], "--modes: unknown mode(s) 'fast'; choose from"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--json", "/no/such/folder/out.json"], "--json /no/such/folder/out.json: cannot write there"),
        (["--json", "/"], "--json /: is a folder; give a file name"),
        (["--ranks-per-gpu", "2", "--device", "cpu"], "--ranks-per-gpu 2: ranks share GPUs, and no CUDA device"),
        (["--ranks-per-gpu", "0"], "--ranks-per-gpu must be at least 1"),
        (["--skew", "nan"], "--skew nan: use a finite number (0 balances the routing"),
        (["--skew", "inf"], "--skew inf: use a finite number"),
        (["--skew=-inf"], "--skew -inf: use a finite number"),
        (["--plot", "/proc/out.png"], "--plot /proc/out.png: cannot write there"),  # os.access says yes to root
        (["--capcity-factor", "2"], "unrecognized arguments: --capcity-factor 2"),
        (["--deep-ep-num-sms", "0"], "--deep-ep-num-sms must be at least 1 (leave it out for deep_ep's default)"),
    ],
)
def test_bad_arguments_are_refused_with_the_fix(argv, message, capsys, monkeypatch):
    from megatron_ext.bench.cli import parse

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-ext-bench: error: ") and message in err, err  # no usage block before it
    assert err.count("\n") == 1, err


GIB = 2**30


@pytest.mark.parametrize(
    "argv, available_gib, refused",
    [
        (["--size", "large"], 23, True),  # SIGKILL'ed some 48 s in on a machine of 23 GiB
        (["--size", "fine"], 23, True),
        (["--size", "large", "--layers", "1", "--world-size", "2"], 23, False),
        (["--size", "small"], 2, False),
        (["--size", "large"], 1024, False),
    ],
    ids=["large", "fine", "large-1-layer-2-ranks", "small", "large-enough-memory"],
)
def test_a_stack_the_cpu_ranks_cannot_hold_is_refused_before_the_run(argv, available_gib, refused, capsys, monkeypatch):
    from megatron_ext.bench import cli

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(cli, "_available_bytes", lambda: available_gib * GIB)
    if not refused:
        assert cli.parse([*argv, "--device", "cpu"]).size == argv[1]
        return
    with pytest.raises(SystemExit) as exit_info:
        cli.parse([*argv, "--device", "cpu"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"megatron-ext-bench: error: --size {argv[1]} on 4 CPU ranks needs at least ")
    assert f"and {available_gib} GiB is available here; run it on GPUs, or on CPU a smaller --size" in err
    assert err.count("\n") == 1


def test_the_memory_estimate_is_a_lower_bound_of_the_weights_and_activations():
    from megatron_ext.bench.sizes import SIZES, least_bytes

    large = SIZES["large"]
    weights = 8 * 64 * 3 * 4096 * 1024  # GLU experts: fc1 [2 x FFN, H], fc2 [H, FFN]
    activations = 8 * 8192 * 8 * (4096 + 2 * 1024)  # per rank: each layer's rows and fc1 outputs
    assert least_bytes(large, 4, 4) == 4 * (2 * weights + 4 * activations)
    assert least_bytes(large, 1, 2) == 2 * (2 * weights + activations)


def test_a_rank_killed_by_sigkill_is_said_to_have_run_out_of_memory(capsys, monkeypatch):
    from megatron_ext.bench import cli

    def killed(*args, **kwargs):
        raise RuntimeError("process 2 terminated with signal SIGKILL")  # as torch.multiprocessing says it

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(cli, "run_on_ranks", killed)
    assert cli.main(["--device", "cpu", "--world-size", "2"]) == 1
    err = capsys.readouterr().err
    assert "FAILED: a rank stopped: process 2 terminated with signal SIGKILL" in err
    assert "a rank ran out of memory; try a smaller stack" in err


def test_modes_selection_keeps_blocking_and_table_order():
    from megatron_ext.bench.modes import select

    assert [m.name for m in select(["capacity+equal", "megatron"], 1.5)] == ["megatron", "blocking", "capacity+equal"]
    assert select(["capacity+equal"], 2.0)[1].overrides["moe_hybridep_capacity_factor"] == 2.0


def _count_on_ranks(rank, world_size):
    from megatron.core.tensor_parallel import mappings

    from megatron_ext.bench.counters import count_collectives

    rows = torch.ones(3 * world_size, 5)  # float32 rows of 20 bytes; 3 rows for each destination...
    splits = [rank + 1 if d != rank else 2 for d in range(world_size)]  # ...except an uneven split
    received = [None] * world_size
    with count_collectives() as log:
        gathered = torch.empty(world_size * 4, dtype=torch.int8)
        dist.all_gather_into_tensor(gathered, torch.ones(4, dtype=torch.int8))
        mappings.dist_all_gather_func(gathered, torch.ones(4, dtype=torch.int8))  # Megatron's alias
        split_sizes = torch.tensor(splits)
        dist.all_gather_object(received, splits)
        in_rows = rows[: sum(splits)]
        out_rows = torch.empty(sum(r[rank] for r in received), 5)
        dist.all_to_all_single(out_rows, in_rows, [r[rank] for r in received], split_sizes.tolist())
        dist.all_reduce(torch.ones(1))
    expected = 2 * 4 * (world_size - 1) + 20 * (sum(splits) - splits[rank])
    assert log.bytes_sent == expected, (rank, log, expected)
    assert log.all_reduces == 1, (rank, log)


@pytest.mark.parametrize("world_size", [1, 3])
def test_collective_counter_counts_bytes_to_other_ranks(world_size):
    run_ranks(world_size, _count_on_ranks)  # a failed assertion on a rank comes back with its traceback


def test_console_script_is_installed():
    script = os.path.join(os.path.dirname(sys.executable), "megatron-ext-bench")
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage: megatron-ext-bench" in result.stdout and "--capacity-factor" in result.stdout


def test_te_per_expert_gradients_stack_under_grouped_mlp_names():
    from megatron_ext.bench.stack import stack_per_expert

    per_expert = {f"layers.0.experts.linear_fc1.weight{i}": torch.full((2, 3), float(i)) for i in range(12)}
    router = torch.randn(4, 8)
    stacked = stack_per_expert({**per_expert, "layers.0.router.weight": router})
    assert sorted(stacked) == ["layers.0.experts.linear_fc1.weight", "layers.0.router.weight"]
    weight = stacked["layers.0.experts.linear_fc1.weight"]
    assert weight.shape == (12, 2, 3) and [int(w[0, 0]) for w in weight] == list(range(12))  # 10, 11 after 9
    assert stacked["layers.0.router.weight"] is router


def test_runahead_counts_the_dispatches_the_host_passed_while_the_gpu_slept(monkeypatch):
    from megatron_ext.bench import report, run
    from megatron_ext.tooling import sync

    start = 1000.0
    probe = sync.RunAhead(host_idle_ms=40.0, host_behind_sleep_ms=330.0, gpu_sleep_ms=300.0, behind_started=start)
    monkeypatch.setattr(sync, "runahead_probe", lambda step, sleep_ms: probe)
    timer = type("Timer", (), {})()
    timer.returned_at = [start - 0.05, start + 0.01, start + 0.25, start + 0.31, start + 0.32, start + 0.40]
    result = run._runahead(lambda: None, 300.0, timer, layers=3)  # this step's dispatches: 0.01, 0.25, 0.31
    assert (result["ran_ahead"], result["dispatches_ahead"], result["dispatches"]) == (False, 2, 3)
    row = dict(result, rounds=1, rounds_ran_ahead=0)
    assert report._ran_ahead(row) == "2/3 disp."
    assert report._ran_ahead(dict(row, ran_ahead=True, rounds_ran_ahead=1)) == "step"
    assert report._ran_ahead(dict(row, rounds=3, rounds_ran_ahead=2)) == "2/3 rounds"
    assert report._ran_ahead(None) == "-"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_kernel_counter_refuses_without_a_gpu():
    result = python_module("megatron_ext.bench.kernels", "--layers", "2")
    assert result.returncode == 2 and "needs a CUDA GPU" in result.stderr, result.stderr


def test_profile_refuses_a_capacity_factor_below_one():
    result = python_module("megatron_ext.bench.profile", "--capacity-factor", "0.5", timeout=120)
    assert result.returncode == 2 and "--capacity-factor 0.5 would drop tokens" in result.stderr, result.stderr


# ------------------------------------------------------------------------------ --size


def _fields(args) -> tuple[int, ...]:
    return (args.layers, args.tokens, args.hidden, args.ffn_hidden, args.experts, args.topk)


def _parse(argv, monkeypatch):
    from megatron_ext.bench import cli

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(cli, "_available_bytes", lambda: None)  # the sizes alone: the memory check is tested apart
    return cli.parse([*argv, "--device", "cpu"])


@pytest.mark.parametrize(
    "name, fields",
    [
        ("small", (8, 512, 512, 256, 16, 2)),
        ("mid", (4, 4096, 2048, 1024, 32, 4)),
        ("fine", (8, 4096, 2048, 768, 128, 8)),
        ("large", (8, 8192, 4096, 1024, 64, 8)),
        ("wide", (4, 4096, 7168, 2048, 32, 8)),
    ],
)
def test_size_names_a_stack(name, fields, monkeypatch):
    from megatron_ext.bench.cli import sizes_of

    args = _parse(["--size", name], monkeypatch)
    assert _fields(args) == fields
    assert sizes_of(args).size == name


def test_deep_ep_sm_count_reaches_every_modes_config(monkeypatch):
    """--deep-ep-num-sms becomes every mode's --moe-flex-dispatcher-num-sms (None when left out)."""
    from megatron_ext.bench.cli import sizes_of
    from megatron_ext.bench.modes import select
    from megatron_ext.bench.stack import megatron_config

    for argv, expected in (([], None), (["--deep-ep-num-sms", "16"], 16)):
        sizes = sizes_of(_parse(argv, monkeypatch))
        for mode in select(["capacity+equal", "megatron"], 1.5):  # deep_ep's modes need deep_ep to build
            config = megatron_config(sizes, 1, torch.device("cpu"), mode)
            assert config.moe_flex_dispatcher_num_sms == expected, (mode.name, argv)


def test_a_size_flag_overrides_its_field_of_the_size(monkeypatch):
    args = _parse(["--size", "fine", "--layers", "2"], monkeypatch)
    assert _fields(args) == (2, 4096, 2048, 768, 128, 8)
    # Without --size: the old defaults, each overridable alone, and no size name recorded.
    args = _parse(["--tokens", "64"], monkeypatch)
    assert _fields(args) == (2, 64, 128, 128, 8, 2)
    assert args.size is None


def test_a_bad_size_is_a_parse_error_and_help_keeps_the_defaults(capsys, monkeypatch):
    from megatron_ext.bench.cli import parser

    with pytest.raises(SystemExit) as exit_info:
        _parse(["--size", "huge"], monkeypatch)
    assert exit_info.value.code == 2
    assert "--size: invalid choice: 'huge'" in capsys.readouterr().err
    text = " ".join(parser().format_help().split())
    for default in ("(default 2)", "tokens per rank (default 256)", "hidden size (default 128)", "(default 8)"):
        assert default in text
    assert "fine: 8 layers, T 4096, H 2048, FFN 768, E 128, top-8" in text


def test_profile_and_kernels_take_the_size_too(capsys):
    from megatron_ext.bench import profile

    p = profile.size_arguments("prog", "the profile's flags", ("capacity_factor", "seed"))
    args = p.parse_args(["--size", "large", "--experts", "32"])
    sizes = profile.sizes_from(args)
    assert (sizes.layers, sizes.tokens, sizes.hidden, sizes.ffn_hidden, sizes.experts, sizes.topk) == (
        8, 8192, 4096, 1024, 32, 8,
    )  # fmt: skip
    assert sizes.size == "large" and sizes.dtype == "bf16"
    assert args.layers == 8  # the tools read the namespace too (the stack's layers)
    default = profile.sizes_from(p.parse_args([]))
    assert (default.layers, default.tokens, default.size) == (2, 256, None)
    # A namespace built by hand, sizes left None: filled from its size as the parser would.
    assert profile.sizes_from(argparse.Namespace(size="mid", layers=None, modes=None)).tokens == 4096
    # deep_ep's SM count reaches the profiled stack as it reaches the bench's.
    assert profile.sizes_from(profile.parser().parse_args(["--deep-ep-num-sms", "16"])).deep_ep_num_sms == 16
    with pytest.raises(SystemExit) as exit_info:
        profile.main(["--size", "huge"])
    assert exit_info.value.code == 2 and "invalid choice: 'huge'" in capsys.readouterr().err


# ------------------------------------------------------------------------------ +graph modes


def test_graph_modes_follow_their_eager_twins_with_the_same_settings():
    from dataclasses import replace

    from megatron_ext.bench.modes import all_modes, select

    modes = all_modes(1.5)
    names = [m.name for m in modes]
    for twin, graph in (("capacity+equal", GRAPH_MODES[0]), ("deep_ep+capacity+equal+reuse", GRAPH_MODES[1])):
        eager, graphed = modes[names.index(twin)], modes[names.index(graph)]
        assert names.index(graph) == names.index(twin) + 1
        assert graphed.graph and not eager.graph
        assert replace(graphed, name=twin, summary=eager.summary, graph=False) == eager  # nothing else differs
    assert modes[names.index(GRAPH_MODES[0])].equality == "bitwise"
    assert modes[names.index(GRAPH_MODES[1])].equality == "close" and modes[names.index(GRAPH_MODES[1])].needs_deep_ep
    assert [m.name for m in modes if m.graph] == list(GRAPH_MODES)
    assert [m.name for m in select([GRAPH_MODES[0]], 1.5)] == ["blocking", GRAPH_MODES[0]]


def test_graphed_step_refuses_a_cpu_input():
    from megatron_ext.bench.graphed import GraphedStep

    stack = torch.nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match="CUDA graphs need a GPU: the input is on cpu"):
        GraphedStep(stack, torch.randn(3, 1, 4), torch.ones(3, 1, 4))
    assert all(p.grad is None for p in stack.parameters())  # refused before any step


def _cpu_runner(progress=lambda: None):
    from megatron_ext.bench.run import _Runner
    from megatron_ext.bench.sizes import Sizes

    sizes = Sizes(layers=1, tokens=3, hidden=4, ffn_hidden=4, experts=2, topk=1, dtype="fp32", skew=0.0,
                  capacity_factor=1.5, steps=2, check_steps=1, warmup=0, seed=0)  # fmt: skip
    return _Runner(sizes, 0, 1, torch.device("cpu"), progress)


def test_fp8_modes_come_with_their_reference_and_need_the_recipe():
    from megatron_ext.bench.modes import FP8_REFERENCE, select

    chosen = select(["capacity+equal+te+fp8"], 1.5, "blockwise")
    assert [m.name for m in chosen] == ["blocking", FP8_REFERENCE, "capacity+equal+te+fp8"]
    assert [m.reference for m in chosen] == ["blocking", "blocking", FP8_REFERENCE]
    for mode in chosen[1:]:
        assert mode.overrides["fp8"] == "e4m3" and mode.overrides["fp8_recipe"] == "blockwise"
        assert mode.overrides["use_transformer_engine_op_fuser"] and mode.needs_te
        assert "--fp8-recipe blockwise" in mode.flags and "--use-transformer-engine-op-fuser" in mode.flags
    assert "capacity+equal+te+fp8" not in {m.name for m in select(None, 1.5)}  # no recipe, no fp8 modes
    with pytest.raises(ValueError, match=r"'capacity\+equal\+te\+fp8' \(the fp8 modes need --fp8-recipe\)"):
        select(["capacity+equal+te+fp8"], 1.5)


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise"])
def test_every_fp8_mode_is_one_megatron_ext_accepts_for_its_recipe(recipe):
    """Delayed scaling has no device-count grouped GEMM in TE: its capacity mode is the static
    expert splits one alone (the op-fuser one would be refused); every mode's config validates."""
    import argparse

    from megatron_ext.bench.modes import FP8_REFERENCE, fp8_modes
    from megatron_ext.options import validate

    modes = fp8_modes(1.5, recipe)
    expected = [FP8_REFERENCE, "capacity+equal+static+te+fp8"]
    if recipe != "delayed":
        expected[1:1] = ["capacity+equal+te+fp8", "capacity+equal+te+fp8+fp8-weights"]
    if recipe == "blockwise":  # fp8 on the wire: blockwise's blocks only
        expected.insert(3, "capacity+equal+te+fp8+fp8-dispatch")
    assert [m.name for m in modes] == expected
    for mode in modes:
        config = argparse.Namespace(transformer_impl="transformer_engine", moe_grouped_gemm=True, **mode.overrides)
        validate(config)  # raises where megatron-ext would refuse the mode's flags
        assert f"--fp8-recipe {recipe}" in mode.flags
    static = modes[-1]
    assert static.experts == "te" and static.overrides["moe_hybridep_static_expert_splits"]
    assert "--moe-hybridep-static-expert-splits" in static.flags and static.reference == FP8_REFERENCE
    # The reference runs the experts of the modes checked against it: TE's op-fuser ones where a
    # capacity mode runs them, else TEGroupedMLP, which static splits feed.
    reference = modes[0]
    op_fuser = recipe != "delayed"
    assert reference.experts == ("te-op-fuser" if op_fuser else "te")
    assert reference.overrides["use_transformer_engine_op_fuser"] is op_fuser
    assert ("--use-transformer-engine-op-fuser" in reference.flags) is op_fuser
    if op_fuser:  # fp8 weights: the op-fuser capacity mode with fp8_param, as Megatron's flag sets it
        plain, weights = modes[1], modes[2]
        assert weights.overrides == {**plain.overrides, "fp8_param": True} and not plain.overrides.get("fp8_param")
        assert "--fp8-param-gather" in weights.flags and weights.reference == FP8_REFERENCE


def test_fp8_init_context_is_megatrons_init_context_where_the_config_asks_for_fp8_weights(monkeypatch):
    """fp8_param: the stack's layers are built inside Megatron's fp8 init context (as a
    TransformerBlock builds them), so TE creates its weights in fp8; otherwise no context."""
    import contextlib

    import megatron.core.fp8_utils as fp8_utils

    from megatron_ext.bench.stack import fp8_init_context

    entered = []

    @contextlib.contextmanager
    def recording(config, layer_no=-1, is_init=False):
        entered.append(is_init)
        yield

    monkeypatch.setattr(fp8_utils, "get_fp8_context", recording)
    with fp8_init_context(argparse.Namespace(fp8="e4m3", fp8_param=False)):
        pass
    assert entered == []
    with fp8_init_context(argparse.Namespace(fp8="e4m3", fp8_param=True)):
        pass
    assert entered == [True]


def test_fp8_modes_are_checked_against_their_own_blocking_twin():
    """The fp8 blocking mode against bf16 blocking within fp8's tolerance; fp8 capacity mode
    against the fp8 blocking mode, so that a bitwise match there is seen as one."""
    from megatron_ext.bench.modes import FP8_REFERENCE, fp8_modes, select
    from megatron_ext.bench.run import FP8_TOLERANCE, ModeResult, tolerance

    blocking = select([], 1.5)[1]
    fp8_blocking, fp8_capacity = fp8_modes(1.5, "tensorwise")[:2]
    assert blocking.name == "blocking" and tolerance(fp8_capacity, "bf16") == FP8_TOLERANCE > tolerance(
        blocking, "bf16"
    )

    def check(runner, mode, out):
        runner.step = lambda stack, x: (out, None)
        runner.snapshot = lambda stack, out, grad: {"output": out.clone()}
        result = ModeResult(mode.name)
        runner._check(None, mode, result, iter(runner.inputs))
        return result

    runner = _cpu_runner()
    runner.expert_load = 1.0  # what blocking's check would measure on a real stack
    base = torch.linspace(1.0, 2.0, 12)
    assert check(runner, blocking, base).equality == "bitwise"
    in_fp8 = check(runner, fp8_blocking, base * 1.05)
    assert in_fp8.equality == "close" and 0.04 < in_fp8.max_rel_error < 0.06 and in_fp8.status == "ok"
    assert check(runner, fp8_capacity, base * 1.05).equality == "bitwise"
    off = check(runner, fp8_capacity, base * 1.3)
    assert off.status == "differs" and f"differ from {FP8_REFERENCE} on rank 0" in off.detail
    assert "relative error 0.238 (step 1, output), expected within 0.1" in off.detail
    assert off.worst_error_at == "step 1, output" and off.step_rel_errors == [off.max_rel_error]
    alone = _cpu_runner()
    alone.expert_load = 1.0
    check(alone, blocking, base)
    orphan = check(alone, fp8_capacity, base)
    assert orphan.status == "differs" and f"no results of {FP8_REFERENCE}" in orphan.detail


def test_running_out_of_memory_in_the_check_names_the_flag():
    """The check keeps every checked step's gradients on the device: running out there says which
    step and what to lower, not only the allocator's message."""
    from megatron_ext.bench.modes import select
    from megatron_ext.bench.run import ModeResult

    runner = _cpu_runner()
    runner.step = lambda stack, x: (torch.ones(3), None)

    def full(stack, out, grad):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB.")

    runner.snapshot = full
    mode = select(["capacity+equal"], 1.5)[1]
    with pytest.raises(torch.OutOfMemoryError, match=r"checked step 1 of 1 .*lower --check-steps .*512.00 MiB"):
        runner._check(None, mode, ModeResult(mode.name), iter(runner.inputs))


def test_the_check_names_the_step_and_tensor_of_the_worst_error():
    """Tensors are matched by name (two stacks may build their experts apart); each checked step's
    worst error is kept, and where the worst of all is, so that a failed check says what to look at."""
    from megatron_ext.bench.run import _compare

    torch.manual_seed(0)
    reference = [{"output": torch.randn(8), "gradient of w": torch.randn(8)} for _ in range(3)]
    actual = [{name: t.clone() for name, t in step.items()} for step in reference]
    same = _compare(reference, actual)
    assert same.bitwise and same.worst == 0.0 and same.worst_at == "" and same.per_step == [0.0, 0.0, 0.0]
    assert same.per_tensor == {}
    actual[0]["output"] = reference[0]["output"] * 1.01
    actual[1]["gradient of w"] = reference[1]["gradient of w"] * 1.2
    actual[2]["output"] = reference[2]["output"] * 0.95
    found = _compare(reference, actual)
    assert not found.bitwise and found.worst_at == "step 2, gradient of w"
    assert found.per_step == pytest.approx([0.01, 0.2, 0.05]) and found.worst == pytest.approx(0.2)
    assert found.per_tensor == pytest.approx({"output": 0.05, "gradient of w": 0.2})  # each one's worst step
    reordered = [dict(reversed(list(step.items()))) for step in actual]  # by name, not by position
    assert _compare(reference, reordered).per_step == pytest.approx([0.01, 0.2, 0.05])
    renamed = [{"output": s["output"], "gradient of v": s["gradient of w"]} for s in actual]
    unmatched = _compare(reference, renamed)
    assert unmatched.worst == float("inf") and "step 1, tensors in one run only" in unmatched.worst_at
    assert "gradient of v" in unmatched.worst_at and "gradient of w" in unmatched.worst_at
    reshaped = [{"output": s["output"].view(2, 4), "gradient of w": s["gradient of w"]} for s in actual]
    assert _compare(reference, reshaped).worst_at == "step 1, output: shape (2, 4) against (8,)"


def test_rounds_and_ranks_keep_the_worst_error_and_where_it_is():
    from megatron_ext.bench import report
    from megatron_ext.bench.modes import select
    from megatron_ext.bench.run import ModeResult

    def errors(largest, at, steps=(), tensors=None):
        return ModeResult("m", max_rel_error=largest, worst_error_at=at, step_rel_errors=list(steps),
                          tensor_rel_errors=tensors or {})  # fmt: skip

    def worst(result):
        return (result["max_rel_error"], result["worst_error_at"], result["step_rel_errors"])

    first = errors(0.02, "step 1, output", [0.02, 0.01], {"output": 0.02, "input gradient": 0.01})
    first.merge(errors(0.05, "step 2, input gradient", [0.0, 0.05], {"input gradient": 0.05}))
    assert first.tensor_rel_errors == {"output": 0.02, "input gradient": 0.05}
    assert worst(first.to_dict()) == (0.05, "step 2, input gradient", [0.02, 0.05])
    first.merge(errors(0.03, "step 1, output"))  # a later round: kept
    assert worst(first.to_dict()) == (0.05, "step 2, input gradient", [0.02, 0.05])
    mode = select(["capacity+equal"], 1.5)[1]
    other = errors(0.08, "step 1, gradient of w", [0.08, 0.01], {"gradient of w": 0.08, "output": 0.01})
    row = report.aggregate(mode, [first.to_dict(), other.to_dict()])
    assert row["tensor_rel_errors"] == {"output": 0.02, "input gradient": 0.05, "gradient of w": 0.08}
    assert worst(row) == (0.08, "step 1, gradient of w", [0.08, 0.05])


def test_a_graph_modes_step_is_the_replay():
    runner = _cpu_runner()
    replayed = []
    out, grad = torch.zeros(3, 1, 4), torch.ones(3, 1, 4)

    def replay(x):
        replayed.append(x)
        return out, grad

    runner.graphed = replay
    runner.recovery = lambda **_: pytest.fail("a replay goes through nothing else")
    x = runner.inputs[0]
    assert runner.step(None, x) == (out, grad) and replayed == [x]  # no stack: `_step` is not called
    runner.graphed = runner.recovery = None
    stack = torch.nn.Linear(4, 4)
    eager_out, eager_grad = runner.step(stack, x)  # without a graph: the eager step
    assert eager_out.shape == x.shape and eager_grad.shape == x.shape and stack.weight.grad is not None


def test_a_failed_capture_fails_the_mode_with_the_error(gloo_group):
    from megatron_ext.bench.run import ModeResult

    steps = []
    runner = _cpu_runner(progress=lambda: steps.append(1))
    stack = torch.nn.Linear(4, 4)
    result = ModeResult(GRAPH_MODES[0])
    # On CPU the capture raises (GraphedStep refuses the device): the path of any capture that raises.
    assert runner._capture(stack, result) is False
    assert result.status == "failed" and runner.graphed is None
    error = "RuntimeError: CUDA graphs need a GPU: the input is on cpu"
    assert result.detail == f"CUDA graph capture failed on rank 0: {error}"
    assert stack.weight.grad is not None  # the two eager steps ran first
    assert len(steps) == runner.sizes.steps_per_mode  # the progress bar still ends


def test_a_capture_error_names_the_first_error_then_the_one_ending_the_capture():
    from megatron_ext.bench.run import _describe

    try:
        try:
            raise RuntimeError("a host read under capture\nmore lines")
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture") from None
    except RuntimeError as exc:
        assert _describe(exc) == "RuntimeError: CUDA error: operation failed due to a previous error during capture"
    try:
        try:
            raise ValueError("a host read under capture\nmore lines")
        except ValueError:
            raise RuntimeError("capture invalidated")  # noqa: B904 - as torch.cuda.graph's __exit__ raises
    except RuntimeError as exc:
        then = "(then, ending the capture: RuntimeError: capture invalidated)"
        assert _describe(exc) == f"ValueError: a host read under capture {then}"


# ------------------------------------------------------------------------------ GPU busy time, the table


def test_gpu_busy_time_counts_overlapping_operations_once(monkeypatch):
    from megatron_ext.bench import counters, profile

    operations = [("gemm", 0.0, 10.0), ("nccl", 5.0, 20.0), ("copy", 30.0, 40.0), ("inside", 31.0, 32.0)]
    assert counters.busy_ms(operations) == pytest.approx(0.030)  # [0, 20] and [30, 40] us
    assert counters.busy_ms([]) == 0.0
    calls = []
    monkeypatch.setattr(counters, "gpu_operations", lambda step, steps: calls.append(steps) or operations * steps)
    assert counters.kernel_times(lambda: None, 2) == pytest.approx(
        {"gemm": 0.010, "nccl": 0.015, "copy": 0.010, "inside": 0.001}
    )  # per step: the profile's kernel table
    assert calls == [2] and profile.kernel_times is counters.kernel_times


def _rank_result(name, **fields):
    from megatron_ext.bench.run import ModeResult

    return ModeResult(name, **fields).to_dict()


def test_the_table_shows_gpu_time_and_graph_rows_without_nonsense():
    from megatron_ext.bench import report
    from megatron_ext.bench.modes import all_modes
    from megatron_ext.bench.run import ModeResult

    modes = {m.name: m for m in all_modes(1.5)}
    probe = dict(host_idle_ms=1.0, host_behind_sleep_ms=1.0, gpu_sleep_ms=300.0, ran_ahead=True, dispatches=2)
    eager = dict(equality="bitwise", step_ms=[3.0], round_step_ms=[3.0], host_syncs_per_step=0,
                 all_reduces_per_step=0, bytes_sent_per_dispatch=1024.0, forward_memory_bytes=2048,
                 peak_step_memory_bytes=4096, ran_ahead_rounds=[True], dispatches_ahead_rounds=[2],
                 runahead=dict(probe, dispatches_ahead=2))  # fmt: skip
    # A graph mode as `_Runner.run` leaves it: Python-side counts None, the probe's dispatches unseen.
    graph = dict(equality="bitwise", step_ms=[2.0], round_step_ms=[2.0], host_syncs_per_step=0,
                 peak_step_memory_bytes=4096, ran_ahead_rounds=[False], dispatches_ahead_rounds=[None],
                 runahead=dict(probe, ran_ahead=False, dispatches_ahead=None))  # fmt: skip
    rows = [
        report.aggregate(modes["blocking"], [_rank_result("blocking", gpu_busy_ms=g, **eager) for g in (2.0, 1.5)]),
        report.aggregate(modes[GRAPH_MODES[0]], [_rank_result(GRAPH_MODES[0], gpu_busy_ms=1.6, **graph)] * 2),
        report.aggregate(modes["capacity+equal"], [_rank_result("capacity+equal", **eager)] * 2),  # GPU time: none
        report.aggregate(
            modes[GRAPH_MODES[1]], [_rank_result(GRAPH_MODES[1], status="failed", detail="CUDA graph capture failed")]
        ),
    ]
    report.add_ratios(rows)
    assert rows[0]["gpu_busy_ms"] == 2.0 and rows[0]["step_vs_gpu"] == 1.5  # the slowest rank's
    assert rows[1]["step_vs_gpu"] == 1.25 and rows[1]["runahead"]["dispatches_ahead"] is None
    assert rows[2]["step_vs_gpu"] is None and rows[3]["step_vs_gpu"] is None  # no GPU time, no step: no ratio
    table = _parse_table(report.table(rows, cuda=True))
    assert list(table["blocking"])[:6] == ["mode", "vs blocking", "step ms", "x GPU", "x stock", "syncs"]
    assert not {"GPU ms", "fwd held", "sent/disp", "all-reduces"} & set(table["blocking"])  # --wide only
    assert [table["blocking"][c] for c in ("step ms", "x GPU", "ran ahead")] == ["3.00", "1.50", "step"]
    # graph: the replay's syncs (0), '-' for what is counted at Python calls, ran ahead 'no' (dispatches unseen)
    graphed = table[GRAPH_MODES[0]]
    assert [graphed[c] for c in ("vs blocking", "step ms", "x GPU", "x stock", "syncs", "ran ahead")] == [
        "bitwise", "2.00", "1.25", "-", "0", "no",
    ]  # fmt: skip
    assert table["capacity+equal"]["x GPU"] == "-"
    assert table[GRAPH_MODES[1]]["vs blocking"] == "failed"
    assert report.failures(rows) == [f"{GRAPH_MODES[1]}: failed: CUDA graph capture failed"]
    wide = _parse_table(report.table(rows, cuda=True, wide=True))
    assert [wide["blocking"][c] for c in ("GPU ms", "fwd held", "sent/disp", "all-reduces")] == [
        "2.00", "2.0 KiB", "1.0 KiB", "0",
    ]  # fmt: skip
    assert [wide[GRAPH_MODES[0]][c] for c in ("GPU ms", "disp host ms", "all-reduces")] == ["1.60", "-", "-"]
    # (naming them all would pass 120 characters)
    assert report.hint(rows, cuda=True) == f"--wide adds 8 columns (the JSON has every number)\n{report.EXPLAIN_HINT}"
    assert report.hint(rows, cuda=True, wide=True) == "--explain: what each column means"
    sizes = _cpu_runner().sizes
    legend = report.legend(rows, cuda=True, sizes=sizes)
    assert "  GPU ms (--wide): the time the GPU was busy" in legend and "+graph: every step after the capture" in legend
    assert "  x GPU: step ms over GPU ms" in legend
    assert "GPU ms" not in report.legend(rows, cuda=False, sizes=sizes)
    # Rounds: the lowest GPU time is kept (the round least disturbed).
    first = ModeResult("blocking", gpu_busy_ms=2.0)
    first.merge(ModeResult("blocking", gpu_busy_ms=1.8))
    first.merge(ModeResult("blocking"))
    assert first.gpu_busy_ms == 1.8


def _parse_table(text: str) -> dict[str, dict[str, str]]:
    """The table's rows by mode, each {header: cell}, cut where the dashes under the headers are."""
    lines = text.splitlines()
    spans = [(m.start(), m.end()) for m in re.finditer(r"-+", lines[1])]
    rows = [[line[a:b].strip() for a, b in spans] for line in [lines[0], *lines[2:]]]
    return {row[0]: dict(zip(rows[0], row)) for row in rows[1:]}


LONGEST = "deep_ep+capacity+equal+reuse+graph"


def _synthetic_rows(cuda: bool, rounds: int = 1) -> list[dict]:
    """Every mode, as a slow large stack on GPUs (or CPU ranks) might leave them: wide numbers in every
    cell, a 'close' error, one mode that differs, one that failed, TE's skipped on CPU."""
    from megatron_ext.bench import report
    from megatron_ext.bench.modes import all_modes

    step = [1234.56 + i for i in range(rounds)]
    probe = dict(host_idle_ms=1.0, host_behind_sleep_ms=300.0, gpu_sleep_ms=300.0, ran_ahead=False,
                 dispatches_ahead=3, dispatches=8)  # fmt: skip
    base = dict(equality="bitwise", step_ms=step, round_step_ms=step, host_syncs_per_step=16, all_reduces_per_step=16,
                bytes_sent_per_dispatch=1.5 * 2**30, routing_map_bytes_allocated_per_step=2**20,
                dispatch_host_ms=[0.5])  # fmt: skip
    if cuda:
        base.update(gpu_busy_ms=1000.25, runahead=probe, ran_ahead_rounds=[False] * rounds,
                    dispatches_ahead_rounds=[3] * rounds, peak_step_memory_bytes=130 * 2**30,
                    forward_memory_bytes=20 * 2**30)  # fmt: skip
    rows = []
    for mode in all_modes(1.5):
        fields = dict(base)
        if mode.equality == "close":
            fields.update(equality="close", max_rel_error=0.0123)
        if "capacity" in mode.name:
            fields.update(
                capacities=[98304, 99072], rows_used=[70001], overflows=12, reruns=3 if mode.overflow_rerun else None
            )
            if cuda and rounds > 1:
                fields.update(ran_ahead_rounds=[True] * (rounds - 1) + [False])  # "N/M rounds"
        if mode.name == "capacity+equal+check":
            fields.update(status="differs", equality="differs", max_rel_error=0.5, detail="outputs differ")
        if mode.name == LONGEST:
            fields = dict(status="failed", detail="CUDA graph capture failed")
        if mode.needs_te and not cuda:
            fields = dict(status="skipped", detail="Transformer Engine's experts need a CUDA GPU")
        rows.append(report.aggregate(mode, [_rank_result(mode.name, **fields)] * 2))
    report.add_ratios(rows)
    return rows


@pytest.mark.parametrize("rounds", [1, 3])
@pytest.mark.parametrize("cuda", [True, False], ids=["gpu", "cpu"])
def test_the_default_table_fits_120_columns_and_wide_has_every_column(cuda, rounds):
    from megatron_ext.bench import report

    rows = _synthetic_rows(cuda, rounds)
    default, wide = report.table(rows, cuda), report.table(rows, cuda, wide=True)
    widest = max(default.splitlines(), key=len)
    assert len(widest) <= 120, widest
    shown, everything = _parse_table(default), _parse_table(wide)
    assert LONGEST in shown and shown["capacity+equal+check"]["vs blocking"] == "differs 5e-01"  # names whole
    ran = [r["name"] for r in rows if r["status"] != "skipped"]
    assert list(shown) == ran and list(everything) == ran  # TE's modes, skipped on CPU: no row
    assert ("megatron+te" in shown) is cuda
    assert shown["megatron"]["vs blocking"] == "close 1e-02"
    headers, wide_headers = list(shown["blocking"]), list(everything["blocking"])
    assert headers[:3] == ["mode", "vs blocking", "step ms"] and "syncs" in headers
    assert {"x stock", "ran ahead", "x GPU"} <= set(headers) if cuda else {"all-reduces", "cap/used"} <= set(headers)
    assert set(headers) < set(wide_headers)  # the rest with --wide, where every column of the device is
    assert wide_headers == [c.header for c in report._present(rows, cuda)]
    assert ("rounds ms" in wide_headers) == (rounds > 1) and ("GPU ms" in wide_headers) == cuda
    assert len(max(wide.splitlines(), key=len)) > 120  # what the default leaves out is worth a flag
    more, explain = report.hint(rows, cuda).splitlines()
    assert explain == "--explain: what each column means"
    added = [h for h in wide_headers if h not in headers]
    named = f"--wide adds {', '.join(added)} (the JSON has every number)"
    assert more == (named if len(named) <= 120 else f"--wide adds {len(added)} columns (the JSON has every number)")
    legend = report.legend(rows, cuda, _cpu_runner().sizes)
    assert all(len(line) <= 120 for line in legend.splitlines())
    assert all(f"  {h}" in legend for h in wide_headers) and "modes:" in legend


def test_a_narrow_table_drops_the_least_kept_columns_first():
    from megatron_ext.bench import report

    rows = _synthetic_rows(cuda=True)
    kept = {c.header: c.keep for c in report.COLUMNS}
    default = [c.header for c in report.columns(rows, cuda=True)]
    narrow = [c.header for c in report.columns(rows, cuda=True, width=80)]
    assert narrow[:3] == ["mode", "vs blocking", "step ms"] and set(narrow) < set(default)
    assert min(kept[h] for h in narrow) > max(kept[h] for h in default if h not in narrow)
    assert len(max(report.table(rows, cuda=True, width=80).splitlines(), key=len)) <= 80


def test_nothing_compared_says_what_was_skipped_and_why():
    from megatron_ext.bench import report

    rows = _synthetic_rows(cuda=False)
    by_name = {r["name"]: r for r in rows}
    deep_ep_error = "deep_ep does not import: ModuleNotFoundError: No module named 'deep_ep'"
    alone = [by_name["blocking"], dict(by_name["deep_ep"], status="skipped", detail=deep_ep_error)]
    assert report.nothing_compared(alone) == (
        f"no mode besides the reference ran: deep_ep skipped ({deep_ep_error}); nothing was compared"
    )
    graph = dict(by_name["capacity+equal+graph"], status="skipped", detail="CUDA graphs need a GPU")
    assert report.nothing_compared([*alone, graph]) == (
        f"no mode besides the reference ran: deep_ep skipped ({deep_ep_error}); "
        "capacity+equal+graph skipped (CUDA graphs need a GPU); nothing was compared"
    )
    assert "no other mode was selected" in report.nothing_compared([by_name["blocking"]])
    assert report.nothing_compared([*alone, by_name["capacity+equal"]]) is None  # one ran: the rest may skip
    assert report.nothing_compared([*alone, by_name["capacity+equal+check"]]) is None  # it ran, and differs
    assert report.nothing_compared(rows) is None


def test_a_run_that_would_compare_nothing_is_refused_before_it_starts(capsys, monkeypatch):
    # Modes named that cannot run here (CPU ranks skip every +graph mode; deep_ep where it does not
    # import), or blocking alone: refused at parsing, not after blocking ran (the run's own check,
    # `report.nothing_compared`, stays for what the parse cannot see).
    from megatron_ext.bench.cli import parse

    monkeypatch.delenv("RANK", raising=False)
    modes = "capacity+equal+graph" if HAS_DEEP_EP else "deep_ep,capacity+equal+graph"
    for argv, said in (
        (["--modes", modes], "cannot run here: "),
        (["--modes", "blocking"], "--modes blocking: blocking alone compares nothing"),
    ):
        with pytest.raises(SystemExit) as stop:
            parse([*TINY, "--world-size", "2", "--device", "cpu", *argv])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("megatron-ext-bench: error: --modes ") and said in err and err.count("\n") == 1, err


def test_the_printed_report_says_cpu_times_are_no_figures_and_explains_on_request(capsys, monkeypatch):
    from megatron_ext.bench import cli, report

    plots = []
    monkeypatch.setattr(report, "write_plot", lambda path, rows, title, note=None: plots.append(note))
    monkeypatch.setattr(cli, "_machine", lambda args, world_size: f"{world_size} ranks")
    sizes = _cpu_runner().sizes

    def printed(cuda, **flags):
        device = "cuda" if cuda else "cpu"
        args = argparse.Namespace(device=device, wide=False, explain=False, json=None, plot="p.png")
        args.placement = Placement(device)
        vars(args).update(flags)
        rows = [r for r in _synthetic_rows(cuda) if r["status"] in ("ok", "skipped")]
        cli._print_report(args, sizes, 4, rows, {}, [])
        return capsys.readouterr().out.splitlines()

    lines = printed(cuda=False)
    header = next(i for i, line in enumerate(lines) if line.startswith("mode "))
    assert lines[header - 1] == report.CPU_NOTE and plots == [report.CPU_NOTE]
    explain = lines.index("--explain: what each column means")  # the legend's place: a hint
    assert lines[explain - 1].startswith("--wide adds ") and "modes:" not in lines
    assert lines[explain + 2].startswith("OK: ") and max(len(line) for line in lines) <= 120
    explained = printed(cuda=False, explain=True)
    assert (
        "modes:" in explained
        and "columns (those marked --wide: with --wide only; the JSON has every number):" in explained
    )
    assert not any(line.startswith("--wide adds") for line in explained)
    on_gpu = printed(cuda=True)
    assert report.CPU_NOTE not in on_gpu and report.SHARED_GPU_NOTE not in on_gpu and plots[-1] is None
    assert max(len(line) for line in on_gpu) <= 120
    shared = printed(cuda=True, placement=Placement("cuda", ranks_per_gpu=4))  # gloo ranks sharing a GPU
    header = next(i for i, line in enumerate(shared) if line.startswith("mode "))
    assert shared[header - 1] == report.SHARED_GPU_NOTE and plots[-1] == report.SHARED_GPU_NOTE
    assert max(len(line) for line in shared) <= 120


def test_the_plot_on_cpu_ranks_says_its_times_are_no_figures(tmp_path):
    import matplotlib.pyplot as plt

    from megatron_ext.bench import report

    rows = _synthetic_rows(cuda=False)
    figure = report.plot_figure(rows, "megatron-ext-bench: 4 gloo rank(s) on CPU", note=report.CPU_NOTE)
    try:
        assert figure.get_suptitle() == f"megatron-ext-bench: 4 gloo rank(s) on CPU\n{report.CPU_NOTE}"
    finally:
        plt.close(figure)
    figure = report.plot_figure(rows, "on GPUs")
    assert figure.get_suptitle() == "on GPUs"
    plt.close(figure)
    report.write_plot(str(tmp_path / "p.png"), rows, "t", note=report.CPU_NOTE)
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_docs_explain_every_column():
    from megatron_ext.bench import report

    with open(os.path.join(ROOT, "docs", "bench.md")) as f:
        section = f.read().split("## The table's columns")[1].split("\n## ")[0]
    for column in report.COLUMNS:
        assert f"`{column.header}`" in section, column.header
    assert "--explain" in section and "--wide" in section


# ------------------------------------------------------------------------------ the package's imports


def _import_graph(root: str, package: str) -> dict[str, set[str]]:
    """Each module of `package` (under `root`) -> the modules of `package` it imports at its top
    level or under `if TYPE_CHECKING:` (also inside try/except there); function-level imports not."""
    modules = {}
    for folder, _, files in os.walk(os.path.join(root, package)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path, root)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                modules[module] = path

    def top_level(body):
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                yield from top_level(node.body)
            elif isinstance(node, ast.Try):
                for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                    yield from top_level(block)
            else:
                yield node

    graph = {}
    for module, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        here = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        imported = set()
        for node in top_level(tree.body):
            if isinstance(node, ast.Import):
                imported |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                    base = f"{parent}.{base}" if base else parent
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    imported |= {target} if target in modules else ({base} if base in modules else set())
        graph[module] = imported - {module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import circle once, as the path that closes it."""
    found, done = [], set()

    def visit(module, path):
        for target in sorted(graph[module]):
            if target in path:
                cycle = path[path.index(target) :]
                if frozenset(cycle) not in done:
                    done.add(frozenset(cycle))
                    found.append([*cycle, target])
            elif len(path) < 50:
                visit(target, [*path, target])

    for module in sorted(graph):
        visit(module, [module])
    return found


def test_no_import_circles_among_megatron_ext_modules():
    graph = _import_graph(ROOT, "megatron_ext")
    assert "megatron_ext.bench.sizes" in graph["megatron_ext.bench.stack"]  # the walk sees TYPE_CHECKING-free ones
    assert "megatron_ext.experts.checkpoint" in graph["megatron_ext.experts"]
    assert _cycles(graph) == [], " / ".join(" -> ".join(c) for c in _cycles(graph))


def test_the_import_walk_finds_a_circle_through_type_checking(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\ndef f():\n    from pkg import a\n"
    )
    (package / "c.py").write_text("import pkg.a\n")
    graph = _import_graph(str(tmp_path), "pkg")
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"}}
    assert _cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    (package / "c.py").write_text("def g():\n    import pkg.a\n")  # a function-level import: no circle
    assert _cycles(_import_graph(str(tmp_path), "pkg")) == []
