#!/bin/bash
# The sixth GPU session of 2026-12-01, from the repository root:
# `bash docs/results/h200-2026-12-01/session6.sh STAGE`, carrying .whl/ (megatron-core 0.19.2,
# ../shared/tools/deep_ep's wheel, deep_ep's JIT cache in .whl/jit.tgz) and .baseline/ (the
# megatron_ext tree of the last session's commit 2568dee: `git archive 2568dee megatron_ext | tar -x -C .baseline`).
# Results: s6-* beside this file.
#   host:  the host time of the buffer's calls, this tree against .baseline/, alternately
#          (host_calls.py); the round trip likewise; the kernel and buffer GPU tests, the NVSHMEM test.
#   tests: the GPU tests of the layers, experts, recovery, deep_ep's buffer and layers; the large bench.
#   two-gpu: for two H200s (the nvidia-h200-x2 kind): the tests across GPU ranks, the round trip at
#          two ranks with each transport (GB/s against all_to_all_single), the large bench at EP 2.
# What ran: nothing in the sixth session (no device was lent). In the seventh, at 5845db1: `host`
# (s7-call1-host.log) and `tests` (s7-call2-tests.log, which ran out of its 600 s in deep_ep's tests;
# its bench was run again by session7.sh). `two-gpu` waits for a two-H200 machine.
set -uo pipefail
export PYTHONUNBUFFERED=1 CUDA_HOME=/usr/local/cuda PATH=/usr/local/cuda/bin:$PATH
export HYBRID_EP_CACHE_DIR=/tmp/hybrid_ep_jit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
[ -d /tmp/site/deep_ep ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
[ -f .whl/jit.tgz ] && [ ! -d /tmp/hybrid_ep_jit ] && tar xzf .whl/jit.tgz -C /tmp
HERE=docs/results/h200-2026-12-01
NEW=$PWD:/tmp/site
BASE=$PWD/.baseline:/tmp/site
export PYTHONPATH=$NEW
LARGE="--layers 8 --tokens 8192 --hidden 4096 --ffn-hidden 1024 --experts 64 --topk 8"
ALL=megatron,blocking,capacity+equal,capacity+equal+rerun,deep_ep,deep_ep+capacity+equal+reuse,deep_ep+capacity+equal+reuse+rerun
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
lscpu | grep -E "^Model name|^CPU\(s\)|MHz" | head -4
git log --oneline -1 2>/dev/null

tests() {  # tests LIMIT FILES...
  local limit=$1; shift
  echo "=== tests $* $(date -u +%H:%M:%S)"
  timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider -rfs --tb=short "$@" 2>&1 | grep -v Warning | tail -40
}
roundtrip() {  # roundtrip LABEL PYTHONPATH
  echo "=== roundtrip $1 $(date -u +%H:%M:%S)"
  PYTHONPATH=$2 timeout 120 python3 -m megatron_ext.tooling.roundtrip --backend nccl --world-size 1 --iters 50 \
    --tokens 8192 --hidden 4096 --experts 64 --topk 8 2>&1 | grep -v Warning
}
host_calls() {  # host_calls LABEL PYTHONPATH
  echo "=== host_calls $1 $(date -u +%H:%M:%S)"
  PYTHONPATH=$2 timeout 90 python3 $HERE/host_calls.py "$1" 2>&1 | grep -v Warning
}

case ${1:-} in
  host)
    {
      for round in 1 2; do
        host_calls new "$NEW"; host_calls baseline "$BASE"
      done
      roundtrip new "$NEW"; roundtrip baseline "$BASE"; roundtrip new "$NEW"
      tests 200 tests/test_fused.py tests/test_gpu_buffer.py
      tests 120 tests/test_gpu_nvshmem.py
    } > "$OUT/host.log" 2>&1
    grep -hE "^=== |passed|failed|rror| us |host ms|on the GPU|device copy|OK|FAIL" "$OUT/host.log" | head -120 ;;
  tests)
    {
      tests 240 tests/test_gpu_moe_layer.py tests/test_experts.py tests/test_gpu_recovery.py
      tests 300 tests/test_gpu_deep_ep.py tests/test_gpu_deep_ep_layer.py
      echo "=== bench large $(date -u +%H:%M:%S)"
      timeout 300 python3 -m megatron_ext.bench $LARGE --check-steps 1 --steps 5 --repeat 2 --modes $ALL \
        --no-progress --json "$OUT/large.json" 2>&1 | grep -v Warning
    } > "$OUT/tests.log" 2>&1
    grep -hE "^=== |passed|failed|rror|^(megatron|blocking|capacity|deep_ep|mode )|OK|FAIL" "$OUT/tests.log" | head -90 ;;
  two-gpu)
    {
      tests 200 tests/test_gpu_ranks.py
      for transport in process_group nvshmem; do
        echo "=== roundtrip, 2 ranks, transport $transport $(date -u +%H:%M:%S)"
        timeout 120 torchrun --standalone --nproc-per-node 2 -m megatron_ext.tooling.roundtrip --backend nccl \
          --iters 20 --tokens 8192 --hidden 4096 --experts 64 --topk 8 --transport $transport 2>&1 | grep -v Warning
      done
      echo "=== bench ep2-large $(date -u +%H:%M:%S)"
      timeout 300 python3 -m megatron_ext.bench $LARGE --check-steps 1 --steps 5 --repeat 3 --modes $ALL \
        --no-progress --json "$OUT/ep2-large.json" 2>&1 | grep -v Warning
    } > "$OUT/two-gpu.log" 2>&1
    grep -hE "^=== |passed|failed|GB/s|transport|on the GPU|^(megatron|blocking|capacity|deep_ep|mode )|OK|FAIL" "$OUT/two-gpu.log" ;;
  *) echo "usage: $0 host|tests|two-gpu" >&2; exit 2 ;;
esac
