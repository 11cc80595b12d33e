"""The fused (Triton) paths on CPU: test files re-run under Triton's interpreter.

Triton reads TRITON_INTERPRET when a kernel is defined, so these run in a fresh pytest process.
There `megatron_ext.fused.enabled_for` is true for CPU tensors, and the experts and the PyTorch
HybridEP buffer take the same fused paths they take on a GPU: the kernels against their
references, GroupedMLP against its float64 reference, the buffer against the dense reference at
several world sizes, and the MoE layer's capacity mode bitwise against blocking.

The re-runs take most of the suite's time (some 6 minutes of CPU, two thirds of it in the MoE
layer's), so a run of the whole suite starts them in the background as soon as it has collected
them (`start`, from the conftest), one file after the other, the longest first, while it runs the
other tests; the conftest runs these tests last, and each waits for its file's run. Each re-run is
a pytest process of its own, which holds a heavy-process slot (`tests/slots.py`) like this one.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests import slots

ROOT = Path(__file__).resolve().parents[1]

# file -> the least number of tests that must pass there (so a run that skips them all fails).
# The longest first: the background runs them in this order.
FILES = {
    "tests/test_moe_layer.py": 30,
    "tests/test_torch_buffer.py": 25,
    "tests/test_fused.py": 25,
    "tests/test_experts.py": 40,
}


# Each re-run's limit, from its start.
TIMEOUT_S = 1500

_runs: dict[str, concurrent.futures.Future] = {}
_running: list[subprocess.Popen] = []
_stopped = threading.Event()
_lock = threading.Lock()


def _rerun(path: str) -> tuple[int, str, str]:
    """`path`'s tests in a fresh pytest process under TRITON_INTERPRET=1: (return code, stdout, stderr)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path]
    with _lock:
        if _stopped.is_set():
            raise RuntimeError("the session ended before this re-run started")
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        _running.append(process)
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
        stderr += f"\nstopped after {TIMEOUT_S} s"
    finally:
        with _lock:
            _running.remove(process)
    return process.returncode, stdout, stderr


def start(paths: list[str]) -> None:
    """Start the re-runs of `paths` in the background, one at a time, in FILES' order (the longest
    first): the tests below wait for them. Called by the conftest once the session has collected."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="triton-interpreter")
    for path in FILES:
        if path in paths and path not in _runs:
            _runs[path] = pool.submit(_rerun, path)
    pool.shutdown(wait=False)


def stop() -> None:
    """End the re-runs still running or waiting (the session ended first: a failure with -x, ^C)."""
    with _lock:
        _stopped.set()
        for process in _running:
            process.kill()
    for run in _runs.values():
        run.cancel()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="already under the interpreter")
@pytest.mark.parametrize("path", list(FILES))
def test_file_passes_under_the_triton_interpreter(path):
    with slots.lend(0):  # this process only waits for the re-run, which holds a slot of its own
        returncode, stdout, stderr = _runs[path].result() if path in _runs else _rerun(path)
    tail = "\n".join((stdout + stderr).splitlines()[-40:])
    assert returncode == 0, f"{path} under TRITON_INTERPRET=1 failed:\n{tail}"
    passed = re.search(r"(\d+) passed", stdout)
    assert passed and int(passed.group(1)) >= FILES[path], f"too few tests ran:\n{tail}"
