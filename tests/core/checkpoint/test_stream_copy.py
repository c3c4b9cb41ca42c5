"""An "overlap" save on an accelerator (`StreamCopyStager`): the copies are queued in `save()`, on a side
stream that first waits for the current stream; the next optimizer step's kernels are ordered after
them on the device while the host goes on; DCP writes the copy once the copies' event has completed.
A later save of the same structure refills the first one's host tensors; another structure is staged
anew.

No accelerator here: the side stream and its event are stand-ins that log what was asked of them (the
event completes only when the test lets it), the copies themselves are real host copies, and the
checkpoint is loaded back. On a GPU the device suite's checkpoint part checks the same round trip.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict

import torch
from helpers.harness import run_distributed
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
    g = torch.Generator().manual_seed(seed)  # the same batch on every rank (BatchNorm's buffers agree)
    nn.functional.mse_loss(model(torch.randn(4, 8, generator=g)), torch.randn(4, 1, generator=g)).backward()
    opt.step()
    opt.zero_grad()


def _sharded():
    model = f2.shard_model(_model(), wrap_policy=[nn.Linear], log_plan=False)
    return model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _saved_then_stepped(ckpt, stager, side, step: int, model, opt) -> dict:
    """Save, take one step while the copies are "running", let them finish, commit; what happened."""
    at_save = full_state(model, opt)
    log = side.log
    log.clear()
    ckpt.save(step, model=model, optimizer=opt)
    staging, at_return = ckpt._saver._staging, list(log)
    host = _host_tensors(stager._staged)
    _step(model, opt, step)  # forward, backward, then a step ordered after the copies, not waiting for them
    after_step, in_flight = list(log), not staging.done()
    side.events[-1].done.set()  # the copies finish
    ckpt.wait()
    return {"at_save": at_save, "at_return": at_return, "after_step": after_step, "in_flight": in_flight, "host": host}


def _host_tensors(staged) -> list:
    if isinstance(staged, dict):
        return [t for v in staged.values() for t in _host_tensors(v)]
    return [staged] if isinstance(staged, torch.Tensor) else []


def _loaded(ckpt, step: int) -> dict:
    model, opt = _sharded()
    _step(model, opt, 9)  # other values everywhere, the same state keys
    ckpt.load(model=model, optimizer=opt, step=step)
    return full_state(model, opt)


def _stream_world(root: str) -> dict:
    log = Log()
    current = FakeCurrentStream(log)
    torch.accelerator.current_stream = lambda *a: current  # this rank's process only
    side = FakeStream(log)
    stager = StreamCopyStager(stream=side)

    class StreamCheckpointer(f2.Checkpointer):
        def _make_stager(self):
            return stager

    model, opt = _sharded()
    _step(model, opt, 0)
    ckpt = StreamCheckpointer(root, async_save="overlap")
    first = _saved_then_stepped(ckpt, stager, side, 1, model, opt)
    second = _saved_then_stepped(ckpt, stager, side, 2, model, opt)  # the host copies refilled
    after = full_state(model, opt)
    loaded = {1: _loaded(ckpt, 1), 2: _loaded(ckpt, 2)}
    ckpt.close()
    queued = [
        ("side.wait_stream", True, current),
        ("side.enter", True),
        ("side.exit", True),
        ("side.record_event", True),
    ]
    return {
        "queued_in_save": [r["at_return"][:4] == queued for r in (first, second)],
        "host_waits_in_worker_only": [
            [e[1] for e in r["after_step"] if e[0] == "event.synchronize"] == [False] for r in (first, second)
        ],
        "step_ordered_once": [
            [e for e in r["after_step"] if e[0] == "current.wait_event"]
            == [("current.wait_event", True, side.events[i])]
            for i, r in enumerate((first, second))
        ],
        "in_flight_after_step": [first["in_flight"], second["in_flight"]],
        "host_reused": len(first["host"]) > 0 and [id(t) for t in first["host"]] == [id(t) for t in second["host"]],
        "differs": [differing(loaded[1], first["at_save"]), differing(loaded[2], second["at_save"])],
        "unchanged_by_next_step": [
            sorted(k for k in first["at_save"] if torch.equal(second["at_save"][k], first["at_save"][k])),
            sorted(k for k in second["at_save"] if torch.equal(after[k], second["at_save"][k])),
        ],
    }


def test_the_copies_are_queued_in_save_and_the_next_step_waits_on_the_device(tmp_path):
    for r in run_distributed(_stream_world, 2, str(tmp_path)):
        # In save(), on the training thread: the side stream waits for the current one (the last
        # step's writes), the copies are queued on it, then its event is recorded.
        assert r["queued_in_save"] == [True, True], r
        # Only a worker waits on the host for the copies, and the next optimizer step went on without
        # them: its kernels were ordered after the copies' event, on the training thread, once.
        assert r["host_waits_in_worker_only"] == [True, True], r
        assert r["step_ordered_once"] == [True, True], r
        assert r["in_flight_after_step"] == [True, True], r
        # The second save refilled the first one's host tensors (no new host tensor per state tensor) ...
        assert r["host_reused"], r
        # ... and each checkpoint holds the state at its save(), though the next step changed every tensor.
        assert r["differs"] == [[], []], r
        assert r["unchanged_by_next_step"] == [[], []], r


def test_overlap_takes_the_stream_copy_where_an_accelerator_exists(monkeypatch):
    assert not isinstance(async_save.default_stager("overlap"), StreamCopyStager)  # the host: DCP's thread
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch, "Stream", lambda *a, **k: FakeStream(Log()))  # a CUDA build without a GPU would fail
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


def _staged_now(stager: StreamCopyStager, side: FakeStream, state: dict) -> dict:
    future = stager.stage(state)
    side.events[-1].done.set()
    return future.result(timeout=30)


def test_a_changed_structure_is_staged_anew_and_other_values_are_copied(monkeypatch):
    log = Log()
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda *a: FakeCurrentStream(log))
    side = FakeStream(log)
    stager = StreamCopyStager(stream=side)
    groups = [{"lr": 0.1, "params": ["w"]}]
    state = {"model": OrderedDict(w=torch.arange(4.0)), "optim": {"param_groups": groups}}
    first = _staged_now(stager, side, state)
    state["model"]["w"].add_(1)
    groups[0]["lr"] = 0.05  # a scheduler changes it in place after save()
    second = _staged_now(stager, side, state)
    state["model"]["b"] = torch.ones(2)  # a new key
    third = _staged_now(stager, side, state)
    state["model"]["w"] = torch.arange(6.0)  # a new shape
    fourth = _staged_now(stager, side, state)
    state["model"]["w"] = torch.arange(6.0).as_subclass(Marked)  # a subclass: DCP's stager copies it
    fifth, sixth = _staged_now(stager, side, state), _staged_now(stager, side, state)
    stager.close()
    assert second["model"]["w"] is first["model"]["w"]  # refilled
    assert torch.equal(second["model"]["w"], torch.arange(4.0) + 1)
    assert (first["optim"]["param_groups"][0]["lr"], second["optim"]["param_groups"][0]["lr"]) == (0.1, 0.05)
    assert second["optim"]["param_groups"][0] is not groups[0]  # a copy, not the live dict
    assert third["model"]["w"] is not first["model"]["w"] and torch.equal(third["model"]["b"], torch.ones(2))
    assert torch.equal(third["model"]["w"], torch.arange(4.0) + 1)
    assert torch.equal(fourth["model"]["w"], torch.arange(6.0))
    assert sixth["model"]["w"] is not fifth["model"]["w"]  # never refilled through copy_
    assert torch.equal(sixth["model"]["w"].as_subclass(torch.Tensor), torch.arange(6.0))


class Marked(torch.Tensor):
    pass
