"""The training-loop readers: a profiler trace's per-iteration figures (loop_profile) and one shape's
runs side by side (train_shapes), on traces and logs written here with known answers."""

from __future__ import annotations

import gzip
import json
import os

import pytest

from megatron_ext.tooling import loop_profile, train_shapes

GROUPED = "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversalINS5_17GroupProblemShapeIN4cute5tupleIJiiiEEEE"  # noqa: E501


def _x(cat: str, name: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1}


def _trace(steps: int = 2) -> list[dict]:
    """`steps` iterations of 1000 µs on the host; per iteration, on the GPU: two overlapping kernels
    (union 15 µs), a grouped GEMM of 10 µs, a copy of 5 µs; the host: 2 waits of 4 µs, 3 launches."""
    events = []
    for i in range(steps):
        t = i * 1000.0
        events += [
            _x("user_annotation", f"ProfilerStep#{10 + i}", t, 1000),
            _x("gpu_user_annotation", f"ProfilerStep#{10 + i}", t, 1000, tid=7),  # the GPU's copy: not a step
            _x("kernel", "void at::native::vectorized_elementwise_kernel<4, Foo<int>>(int, Foo)", t + 0, 10, tid=7),
            _x("kernel", "void at::native::vectorized_elementwise_kernel<4, Foo<int>>(int, Foo)", t + 5, 10, tid=7),
            _x("kernel", GROUPED, t + 100, 10, tid=7),
            _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", t + 200, 5, tid=7),
            _x("cuda_runtime", "cudaStreamSynchronize", t + 300, 4),
            _x("cuda_runtime", "cudaEventSynchronize", t + 310, 4),
            _x("cuda_runtime", "cudaLaunchKernel", t + 1, 2),
            _x("cuda_runtime", "cudaLaunchKernel", t + 3, 2),
            _x("cuda_driver", "cuLaunchKernelEx", t + 5, 2),
            _x("cuda_runtime", "cudaMemcpyAsync", t + 199, 2),
            _x("cpu_op", "aten::add", t + 1, 3),
        ]
    return events


def test_summarize_counts_host_steps_and_the_union_of_gpu_work():
    s = loop_profile.summarize(_trace(2))
    assert s["iterations"] == 2  # the gpu_user_annotation twins of ProfilerStep# are not steps
    assert s["wall_ms"] == pytest.approx(1.0)
    assert s["gpu_busy_ms"] == pytest.approx((15 + 10 + 5) / 1e3)  # overlapping kernels count once
    assert s["host_waits"] == 2 and s["host_wait_ms"] == pytest.approx(0.008)
    assert s["launches"] == 3  # cudaMemcpyAsync is no launch
    cats = s["categories"]
    assert cats["elementwise"] == {"calls": 2, "ms": pytest.approx(0.020)}  # summed, not unioned
    assert cats["grouped GEMM (experts)"]["ms"] == pytest.approx(0.010)
    assert cats["copy, memset"]["ms"] == pytest.approx(0.005)
    assert s["kernels"][0]["kernel"] == "at::native::vectorized_elementwise_kernel<>"
    assert [k["ms"] for k in s["kernels"]] == sorted((k["ms"] for k in s["kernels"]), reverse=True)


