"""Expert parallelism on GPU ranks: the CPU rank suites' checks with every tensor on a GPU.

Two placements (`megatron_ext.tooling.ranks.Placement`):
- **ranks sharing one GPU** (W = 2 and 4 by default; `MEGATRON_EXT_SHARED_GPU_RANKS="2 4 8"` sets
  them): W processes on GPU 0 over gloo, which stages CUDA tensors through host memory. Every GPU
  kernel and layout of W ranks runs (remote rows, an EP-group maximum that differs from the local
  count, one rank overflowing while the others do not); nothing here is a speed figure. Needs one
  GPU.
- **one NCCL rank per GPU** on a machine with two GPUs or more (W = the GPUs).

Each placement and W runs the suites in one spawn, inside a child process with a deadline (a
hang fails the test with the child's output instead of waiting): the buffer checks of
`tests/test_torch_buffer.py`, the MoE layer checks of `tests/test_moe_layer.py` (TP 2 x EP 2 at 4
ranks), the overflow re-run policy's of `tests/test_recovery.py` and the static expert splits' of
`tests/test_static_splits.py`. Left out of those: checks whose failure path is a device assert
(on a GPU it ends the process instead of raising; `test_one_rank_overflows_on_the_device` runs it
at W ranks in a process of its own), the deep_ep stand-in, and the host-read count of a blocking
dispatch (CUDA's sync-debug mode reports the same read again on a GPU). On ranks sharing a GPU,
the checks that capture CUDA graphs are left out too: a gloo collective cannot be captured.

Then, at 2 ranks on one GPU under a private MPS daemon (their kernels wait for each other's):
deep_ep's HybridEP (blocking, capacity mode, and capacity mode's CUDA graph, whose gather and
dispatch run in deep_ep's kernels) and the exact transport (NVSHMEM) against the torch blocking
dispatch; and the sync guard with a gloo collective's staging.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess

import pytest
import torch

from tests import test_moe_layer as moe
from tests import test_recovery as recovery
from tests import test_static_splits as static_splits
from tests import test_torch_buffer as buffer
from tests.distributed import assert_ok, merged_results, python_module, timed_out_output

pytestmark = pytest.mark.gpu

# The whole module at 4 ranks on one H200 took 3 minutes (2026-12-03); a hang fails after this.
DEADLINE_S = float(os.environ.get("MEGATRON_EXT_TEST_CHILD_TIMEOUT", "600"))


def _names(checks) -> tuple[str, ...]:
    return tuple(check.__name__ for check in checks)


# Checks whose failure path is a device assert (it ends the process on a GPU).
DEVICE_ASSERTS = _names(
    (
        moe.too_small_capacity_fails_loudly,
        moe.verify_catches_unequal_counts,
        recovery.fail_policy_stops_on_the_device,
        static_splits.over_budget_stops_on_the_device,
    )
)
# Left out on a GPU for another reason (module docstring).
NOT_ON_GPU = _names((moe.blocking_backward_reads_nothing, moe.deep_ep_buffer_through_the_same_path))
# Capture CUDA graphs: a gloo group's collectives cannot be captured.
CAPTURES = _names(
    (
        recovery.per_layer_graphs_rerun_eagerly_and_are_captured_again,
        recovery.host_work_under_capture_is_refused_by_name,
        recovery.full_iteration_graph_keeps_the_policy_outside,
        recovery.megatron_graph_warmup_leaves_the_overflow_check_and_counters_alone,
    )
)

LAYER_CHECKS = tuple(n for n in _names(moe.CHECKS) if n not in DEVICE_ASSERTS + NOT_ON_GPU)
RECOVERY_CHECKS = tuple(n for n in _names(recovery.CHECKS) if n not in DEVICE_ASSERTS)
STATIC_CHECKS = tuple(n for n in _names(static_splits.CHECKS) if n not in DEVICE_ASSERTS)
SUITES = {
    "buffer": buffer.CHECKS + _names(buffer.EXACT_CHECKS),
    "layer": LAYER_CHECKS,
    "recovery": RECOVERY_CHECKS,
    "static": STATIC_CHECKS,
}


def _placement(kind: str, world: int):
    from megatron_ext.tooling.ranks import Placement

    return Placement("cuda", ranks_per_gpu=world if kind == "shared" else 1)


def _wanted(kind: str, world: int, suite: str) -> tuple[str, ...]:
    names = SUITES[suite]
    if kind == "shared":
        names = tuple(n for n in names if n not in CAPTURES)
    if world != 4:
        names = tuple(n for n in names if n not in moe.FOUR_RANKS_ONLY)
    if world == 1:
        names = tuple(n for n in names if n not in _names(buffer.EXACT_CHECKS))
    return names


def _megatron_suite(rank, world, out_dir, checks) -> None:
    from megatron.core import parallel_state

    from tests.megatron_env import run_megatron_checks

    try:
        run_megatron_checks(rank, world, out_dir, checks)
    finally:
        parallel_state.destroy_model_parallel()


def _suites_worker(rank, world, out_dir, kind) -> None:
    """Every suite on this rank, each into its own folder of `out_dir`."""
    by_name = {c.__name__: c for c in (*moe.CHECKS, *recovery.CHECKS, *static_splits.CHECKS)}
    for suite in SUITES:
        folder = os.path.join(out_dir, suite)
        os.makedirs(folder, exist_ok=True)
        if suite == "buffer":
            buffer._worker(rank, world, folder)
        else:
            _megatron_suite(rank, world, folder, [by_name[n] for n in _wanted(kind, world, suite)])


def _run_child(args: list[str], what: str) -> subprocess.CompletedProcess:
    """`python -m tests.test_gpu_ranks ARGS` in the repository root, ended at the deadline."""
    try:
        return python_module("tests.test_gpu_ranks", *args, timeout=DEADLINE_S)
    except subprocess.TimeoutExpired as stopped:
        output = timed_out_output(stopped)
        raise AssertionError(f"{what}: not ended after {DEADLINE_S:.0f} s (a hang?):\n{output[-6000:]}") from None


def _shared_sizes() -> tuple[int, ...]:
    return tuple(int(w) for w in os.environ.get("MEGATRON_EXT_SHARED_GPU_RANKS", "2 4").split())


def _layouts():
    layouts = [pytest.param(("shared", w), id=f"{w}-ranks-on-1-gpu") for w in _shared_sizes()]
    return layouts + [pytest.param(("per-gpu", None), id="1-rank-per-gpu")]


def _resolve(layout) -> tuple[str, int]:
    kind, world = layout
    gpus = torch.cuda.device_count()
    if kind == "per-gpu":
        if gpus < 2:
            pytest.skip(f"one rank per GPU needs 2 or more GPUs (found {gpus}); the shared-GPU rehearsal runs on one")
        world = gpus
    if any(case[1] % world for case in buffer.CASES):
        pytest.skip(f"the buffer cases' expert counts do not divide over {world} ranks")
    return kind, world


@pytest.fixture(scope="module", params=_layouts())
def results(request, tmp_path_factory):
    kind, world = _resolve(request.param)
    out_dir = tmp_path_factory.mktemp(f"ranks_{kind}_{world}")
    child = _run_child(["suites", kind, str(world), str(out_dir)], f"{world} ranks ({kind})")
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-6000:]
    return kind, world, {suite: merged_results(out_dir / suite, world) for suite in SUITES}


@pytest.mark.parametrize("suite,check", [(s, c) for s, names in SUITES.items() for c in names])
def test_check_on_gpu_ranks(results, suite, check):
    kind, world, outcomes = results
    if check not in _wanted(kind, world, suite):
        if check in CAPTURES:
            pytest.skip("captures a CUDA graph: a gloo group's collectives (ranks sharing a GPU) cannot be captured")
        pytest.skip(f"not at {world} rank(s)")
    assert_ok(outcomes[suite], check)


# --------------------------------------------------------------------------- one rank overflows

OVERFLOWING_RANK = 1


def _overflow_worker(rank, world, out_dir) -> None:
    """Capacity mode at W ranks; after calibration one rank's capacity drops to 4 rows, so it
    alone overflows: its process must stop at the device assert and no rank may wait forever."""
    from megatron.core import parallel_state

    import megatron_ext.patches
    from tests.megatron_env import FLEX, init_megatron, make_config, moe_layer, run_steps, step_inputs

    init_megatron(world)
    megatron_ext.patches.apply(training=False)  # no training loop: an overflow stops on the device
    layer = moe_layer(make_config(world, **FLEX, moe_hybridep_capacity_factor=1.5), experts="grouped")
    inputs = step_inputs(rank, 2, 64, 16, seed=21)
    run_steps(layer, inputs[:1])
    if rank == OVERFLOWING_RANK:
        layer.token_dispatcher.capacity_manager.capacity = 4
    run_steps(layer, inputs[1:])
    torch.cuda.synchronize()
    print(f"NO FAILURE on rank {rank}", flush=True)
    parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("world", [w for w in _shared_sizes() if w > OVERFLOWING_RANK])
def test_one_rank_overflows_on_the_device(world, tmp_path):
    """The overflowing rank stops at the device assert with the layer's message; the others stop
    with an error from their next collective, not a hang (the child's deadline)."""
    child = _run_child(["overflow", "shared", str(world), str(tmp_path)], f"{world} ranks, rank 1 overflowing")
    output = child.stdout + child.stderr
    print("\n".join(line for line in output.splitlines() if "megatron-ext" in line or "Assertion" in line))
    assert child.returncode != 0 and "NO FAILURE" not in output, output[-3000:]
    assert "capacity of 4 rows" in output, f"the device assert did not carry the layer's message:\n{output[-6000:]}"


# --------------------------------------------------------------------------- the sync guard on gloo


def _guard_worker(rank, world, out_dir) -> None:
    """Under `forbid_host_sync()`, a gloo collective on CUDA tensors (its staging waits inside the
    backend) passes and is counted apart, and a host read of ours around it still raises."""
    from megatron_ext.tooling.sync import HostSyncError, count_host_syncs, forbid_host_sync

    x = torch.full((4,), float(rank + 1), device="cuda")
    with forbid_host_sync() as log:
        torch.distributed.all_reduce(x)
    assert log.staged_collectives == 1 and log.count == 0, log
    assert x.tolist() == [world * (world + 1) / 2] * 4
    try:
        with forbid_host_sync():
            torch.distributed.all_reduce(x)
            x.sum().item()
    except HostSyncError:
        pass
    else:
        raise AssertionError("forbid_host_sync() let .item() through next to a gloo collective")
    with count_host_syncs() as log:
        torch.distributed.all_reduce(x)
        x.sum().item()
    assert log.count == 1 and log.staged_collectives == 1, log
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"guard": "ok"}, f)


