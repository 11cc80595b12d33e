"""Tools for the tests and the bench; nothing here runs in a training job.

- `sync`: the host-synchronisation guard (`forbid_host_sync`, `count_host_syncs`) and the GPU
  run-ahead probe (`runahead_probe`).
- `roundtrip`: a dispatch/combine round trip of the PyTorch buffer across ranks, checked and timed
  (`python -m megatron_ext.tooling.roundtrip`).
- `cpu_ranks`: `use_cpu_ranks()`, CPU stand-ins for the CUDA calls of Megatron's MoE layer. It
  replaces the CUDA stream API for the whole process, with no way back: call it only in processes
  whose layers run on CPU (spawned test ranks, the bench on CPU).
"""
