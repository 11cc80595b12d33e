"""`megatron_ext.tooling.timing.cuda_ms` with stand-in CUDA events on a fake clock: the median of the
timed calls, the warm-up untimed, and each call waited for only when asked."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.tooling import timing


class _Clock:
    def __init__(self):
        self.now = 0.0
        self.waits = []  # ("event", call number) or ("all", call number)
        self.calls = 0


@pytest.fixture
def clock(monkeypatch):
    clock = _Clock()

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = clock.now

        def synchronize(self):
            clock.waits.append(("event", clock.calls))

        def elapsed_time(self, end):
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: clock.waits.append(("all", clock.calls)))
    return clock


def _call_taking(clock, durations):
    def fn():
        clock.now += durations[clock.calls]
        clock.calls += 1

    return fn


def test_the_median_of_the_timed_calls_after_the_warm_up(clock):
    # two warm-up calls (100 ms each, untimed), then 5 timed: median 3
    fn = _call_taking(clock, [100.0, 100.0, 5.0, 1.0, 3.0, 9.0, 2.0])
    assert timing.cuda_ms(fn, iters=5, warmup=2) == 3.0
    assert clock.calls == 7
    assert clock.waits == [("all", 2), ("all", 7)]  # queued back to back: one wait before, one after


def test_each_alone_waits_for_every_call(clock):
    fn = _call_taking(clock, [0.5, 4.0, 2.0])
    assert timing.cuda_ms(fn, iters=2, warmup=1, each_alone=True) == 3.0  # an even count: the mean of the middle two
    assert clock.waits == [("all", 1), ("event", 2), ("event", 3), ("all", 3)]
