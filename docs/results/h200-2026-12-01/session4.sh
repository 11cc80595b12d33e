#!/bin/bash
# The fourth GPU session of 2026-12-01, from the repository root:
# `bash docs/results/h200-2026-12-01/session4.sh STAGE`, carrying .whl/ (megatron-core 0.19.2,
# ../shared/tools/deep_ep's wheel, DeepEP's tests in .whl/deepep_tests/). Results: s4-* beside this file.
#   verify: every one-GPU test at HEAD (the deep_ep files last: they JIT-compile), the buffer's
#           round trip and where one dispatch call's host time goes (host_ops.py).
#   kernels: after the fused layout (fused.block_counts/dispatch_layout) and the one-rank paths:
#           the GPU tests of the kernels, buffer and layers, the re-run checks alone (call 1 aborted
#           in them), the round trip with its GPU lines (torch and deep_ep side by side), host_ops.py,
#           the large bench's torch and deep_ep rows, and deep_ep against the buffer.
#   last:   after the block scan moved into the layout kernel and the buffer's lazy argument
#           messages: the re-run checks on the torch implementation, the round trip, the kernels'
#           and buffer's GPU tests, deep_ep against the buffer, and the small size's rows.
#   bench:  the three sizes, every mode, --repeat 3, and the round trip (not run: no device time left).
#   two-gpu: for the nvidia-h200-x2 kind (not lent this session, not run): the tests across GPU
#           ranks, the round trip at two ranks (GB/s against all_to_all_single, deep_ep beside
#           it), torch's symmetric-memory all-to-all probe (copy ../shared/probes/symm_a2a.py to
#           .whl/ first), and the large bench at EP 2.
# What ran: call 1 `verify` at 69b183b (s4-call1-verify.log), call 2 `kernels` at d8f76be (s4-call2-*),
# call 3 `last` at 51ffb48 (s4-call3-last.log; its small bench ran out of its limit while deep_ep
# compiled), call 4 (warm, by hand) the small bench with a longer limit: s4-call4-small.{log,json}.
set -uo pipefail
export PYTHONUNBUFFERED=1 CUDA_HOME=/usr/local/cuda PATH=/usr/local/cuda/bin:$PATH
export HYBRID_EP_CACHE_DIR=/tmp/hybrid_ep_jit
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
[ -d /tmp/site/deep_ep ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
LARGE="--layers 8 --tokens 8192 --hidden 4096 --ffn-hidden 1024 --experts 64 --topk 8"
MID="--layers 4 --tokens 4096 --hidden 2048 --ffn-hidden 1024 --experts 32 --topk 4"
SMALL="--layers 8 --tokens 512 --hidden 512 --ffn-hidden 256 --experts 16 --topk 2"
ALL=megatron,blocking,capacity+equal,capacity+equal+rerun,deep_ep,deep_ep+capacity+equal+reuse,deep_ep+capacity+equal+reuse+rerun
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader

bench() {  # bench NAME TIMEOUT ARGS...: one bench run, its table to the log, its JSON to $OUT/NAME.json
  local name=$1 limit=$2; shift 2
  echo "=== bench $name $(date -u +%H:%M:%S)"
  timeout "$limit" python3 -m megatron_ext.bench "$@" --no-progress --json "$OUT/$name.json" 2>&1 | grep -v Warning
}
tests() {  # tests LIMIT FILES...
  local limit=$1; shift
  echo "=== tests $* $(date -u +%H:%M:%S)"
  timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider -rfs --tb=short "$@" 2>&1 | grep -v Warning | tail -40
}
roundtrip() {
  echo "=== roundtrip $(date -u +%H:%M:%S)"
  timeout 90 python3 -m megatron_ext.tooling.roundtrip --backend nccl --world-size 1 --iters 50 \
    --tokens 8192 --hidden 4096 --experts 64 --topk 8 2>&1 | grep -v Warning
}

case ${1:-} in
  verify)
    {
      tests 170 tests/test_fused.py tests/test_experts.py tests/test_gpu_buffer.py tests/test_gpu_moe_layer.py tests/test_gpu_recovery.py
      roundtrip
      echo "=== host_ops $(date -u +%H:%M:%S)"
      timeout 60 python3 docs/results/h200-2026-12-01/host_ops.py 2>&1 | grep -v Warning
      tests 330 tests/test_gpu_deep_ep.py tests/test_gpu_deep_ep_layer.py
    } > "$OUT/verify.log" 2>&1
    grep -hE "^=== |passed|failed|error|host ms|GPU ops" "$OUT/verify.log" | head -80 ;;
  kernels)
    {
      echo "=== tests tests/test_gpu_recovery.py $(date -u +%H:%M:%S)"
      timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rfs --tb=short -x tests/test_gpu_recovery.py > "$OUT/recovery.log" 2>&1
      grep -E "passed|failed|rror|terminate|what\(\)|ssert|Fatal|megatron-ext" "$OUT/recovery.log" | head -40
      tests 200 tests/test_fused.py tests/test_experts.py tests/test_gpu_buffer.py tests/test_gpu_moe_layer.py
      roundtrip
      echo "=== host_ops $(date -u +%H:%M:%S)"
      timeout 60 python3 docs/results/h200-2026-12-01/host_ops.py 2>&1 | grep -v Warning
      bench large 200 $LARGE --check-steps 1 --steps 5 --repeat 3 --modes blocking,capacity+equal,deep_ep,deep_ep+capacity+equal+reuse
      tests 150 tests/test_gpu_deep_ep.py
    } > "$OUT/kernels.log" 2>&1
    grep -hE "^=== |passed|failed|rror|terminate|what\(\)|Fatal|host ms|GPU ops|on the GPU|device copy|^(megatron|blocking|capacity|deep_ep|mode )|OK|FAIL" "$OUT/kernels.log" | head -90 ;;
  last)
    FIVE=megatron,blocking,capacity+equal,deep_ep,deep_ep+capacity+equal+reuse
    {
      tests 60 tests/test_gpu_recovery.py
      roundtrip
      tests 90 tests/test_fused.py tests/test_gpu_buffer.py
      tests 200 tests/test_gpu_deep_ep.py
      bench small 120 $SMALL --steps 20 --repeat 3 --modes $FIVE
    } > "$OUT/last.log" 2>&1
    grep -hE "^=== |passed|failed|rror|host ms|on the GPU|device copy|^(megatron|blocking|capacity|deep_ep|mode )|OK|FAIL" "$OUT/last.log" | head -60 ;;
  two-gpu)
    {
      tests 200 tests/test_gpu_ranks.py
      echo "=== roundtrip, 2 ranks $(date -u +%H:%M:%S)"
      timeout 120 torchrun --standalone --nproc-per-node 2 -m megatron_ext.tooling.roundtrip --backend nccl --iters 20 \
        --tokens 8192 --hidden 4096 --experts 64 --topk 8 2>&1 | grep -v Warning | tail -20
      echo "=== symm_a2a probe $(date -u +%H:%M:%S)"
      [ -f .whl/symm_a2a.py ] && timeout 90 torchrun --standalone --nproc-per-node 2 .whl/symm_a2a.py 2>&1 | tail -12
      bench ep2-large 300 $LARGE --check-steps 1 --steps 5 --repeat 3 --modes $ALL
    } > "$OUT/two-gpu.log" 2>&1
    grep -hE "^=== |passed|failed|GB/s|on the GPU|^(megatron|blocking|capacity|deep_ep|mode )|OK|FAIL" "$OUT/two-gpu.log" ;;
  bench)
    {
      roundtrip
      bench large 260 $LARGE --check-steps 1 --steps 5 --repeat 3 --modes $ALL
      bench mid 150 $MID --steps 10 --repeat 3 --modes $ALL
      bench small 150 $SMALL --steps 20 --repeat 3 --modes $ALL
    } > "$OUT/bench.log" 2>&1
    grep -hE "^=== |host ms|^(megatron|blocking|capacity|deep_ep|mode )|OK|FAIL" "$OUT/bench.log" ;;
  *) echo "usage: $0 verify|kernels|last|bench|two-gpu" >&2; exit 2 ;;
esac
