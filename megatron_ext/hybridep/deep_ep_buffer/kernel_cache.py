"""deep_ep's compiled HybridEP kernels kept across jobs (`--moe-hybridep-kernel-cache DIR`).

deep_ep (hybrid-ep 1.2.1) compiles its HybridEP kernels with nvcc the first time a buffer meets a
configuration, into a folder of the process: `$HYBRID_EP_CACHE_DIR/.deepep/hybrid_ep/jit/proc-<pid>`
(`/tmp` when the variable is unset). A new process has a new folder, so keeping
`HYBRID_EP_CACHE_DIR` across jobs saves nothing: every process of every job compiles again (about
20 s per process at the training example's shapes on an H200). A buffer built with
`load_cached_kernels=True` loads the kernels it finds in its process's folder instead of compiling
them.

`KernelCache` bridges the two. Before a deep_ep buffer is built, the kernels stored under DIR are
copied into this process's folder; after the warm-up (`--moe-hybridep-warm-up`) and when the
process exits, the kernels compiled here and missing from DIR are copied there. DIR keeps one
folder per deep_ep build, CUDA version and GPU architecture, so a kernel is only ever loaded by
the build that compiled it. Every copy goes through a temporary name and an atomic rename: ranks
and jobs sharing DIR (one file system) never read half a file, and the same kernel stored twice
is the same bytes.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from functools import cache
from pathlib import Path
from typing import Optional

import torch

from megatron_ext.logs import once_per_job

logger = logging.getLogger("megatron_ext.hybridep.kernel_cache")  # the name its lines had: users may filter by it

KERNEL_SUFFIX = ".so"
# deep_ep's HybridEP extension, whose bytes key the cache (a rebuild gets a folder of its own).
EXTENSION_MODULE = "hybrid_ep_cpp"


def process_jit_dir(pid: Optional[int] = None) -> Path:
    """The folder deep_ep compiles this process's HybridEP kernels into and loads them from."""
    base = os.environ.get("HYBRID_EP_CACHE_DIR") or "/tmp"
    return Path(base) / ".deepep" / "hybrid_ep" / "jit" / f"proc-{os.getpid() if pid is None else pid}"


def build_key(extension: Path, cuda: Optional[str], capability: tuple[int, int]) -> str:
    """The cache folder's name for kernels compiled by the deep_ep extension at `extension` with
    CUDA `cuda` for GPUs of compute capability `capability`."""
    digest = hashlib.sha256()
    with open(extension, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    major, minor = capability
    return f"hybrid_ep-{digest.hexdigest()[:16]}-cuda{cuda}-sm{major}{minor}"


@cache
def _this_build_key() -> str:
    spec = importlib.util.find_spec(EXTENSION_MODULE)
    if spec is None or spec.origin is None:
        raise ImportError(f"deep_ep's {EXTENSION_MODULE} extension is not installed")
    return build_key(Path(spec.origin), torch.version.cuda, torch.cuda.get_device_capability())


def _copy_atomically(source: Path, target: Path) -> None:
    """`source` to `target` through a temporary file beside `target` and a rename."""
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    try:
        shutil.copyfile(source, temporary)
        os.replace(temporary, target)
    except BaseException:
        os.unlink(temporary)
        raise


def _copy_missing(source: Path, target: Path) -> list[str]:
    """Copy every kernel of `source` that `target` lacks; the names copied."""
    if not source.is_dir():
        return []
    target.mkdir(parents=True, exist_ok=True)
    copied = []
    for kernel in sorted(source.glob("*" + KERNEL_SUFFIX)):
        if not (target / kernel.name).exists():
            _copy_atomically(kernel, target / kernel.name)
            copied.append(kernel.name)
    return copied


class KernelCache:
    """deep_ep's HybridEP kernels of one build, stored under `root` (see the module docstring)."""

    def __init__(self, root: str | os.PathLike, key: Optional[str] = None):
        self.directory = Path(root) / (key or _this_build_key())

    def load(self) -> list[str]:
        """Copy the stored kernels into this process's deep_ep folder (before a buffer is built);
        the folder exists afterwards, kernels or none."""
        process_jit_dir().mkdir(parents=True, exist_ok=True)
        return _copy_missing(self.directory, process_jit_dir())

    def store(self) -> list[str]:
        """Copy the kernels this process compiled, and the cache lacks, into the cache."""
        return _copy_missing(process_jit_dir(), self.directory)


# Every cache a buffer of this process loaded from: stored after the warm-up and at exit.
_ACTIVE: dict[Path, KernelCache] = {}


def activate(root: str | os.PathLike) -> KernelCache:
    """The cache under `root`, loaded into this process's deep_ep folder on first use, and stored
    back when the process exits. A cache that cannot be read is logged, never raised: deep_ep then
    compiles what it needs, as without the cache."""
    kernel_cache = KernelCache(root)
    if kernel_cache.directory in _ACTIVE:
        return _ACTIVE[kernel_cache.directory]
    if not _ACTIVE:
        atexit.register(store_all)
    _ACTIVE[kernel_cache.directory] = kernel_cache
    try:
        loaded = kernel_cache.load()
    except OSError as error:
        logger.warning(
            "megatron-ext: --moe-hybridep-kernel-cache: could not load kernels (%s); deep_ep compiles.", error
        )
        return kernel_cache
    logger.log(
        once_per_job(logging.INFO),
        "megatron-ext: --moe-hybridep-kernel-cache: %d deep_ep kernel(s) loaded from %s.",
        len(loaded),
        kernel_cache.directory,
    )
    return kernel_cache


def store_all() -> int:
    """Store what this process compiled into every active cache; how many kernels were stored.
    A cache that cannot be written is logged, never raised: training does not depend on it."""
    stored = 0
    for kernel_cache in _ACTIVE.values():
        try:
            names = kernel_cache.store()
        except OSError as error:
            logger.warning("megatron-ext: --moe-hybridep-kernel-cache: could not store kernels: %s", error)
            continue
        if names:
            logger.info("megatron-ext: stored %d new deep_ep kernel(s) in %s.", len(names), kernel_cache.directory)
        stored += len(names)
    return stored


def deactivate_all() -> None:
    """Forget the active caches (tests)."""
    _ACTIVE.clear()
    atexit.unregister(store_all)
