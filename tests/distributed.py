"""Run a function on W spawned ranks (one spawn, many cases): CPU ranks on gloo, one rank per GPU
on NCCL, or ranks sharing a GPU on gloo (`megatron_ext.tooling.ranks.Placement`); and a module of
this repository in a child process."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_ext.tooling.ranks import Placement, become_rank, placement_of, run_on_ranks
from tests import slots


def _one_thread(rank, world_size, fn, *args):
    # One intra-op thread per rank: the ranks share the cores. Setting OMP_NUM_THREADS here is too
    # late (torch read it at import, in the server the rank was forked from), so torch is told.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    fn(rank, world_size, *args)


# How long a spawned rank waits in one collective before its group fails the test: the slowest
# legitimate wait here (a rank under Triton's interpreter while the others wait) is a few minutes
# on 2 cores; a rank that died or hung fails the test after this, not after torch's 30 minutes.
COLLECTIVE_TIMEOUT_S = 600


# What the server that forks the tests' ranks imports once, so that each rank starts without
# importing them again (some 4 s of CPU a rank for torch and Megatron; the suite starts some 60
# ranks). A module that does not import here is imported by the rank, as it would be when spawned.
FORKSERVER_PRELOAD = (
    "torch",
    "torch.distributed",
    "megatron.core.parallel_state",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.transformer.moe.moe_layer",
    "megatron_ext.patches",
    "megatron_ext.hybridep",
    "tests.megatron_env",
    "tests.reference",
)


def run_ranks(world_size: int, fn, *args, backend: str = "gloo", where: Placement | None = None) -> None:
    """Call fn(rank, world_size, *args) on `world_size` processes forked from a server that has
    imported torch and Megatron (`FORKSERVER_PRELOAD`); re-raise the first failure.

    `fn` must be importable (a module-level function of a test module). With backend "nccl" rank i
    runs on GPU i; `where` places them otherwise. (`megatron_ext.tooling.ranks.run_on_ranks`.) The
    server starts at the first call, with this process's environment then (TRITON_INTERPRET
    included), and serves every later call of this process. The ranks start once `world_size`
    heavy-process slots are free (`tests.slots.lend`; this process waits meanwhile).
    """
    where = where or placement_of(backend)
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(FORKSERVER_PRELOAD))
    with slots.lend(world_size):
        run_on_ranks(
            _one_thread, world_size, fn, *args, where=where, timeout_s=COLLECTIVE_TIMEOUT_S, start_method="forkserver"
        )


@contextlib.contextmanager
def one_rank_group(backend: str, folder: Path):
    """This process as the only rank of a `backend` group (rendezvous file in `folder`; on NCCL,
    GPU 0): yields the group, destroys it on exit. The conftest's gloo_group/nccl_group fixtures."""
    previous = become_rank(placement_of(backend), 0)
    dist.init_process_group(backend, init_method=f"file://{folder / 'init'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
        become_rank(previous, 0)


class Checks:
    """Records the outcome of named checks on one rank ("ok" or the traceback)."""

    def __init__(self):
        self.results = {}

    def run(self, name, fn, *args):
        try:
            fn(*args)
            self.results.setdefault(name, "ok")
        except (Exception, pytest.fail.Exception):  # noqa: BLE001 - recorded, asserted by the parent test
            self.results[name] = traceback.format_exc()

    def save(self, out_dir, rank):
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(self.results, f)


def merged_results(out_dir, world_size) -> dict:
    """Every rank's check outcomes: a check is "ok" only if it is on every rank that ran it."""
    merged = {}
    for rank in range(world_size):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            for name, outcome in json.load(f).items():
                if outcome != "ok" or name not in merged:
                    merged[name] = outcome if outcome == "ok" else f"rank {rank}:\n{outcome}"
    return merged


def rank_results(
    tmp_path_factory, world_size: int, worker, *args, backend: str = "gloo", where: Placement | None = None
) -> dict:
    """run_ranks(world_size, worker, out_dir, *args) into a fresh folder, then merged_results:
    `worker(rank, world_size, out_dir, *args)` saves its Checks in out_dir."""
    out_dir = tmp_path_factory.mktemp(f"{worker.__module__.rsplit('.', 1)[-1]}_world{world_size}")
    run_ranks(world_size, worker, str(out_dir), *args, backend=backend, where=where)
    return merged_results(out_dir, world_size)


def results_fixture(worker, world_sizes, *args):
    """A module-scoped fixture, one parameter per world size: (world size, rank_results of `worker`
    on that many gloo ranks). In a test module: `results = results_fixture(_worker, WORLD_SIZES)`."""

    @pytest.fixture(scope="module", params=world_sizes, ids=lambda w: f"world{w}")
    def results(request, tmp_path_factory):
        return request.param, rank_results(tmp_path_factory, request.param, worker, *args)

    return results


def outcome_test(checks):
    """A test with one case per check, which reads the check's outcome from the module's `results`
    fixture (`results_fixture`). In a test module: `test_x = outcome_test(CHECKS)`."""

    @pytest.mark.parametrize("check", [c.__name__ for c in checks])
    def test(results, check):
        _, outcomes = results
        assert_ok(outcomes, check)

    return test


ROOT = Path(__file__).resolve().parent.parent


def python_module(module: str, *args: str, timeout: float | None = None, env: dict | None = None, heavy: int = 1):
    """`python -m MODULE ARGS` in the repository root, its output captured as text (`env`: added
    to this process's environment); the `subprocess.CompletedProcess`. `heavy`: how many heavy
    processes it is at most (the ranks it spawns), the slots it waits for (`tests.slots.lend`); the
    child itself takes none."""
    child_env = {k: v for k, v in os.environ.items() if k != slots.ENV} | (env or {})
    with slots.lend(heavy):
        return subprocess.run(
            [sys.executable, "-m", module, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            env=child_env,
        )


def timed_out_output(stopped) -> str:
    """What a child process that `subprocess.run` stopped at its timeout had printed, stdout then stderr."""
    parts = (stopped.stdout, stopped.stderr)
    return "".join(part.decode() if isinstance(part, bytes) else part or "" for part in parts)


def assert_ok(results, name):
    assert name in results, f"check {name} never ran"
    assert results[name] == "ok", results[name]
