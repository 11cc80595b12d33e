"""--moe-hybridep-kernel-cache: deep_ep's compiled kernels carried from one process to the next.

deep_ep stands in as a class that does what hybrid-ep 1.2.1 does with its JIT folder: with
`load_cached_kernels=True` it loads the kernels in its process's folder at construction, and a
kernel it lacks it "compiles" into that folder."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest

from megatron_ext.hybridep.deep_ep_buffer import kernel_cache
from megatron_ext.hybridep.deep_ep_buffer.kernel_cache import KernelCache, build_key, process_jit_dir


@pytest.fixture(autouse=True)
def jit_base(tmp_path, monkeypatch):
    """deep_ep's JIT folders under a temporary HYBRID_EP_CACHE_DIR; no cache active before or after."""
    monkeypatch.setenv("HYBRID_EP_CACHE_DIR", str(tmp_path / "jit"))
    kernel_cache.deactivate_all()
    yield tmp_path / "jit"
    kernel_cache.deactivate_all()


def _as_process(monkeypatch, pid: int) -> None:
    monkeypatch.setattr(os, "getpid", lambda: pid)


class StandInDeepEP:
    """deep_ep's HybridEPBuffer as far as its JIT folder goes (see the module docstring)."""

    KERNELS = ("preprocess_a1", "dispatch_b2", "combine_c3")

    def __init__(self, group, hidden_dim, max_num_of_tokens_per_rank, num_local_experts, load_cached_kernels=False):
        folder = process_jit_dir()
        self.loaded = sorted(p.stem for p in folder.glob("*.so")) if load_cached_kernels else []
        self.compiled = [k for k in self.KERNELS if k not in self.loaded]
        folder.mkdir(parents=True, exist_ok=True)
        for name in self.compiled:
            (folder / f"{name}.so").write_bytes(f"kernel {name}".encode())


def test_deep_eps_folder_is_one_per_process(monkeypatch, jit_base):
    _as_process(monkeypatch, 41)
    assert process_jit_dir() == jit_base / ".deepep" / "hybrid_ep" / "jit" / "proc-41"
    monkeypatch.delenv("HYBRID_EP_CACHE_DIR")
    assert process_jit_dir(7) == Path("/tmp/.deepep/hybrid_ep/jit/proc-7")


def test_a_second_process_loads_what_the_first_stored(monkeypatch, tmp_path):
    cache_root = tmp_path / "kernels"
    _as_process(monkeypatch, 100)
    first = KernelCache(cache_root, key="build")
    assert first.load() == []  # nothing stored yet; the process's folder exists for deep_ep
    assert process_jit_dir().is_dir()
    compiled = StandInDeepEP(None, 256, 64, 2, load_cached_kernels=True)
    assert compiled.compiled == list(StandInDeepEP.KERNELS)
    assert sorted(first.store()) == sorted(f"{k}.so" for k in StandInDeepEP.KERNELS)
    assert first.store() == []  # stored once
    assert not [p for p in first.directory.iterdir() if p.name.startswith(".")], "a temporary file was left"

    _as_process(monkeypatch, 200)  # the next job's process: a new, empty deep_ep folder
    assert not process_jit_dir().exists()
    second = KernelCache(cache_root, key="build")
    assert sorted(second.load()) == sorted(f"{k}.so" for k in StandInDeepEP.KERNELS)
    warm = StandInDeepEP(None, 256, 64, 2, load_cached_kernels=True)
    assert warm.compiled == [] and warm.loaded == sorted(StandInDeepEP.KERNELS)
    for name in StandInDeepEP.KERNELS:
        assert (process_jit_dir() / f"{name}.so").read_bytes() == f"kernel {name}".encode()
    # Another build's kernels live apart: nothing of this one is loaded there.
    _as_process(monkeypatch, 300)
    assert KernelCache(cache_root, key="other-build").load() == []


def test_store_keeps_kernels_already_stored_and_adds_new_ones(monkeypatch, tmp_path):
    cache = KernelCache(tmp_path / "kernels", key="build")
    cache.directory.mkdir(parents=True)
    (cache.directory / "dispatch_b2.so").write_bytes(b"stored by another job")
    _as_process(monkeypatch, 5)
    cache.load()
    StandInDeepEP(None, 256, 64, 2, load_cached_kernels=True)
    assert sorted(cache.store()) == ["combine_c3.so", "preprocess_a1.so"]
    assert (cache.directory / "dispatch_b2.so").read_bytes() == b"stored by another job"


def test_the_key_follows_the_build_the_cuda_version_and_the_architecture(tmp_path):
    extension = tmp_path / "hybrid_ep_cpp.so"
    extension.write_bytes(b"one build")
    key = build_key(extension, "13.0", (9, 0))
    assert key == build_key(extension, "13.0", (9, 0)) and key.endswith("-cuda13.0-sm90")
    assert build_key(extension, "12.9", (9, 0)) != key
    assert build_key(extension, "13.0", (10, 0)) != key
    extension.write_bytes(b"a rebuild of the same version")
    assert build_key(extension, "13.0", (9, 0)) != key


