import os

import pytest
import torch

from tests import slots
from tests.distributed import one_rank_group

# Modules whose tests spawn ranks or processes: `pytest -m "not slow"` leaves them out.
SLOW_MODULES = {
    "test_bad_inputs",
    "test_bench",
    "test_checkpoint",
    "test_examples",
    "test_interpreter",
    "test_launch",
    "test_moe_layer",
    "test_recovery",
    "test_roundtrip",
    "test_torch_buffer",
}


INTERPRETER = "tests.test_interpreter"


def pytest_sessionstart(session):
    # One intra-op thread, as each spawned rank has: up to 4 heavy processes share the cores (2 on
    # CI), and a second thread only spins. The children it starts keep their own environment.
    torch.set_num_threads(1)
    slots.ensure_folder()  # the first pytest process of a run makes it; the re-runs inherit it
    slots.hold_lane()


def pytest_sessionfinish(session):
    from tests import test_interpreter

    test_interpreter.stop()
    slots.drop_lane()
    slots.remove_folder()


def pytest_collection_modifyitems(config, items):
    # test_interpreter's tests last: they wait for their re-runs, which start in the background
    # once collected (pytest_collection_finish), so the other tests run meanwhile.
    items.sort(key=lambda item: item.module.__name__ == INTERPRETER)
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` where one is visible)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Start test_interpreter's re-runs of the files its selected tests name, in the background."""
    if session.config.option.collectonly or os.environ.get("TRITON_INTERPRET") == "1":
        return
    paths = [item.callspec.params["path"] for item in session.items if item.module.__name__ == INTERPRETER]
    if paths:
        from tests import test_interpreter

        test_interpreter.start(paths)


@pytest.fixture(scope="module")
def gloo_group(tmp_path_factory):
    """This process as a one-rank gloo group, for the module: yields the group."""
    with one_rank_group("gloo", tmp_path_factory.mktemp("gloo")) as group:
        yield group


@pytest.fixture(scope="module")
def nccl_group(tmp_path_factory):
    """This process as a one-rank NCCL group on GPU 0, for the module: yields the group (GPU tests)."""
    with one_rank_group("nccl", tmp_path_factory.mktemp("nccl")) as group:
        yield group


@pytest.fixture(scope="module")
def megatron(nccl_group):
    """One NCCL rank on GPU 0 with Megatron's parallel state and megatron-ext's patch (GPU tests)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import megatron_ext.patches

    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1)
    applied = megatron_ext.patches.apply(training=False)  # no training loop here
    yield
    megatron_ext.patches.revert(applied)
    parallel_state.destroy_model_parallel()
    # Stock Megatron keeps one deep_ep buffer per process, bound to the group it was made on, and
    # reuses it whatever the group: drop it with this module's group, or the next module's stock
    # runs dispatch over a destroyed communicator.
    from megatron.core.transformer.moe import fused_a2a

    fused_a2a.reset_hybrid_ep_buffer()
