"""An "overlap" save on an accelerator (`StreamCopyStager`): the copies are queued in `save()`, on a side
stream that first waits for the current stream; the next optimizer step's kernels are ordered after
them on the device while the host goes on; DCP writes the copy once the copies' event has completed.

No accelerator here: the side stream and its event are stand-ins that log what was asked of them (the
event completes only when the test lets it), the copies themselves are real host copies, and the
checkpoint is loaded back. On a GPU the device suite's checkpoint part checks the same round trip.
"""

from __future__ import annotations

import threading
import time
import weakref

import torch
from helpers.slow_staging import differing, full_state
from torch import nn

import fsdp2_strategy as f2
from fsdp2_strategy.checkpoint import async_save
from fsdp2_strategy.checkpoint.stream_copy import StreamCopyStager


class Log(list):
    def add(self, what: str, *args) -> None:
        self.append((what, threading.current_thread() is threading.main_thread(), *args))


class FakeEvent:
    """Completes when the test sets `done` (the copies finishing on the device)."""

    def __init__(self, log: Log):
        self.log, self.done = log, threading.Event()

    def synchronize(self) -> None:
        self.log.add("event.synchronize")
        assert self.done.wait(30), "the test never let the copies finish"


class FakeStream:
    def __init__(self, log: Log):
        self.log, self.events = log, []

    def wait_stream(self, other) -> None:
        self.log.add("side.wait_stream", other)

    def __enter__(self):
        self.log.add("side.enter")

    def __exit__(self, *exc) -> None:
        self.log.add("side.exit")

    def record_event(self) -> FakeEvent:
        self.log.add("side.record_event")
        self.events.append(FakeEvent(self.log))
        return self.events[-1]


class FakeCurrentStream:
    def __init__(self, log: Log):
        self.log = log

    def wait_event(self, event) -> None:
        self.log.add("current.wait_event", event)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))


def _step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    nn.functional.mse_loss(model(torch.randn(4, 8, generator=g)), torch.randn(4, 1, generator=g)).backward()
    opt.step()
    opt.zero_grad()


def test_the_copies_are_queued_in_save_and_the_next_step_waits_on_the_device(tmp_path, monkeypatch):
    log = Log()
    current = FakeCurrentStream(log)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda *a: current)
    side = FakeStream(log)

    class StreamCheckpointer(f2.Checkpointer):
        def _make_stager(self):
            return StreamCopyStager(stream=side)

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    _step(model, opt, 0)
    ckpt = StreamCheckpointer(tmp_path, async_save="overlap")
    at_save = full_state(model, opt)
    ckpt.save(1, model=model, optimizer=opt)
    staging = ckpt._saver._staging
    at_return = list(log)
    _step(model, opt, 1)  # forward, backward, then a step ordered after the copies, not waiting for them
    after_step = list(log)
    in_flight_after_step = not staging.done()
    side.events[0].done.set()  # the copies finish
    ckpt.wait()
    after = full_state(model, opt)

    fresh = _model()
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)
    _step(fresh, fresh_opt, 5)
    ckpt.load(model=fresh, optimizer=fresh_opt)

    # In save(), on the training thread: the side stream waits for the current one (the last step's
    # writes), the copies are queued on it, then its event is recorded.
    assert at_return[:4] == [
        ("side.wait_stream", True, current),
        ("side.enter", True),
        ("side.exit", True),
        ("side.record_event", True),
    ], at_return
    # Only a worker waits on the host for the copies, and the next optimizer step went on without
    # them: its kernels were ordered after the copies' event, on the training thread, once.
    assert ("event.synchronize", False) in after_step, after_step
    assert [e for e in after_step if e[0] == "current.wait_event"] == [("current.wait_event", True, side.events[0])]
    assert in_flight_after_step
    # The checkpoint holds the state at save(), though the next step changed every tensor.
    assert differing(full_state(fresh, fresh_opt), at_save) == []
    assert sorted(k for k in at_save if torch.equal(after[k], at_save[k])) == []
    _step(model, opt, 2)  # no save in flight: no further ordering
    assert sum(e[0] == "current.wait_event" for e in log) == 1
    ckpt.close()


def test_overlap_takes_the_stream_copy_where_an_accelerator_exists(monkeypatch):
    assert not isinstance(async_save.default_stager("overlap"), StreamCopyStager)  # the host: DCP's thread
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    stager = async_save.default_stager("overlap")
    try:
        assert isinstance(stager, StreamCopyStager)
    finally:
        stager.close()


def test_the_worker_keeps_the_source_until_the_copies_are_done(monkeypatch):
    log = Log()
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda *a: FakeCurrentStream(log))
    side = FakeStream(log)
    stager = StreamCopyStager(stream=side)
    source = {"w": torch.arange(4.0)}
    freed = threading.Event()
    weakref.finalize(source["w"], freed.set)
    future = stager.stage(source)
    del source
    time.sleep(0.05)
    kept_while_copying = not freed.is_set()
    side.events[0].done.set()
    staged = future.result(timeout=30)
    assert kept_while_copying  # a tensor freed under a running copy could be reused by the allocator
    assert torch.equal(staged["w"], torch.arange(4.0))
    assert freed.wait(5)  # ... and released once they are done
    stager.close()