def _install_stand_in(monkeypatch, buffer_class) -> None:
    monkeypatch.setitem(sys.modules, "deep_ep", types.SimpleNamespace(HybridEPBuffer=buffer_class))
    monkeypatch.setattr(kernel_cache, "_this_build_key", lambda: "build")


def test_a_deep_ep_buffer_with_the_flag_loads_instead_of_compiling(monkeypatch, tmp_path):
    """Through `create_deep_ep_buffer`, as a MoE layer builds its buffer: the first process compiles
    and stores (after the warm-up), the next one loads every kernel and compiles none."""
    from megatron_ext.hybridep.deep_ep_buffer import create_deep_ep_buffer

    _install_stand_in(monkeypatch, StandInDeepEP)
    root = str(tmp_path / "kernels")
    _as_process(monkeypatch, 1)
    first = create_deep_ep_buffer(None, 256, 64, 2, reuse_allgather_buffer=False, kernel_cache=root)
    assert first.compiled == list(StandInDeepEP.KERNELS)
    assert kernel_cache.store_all() == 3  # what the warm-up calls; the exit hook calls it too
    kernel_cache.deactivate_all()  # the process ends

    _as_process(monkeypatch, 2)
    second = create_deep_ep_buffer(None, 256, 64, 2, reuse_allgather_buffer=False, kernel_cache=root)
    assert second.compiled == [] and second.loaded == sorted(StandInDeepEP.KERNELS)
    # Without the flag deep_ep is built as before: no load, it compiles.
    _as_process(monkeypatch, 3)
    plain = create_deep_ep_buffer(None, 256, 64, 2, reuse_allgather_buffer=False)
    assert plain.compiled == list(StandInDeepEP.KERNELS)


def test_the_warm_up_stores_the_kernels_it_compiled(monkeypatch, tmp_path):
    from megatron_ext.training import warmup

    stored = []
    monkeypatch.setattr(kernel_cache, "store_all", lambda: stored.append(True) or 0)
    monkeypatch.setattr(warmup, "dispatch_managers", lambda model: [])
    warmup.warm_up(object(), 64)
    assert stored == [True]


def test_the_exit_hook_is_registered_once(monkeypatch, tmp_path):
    registered = []
    monkeypatch.setattr(kernel_cache.atexit, "register", registered.append)
    monkeypatch.setattr(kernel_cache, "_this_build_key", lambda: "build")
    _as_process(monkeypatch, 9)
    kernel_cache.activate(tmp_path / "a")
    kernel_cache.activate(tmp_path / "a")
    kernel_cache.activate(tmp_path / "b")
    assert registered == [kernel_cache.store_all]


def test_a_deep_ep_build_that_cannot_load_kernels_is_refused_by_flag(monkeypatch, tmp_path):
    from megatron_ext.hybridep.deep_ep_buffer import create_deep_ep_buffer
    from megatron_ext.options import HybridEPConfigError

    class NoLoading:
        def __init__(self, group, hidden_dim, max_num_of_tokens_per_rank, num_local_experts):
            pass

    _install_stand_in(monkeypatch, NoLoading)
    with pytest.raises(HybridEPConfigError, match="--moe-hybridep-kernel-cache: this deep_ep build's HybridEPBuffer"):
        create_deep_ep_buffer(None, 256, 64, 2, reuse_allgather_buffer=False, kernel_cache=str(tmp_path))


def test_a_cache_that_cannot_be_read_is_logged_and_deep_ep_compiles(monkeypatch, tmp_path, caplog):
    _install_stand_in(monkeypatch, StandInDeepEP)
    _as_process(monkeypatch, 12)
    stored = tmp_path / "kernels" / "build"
    stored.mkdir(parents=True)
    (stored / "dispatch_b2.so").write_bytes(b"k")

    def unreadable(source, target):
        raise PermissionError(13, "Permission denied", str(source))

    monkeypatch.setattr(kernel_cache.shutil, "copyfile", unreadable)
    from megatron_ext.hybridep.deep_ep_buffer import create_deep_ep_buffer

    buffer = create_deep_ep_buffer(
        None, 256, 64, 2, reuse_allgather_buffer=False, kernel_cache=str(tmp_path / "kernels")
    )
    assert buffer.compiled == list(StandInDeepEP.KERNELS)
    assert "could not load kernels" in caplog.text and "Permission denied" in caplog.text
    assert not [p for p in process_jit_dir().iterdir() if p.name.startswith(".")], "a temporary file was left"


def test_a_cache_that_cannot_be_written_is_logged_not_raised(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(kernel_cache, "_this_build_key", lambda: "build")
    _as_process(monkeypatch, 11)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    kernel_cache.activate(blocker)  # its folder would be under a file
    (process_jit_dir() / "dispatch.so").write_bytes(b"k")
    assert kernel_cache.store_all() == 0
    assert "could not store kernels" in caplog.text