def test_copies_are_grouped_by_size_and_by_the_host_ops_that_issued_them():
    def copy(ts, mib, corr):
        event = _x("gpu_memcpy", "Memcpy DtoD (Device -> Device)", ts, 20, tid=7)
        return {**event, "args": {"bytes": mib * 2**20, "correlation": corr}}

    def call(name, ts, corr, tid=2):
        return {**_x("cuda_runtime", name, ts, 1, tid=tid), "args": {"correlation": corr}}

    events = []
    for i in range(2):
        t = i * 1000.0
        events += [
            _x("user_annotation", f"ProfilerStep#{i}", t, 1000),
            # autograd's thread: a node whose clone copies 64 MiB twice, each inside aten::copy_
            _x("cpu_op", "autograd::engine::evaluate_function: AccumulateGrad", t + 10, 100, tid=2),
            _x("cpu_op", "aten::clone", t + 20, 30, tid=2),
            _x("cpu_op", "aten::copy_", t + 25, 10, tid=2),
            call("cudaMemcpyAsync", t + 30, 10 * i + 1),
            _x("cpu_op", "aten::clone", t + 60, 30, tid=2),
            _x("cpu_op", "aten::copy_", t + 65, 10, tid=2),
            call("cudaMemcpyAsync", t + 70, 10 * i + 2),
            copy(t + 300, 64, 10 * i + 1),
            copy(t + 330, 64, 10 * i + 2),
            # the main thread: a graph replay holding a 1 MiB copy; a copy no call is known for
            _x("cpu_op", "GraphedBackward", t + 200, 50, tid=1),
            call("cudaGraphLaunch", t + 210, 10 * i + 3, tid=1),
            copy(t + 400, 1, 10 * i + 3),
            copy(t + 450, 2, 999 + i),
        ]
    copies = loop_profile.summarize(events)["copies"]
    assert copies[0] == {
        "kind": "Memcpy DtoD",
        "mib": 64.0,
        "issued_by": "cudaMemcpyAsync",
        "ops": "autograd::engine::evaluate_function: AccumulateGrad > aten::copy_",
        "calls": 2,
        "ms": pytest.approx(0.040),
    }
    rest = {(c["mib"], c["issued_by"], c["ops"]): c["calls"] for c in copies[1:]}
    assert rest == {(1.0, "cudaGraphLaunch", "GraphedBackward"): 1, (2.0, "", ""): 1}
    table = loop_profile.markdown(loop_profile.summarize(events))
    ops = "autograd::engine::evaluate_function: AccumulateGrad > aten::copy_"
    row = f"| Memcpy DtoD | 64.0 | cudaMemcpyAsync | {ops} | 2 |"
    assert row in table


def test_gpu_idle_is_split_where_the_host_ends_forward_and_backward():
    events = [
        _x("user_annotation", "ProfilerStep#3", 0, 10_000),
        _x("kernel", "k", 0, 1000, tid=7),
        _x("kernel", "k", 5000, 1000, tid=7),
        _x("cpu_op", "autograd::engine::evaluate_function: MulBackward0", 300, 100, tid=2),
        _x("cpu_op", "autograd::engine::evaluate_function: AddBackward0", 2000, 600, tid=2),  # ends at 2600
        _x("cpu_op", "Optimizer.step#AdamW.step", 7000, 500),
    ]
    s = loop_profile.summarize(events)
    assert s["gpu_idle_forward_backward_ms"] == pytest.approx(1.6)  # 1000-2600
    assert s["gpu_idle_step_end_ms"] == pytest.approx(2.4 + 4.0)  # 2600-5000, 6000-10000
    assert s["gpu_busy_ms"] == pytest.approx(2.0)
    graphed = [e for e in events if not e["name"].startswith("autograd")]
    graphed.append(_x("cuda_runtime", "cudaGraphLaunch", 4000, 10))  # a graph of the step: its launch ends it
    s = loop_profile.summarize(graphed)
    assert s["gpu_idle_forward_backward_ms"] == pytest.approx(3.01)  # 1000-4010
    no_marks = loop_profile.summarize(_trace(2))  # nothing marks the end: all of a step's idle time
    assert no_marks["gpu_idle_forward_backward_ms"] == pytest.approx(0.970)
    assert no_marks["gpu_idle_step_end_ms"] == 0


def _frame(name: str, ts: float, dur: float, pid: int, parent: int | None, tid: int = 1) -> dict:
    event = _x("python_function", name, ts, dur, tid)
    event["args"] = {"Python id": pid, "Python parent id": parent}
    return event