def test_sync_guard_leaves_a_gloo_collectives_staging_out(tmp_path):
    child = _run_child(["guard", "shared", "2", str(tmp_path)], "the guard on 2 ranks")
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-6000:]
    assert merged_results(tmp_path, 2) == {"guard": "ok"}


# --------------------------------------------------------------------------- kernels of ranks that wait for each other

WIDE = 128  # deep_ep's buffer takes hidden sizes of 128 and more
CAPACITY = dict(moe_hybridep_capacity_factor=1.5, moe_hybridep_equal_token_counts=True)


def _layer_pair(world, overrides, hidden):
    """Torch blocking (the reference) and a capacity-mode layer with `overrides`, the same weights."""
    from tests.megatron_env import FLEX, copy_weights, make_config, moe_layer

    reference = moe_layer(
        make_config(world, **FLEX, hidden_size=hidden, moe_hybridep_implementation="torch"), experts="grouped"
    )
    layer = moe_layer(make_config(world, **FLEX, hidden_size=hidden, **overrides), experts="grouped", seed=7)
    copy_weights(reference, layer)
    return reference, layer


def _eager_equals_blocking(rank, world, overrides, hidden):
    from tests.megatron_env import run_steps, step_inputs

    reference, layer = _layer_pair(world, overrides, hidden)
    inputs = step_inputs(rank, 4, 64, hidden, seed=31)
    moe._assert_same(run_steps(reference, inputs), run_steps(layer, inputs))
    if "moe_hybridep_capacity_factor" in overrides:  # else Megatron's own manager dispatches
        stats = layer.token_dispatcher.capacity_manager.stats
        assert stats.non_blocking_dispatches == len(inputs) - 1, stats


