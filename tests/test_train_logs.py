"""`python -m megatron_ext.tooling.train_logs`: Megatron training logs compared iteration by iteration."""

import pytest

from megatron_ext.tooling import train_logs

HEADER = "  global_batch_size ....... 2\n  seq_length .............. 512\n  world_size .............. 1\n"


def _log(rows):
    return HEADER + "".join(
        f" [t] iteration {i:>8}/     300 | elapsed time per iteration (ms): {ms} | lm loss: {loss} | "
        f"load_balancing_loss: 1.1E+00 | grad norm: {norm} | hybridep_capacity_use: 0.667 | "
        f"hybridep_capacity_use_max: 0.{700 + i % 2} |\n"
        for i, ms, loss, norm in rows
    )


def test_logs_are_compared_with_the_first_at_every_iteration():
    rows = [(i, 20.0 + i % 3, f"1.0{i}E+01", "4.05") for i in range(1, 15)]
    logs = {
        "blocking": _log(rows),
        "graphed": _log([(i, 5.0, loss, norm) for i, _, loss, norm in rows]),
        "drifted": _log([(i, 5.0, loss if i < 12 else "9.9E+00", norm) for i, _, loss, norm in rows]),
    }
    lines = train_logs.table(logs).splitlines()
    # median of iterations 11-14: 22, 20, 21, 22 ms -> 21.5; the first iteration's 21.0 as printed;
    # 1024 tokens per iteration on 1 GPU; the largest rank's use: 0.700 and 0.701 in turn over 14
    # iterations -> 0.7005
    assert lines[2] == "| blocking | 14 | reference | 21.5 | 21.0 | 47,628 | 0.667 | 0.700 | 0 | 0 |", lines[2]
    assert lines[3] == "| graphed | 14 | identical | 5.0 | 5.0 | 204,800 | 0.667 | 0.700 | 0 | 0 |", lines[3]
    late = train_logs.table({"resumed": _log([(i, 900.0 if i == 7 else 20.0, "1.0E+01", "4.0") for i in (7, 8)])})
    assert late.splitlines()[2].startswith("| resumed | 2 | reference | - | 900.0 |"), late  # its first logged
    # lm loss 10.12, 10.13 and 10.14 against 9.9 at iterations 12-14: gaps 0.22, 0.23 and 0.24, mean
    # 0.69 / 14; over iterations 5-14 the reference's 10.5 ... 10.9, 10.10 ... 10.14 average 10.41,
    # the drifted run's 0.69 / 10 less
    said = (
        "| drifted | 14 | differs: iteration 12: lm loss 1.012E+01 against 9.9E+00 (lm loss apart by 0.0493 on "
        "average, 0.2400 at most; last 10 iterations' mean 10.3410 against 10.4100) |"
    )
    assert lines[4].startswith(said), lines[4]


def test_the_loss_distance_is_measured_over_the_iterations_both_logged():
    reference = train_logs.parse_log(_log([(i, 20.0, f"{10 - i}.0E+00", "4.0") for i in range(1, 6)]))
    # iterations 3-7, losses 1.5 above the reference's at 3 and 5, equal at 4; 6 and 7 not in the reference
    other = train_logs.parse_log(
        _log([(i, 20.0, f"{10 - i + (1.5 if i in (3, 5) else 0)}E+00", "4.0") for i in range(3, 8)])
    )
    said = "lm loss apart by 1.0000 on average, 1.5000 at most; last 2 iterations' mean 6.2500 against 5.5000"
    assert train_logs.loss_distance(reference, other, last=2) == said
    assert train_logs.loss_distance(reference, reference).startswith(
        "lm loss apart by 0.0000 on average, 0.0000 at most;"
    )
    assert train_logs.loss_distance(reference, {}) is None


def test_a_log_that_stopped_early_differs():
    rows = [(i, 20.0, "1.0E+01", "4.0") for i in range(1, 6)]
    reference, short = train_logs.parse_log(_log(rows)), train_logs.parse_log(_log(rows[:3]))
    said = "logged iterations differ: 5 against 3 (the same at the 3 both logged)"
    assert train_logs.first_difference(reference, short) == said
    drifted = train_logs.parse_log(_log([*rows[:2], (3, 20.0, "9.0E+00", "4.0")]))
    assert train_logs.first_difference(reference, drifted) == "iteration 3: lm loss 1.0E+01 against 9.0E+00"
    assert train_logs.first_difference(reference, reference) is None
    # A run that failed before its first iteration (or a reference that did) is no match.
    assert train_logs.first_difference(reference, {}) == "no iterations logged (see the run's log for why)"
    assert train_logs.first_difference({}, {}).startswith("no iterations logged")
    assert train_logs.first_difference({}, reference) == "the reference logged no iterations"


def test_main_reads_files_named_by_run(tmp_path, capsys):
    rows = [(i, 20.0, "1.0E+01", "4.0") for i in range(1, 4)]
    for name in ("train-a", "train-b"):
        (tmp_path / f"{name}.log").write_text(_log(rows))
    assert train_logs.main([str(tmp_path / "train-a.log"), str(tmp_path / "train-b.log")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("| a | 3 | reference |") and out[3].startswith("| b | 3 | identical |"), out
    for argv, said in (([], "the following arguments are required: LOG"), (["--help"], "the first is the reference")):
        with pytest.raises(SystemExit) as exit_:
            train_logs.main(argv)
        assert exit_.value.code == (2 if argv == [] else 0)
        assert said in "".join(capsys.readouterr())
    with pytest.raises(SystemExit) as exit_:
        train_logs.main([str(tmp_path / "train-a.log"), str(tmp_path / "nowhere.log")])
    assert exit_.value.code == 2 and f"no such log: {tmp_path / 'nowhere.log'}" in capsys.readouterr().err


RERUN_AND_GROWTHS = """\
WARNING:megatron_ext.recovery:megatron-ext: a capacity-mode MoE dispatch overflowed in this step; its gradients are \
discarded and its micro-batches run again with blocking dispatches (re-run 1).
WARNING:megatron_ext.dispatcher:megatron-ext: MoE layer 2: capacity 104 -> 160 (a re-run after an overflow needed: \
106 rows, EP-group max, x 1.5).
WARNING:megatron_ext.dispatcher:megatron-ext: MoE layer 3: capacity 100 -> 152 (a re-run after an overflow needed: \
101 rows, EP-group max, x 1.5).
WARNING:megatron_ext.dispatcher:megatron-ext: MoE layer 2: capacity 104 -> 160 (a re-run after an overflow needed: \
106 rows, EP-group max, x 1.5).
WARNING:megatron_ext.recovery:megatron-ext: a capacity-mode MoE dispatch overflowed in this step; its gradients are \
discarded and its micro-batches run again with blocking dispatches (re-run 2).
"""


def test_reruns_and_capacity_growths_are_counted_once_each():
    # layer 2's growth appears twice (said again, as by another rank of its group): counted once
    assert train_logs.reruns_and_growths(RERUN_AND_GROWTHS) == (2, 2)
    assert train_logs.reruns_and_growths("") == (0, 0)
    rows = [(i, 20.0, "1.0E+01", "4.0") for i in range(1, 4)]
    lines = train_logs.table({"a": _log(rows), "b": _log(rows) + RERUN_AND_GROWTHS}).splitlines()
    assert lines[3].endswith("| 0.667 | 0.701 | 2 | 2 |"), lines[3]
