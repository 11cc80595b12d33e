#!/bin/bash
# The seventh GPU session of 2026-12-01 (one H200), from the repository root, carrying .whl/ as in
# session6.sh: `bash docs/results/h200-2026-12-01/session7.sh STAGE`. Results: s7-* beside this file.
# What ran, at 5845db1 (call numbers as in the s7-* files):
#   call 1: `session6.sh host` (s7-call1-host.log); call 2: `session6.sh tests` (s7-call2-tests.log),
#           which ran out of its 600 s: deep_ep's two test files stopped at their 300 s limit after 15
#           of 16 tests (as in the fifth session), and the large bench after them was cut short;
#   call 3: stage `probe-bench` (s7-call3-*); call 4: stage `overflow` (s7-call4-*).
# Stages:
#   probe-bench: where a too-small capacity on deep_ep stops (deep_ep_overflow_probe.py), then the
#          large bench, every mode.
#   overflow: deep_ep's layer overflow test alone, then after the blocking test in one process.
#   next:  for the next session: deep_ep's two test files in one pytest process with the overflow
#          test's child ended (and its Python stacks printed) after 120 s, to see where it stops
#          there; the host time with the two buffers timed in both orders (host_calls.py ORDER).
set -uo pipefail
export PYTHONUNBUFFERED=1 CUDA_HOME=/usr/local/cuda PATH=/usr/local/cuda/bin:$PATH
export HYBRID_EP_CACHE_DIR=/tmp/hybrid_ep_jit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
[ -d /tmp/site/deep_ep ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
[ -f .whl/jit.tgz ] && [ ! -d /tmp/hybrid_ep_jit ] && tar xzf .whl/jit.tgz -C /tmp
HERE=docs/results/h200-2026-12-01
export PYTHONPATH=$PWD:/tmp/site
LARGE="--layers 8 --tokens 8192 --hidden 4096 --ffn-hidden 1024 --experts 64 --topk 8"
ALL=megatron,blocking,capacity+equal,capacity+equal+rerun,deep_ep,deep_ep+capacity+equal+reuse,deep_ep+capacity+equal+reuse+rerun
PYTEST="python3 -m pytest -q -m gpu -p no:cacheprovider -rfs --tb=short"
git log --oneline -1 2>/dev/null | cut -c1-60

case ${1:-} in
  probe-bench)
    echo "=== probe $(date -u +%T)"
    timeout 100 python3 $HERE/deep_ep_overflow_probe.py deep_ep > "$OUT/probe.log" 2>&1
    grep -v "^\s*$" "$OUT/probe.log" | tail -60
    echo "=== bench large $(date -u +%T)"
    timeout 330 python3 -m megatron_ext.bench $LARGE --check-steps 1 --steps 5 --repeat 2 --modes $ALL \
      --no-progress --json "$OUT/large.json" 2>&1 | grep -v Warning | tee "$OUT/bench.log" ;;
  overflow)
    export MEGATRON_EXT_TEST_CHILD_TIMEOUT=90
    echo "=== alone $(date -u +%T)"
    timeout 120 $PYTEST -s tests/test_gpu_deep_ep_layer.py -k overflow > "$OUT/a.log" 2>&1
    echo "=== after the blocking test $(date -u +%T)"
    timeout 150 $PYTEST -s tests/test_gpu_deep_ep_layer.py -k "blocking_makes or overflow" > "$OUT/b.log" 2>&1
    grep -hE "^=== |passed|failed|Assertion" "$OUT/a.log" "$OUT/b.log" ;;
  next)
    {
      echo "=== deep_ep's two files in one process $(date -u +%T)"
      MEGATRON_EXT_TEST_CHILD_TIMEOUT=120 timeout 280 $PYTEST tests/test_gpu_deep_ep.py tests/test_gpu_deep_ep_layer.py 2>&1 \
        | grep -v Warning | tail -80
      for order in 01 10 01 10; do
        echo "=== host_calls order $order $(date -u +%T)"
        timeout 90 python3 $HERE/host_calls.py new $order 2>&1 | grep -v Warning
      done
    } > "$OUT/next.log" 2>&1
    grep -hE "^=== |passed|failed| us |File |Timeout|ran past" "$OUT/next.log" | head -120 ;;
  *) echo "usage: $0 probe-bench|overflow|next" >&2; exit 2 ;;
esac
