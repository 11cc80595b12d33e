"""The fused (Triton) paths on CPU: test files re-run under Triton's interpreter.

Triton reads TRITON_INTERPRET when a kernel is defined, so these run in a fresh pytest process.
There `megatron_ext.fused.enabled_for` is true for CPU tensors, and the experts and the PyTorch
HybridEP buffer take the same fused paths they take on a GPU: the kernels against their
references, GroupedMLP against its float64 reference, the buffer against the dense reference at
several world sizes, and the MoE layer's capacity mode bitwise against blocking.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# file -> the least number of tests that must pass there (so a run that skips them all fails).
FILES = {
    "tests/test_fused.py": 25,
    "tests/test_experts.py": 40,
    "tests/test_torch_buffer.py": 25,
    "tests/test_moe_layer.py": 30,
}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="already under the interpreter")
@pytest.mark.parametrize("path", list(FILES))
def test_file_passes_under_the_triton_interpreter(path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-40:])
    assert done.returncode == 0, f"{path} under TRITON_INTERPRET=1 failed:\n{tail}"
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= FILES[path], f"too few tests ran:\n{tail}"
