"""Proving "no host synchronisation": a guard that traps host reads, and a GPU run-ahead probe.

`forbid_host_sync()` raises on any host read of a tensor's value; `count_host_syncs()` counts
them instead. Both trap three layers, because no single one sees everything:

* Python methods that read a value on the host: `Tensor.item`, `tolist`, `__bool__`, `__int__`,
  `__float__`, `__index__`, `cpu`, `numpy`, and on CUDA `Event.synchronize`,
  `Stream.synchronize` and `torch.cuda.synchronize` (torch's sync-debug mode misses these).
* Operators whose output size depends on tensor values, seen at the dispatcher whatever the
  device (so a CPU test catches what would stall a GPU): `nonzero`, `masked_select`, Boolean-mask
  indexing, `unique`, `repeat_interleave` without `output_size`, and the scalar reads behind
  `is_nonzero` / `equal` / `_local_scalar_dense`.
* Host-to-device copies: `Tensor.__setitem__` with a Python value (on CUDA it copies a host
  scalar from pageable memory, which waits for the GPU: measured with the probe), and at the
  dispatcher any copy from unpinned host memory to a CUDA tensor.
* On CUDA, `torch.cuda.set_sync_debug_mode` for synchronising copies inside kernels ("error"
  under `forbid_host_sync()`; under `count_host_syncs()` its warnings are counted).

A collective of a group whose backend stages CUDA tensors through host memory (gloo, as when
several ranks share one GPU: `megatron_ext.tooling.ranks`) waits for the GPU inside the backend,
in its own thread. That wait is the backend's, not the code's, and NCCL makes none: such a
collective runs with the sync-debug layer paused and is counted apart
(`SyncLog.staged_collectives`), while the Python and dispatcher layers still see everything the
calling code does around it. Only blocking calls are covered (`async_op=False`, what the dispatch
path issues).

Where CUDA is in use, Python-method reads of CPU tensors are not counted: they wait for no device
(split sizes TE's grouped linear rebuilds from a Python list, static expert splits' budgets). The
device-to-host copy that may have filled one is what waits, and CUDA's sync-debug mode reports it.
On a CPU-only run every read counts, as it would stall a GPU were the tensor on one, except a
tensor marked with `megatron_ext.capacity.host_constant.host_constant()` (made on the host, never written by a
kernel).

The ground truth on a GPU is `runahead_probe`: queue a long GPU sleep, then time how long the
host takes to enqueue a step. A step that never waits returns long before the sleep ends.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_ext.capacity.host_constant import is_host_constant

aten = torch.ops.aten


class HostSyncError(RuntimeError):
    """A host read of a device value happened where none is allowed."""


_TENSOR_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")

_SYNCING_OPS = {
    aten._local_scalar_dense.default: "a scalar read (_local_scalar_dense)",
    aten.is_nonzero.default: "Tensor.is_nonzero()",
    aten.equal.default: "torch.equal()",
    aten.nonzero.default: "torch.nonzero() (output size depends on values)",
    aten.masked_select.default: "torch.masked_select() (output size depends on values)",
    aten._unique2.default: "torch.unique() (output size depends on values)",
    aten.unique_consecutive.default: "torch.unique_consecutive() (output size depends on values)",
    aten.unique_dim.default: "torch.unique(dim=...) (output size depends on values)",
}


@dataclass
class SyncEvent:
    what: str


@dataclass
class SyncLog:
    """What a `count_host_syncs()` block saw."""

    events: list[SyncEvent] = field(default_factory=list)
    # Collectives on CUDA tensors of a group that stages them through host memory (module
    # docstring): not host reads of the code's, so not in `events`.
    staged_collectives: int = 0

    @property
    def count(self) -> int:
        return len(self.events)


_state = threading.local()  # .inside: a trapped Python method is running (don't count twice)
_active: list[_Guard] = []
_originals: dict[tuple[object, str], Callable] = {}


def _waits_for_nothing(value: object) -> bool:
    """A Python read of `value` waits for no device: a CPU tensor that is a host constant, or any
    CPU tensor while CUDA is in use (module docstring)."""
    if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
        return False
    return is_host_constant(value) or (bool(_active) and _active[-1].cuda)


def _report(what: str) -> None:
    if getattr(_state, "inside", False) or not _active:
        return
    _active[-1].record(what)


def _is_sync_debug(warning: warnings.WarningMessage) -> bool:
    return "synchronizing CUDA operation" in str(warning.message)


def _wrap(owner: object, name: str, label: str) -> None:
    original = getattr(owner, name)
    _originals[(owner, name)] = original

    def trapped(*args, **kwargs):
        if not (args and _waits_for_nothing(args[0])):
            _report(label)
        _state.inside = True
        try:
            # The read is counted once, here: CUDA's sync-debug warning for the same read is dropped.
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = original(*args, **kwargs)
        finally:
            _state.inside = False
        for warning in caught:
            if not _is_sync_debug(warning):
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
        return result

    trapped.__name__ = name
    trapped.__wrapped__ = original
    setattr(owner, name, trapped)


def _wrap_setitem() -> None:
    original = torch.Tensor.__setitem__
    _originals[(torch.Tensor, "__setitem__")] = original

    def __setitem__(self, index, value):
        if not isinstance(value, torch.Tensor):
            _report("Tensor.__setitem__ with a Python value (a host-to-device copy: waits for the GPU on CUDA)")
        return original(self, index, value)

    __setitem__.__wrapped__ = original
    torch.Tensor.__setitem__ = __setitem__


# The collectives whose CUDA tensors a gloo group stages through host memory.
_COLLECTIVES = (
    "all_reduce",
    "all_gather_into_tensor",
    "all_to_all_single",
    "all_gather",
    "broadcast",
    "reduce_scatter_tensor",
)


def _stages_through_host(signature: inspect.Signature, args: tuple, kwargs: dict) -> bool:
    """A blocking collective, on CUDA tensors, of a group whose backend is not NCCL."""
    import torch.distributed as dist

    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return False  # the original call raises its own error
    if bound.arguments.get("async_op", False):
        return False
    values = list(bound.arguments.values())
    values += [item for v in values if isinstance(v, (list, tuple)) for item in v]
    if not any(isinstance(v, torch.Tensor) and v.is_cuda for v in values):
        return False
    return dist.get_backend(bound.arguments.get("group")) != "nccl"


def _wrap_collective(name: str) -> None:
    import torch.distributed as dist

    original = getattr(dist, name)
    _originals[(dist, name)] = original
    signature = inspect.signature(original)

    def collective(*args, **kwargs):
        if not (_active and _stages_through_host(signature, args, kwargs)):
            return original(*args, **kwargs)
        _active[-1].log.staged_collectives += 1
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)  # the backend's own wait, in its own thread
        try:
            return original(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    collective.__name__ = name
    collective.__wrapped__ = original
    setattr(dist, name, collective)


def _install() -> None:
    for name in _TENSOR_METHODS:
        _wrap(torch.Tensor, name, f"Tensor.{name}()")
    _wrap_setitem()
    if torch.cuda.is_available():
        _wrap(torch.cuda.Event, "synchronize", "torch.cuda.Event.synchronize()")
        _wrap(torch.cuda.Stream, "synchronize", "torch.cuda.Stream.synchronize()")
        _wrap(torch.cuda, "synchronize", "torch.cuda.synchronize()")
        import torch.distributed as dist

        if dist.is_available():
            for name in _COLLECTIVES:
                _wrap_collective(name)


def _uninstall() -> None:
    for (owner, name), original in _originals.items():
        setattr(owner, name, original)
    _originals.clear()


def _host_to_device_copy(func, args, kwargs) -> str | None:
    """A copy from unpinned host memory to a CUDA tensor (CUDA waits for the stream first)."""
    if func is aten.copy_.default:
        destination, source = args[0].device, args[1]
    else:
        source, destination = args[0], kwargs.get("device")
    if destination is None or torch.device(destination).type != "cuda":
        return None
    if not isinstance(source, torch.Tensor) or source.device.type != "cpu" or source.is_pinned():
        return None
    return "a copy from unpinned host memory to the GPU (waits for the GPU)"


class _SyncingOpMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = _SYNCING_OPS.get(func)
        if what is None and func is aten.index.Tensor:
            if any(i is not None and i.dtype == torch.bool for i in args[1]):
                what = "Boolean-mask indexing (output size depends on values)"
        elif what is None and func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            what = "torch.repeat_interleave() without output_size"
        elif what is None and func in (aten.copy_.default, aten._to_copy.default):
            what = _host_to_device_copy(func, args, kwargs)
        if what is not None:
            _report(what)
        return func(*args, **kwargs)


class _Guard:
    def __init__(self, raise_on_sync: bool, cuda: bool):
        self.raise_on_sync = raise_on_sync
        self.cuda = cuda  # CUDA initialised when the block began: reads of CPU tensors are free
        self.log = SyncLog()

    def record(self, what: str) -> None:
        self.log.events.append(SyncEvent(what))
        if self.raise_on_sync:
            raise HostSyncError(
                f"host synchronisation under forbid_host_sync(): {what}. This path must not read "
                "device values on the host; keep sizes as host ints and checks on the device "
                "(torch._assert_async)."
            )


@contextlib.contextmanager
def _guard(raise_on_sync: bool) -> Iterator[SyncLog]:
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    guard = _Guard(raise_on_sync, cuda)
    if not _active:
        _install()
    _active.append(guard)
    previous_debug_mode = torch.cuda.get_sync_debug_mode() if cuda else 0
    if cuda:
        torch.cuda.set_sync_debug_mode("error" if raise_on_sync else "warn")
    try:
        with _SyncingOpMode(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield guard.log
        for warning in caught:
            if _is_sync_debug(warning):
                where = f"{warning.filename}:{warning.lineno}"
                guard.log.events.append(SyncEvent(f"CUDA sync-debug: {warning.message} ({where})"))
            else:
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(previous_debug_mode)
        _active.remove(guard)
        if not _active:
            _uninstall()


def forbid_host_sync() -> contextlib.AbstractContextManager[SyncLog]:
    """Raise `HostSyncError` on any host read of a tensor's value inside the block."""
    return _guard(raise_on_sync=True)


