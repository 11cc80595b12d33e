# Sourced by the example launch scripts (smoke_1gpu.sh, ep8_single_node.sh, slurm_multinode.sbatch):
# reads MODE and PRECISION, refuses other values (exit 2), and sets
#   mode_flags: what MODE adds to Megatron's flags
#     capacity (default): --moe-hybridep-capacity-factor 1.5 --moe-hybridep-equal-token-counts
#     blocking: nothing (Megatron's blocking dispatch, the same run otherwise)
#   PRECISION: bf16 (default) or fp16; a script passes --$PRECISION.
MODE=${MODE:-capacity}
PRECISION=${PRECISION:-bf16}
case $MODE in
  capacity) mode_flags=(--moe-hybridep-capacity-factor 1.5 --moe-hybridep-equal-token-counts) ;;
  blocking) mode_flags=() ;;
  *) echo "MODE must be capacity or blocking, not '$MODE'" >&2; exit 2 ;;
esac
case $PRECISION in
  bf16 | fp16) ;;
  *) echo "PRECISION must be bf16 or fp16, not '$PRECISION'" >&2; exit 2 ;;
esac
