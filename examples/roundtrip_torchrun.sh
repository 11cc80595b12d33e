#!/usr/bin/env bash
# The HybridEP round trip on every GPU of this node, one rank per GPU, NCCL.
# Needs: megatron-ext installed (pip install -e .), CUDA GPUs; nothing from deep_ep.
# Sets none of megatron-ext's Megatron flags: it exercises the PyTorch HybridEP buffer alone.
set -euo pipefail
GPUS=${GPUS:-$(nvidia-smi -L | wc -l)}
torchrun --standalone --nproc-per-node "$GPUS" -m megatron_ext.tooling.roundtrip --backend nccl \
  --tokens "${TOKENS:-4096}" --hidden "${HIDDEN:-4096}" --experts "${EXPERTS:-64}" --topk "${TOPK:-8}" "$@"
