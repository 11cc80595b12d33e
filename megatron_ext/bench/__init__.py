"""`megatron-ext-bench` / `python -m megatron_ext.bench`: every dispatch mode on one Megatron MoE stack.

`cli` parses and launches (spawned ranks or torchrun), `modes` lists what is compared, `run` is
one rank's work, `counters` counts bytes and times dispatches, `report` builds the table, JSON
and plot.
"""

from megatron_ext.bench.cli import main

__all__ = ["main"]
