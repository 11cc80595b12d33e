#!/usr/bin/env bash
# The HybridEP round trip on every GPU of this node, one rank per GPU, NCCL.
# Needs: megatron-ext installed (pip install -e .), CUDA GPUs; nothing from deep_ep.
# Sets none of megatron-ext's Megatron flags: it exercises the PyTorch HybridEP buffer alone.
#
# Env: GPUS (default: the GPUs `nvidia-smi -L` lists; the rank count, which EXPERTS must divide),
# TOKENS (per rank, default 4096), HIDDEN (4096), EXPERTS (64), TOPK (8), PYTHON (default: the
# checkout's .venv/bin/python where it exists, else python), DRY_RUN=1 (check the arguments with the
# round trip's own parser and print the command, on any machine: no GPU, no nvidia-smi; GPUS
# defaults to 8 there when nvidia-smi is absent).
# Extra arguments go to `python -m megatron_ext.tooling.roundtrip` after these (a later flag wins),
# e.g. --transport nvshmem.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# The checkout's environment (.ci/setup) where there is one, as the README's setup line makes it.
[ -x "$here/../.venv/bin/python" ] && default_python=$here/../.venv/bin/python || default_python=python
PYTHON=${PYTHON:-$default_python}
DRY_RUN=${DRY_RUN:-0}

if [[ -z ${GPUS:-} ]]; then
  if command -v nvidia-smi > /dev/null 2>&1; then
    GPUS=$(nvidia-smi -L | wc -l)
  elif [[ $DRY_RUN == 1 ]]; then
    GPUS=8 # a node of 8 GPUs, as the other examples assume
  else
    echo "$0: nvidia-smi not found: set GPUS to the number of GPUs to run on (or DRY_RUN=1 to check the arguments)" >&2
    exit 2
  fi
fi

args=(--backend nccl --tokens "${TOKENS:-4096}" --hidden "${HIDDEN:-4096}" --experts "${EXPERTS:-64}" --topk "${TOPK:-8}")
args+=("$@")
command=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$GPUS" -m megatron_ext.tooling.roundtrip "${args[@]}")

if [[ $DRY_RUN == 1 ]]; then
  # The round trip's parser on these arguments, and the check its main() makes before it runs.
  ROUNDTRIP_COMMAND=$(printf '%q ' "${command[@]}") exec "$PYTHON" - "$GPUS" "${args[@]}" << 'EOF'
import os
import sys

from megatron_ext.tooling.roundtrip import _parse

ranks, args = int(sys.argv[1]), _parse(sys.argv[2:])
if args.experts % ranks:
    print(f"roundtrip_torchrun.sh: --experts {args.experts} must be divisible by the {ranks} ranks (GPUS)", file=sys.stderr)
    sys.exit(2)
print("megatron-ext dry run: nothing run, no GPU used")
print(f"command: {os.environ['ROUNDTRIP_COMMAND'].strip()}")
print(f"ranks: {ranks} ({args.backend}, one per GPU)")
for name in ("tokens", "hidden", "experts", "topk", "dtype", "capacity_factor", "transport", "iters"):
    print(f"{name.replace('_', ' ')}: {getattr(args, name)}")
EOF
fi
exec "${command[@]}"
