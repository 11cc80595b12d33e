"""`python -m megatron_ext.tooling.train_logs`: Megatron training logs compared iteration by iteration."""

from megatron_ext.tooling import train_logs

HEADER = "  global_batch_size ....... 2\n  seq_length .............. 512\n"


def _log(tmp_path, name, rows):
    lines = [
        f" [t] iteration {i:>8}/     300 | elapsed time per iteration (ms): {ms} | lm loss: {loss} | "
        f"load_balancing_loss: 1.1E+00 | grad norm: {norm} | hybridep_capacity_use: 0.667 |"
        for i, ms, loss, norm in rows
    ]
    path = tmp_path / f"train-{name}.log"
    path.write_text(HEADER + "\n".join(lines) + "\n")
    return path


def test_runs_are_compared_with_the_first_at_every_iteration(tmp_path):
    rows = [(i, 20.0 + i % 3, f"1.0{i}E+01", "4.05") for i in range(1, 15)]
    reference = _log(tmp_path, "blocking", rows)
    same = _log(tmp_path, "graphed", [(i, 5.0, loss, norm) for i, _, loss, norm in rows])
    drift = _log(tmp_path, "drifted", [(i, 5.0, loss if i < 12 else "9.9E+00", norm) for i, _, loss, norm in rows])
    out = train_logs.table([train_logs.read(p) for p in (reference, same, drift)])
    lines = out.splitlines()
    assert lines[2].startswith("| blocking | 14 | reference | 21.5 | 47,628 | 0.667 |"), lines[2]
    assert lines[3].startswith("| graphed | 14 | every iteration | 5.0 | 204,800 |"), lines[3]
    assert "| drifted | 14 | no: from 12 |" in lines[4], lines[4]


def test_a_run_that_stopped_early_differs_at_its_first_missing_iteration(tmp_path):
    rows = [(i, 20.0, "1.0E+01", "4.0") for i in range(1, 6)]
    reference = train_logs.read(_log(tmp_path, "a", rows))
    short = train_logs.read(_log(tmp_path, "b", rows[:3]))
    assert train_logs.first_difference(short, reference) == "4 (missing)"
    assert train_logs.first_difference(reference, reference) is None