def test_host_time_charges_each_frame_to_its_package_or_its_callers():
    events = [
        _x("user_annotation", "ProfilerStep#5", 0, 1000),
        # Main thread: Megatron's schedule -> megatron-ext's dispatch -> torch -> a built-in; TE's layer;
        # then autograd's backward, which the main thread waits in.
        _frame("site/megatron/core/pipeline_parallel/schedules.py(10): forward_step", 0, 900, 1, None),
        _frame("/r/megatron_ext/dispatcher.py(352): dispatch", 10, 300, 2, 1),
        _frame("site/torch/nn/functional.py(5): pad", 20, 100, 3, 2),
        _frame("<built-in method pad of type object>", 30, 60, 4, 3),
        _frame("/r/megatron_ext/capacity/policy.py(300): _assert_no_overflow", 150, 50, 5, 2),  # nested: no entry
        _frame("site/transformer_engine/pytorch/module/linear.py(9): forward", 400, 200, 6, 1),
        _frame("site/torch/autograd/__init__.py(1): backward", 650, 240, 7, 1),
        _frame("<built-in method run_backward of torch._C._EngineBase object>", 660, 220, 8, 7),
        # Autograd's thread: a custom Function's backward enters megatron-ext from torch.
        _frame("site/torch/autograd/function.py(300): apply", 700, 100, 9, None, tid=2),
        _frame("/r/megatron_ext/hybridep/autograd.py(80): backward", 710, 80, 10, 9, tid=2),
        _frame("megatron_ext/dispatcher.py(352): dispatch", 2000, 50, 11, None),  # after the profiled steps
        # A background thread that waits through the step: none of the step's work, left out.
        _frame("python3.12/threading.py(300): wait", 0, 1000, 12, None, tid=3),
        _frame("<built-in method acquire of _thread.lock object>", 0, 1000, 13, 12, tid=3),
    ]
    host = loop_profile.summarize(events)["host"]
    assert host["host_packages"] == {
        # megatron-ext: dispatch 300 (torch's pad and its built-in under it) + the backward 80; TE 200;
        # schedules: 900 - 300 - 200 - 240 = 160 of its own, + 20 of torch's backward frame it called.
        "megatron-ext": pytest.approx(0.380),
        "transformer-engine": pytest.approx(0.200),
        "megatron-core": pytest.approx(0.180),
        "torch and Python, called by none of these": pytest.approx(0.020),  # apply's own 100 - 80
    }
    # run_backward's 220 µs: the main thread waiting for autograd's thread, charged to no package.
    assert host["waiting_for_backward_ms"] == pytest.approx(0.220)
    calls = {c["function"]: (c["calls"], c["ms"]) for c in host["megatron_ext_calls"]}
    assert calls == {
        "megatron_ext/dispatcher.py(352): dispatch": (1, pytest.approx(0.300)),
        "megatron_ext/hybridep/autograd.py(80): backward": (1, pytest.approx(0.080)),
    }
    assert "Host Python time per iteration" in loop_profile.markdown(loop_profile.summarize(events))
    assert "host" not in loop_profile.summarize(_trace(2))  # no Python frames recorded: no host section


def test_callees_that_outlast_their_caller_leave_it_no_time_and_are_reported(tmp_path):
    """A frame whose recorded callees add up to more than its own length (seen in a blocking run's
    trace) gets no time of its own, never a negative one; the excess is reported beside the packages."""
    events = [
        _x("user_annotation", "ProfilerStep#5", 0, 100_000),
        _frame("site/megatron/core/pipeline_parallel/schedules.py(10): forward_step", 0, 90_000, 1, None),
        _frame("/r/megatron_ext/dispatcher.py(352): dispatch", 10, 10_000, 2, 1),
        _frame("site/megatron/core/transformer/moe/token_dispatcher.py(5): f", 20, 7_000, 3, 2),
        _frame("site/megatron/core/transformer/moe/token_dispatcher.py(6): g", 30, 7_000, 4, 2),
    ]
    host = loop_profile.summarize(events)["host"]
    assert host["host_packages"]["megatron-ext"] == 0.0  # 10 - (7 + 7) ms: none, not -4
    assert host["children_past_parents_ms"] == pytest.approx(4.0)
    assert "callees outlasting their callers: 4.00 ms" in loop_profile.markdown(loop_profile.summarize(events))
    _write_run(tmp_path, "h", "blocking", _log([100.0] * 3, ["1.0E+00"] * 3, 1024), 1, events)
    text, _ = train_shapes.report(tmp_path, "h", profile_start=3)
    assert "| host Python ms (with call stacks): callees past callers | 4.0 |" in text
    assert "| host Python ms (with call stacks): megatron-ext | 0.0 |" in text


def test_host_time_reads_torchs_own_trace_of_a_megatron_ext_call(tmp_path):
    import torch

    from megatron_ext.capacity import capacity_from_rows

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as prof:
        for step in range(2):
            with torch.profiler.record_function(f"ProfilerStep#{step}"):
                for rows in range(3):
                    capacity_from_rows(100 + rows, 1.5, None)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    host = loop_profile.summarize(loop_profile.load(path))["host"]
    entries = {c["function"].split(": ")[-1]: c["calls"] for c in host["megatron_ext_calls"]}
    assert entries == {"capacity_from_rows": 3}  # per iteration
    assert host["host_packages"]["megatron-ext"] > 0


