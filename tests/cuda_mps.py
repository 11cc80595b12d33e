"""A private CUDA MPS daemon for a test's child processes: several ranks on one GPU whose kernels
must run at once (NVSHMEM's and deep_ep's wait for each other on the device)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

import pytest


@contextlib.contextmanager
def private_mps(ranks: int):
    """Start an MPS daemon of this process's own (pipe and log folders under /tmp) for `ranks`
    client processes, each given 100 / ranks percent of the GPU's threads: NVSHMEM gives the ranks
    of one GPU full support only when their shares sum to 100 or less (else "limited MPG", and it
    ends the process at its first team split). Skips the test where MPS is missing."""
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        pytest.skip("needs CUDA MPS (nvidia-cuda-mps-control) to run ranks of one GPU at once")
    root = os.path.join("/tmp", f"megatron_ext_mps_{os.getpid()}")
    env = {"CUDA_MPS_PIPE_DIRECTORY": f"{root}/pipe", "CUDA_MPS_LOG_DIRECTORY": f"{root}/log"}
    for folder in env.values():
        os.makedirs(folder, exist_ok=True)
    env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(100 // ranks)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    subprocess.run([control, "-d"], check=True, env=os.environ.copy(), timeout=30)
    try:
        yield
    finally:
        subprocess.run([control], input="quit\n", text=True, env=os.environ.copy(), timeout=30)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
