"""The buffer round trip (`python -m megatron_ext.tooling.roundtrip`) runs across spawned ranks and reports OK."""

import re
import subprocess
import sys

from tests import slots


def _run(*args):
    with slots.lend(2):  # its 2 spawned ranks
        return subprocess.run(
            [sys.executable, "-m", "megatron_ext.tooling.roundtrip", *args], capture_output=True, text=True, timeout=300
        )


def test_roundtrip_on_two_cpu_ranks():
    result = _run(
        "--world-size",
        "2",
        "--tokens",
        "32",
        "--hidden",
        "16",
        "--experts",
        "4",
        "--topk",
        "2",
        "--pad-multiple",
        "4",
        "--iters",
        "1",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK: combine(dispatch(x))" in result.stdout
    assert result.stdout.count("bytes sent per dispatch") == 2  # one line per rank
    for rank in (0, 1):  # bandwidth lines count the same bytes as the traffic line
        traffic_line = rf"rank {rank}: bytes sent per dispatch .*: blocking (\d+) .*, non-blocking (\d+) "
        traffic = re.search(traffic_line, result.stdout)
        for mode, sent in zip(("blocking", "non-blocking"), traffic.groups()):
            bandwidth_line = rf"rank {rank}: {mode}: dispatch (\d+) B in [\d.]+ ms = [\d.e+-]+ GB/s, combine"
            line = re.search(bandwidth_line, result.stdout)
            assert line and line.group(1) == sent, (mode, result.stdout)
        assert result.stdout.count(f"rank {rank}: non-blocking: dispatch") == 1
    assert result.stdout.count("all_to_all_single of the dispatch's bytes") == 4


def test_bad_flags_are_refused_with_the_fix():
    result = _run("--capacity-factor", "0.5")
    assert result.returncode == 2 and "--capacity-factor 0.5 would drop tokens; use >= 1.0" in result.stderr
    result = _run("--topk", "9", "--experts", "8")
    assert result.returncode == 2 and "--topk 9 must be between 1 and --experts (8)" in result.stderr
    result = _run("--experts", "6", "--world-size", "4")
    assert result.returncode == 2 and "--experts 6 must be divisible by --world-size 4" in result.stderr