def test_a_trace_without_profiled_steps_is_refused():
    with pytest.raises(ValueError, match="ProfilerStep"):
        loop_profile.summarize([e for e in _trace(1) if e["cat"] != "user_annotation"])


@pytest.mark.parametrize(
    "name, expected",
    [
        (GROUPED, "grouped GEMM (experts)"),
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "GEMM (attention, router, output)"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "NCCL"),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<Adam>()", "optimizer"),
        ("_gather_rows_kernel", "megatron-ext dispatch (Triton)"),
        ("_activation_probs_kernel", "megatron-ext activation (Triton)"),
        ("memcpy32_post", "copy, memset"),
        ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<8>()", "attention softmax"),
        ("something_else", loop_profile.OTHER),
    ],
)
def test_kernel_categories(name, expected):
    assert loop_profile.category(name) == expected


def test_short_name_drops_templates_and_parameters():
    assert loop_profile.short_name("void a::b<c<d>, e>(int, f<g>)") == "a::b<>"
    assert loop_profile.short_name("x" * 200, width=10) == "x" * 7 + "..."


ARGS = "  global_batch_size ............................... 2\n  seq_length ...................................... 4096\n  world_size ...................................... 1\n"  # noqa: E501


def _log(times: list[float], losses: list[str], peak: int, norms: list[float] | None = None) -> str:
    lines = [ARGS]
    for i, (ms, loss, norm) in enumerate(zip(times, losses, norms or [2.0] * len(times)), start=1):
        lines.append(
            f" [2026-12-04 17:00:00] iteration {i:8d}/{len(times):8d} | elapsed time per iteration (ms): {ms} "
            f"| lm loss: {loss} | load_balancing_loss: 1.0E+00 | grad norm: {norm} |"
        )
    lines.append(f"megatron-ext example: rank 0: peak GPU memory allocated {peak} MiB, reserved {peak + 10} MiB")
    return "\n".join(lines)


def _write_run(directory, shape: str, run: str, text: str, mtime: int, trace: list | None = None) -> None:
    log = directory / f"train-{shape}-{run}.log"
    log.write_text(text)
    os.utime(log, (mtime, mtime))
    if trace is not None:
        path = directory / f"prof-{shape}-{run}" / "torch_profile"
        path.mkdir(parents=True)
        with gzip.open(path / "rank-0.json.gz", "wt") as f:
            json.dump({"traceEvents": trace}, f)


def test_train_shapes_compares_runs_over_the_iterations_before_the_profile(tmp_path):
    # 14 iterations: 1-10 skipped (SKIP_ITERS), 11-12 timed, 13-14 profiled (slow: not in the median).
    n = 14
    assert train_shapes.SKIP_ITERS == 10
    losses = [f"{10 - i * 0.1:.6E}" for i in range(n)]
    _write_run(tmp_path, "s", "blocking", _log([500.0] * 10 + [200.0, 210.0, 900.0, 900.0], losses, 2048), 1, _trace())
    capacity_losses = losses[:12] + ["1.0E+00"] + losses[13:]  # iteration 13 differs
    _write_run(
        tmp_path, "s", "capacity-eager", _log([500.0] * 10 + [100.0, 105.0, 900.0, 900.0], capacity_losses, 3072), 2
    )
    _write_run(tmp_path, "s", "stock", _log([500.0] * 10 + [410.0, 410.0, 900.0, 900.0], losses, 2048), 3)
    text, record = train_shapes.report(tmp_path, "s", profile_start=13)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in text.splitlines()[2:5]}
    assert list(rows) == ["blocking", "capacity-eager", "stock"]  # in the order they ran
    blocking, capacity, stock = rows["blocking"], rows["capacity-eager"], rows["stock"]
    assert blocking[1] == "reference" and stock[1] == "identical"
    # 10 - 12 x 0.1 logged against 1.0: its largest relative deviation, the grad norms equal.
    assert (
        capacity[1]
        == f"differs from iteration 13: lm loss {(8.8 - 1.0) / 8.8:.1e}, grad norm 0.0e+00 (largest relative)"
    )
    assert blocking[2] == "205.0" and capacity[2] == "102.5" and stock[2] == "410.0"  # medians of 11-12
    assert capacity[3] == f"{2 * 4096 / 0.1025:,.0f}"  # tokens/s: global batch x sequence / step
    assert blocking[4] == "0.0" and blocking[5] == f"{205.0 / 0.030:.2f}x"  # step over GPU-busy time
    assert capacity[4] == "-"  # not profiled
    assert capacity[7:10] == ["3.0", "0.50x", "0.25x"] and capacity[10] == "1.50x"  # peak GiB; ratios
    assert "| elementwise | 0.02 |" in text
    assert record["runs"]["capacity-eager"]["peak_mib"] == 3072
    assert record["runs"]["blocking"]["profile"]["iterations"] == 2
    assert "host Python ms" not in text  # no call stacks recorded


