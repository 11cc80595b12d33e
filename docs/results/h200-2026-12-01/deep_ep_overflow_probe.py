"""Where does a too-small capacity on deep_ep stop? (tests/test_gpu_deep_ep_layer.py's overflow
test ran out of its 300 s limit in the fifth and seventh sessions.) The test's child process,
with a time stamp after each step, Python's stacks dumped at 45 s, the GPU's load sampled while
it runs; the child is killed at 90 s. Run from the repository root with deep_ep importable:
`python docs/results/h200-2026-12-01/deep_ep_overflow_probe.py [torch|deep_ep]`."""

import os
import subprocess
import sys
import time

IMPL = sys.argv[1] if len(sys.argv) > 1 else "deep_ep"
CHILD = f"""
import faulthandler, os, sys, time
faulthandler.dump_traceback_later(45, exit=False)
T0 = time.time()
def stamp(what):
    print(f"{{time.time() - T0:6.1f}} s  {{what}}", flush=True)
import torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561", RANK="0", WORLD_SIZE="1")
torch.cuda.set_device(0)
dist.init_process_group("nccl")
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
parallel_state.initialize_model_parallel()
model_parallel_cuda_manual_seed(1)
import megatron_ext.patches
megatron_ext.patches.apply(training=False)
from tests.megatron_env import FLEX, make_config, moe_layer
from tests.test_gpu_moe_layer import GPU, HIDDEN
cfg = make_config(1, **GPU, **FLEX, moe_hybridep_implementation="{IMPL}", moe_hybridep_capacity_factor=1.0)
layer = moe_layer(cfg, experts="grouped")
x = torch.randn(1024, 1, HIDDEN, device="cuda", dtype=torch.bfloat16)
layer(x)[0].sum().backward()
torch.cuda.synchronize()
stamp("calibration step done")
layer.token_dispatcher.capacity_manager.capacity = 16
out = layer(x)[0]
stamp("overflowing forward queued")
try:
    torch.cuda.synchronize()
    stamp("synchronize after the forward returned (no assert?)")
except Exception as e:
    stamp(f"synchronize raised {{type(e).__name__}}: {{str(e).splitlines()[0]}}")
    import atexit
    atexit.register(lambda: stamp("atexit: last handler registered ran"))
    stamp("leaving the script")
    sys.exit(3)
out.sum().backward()
torch.cuda.synchronize()
stamp("NO FAILURE")
"""

env = dict(os.environ, PYTHONUNBUFFERED="1")
log = open(f"/tmp/overflow_probe_{IMPL}.log", "w+")  # a file, not a pipe: a full pipe would stall the child
child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
start = time.time()
samples = []
while child.poll() is None and time.time() - start < 90:
    time.sleep(5)
    load = subprocess.run(
        ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    samples.append(f"{time.time() - start:5.0f} s  GPU {load}")
if child.poll() is None:
    child.kill()
    print(f"KILLED after {time.time() - start:.0f} s")
print(f"return code {child.wait()}")
log.seek(0)
print("\n".join(line for line in log.read().splitlines() if "Warning" not in line)[-6000:])
print("\n".join(samples))
