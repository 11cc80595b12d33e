"""What happens at Megatron's training step: the overflow re-run (`recovery.py`) and the warm-up before the first one
(`warmup.py`)."""