def _profiler_listing(start: int | None) -> str:
    """Megatron's argument listing of the profiler: on from iteration `start`, or off (None)."""
    on = start is not None
    dots = "." * 30
    return f"  profile {dots} {on}\n  profile_step_start {dots} {start or 10}\n"


def test_each_runs_median_stops_where_its_own_log_says_its_profile_starts(tmp_path):
    """Runs of one table made with different ITERS: each run's median stops at the profile start
    its own argument listing names; a run without a profiler stops nowhere; a log without the
    listing falls back to the caller's profile start."""
    slow = 900.0  # profiled iterations
    timed = {"long": ([100.0] * 10 + [200.0] * 5 + [slow] * 3, 16), "short": ([100.0] * 10 + [300.0, slow, slow], 12)}
    for mtime, (name, (times, start)) in enumerate(timed.items(), start=1):
        log = _log(times, [f"{5 - i * 0.1:.6E}" for i in range(len(times))], 1024)
        _write_run(tmp_path, "m", name, _profiler_listing(start) + log, mtime)
    unprofiled = [100.0] * 10 + [400.0, 500.0, 600.0]
    _write_run(tmp_path, "m", "off", _profiler_listing(None) + _log(unprofiled, ["1.0E+00"] * 13, 1024), 3)
    _write_run(tmp_path, "m", "bare", _log([100.0] * 10 + [700.0, 800.0, slow], ["1.0E+00"] * 13, 1024), 4)
    _, record = train_shapes.report(tmp_path, "m", profile_start=13)
    runs = record["runs"]
    assert [runs[n]["ms"] for n in ("long", "short", "off", "bare")] == [200.0, 300.0, 500.0, 750.0]
    assert [runs[n]["profile_start"] for n in ("long", "short", "off", "bare")] == [16, 12, None, 13]


def test_train_shapes_prints_a_records_tables_again_from_its_json(tmp_path, capsys):
    """`--from-json` prints what the run printed, from the JSON record alone; it takes no directory."""
    losses = [f"{10 - i * 0.1:.6E}" for i in range(4)]
    _write_run(tmp_path, "s", "blocking", _log([100.0] * 4, losses, 2048), 1, _trace())
    _write_run(tmp_path, "s", "capacity-eager", _log([90.0] * 4, losses[:3] + ["1.0E+00"], 2048), 2)
    (tmp_path / "train-s-megatron-budget.skipped").write_text("needs deep_ep")
    record = tmp_path / "record.json"
    runs = ["--runs", "blocking", "capacity-eager", "megatron-budget"]
    assert train_shapes.main([str(tmp_path), "s", "--profile-start", "3", *runs, "--json", str(record)]) == 0
    printed = capsys.readouterr().out
    assert "skipped megatron-budget: needs deep_ep" in printed and "| elementwise |" in printed
    assert train_shapes.main(["--from-json", str(record)]) == 0
    assert capsys.readouterr().out == printed
    for argv in (["--from-json", str(record), str(tmp_path), "s"], ["--from-json", str(tmp_path / "none.json")], []):
        with pytest.raises(SystemExit):
            train_shapes.main(argv)
    assert "--from-json" in capsys.readouterr().err


