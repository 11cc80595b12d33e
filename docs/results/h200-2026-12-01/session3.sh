#!/bin/bash
# The third GPU session of 2026-12-01, from the repository root:
# `bash docs/results/h200-2026-12-01/session3.sh STAGE`. Carried with each call: .whl/
# (megatron-core 0.19.2, ../shared/tools/deep_ep's wheel, and DeepEP's tests/test_hybrid_ep.py and
# tests/utils.py from deepep-src.tar.gz in .whl/deepep_tests/). Results: s3-* beside this file.
#   tests: deep_ep against the torch implementation (buffer, Megatron layers), DeepEP's own test at
#          the large bench's shape, then the other one-GPU tests.
#   bench: the three sizes with the deep_ep rows and the overflow re-run policy's rows, --repeat 3.
#   again: the deep_ep tests after their fixes, and the mid and small sizes (in `bench` they ran
#          into their timeouts while deep_ep compiled its kernels).
# What ran: call 1 `tests` (s3-call1-tests.log), call 2 `bench` (s3-call2-*), call 3 `again` (s3-call3-*),
# call 4 (warm, by hand, after the counts fix): `timeout 130 python3 -m pytest -q -m gpu
# tests/test_gpu_deep_ep.py` (its output was cut at the limit: cases 0-2 passed, "...", then killed).
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

case ${1:-} in
  tests)
    {
      tests 200 tests/test_gpu_deep_ep_layer.py
      tests 120 tests/test_gpu_deep_ep.py
      echo "=== DeepEP's tests/test_hybrid_ep.py, 1 GPU, the large bench's shape $(date -u +%H:%M:%S)"
      (cd .whl/deepep_tests && HIDDEN_DIM=4096 MAX_NUM_OF_TOKENS_PER_RANK=8192 NUM_TOKENS_PER_RANK=8192 \
        NUM_LOCAL_EXPERTS=64 TOPK=8 timeout 100 python3 test_hybrid_ep.py --num-processes 1 2>&1 | grep -v Warning | tail -45)
      tests 150 tests/test_fused.py tests/test_experts.py tests/test_gpu_buffer.py tests/test_gpu_moe_layer.py
    } > "$OUT/tests.log" 2>&1
    grep -hE "^=== |passed|failed|error|PASS|FAIL|GB/s" "$OUT/tests.log" | head -80 ;;
  bench)
    {
      bench small 120 $SMALL --steps 20 --repeat 3 --modes $ALL
      bench mid 130 $MID --steps 10 --repeat 3 --modes $ALL
      bench large 300 $LARGE --check-steps 1 --steps 5 --repeat 3 --modes $ALL
    } > "$OUT/bench.log" 2>&1
    grep -hE "^=== |^(megatron|blocking|capacity|deep_ep|mode )|OK|FAIL" "$OUT/bench.log" ;;
  again)  # after the fixes the first two calls asked for, on a fresh machine (the JIT cache was gone)
    FIVE=megatron,blocking,capacity+equal,deep_ep,deep_ep+capacity+equal+reuse
    {
      tests 150 tests/test_gpu_deep_ep.py
      tests 110 tests/test_gpu_deep_ep_layer.py -k recompute
      bench mid 150 $MID --steps 10 --repeat 3 --modes $FIVE
      bench small 110 $SMALL --steps 20 --repeat 3 --modes $FIVE
    } > "$OUT/again.log" 2>&1
    grep -hE "^=== |passed|failed|^(megatron|blocking|capacity|deep_ep|mode )|OK|FAIL" "$OUT/again.log" ;;
  *) echo "usage: $0 tests|bench|again" >&2; exit 2 ;;
esac
