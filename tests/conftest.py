import pytest
import torch
import torch.distributed as dist

# Modules whose tests spawn ranks or processes: `pytest -m "not slow"` leaves them out.
SLOW_MODULES = {
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


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200 machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """One NCCL rank on GPU 0 with Megatron's parallel state and megatron-ext's patch (GPU tests)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import megatron_ext.patches

    torch.cuda.set_device(0)
    init = tmp_path_factory.mktemp("nccl_moe") / "init"
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1)
    applied = megatron_ext.patches.apply(training=False)  # no training loop here
    yield
    megatron_ext.patches.revert(applied)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