def test_the_gpu_harness_tables_runs_made_by_earlier_calls_without_running_any(tmp_path):
    """`TABLE_ONLY=1 .ci/gpu-suite train-shapes SHAPE`: the table of the runs already in $OUT, in the
    harness's order, named by MEGATRON_EXT_COMMIT; nothing trains (no GPU here: a run would fail)."""
    import subprocess
    import sys

    for run, ms in (("capacity-eager", 90.0), ("blocking", 100.0)):
        _write_run(tmp_path, "qwen3-30b-a3b-e64", run, _log([ms] * 30, ["1.0E+00"] * 30, 1024), 1)
    env = dict(
        os.environ, OUT=str(tmp_path), TABLE_ONLY="1", ITERS="30", PYTHON=sys.executable, MEGATRON_EXT_COMMIT="abc1234"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def table_only():
        command = ["bash", ".ci/gpu-suite", "train-shapes", "qwen3-30b-a3b-e64"]
        return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)

    done = table_only()
    assert "=== train-shapes" not in done.stdout, done.stdout  # no run started
    rows = [
        line.split("|")[1].strip() for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line
    ]
    assert rows == ["run", "blocking", "capacity-eager"]  # the harness's order, not the logs'
    record = json.loads((tmp_path / "train-shapes-qwen3-30b-a3b-e64.json").read_text())
    assert record["setup"]["commit"] == "abc1234" and record["runs"]["capacity-eager"]["ms"] == 90.0
    env["OUT"] = str(tmp_path / "empty")
    nothing = table_only()
    assert nothing.returncode == 2 and "TABLE_ONLY=1: no run of qwen3-30b-a3b-e64" in nothing.stderr


def test_train_shapes_lists_host_time_by_package_for_traces_with_call_stacks(tmp_path):
    trace = _trace(1) + [
        _frame("megatron/core/schedules.py(1): forward_step", 0, 800, 1, None),
        _frame("megatron_ext/dispatcher.py(352): dispatch", 10, 300, 2, 1),
    ]
    _write_run(tmp_path, "h", "capacity-eager", _log([100.0] * 3, ["1.0E+00"] * 3, 1024), 1, trace)
    text, record = train_shapes.report(tmp_path, "h", profile_start=3)
    assert "| host Python ms (with call stacks): megatron-ext | 0.3 |" in text
    assert "| host Python ms (with call stacks): megatron-core | 0.5 |" in text
    assert record["runs"]["capacity-eager"]["profile"]["host"]["megatron_ext_calls"][0]["calls"] == 1


def _grad_norm_log(grad_norms: list[float], losses: list[float]) -> str:
    return _log([100.0] * len(losses), [f"{x:.6E}" for x in losses], 1024, grad_norms)


def test_train_shapes_measures_runs_on_other_kernels_against_stocks_deviation(tmp_path):
    # Stock strays from blocking by 1 % in loss and 10 % in grad norm; one run stays within that,
    # one goes beyond it in grad norm alone; a skipped run is named with its reason, in --runs order.
    losses, norms = [4.0, 3.0, 2.0], [10.0, 10.0, 10.0]
    _write_run(tmp_path, "q", "blocking", _grad_norm_log(norms, losses), 1)
    _write_run(tmp_path, "q", "stock", _grad_norm_log([10.0, 11.0, 10.0], [4.0, 3.0, 2.02]), 2)
    _write_run(tmp_path, "q", "near", _grad_norm_log([10.0, 10.5, 10.0], [4.0, 3.0, 2.01]), 3)
    _write_run(tmp_path, "q", "far", _grad_norm_log([10.0, 10.0, 12.0], [4.0, 3.0, 2.0]), 4)
    _write_run(tmp_path, "q", "twin", _grad_norm_log(norms, losses), 5)
    (tmp_path / "train-q-budget.skipped").write_text("skipped budget: needs Transformer Engine's layers\n")
    # A log of another shape whose name starts like this one's is no run of it.
    _write_run(tmp_path, "q-e64", "blocking", _grad_norm_log(norms, losses), 6)
    runs = ["blocking", "stock", "budget", "near", "far", "twin"]
    text, record = train_shapes.report(tmp_path, "q", None, runs, {"layers": "te", "micro_batches": 8})
    rows = {line.split("|")[1].strip(): line.split("|")[3].strip() for line in text.splitlines()[2:7]}
    assert list(rows) == ["blocking", "stock", "near", "far", "twin"]
    assert rows["twin"] == "identical"
    assert rows["stock"] == "differs from iteration 2: lm loss 1.0e-02, grad norm 1.0e-01 (largest relative)"
    assert rows["near"].endswith(", within stock's") and rows["near"].startswith(
        "differs from iteration 2: lm loss 5.0e-03"
    )
    assert rows["far"].endswith(", beyond stock's") and "grad norm 2.0e-01" in rows["far"]
    assert "skipped budget: skipped budget: needs Transformer Engine's layers" in text
    assert record["setup"] == {"layers": "te", "micro_batches": 8}
    assert record["runs"]["budget"] == {
        "run": "budget",
        "status": "skipped",
        "why": "skipped budget: needs Transformer Engine's layers",
    }
    assert record["runs"]["twin"]["losses"] == "identical" and record["runs"]["blocking"]["losses"] == "reference"
    far = record["runs"]["far"]["losses"]
    assert far["from_iteration"] == 3 and far["lm loss"] == 0.0 and abs(far["grad norm"] - 0.2) < 1e-12
    assert record["runs"]["stock"]["lm_loss"] == {1: 4.0, 2: 3.0, 3: 2.02}
    with pytest.raises(FileNotFoundError, match="no train-q-missing.log"):
        train_shapes.report(tmp_path, "q", None, ["blocking", "missing"])


