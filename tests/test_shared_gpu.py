"""Ranks sharing a GPU, what can be checked without one: rank placement
(`megatron_ext.tooling.ranks.Placement`) and the training launcher's stand-ins
(`megatron_ext.tooling.shared_gpu`): LOCAL_RANK mapped to the shared GPU, point-to-point staged
through host copies, ReduceOp.AVG on gloo. On CPU ranks the staging is forced on (a CPU tensor
staged through a host copy takes the same way as a CUDA one); `tests/test_gpu_ranks.py` runs the
rest on a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from megatron_ext.tooling import shared_gpu
from megatron_ext.tooling.ranks import CPU, ONE_PER_GPU, Placement, run_on_ranks
from tests.distributed import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_placement_fills_gpus_in_order_and_picks_the_backend():
    shared = Placement("cuda", ranks_per_gpu=4)
    assert [shared.gpu(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert shared.backend == "gloo" and shared.shares_gpus
    assert ONE_PER_GPU.backend == "nccl" and [ONE_PER_GPU.gpu(r) for r in range(3)] == [0, 1, 2]
    assert CPU.backend == "gloo" and not CPU.shares_gpus
    assert shared.check(8, gpus_visible=2) is None
    assert shared.check(8, gpus_visible=1) == "8 ranks at 4 ranks per GPU need 2 GPU(s); 1 visible"
    assert ONE_PER_GPU.check(2, gpus_visible=1) == "2 ranks at one rank per GPU need 2 GPU(s); 1 visible"
    assert CPU.describe(4) == "4 gloo rank(s) on CPU"


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(device="tpu"), "Placement.device must be 'cpu' or 'cuda'"),
        (dict(device="cuda", ranks_per_gpu=0), "ranks per GPU must be at least 1"),
        (dict(device="cpu", ranks_per_gpu=2), "ranks per GPU is for CUDA ranks"),
    ],
)
def test_a_bad_placement_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        Placement(**fields)


def test_run_on_ranks_refuses_a_backend_that_contradicts_the_placement():
    with pytest.raises(ValueError, match="backend 'nccl' does not fit"):
        run_on_ranks(print, 2, backend="nccl", where=Placement("cuda", ranks_per_gpu=2))


def test_run_on_ranks_refuses_more_gpus_than_are_visible(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="need 2 GPU"):
        run_on_ranks(print, 2, where=ONE_PER_GPU)


def _launch(tmp_path, *argv, local_rank="3"):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys
            import torch.distributed as dist
            import torch.distributed.distributed_c10d as c10d
            print("LOCAL_RANK", os.environ["LOCAL_RANK"], "argv", sys.argv[1:])
            print("staged", dist.isend.__name__, c10d.irecv.__name__, dist.all_reduce.__name__,
                  dist._coalescing_manager.__name__)
            """
        )
    )
    env = dict(os.environ, LOCAL_RANK=local_rank)
    if local_rank is None:
        env.pop("LOCAL_RANK")
    return subprocess.run(
        [sys.executable, "-m", "megatron_ext.tooling.shared_gpu", *argv, str(script) if argv else ""],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )


def test_the_launcher_runs_the_script_with_its_gpu_and_stand_ins(tmp_path):
    script = tmp_path / "train.py"
    result = _launch(tmp_path, "--ranks-per-gpu", "4")  # script given below with its flags
    assert result.returncode == 2  # no script flags yet: --distributed-backend missing
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_ext.tooling.shared_gpu",
            "--ranks-per-gpu",
            "2",
            str(script),
            "--distributed-backend",
            "gloo",
            "--lr",
            "1e-4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=dict(os.environ, LOCAL_RANK="3"),
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "LOCAL_RANK 1 argv ['--distributed-backend', 'gloo', '--lr', '1e-4']"
    assert lines[1] == "staged staged_isend staged_irecv all_reduce_with_avg coalescing_manager"


def test_the_launcher_refuses_nccl_with_shared_gpus_in_one_line(tmp_path):
    result = _launch(tmp_path, "--ranks-per-gpu", "4")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "4 ranks per GPU need --distributed-backend gloo" in lines[0] and "NCCL refuses" in lines[0]


def test_the_launcher_refuses_to_run_outside_torchrun(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("print('ran')\n")
    result = subprocess.run(
        [sys.executable, "-m", "megatron_ext.tooling.shared_gpu", "--ranks-per-gpu", "1", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "LOCAL_RANK"},
    )
    assert result.returncode == 2 and "run it under torchrun" in result.stderr and "ran" not in result.stdout
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def _p2p_on_ranks(rank, world):
    """Forced staging on CPU ranks: Megatron's way (P2POp with dist.isend/irecv, then
    batch_isend_irecv and wait), blocking send/recv, and AVG."""
    shared_gpu.install(stages=lambda tensor, group: True)
    try:
        peer = 1 - rank
        sent = torch.full((3, 2), float(rank + 1))
        received = torch.zeros(3, 2, requires_grad=True)  # as Megatron's pipeline schedules make them
        ops = [dist.P2POp(dist.isend, sent, peer), dist.P2POp(dist.irecv, received, peer)]
        ops = ops if rank == 0 else ops[::-1]
        works = dist.batch_isend_irecv(ops)
        assert all(isinstance(w, shared_gpu.StagedWork) for w in works), works
        sent.fill_(-1.0)  # after the send was staged: the peer must still get the value sent
        for work in works:
            work.wait()
        assert torch.equal(received.detach(), torch.full((3, 2), float(peer + 1))), received
        blocking = torch.zeros(4, requires_grad=True)
        if rank == 0:
            dist.send(torch.arange(4.0), 1)
        else:
            dist.recv(blocking, 0)
            assert torch.equal(blocking.detach(), torch.arange(4.0)), blocking
        mean = torch.tensor([float(rank), 10.0])
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        assert torch.equal(mean, torch.tensor([0.5, 10.0])), mean
        # Megatron's gradient reduction: async all-reduces in a coalescing block, then cm.wait()
        buckets = [torch.full((5,), float(rank + 1)), torch.full((3,), 2.0 * (rank + 1))]
        with dist._coalescing_manager(async_ops=True) as cm:
            for bucket in buckets:
                dist.all_reduce(bucket, async_op=True)
            assert torch.equal(buckets[0], torch.full((5,), 3.0))  # each ran at once, to its end
        cm.wait()
        assert torch.equal(buckets[1], torch.full((3,), 6.0)), buckets
    finally:
        shared_gpu.uninstall()
    assert dist.isend is shared_gpu.c10d.isend and dist.isend.__name__ == "isend"
    assert dist._coalescing_manager.__name__ == "_coalescing_manager"


def test_point_to_point_and_avg_go_through_the_stand_ins():
    run_ranks(2, _p2p_on_ranks)