def _replays_equal_blocking(rank, world, overrides, hidden):
    """After calibration and one eager step, a forward and backward captured in a CUDA graph at
    `world` ranks; its replays equal the torch blocking layer's steps, bitwise."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from tests.megatron_env import run_steps, step_inputs
    from tests.test_gpu_graphs import Captured

    model_parallel_cuda_manual_seed(1, use_cudagraphable_rng=True, force_reset_rng=True)
    reference, layer = _layer_pair(world, overrides, hidden)
    inputs = step_inputs(rank, 5, 64, hidden, seed=33)
    run_steps(layer, inputs[:1])  # the calibration, eagerly
    step = Captured(layer, inputs[1])
    moe._assert_same(run_steps(reference, inputs[2:]), [step(x) for x in inputs[2:]])


DEEP_EP = dict(moe_hybridep_implementation="deep_ep")
REUSE = dict(moe_hybridep_reuse_allgather_buffer=True)
NVSHMEM = dict(moe_hybridep_implementation="torch", moe_hybridep_transport="nvshmem")
# (name, check, overrides, hidden) of the "waiting" work: kernels of one rank wait on another's.
WAITING_CHECKS = {
    "deep_ep_blocking_equals_torch": (_eager_equals_blocking, DEEP_EP),
    "deep_ep_capacity_equals_torch_blocking": (_eager_equals_blocking, dict(DEEP_EP, **CAPACITY, **REUSE)),
    "deep_ep_capacity_graph_replays_equal_blocking": (_replays_equal_blocking, dict(DEEP_EP, **CAPACITY, **REUSE)),
    "nvshmem_capacity_equals_blocking": (_eager_equals_blocking, dict(NVSHMEM, **CAPACITY)),
    # No graph of the exact transport here: its routing-map all-gather runs on the EP group's
    # backend, gloo on ranks sharing a GPU, which a capture refuses ("operation not permitted when
    # stream is capturing", seen on the H200); on NCCL that gather is capturable.
}


def _waiting_worker(rank, world, out_dir, which) -> None:
    """The checks of WAITING_CHECKS whose name starts with `which` (deep_ep or nvshmem)."""
    import megatron_ext.patches
    from tests.distributed import Checks
    from tests.megatron_env import init_megatron

    init_megatron(world)
    megatron_ext.patches.apply(training=False)
    checks = Checks()
    for name, (check, overrides) in WAITING_CHECKS.items():
        if name.startswith(which):
            checks.run(name, check, rank, world, overrides, WIDE)
    checks.save(out_dir, rank)
    torch.cuda.synchronize()
    os._exit(0)  # NVSHMEM's teardown at exit can hang with several ranks on one GPU


@pytest.mark.parametrize("which", ["deep_ep", "nvshmem"])
def test_ranks_whose_kernels_wait_for_each_other_share_a_gpu_under_mps(which, tmp_path):
    """deep_ep's HybridEP (buffers exchanged over CUDA IPC, kernels that wait on flags written by
    the other ranks) and the torch implementation's exact transport (NVSHMEM) at 2 ranks on one
    GPU, under a private MPS daemon so that both ranks' kernels run at once: eager steps and CUDA
    graph replays against the torch blocking dispatch."""
    from tests.cuda_mps import private_mps

    if which == "deep_ep":
        from megatron_ext.options import deep_ep_import_error

        if deep_ep_import_error() is not None:
            pytest.skip(f"deep_ep does not import: {deep_ep_import_error()}")
    world = 2
    with private_mps(world):
        child = _run_child(["waiting", "shared", str(world), str(tmp_path), which], f"{which} on {world} ranks")
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-6000:]
    outcomes = merged_results(tmp_path, world)
    failed = {n: outcomes.get(n, "never ran") for n in WAITING_CHECKS if n.startswith(which)}
    failed = {n: outcome for n, outcome in failed.items() if outcome != "ok"}
    assert not failed, "\n".join(f"{n}: {outcome}" for n, outcome in failed.items())


# --------------------------------------------------------------------------- the child process

WORKERS = {
    "suites": _suites_worker,
    "overflow": _overflow_worker,
    "guard": _guard_worker,
    "waiting": _waiting_worker,
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="one spawn of the GPU rank suite (run by the tests above)")
    p.add_argument("work", choices=tuple(WORKERS))
    p.add_argument("kind", choices=("shared", "per-gpu"))
    p.add_argument("world", type=int)
    p.add_argument("out_dir")
    p.add_argument("which", nargs="?", help="waiting: the checks whose name starts with it")
    args = p.parse_args(argv)
    from tests import test_gpu_ranks  # the workers by their module's name, not __main__'s, for the spawn
    from tests.distributed import run_ranks

    extra = {"suites": (args.kind,), "waiting": (args.which,)}.get(args.work, ())
    worker = test_gpu_ranks.WORKERS[args.work]
    run_ranks(args.world, worker, args.out_dir, *extra, where=_placement(args.kind, args.world))


if __name__ == "__main__":
    main()
