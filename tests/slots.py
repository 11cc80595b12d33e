"""A bound on the suite's heavy processes (a pytest process, a spawned rank, a dry run, a child that
imports Megatron): at most `CAPACITY` at once, across every process of one `pytest` run.

The bound is `CAPACITY` slot files in one folder (`ENV` names it; the first pytest process makes it
and its children inherit it), each held with `flock` by the process it counts for. A pytest process
holds one slot while it runs tests (`hold_lane`, from the conftest) and hands it back while its
children work (`lend(n)`: n slots for them, taken together, under a gate, so two groups of ranks
never each wait for the other's last slot); a waiting parent is not counted. Nothing here changes
what a test checks: it only decides when a heavy process may start.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time

ENV = "MEGATRON_EXT_TEST_SLOTS"
CAPACITY = 4

_lane: list[int] = []  # this process's own slot while it runs tests
_made: list[str] = []  # the folder, where this process made it


def ensure_folder() -> None:
    """Make the slot folder unless an enclosing pytest run made one (its path in `ENV`)."""
    if not os.environ.get(ENV):
        _made.append(tempfile.mkdtemp(prefix="megatron-ext-slots-"))
        os.environ[ENV] = _made[0]


def remove_folder() -> None:
    for folder in _made:
        shutil.rmtree(folder, ignore_errors=True)
    if _made:
        os.environ.pop(ENV, None)
        _made.clear()


def _open(name: str) -> int:
    return os.open(os.path.join(os.environ[ENV], name), os.O_CREAT | os.O_RDWR, 0o600)


def _acquire(n: int) -> list[int]:
    """n slots (n <= CAPACITY), waiting until that many are free; under the gate, so one taker at a time."""
    n = min(n, CAPACITY)
    gate = _open("gate")
    held: list[int] = []
    try:
        fcntl.flock(gate, fcntl.LOCK_EX)
        taken: set[int] = set()
        while len(held) < n:  # no process waits for the gate while it holds a slot: these come free
            for i in range(CAPACITY):
                if len(held) == n:
                    break
                if i in taken:
                    continue
                fd = _open(f"slot{i}")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held.append(fd)
                    taken.add(i)
                except BlockingIOError:
                    os.close(fd)
            if len(held) < n:
                time.sleep(0.05)
    except BaseException:
        _release(held)
        raise
    finally:
        os.close(gate)
    return held


def _release(fds: list[int]) -> None:
    for fd in fds:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def hold_lane() -> None:
    """This pytest process takes its own slot (at its session's start)."""
    if os.environ.get(ENV) and not _lane:
        _lane.extend(_acquire(1))


def drop_lane() -> None:
    _release(_lane)
    _lane.clear()


@contextlib.contextmanager
def lend(n: int):
    """This process's own slot handed back and `n` slots taken for the children it starts inside
    (`n` = how many heavy processes they are at most; 0 while it only waits); afterwards its own
    slot again. Without a slot folder (`ENV`) it changes nothing."""
    if not os.environ.get(ENV):
        yield
        return
    had_lane = bool(_lane)
    drop_lane()
    held = _acquire(n) if n else []
    try:
        yield
    finally:
        _release(held)
        if had_lane:
            hold_lane()