def count_host_syncs() -> contextlib.AbstractContextManager[SyncLog]:
    """Count host reads of tensor values inside the block (`log.count`, `log.events`)."""
    return _guard(raise_on_sync=False)


@dataclass(frozen=True)
class RunAhead:
    """Host time to enqueue a step with the GPU idle and behind a queued GPU sleep."""

    host_idle_ms: float
    host_behind_sleep_ms: float
    gpu_sleep_ms: float
    behind_started: float = 0.0  # time.perf_counter() when the step behind the sleep began

    @property
    def waited(self) -> bool:
        """True when the host waited for the GPU (its time grew by more than half the sleep)."""
        return self.host_behind_sleep_ms - self.host_idle_ms > 0.5 * self.gpu_sleep_ms

    def __str__(self) -> str:
        verdict = "WAITED for the GPU" if self.waited else "ran ahead of the GPU"
        return (
            f"host {self.host_idle_ms:.1f} ms with the GPU idle, {self.host_behind_sleep_ms:.1f} ms "
            f"behind a {self.gpu_sleep_ms:.0f} ms GPU sleep: {verdict}"
        )


def runahead_probe(
    step: Callable[[], object], sleep_ms: float = 300.0, warmup: int = 2, clock_ghz: float = 1.98
) -> RunAhead:
    """Does `step()` make the host wait for the GPU? (CUDA only.)

    Runs `step` `warmup` times, times one call with the GPU idle, then queues a GPU sleep of about
    `sleep_ms` (its real length is measured with CUDA events) and times one more call. The GPU
    sleep is `torch.cuda._sleep(cycles)` with cycles = sleep_ms x `clock_ghz` (the H200's SM clock
    by default); only the measured length is reported.

    CUDA's launch queue holds about 1,000 kernels (measured on the H200: 1,000 tiny kernels queued
    behind a sleep in 9 ms, 1,024 waited for it), so a step that launches more waits here however
    free of syncs it is; then ask how far the host got before the GPU woke (`behind_started`).
    """
    if not torch.cuda.is_available():
        raise RuntimeError("runahead_probe needs a CUDA device; use forbid_host_sync() on CPU.")
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    idle_ms = (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    before.record()
    torch.cuda._sleep(int(sleep_ms * 1e6 * clock_ghz))
    after.record()
    start = time.perf_counter()
    step()
    behind_ms = (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    return RunAhead(idle_ms, behind_ms, before.elapsed_time(after), start)
