"""megatron-ext-bench: its JSON at tiny sizes on spawned gloo ranks, its failures, its arguments and counters.

The full run checks the numbers the bench reports against what they must be, computed here
independently: host syncs and all-reduces per step from what each mode is documented to do, the
bytes of a non-blocking dispatch from the all-gather design, and the routing-map allocations
from the map's shape.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks

WORLD, LAYERS, TOKENS, HIDDEN, EXPERTS, TOPK, STEPS, ROUNDS = 2, 2, 64, 32, 4, 2, 2, 2
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
)
DEEP_EP_MODES = ("deep_ep", "deep_ep+capacity+equal+reuse", "deep_ep+capacity+equal+reuse+rerun")
HAS_DEEP_EP = importlib.util.find_spec("deep_ep") is not None


def _bench(*args, env=None, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "megatron_ext.bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    outputs = ["--json", str(out / "b.json"), "--plot", str(out / "b.png")]
    result = _bench(*TINY, "--world-size", str(WORLD), "--repeat", str(ROUNDS), *outputs)
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
    names = [m["name"] for m in report["modes"]]
    te_modes = ["megatron+te", "blocking+te", "capacity+equal+te"]
    assert names == ["megatron", *OUR_MODES, *DEEP_EP_MODES, *te_modes]
    for name in OUR_MODES:
        assert _mode(report, name)["equal_to_blocking"] == "bitwise", name
        assert _mode(report, name)["status"] == "ok", name
    assert _mode(report, "megatron")["equal_to_blocking"] in ("bitwise", "close")
    if not HAS_DEEP_EP:
        for name in DEEP_EP_MODES:
            assert _mode(report, name)["status"] == "skipped" and "deep_ep" in _mode(report, name)["detail"]
    for name in te_modes:  # CPU ranks: TE's experts need a GPU
        assert _mode(report, name)["status"] == "skipped" and "CUDA GPU" in _mode(report, name)["detail"]
    for name in names:
        assert name in stdout
    assert "OK: outputs and gradients equal blocking's" in stdout


def test_host_syncs_and_all_reduces_per_step(full_run):
    _, report, _ = full_run
    syncs = {m["name"]: m["host_syncs_per_step"] for m in report["modes"]}
    reduces = {m["name"]: m["all_reduces_per_step"] for m in report["modes"]}
    assert syncs["blocking"] == LAYERS  # one count read per forward dispatch; its backward reads nothing
    assert syncs["capacity+pad"] == LAYERS and reduces["capacity+pad"] == LAYERS  # Megatron's pad: max + read
    for name in ("capacity+equal", "capacity+equal+check", "capacity+equal+reuse"):
        assert syncs[name] == 0, (name, _mode(report, name)["sync_examples"])
    assert reduces["capacity+equal"] == 0 and reduces["capacity+equal+reuse"] == 0
    assert reduces["capacity+equal+check"] == LAYERS
    # The overflow re-run policy: one all-reduce and one host read per step, at its end; none per layer.
    assert syncs["capacity+equal+rerun"] == 1 and reduces["capacity+equal+rerun"] == 1
    assert syncs["megatron"] > 0


def test_capacity_modes_dispatch_non_blocking_after_calibration(full_run):
    _, report, _ = full_run
    for name in OUR_MODES[1:]:
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
    result = _bench(*TINY, "--world-size", "2", *overflowing)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAILED mode capacity+equal on rank" in result.stderr
    assert "dispatch needed more than its capacity" in result.stderr


DIFFERS = textwrap.dedent(
    """
    import sys
    from megatron_ext.bench import modes
    everything = modes.all_modes
    def with_a_wrong_mode(factor):
        wrong = modes.Mode("pre-softmax", "other routing probabilities: must differ", (),
                           dict(modes.FLEX, moe_hybridep_implementation="torch", moe_router_pre_softmax=True))
        return (*everything(factor), wrong)
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
        (["--modes", "blocking,fast"], "--modes: unknown mode(s) fast; choose from"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--json", "/no/such/folder/out.json"], "--json /no/such/folder/out.json: cannot write there"),
        (["--json", "/"], "--json /: cannot write there"),
    ],
)
def test_bad_arguments_are_refused_with_the_fix(argv, message, capsys, monkeypatch):
    from megatron_ext.bench.cli import parse

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


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
    assert report._ran_ahead(dict(row, rounds=3, rounds_ran_ahead=2)) == "step in 2/3 rounds"
    assert report._ran_ahead(None) == "-"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_kernel_counter_refuses_without_a_gpu():
    result = subprocess.run(
        [sys.executable, "-m", "megatron_ext.bench.kernels", "--layers", "2"], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 2 and "needs a CUDA GPU" in result.stderr, result.stderr


def test_profile_refuses_a_capacity_factor_below_one():
    result = subprocess.run(
        [sys.executable, "-m", "megatron_ext.bench.profile", "--capacity-factor", "0.5"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 2 and "--capacity-factor 0.5 would drop tokens" in result.stderr, result.stderr