def test_train_shapes_shows_whether_the_curves_of_runs_that_differ_stay_together(tmp_path):
    """Mean losses over 4 spans of blocking's 9 iterations (3, 2, 2, 2): blocking's own, and each
    differing run's relative to them; an identical run gets no row; a span a run did not log all of
    gets "-"; the same table comes back from the JSON record; without a differing run, no table."""
    blocking = [9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0]
    stock = [9.9, 8.8, 7.7, 6.0, 5.0, 4.0, 3.0, 1.0, 1.0]  # +10 % in the first span, -1/3 in the last
    norms = [1.0] * 9
    _write_run(tmp_path, "c", "blocking", _grad_norm_log(norms, blocking), 1)
    _write_run(tmp_path, "c", "stock", _grad_norm_log(norms, stock), 2)
    _write_run(tmp_path, "c", "twin", _grad_norm_log(norms, blocking), 3)
    _write_run(tmp_path, "c", "short", _grad_norm_log(norms[:6], [9.0, 8.0, 7.0, 6.6, 5.5, 4.0]), 4)
    text, record = train_shapes.report(tmp_path, "c", None, ["blocking", "stock", "twin", "short"])
    table = text.split("do the curves stay together):\n\n")[1].split("\n\n")[0].splitlines()
    assert table[0] == "| run | iterations 1-3 | iterations 4-5 | iterations 6-7 | iterations 8-9 |"
    assert table[2:] == [
        "| blocking | 8.0000 | 5.5000 | 3.5000 | 1.5000 |",
        "| stock | +10.00% | +0.00% | +0.00% | -33.33% |",
        "| short | +0.00% | +10.00% | - | - |",
    ]
    assert train_shapes.markdown(json.loads(json.dumps(record))) == text
    text, _ = train_shapes.report(tmp_path, "c", None, ["blocking", "twin"])
    assert "curves" not in text


def test_train_shapes_setup_names_the_stack(monkeypatch):
    monkeypatch.setattr(train_shapes, "_version", lambda *names: f"v-{names[0]}")
    got = train_shapes.setup("te", 8, 4096)
    assert got["layers"] == "te" and got["micro_batches"] == 8 and got["sequence"] == 4096
    assert got["megatron_core"] == "v-megatron-core" and got["transformer_engine"] == "v-transformer-engine"
    assert got["card"] == "cpu" and got["implementation"] in ("deep_ep", "torch") and got["commit"]
    assert set(got) == {
        "card",
        "megatron_core",
        "transformer_engine",
        "deep_ep",
        "implementation",
        "layers",
        "micro_batches",
        "sequence",
        "commit",
    }
    monkeypatch.setenv("MEGATRON_EXT_COMMIT", "abc1234")  # set where a copy's git metadata lags its files
    assert train_shapes.setup("te", 8, 4096)["commit"] == "abc1234"


def test_train_shapes_without_logs_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no train-x-"):
        train_shapes.report(tmp_path, "x", None)
