# Sourced by the example launch scripts (smoke_1gpu.sh, ep8_single_node.sh, slurm_multinode.sbatch):
# reads MODE, PRECISION and CAPACITY_FACTOR, refuses other values (exit 2), and sets
#   mode_flags: what MODE adds to Megatron's flags
#     capacity (default): --moe-hybridep-capacity-factor $CAPACITY_FACTOR (default 1.5)
#                         --moe-hybridep-equal-token-counts
#     blocking: nothing (Megatron's blocking dispatch, the same run otherwise)
#   PRECISION: bf16 (default) or fp16; a script passes --$PRECISION. fp16 with MODE=capacity needs
#     TE's op-fuser experts (megatron-ext's own compute in bf16 on a GPU; the parse says so).
#   common_flags: the flags of both modes that every launch script passes; a script adds its
#     model's sizes and experts, its parallelism, batch, precision, schedule and iterations.
MODE=${MODE:-capacity}
PRECISION=${PRECISION:-bf16}
CAPACITY_FACTOR=${CAPACITY_FACTOR:-1.5}
case $MODE in
  capacity) mode_flags=(--moe-hybridep-capacity-factor "$CAPACITY_FACTOR" --moe-hybridep-equal-token-counts) ;;
  blocking) mode_flags=() ;;
  *) echo "MODE must be capacity or blocking, not '$MODE'" >&2; exit 2 ;;
esac
case $PRECISION in
  bf16 | fp16) ;;
  *) echo "PRECISION must be bf16 or fp16, not '$PRECISION'" >&2; exit 2 ;;
esac
common_flags=(
  --transformer-impl local
  # Without apex or Megatron's CUDA extensions: the fused wgrad accumulation and masked softmax
  # kernels are missing, and torch's norm refuses the persistent layer norm.
  --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-persist-layer-norm
  --position-embedding-type rope --no-rope-fusion --normalization RMSNorm --swiglu
  --disable-bias-linear --untie-embeddings-and-output-weights
  --attention-dropout 0 --hidden-dropout 0
  --moe-grouped-gemm --moe-router-load-balancing-type aux_loss
  --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep
  --moe-hybridep-reuse-allgather-buffer
  --mock-data --tokenizer-type NullTokenizer --vocab-size 32000
)
