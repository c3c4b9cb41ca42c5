"""`Checkpointer(async_save="overlap")`: `save()` returns before the state is copied, training goes on,
and the checkpoint still holds the state of the moment `save()` was called, bit for bit.

The copy is slowed down (a stager that sleeps before copying) so that the next forward, backward and
optimizer step really start while it runs: without the optimizer's wait the saved parameters would be
the next step's. A BatchNorm's running statistics (changed by every forward) are in the model too.
Killed during the copy, the save leaves no committed step: the previous one stays the latest.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from helpers.harness import launch, run_distributed
from helpers.slow_staging import SlowStager, differing, full_state, slow
from torch import nn

import fsdp2_strategy as f2

DELAY = 0.6  # seconds the copy is held back


class SlowCheckpointer(f2.Checkpointer):
    def _make_stager(self):
        return slow(super()._make_stager(), DELAY)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 1))


def _step(model, opt, seed: int) -> None:
    # The same batch on every rank: buffers (not synchronised by FSDP) stay equal across ranks, so
    # the one copy DCP keeps of them is every rank's.
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _overlap_world(root: str) -> dict:
    model = f2.shard_model(_model(), wrap_policy=[nn.Linear], log_plan=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    _step(model, opt, 0)
    ckpt = SlowCheckpointer(root, async_save="overlap")
    at_save = full_state(model, opt)
    committed: list = []
    start = time.perf_counter()
    ckpt.save(1, model=model, optimizer=opt, on_commit=committed.append)
    returned_at = time.perf_counter()
    returned = returned_at - start
    committed_at_return = list(committed)
    in_flight = ckpt._saver._staging is not None and not ckpt._saver._staging.done()
    _step(model, opt, 1)  # forward (BatchNorm statistics change), backward, then a step that must wait
    waited = time.perf_counter() - start
    after = full_state(model, opt)
    ckpt.wait()
    committed_after_wait = [p.name for p in committed]
    fresh = f2.shard_model(_model(), wrap_policy=[nn.Linear], log_plan=False)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)
    _step(fresh, fresh_opt, 5)  # other values everywhere, the same state keys
    ckpt.load(model=fresh, optimizer=fresh_opt)
    loaded = full_state(fresh, fresh_opt)
    return {
        "returned": returned,
        "copy_started_after_return": [t >= returned_at for t in SlowStager.copies_started],
        "waited": waited,
        "in_flight": in_flight,
        "on_commit": (committed_at_return, committed_after_wait),
        "differs": differing(loaded, at_save),
        "changed_by_next_step": sorted(k for k in at_save if not torch.equal(after[k], at_save[k])),
        "keys": sorted(at_save),
    }


def test_overlap_save_returns_at_once_and_holds_the_state_of_the_call(tmp_path):
    for r in run_distributed(_overlap_world, 2, str(tmp_path)):
        # save() did not wait for the copy: it was still running when save() returned (a statement
        # about order, not a timing that a loaded machine could break).
        assert r["in_flight"], r
        # ... and the copy started only then: started at once in DCP's stager thread, it would hold
        # the GIL while save() still starts DCP's upload thread (tens of milliseconds more blocking).
        assert r["copy_started_after_return"] == [True], r
        assert r["waited"] >= DELAY * 0.9, r  # the optimizer step waited for it
        assert r["differs"] == []  # bit for bit the state at save()
        assert r["on_commit"] == ([], ["step-000001"])  # on_commit ran in wait(), with the committed directory
        # ... although the next step changed every tensor (parameters, running statistics, momentum).
        assert r["changed_by_next_step"] == r["keys"], set(r["keys"]) - set(r["changed_by_next_step"])


def _killed_world(root: str) -> None:
    model = f2.shard_model(_model(), wrap_policy=[nn.Linear], log_plan=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    _step(model, opt, 0)
    f2.Checkpointer(root).save(1, model=model, optimizer=opt)
    SlowCheckpointer(root, async_save="overlap").save(2, model=model, optimizer=opt)
    os._exit(3)  # killed while the copy of step 2 is in flight


def test_killed_during_the_copy_the_previous_step_stays_the_latest(tmp_path):
    run_distributed(_killed_world, 2, str(tmp_path), timeout=60, exit_codes=3)
    assert f2.Checkpointer(tmp_path).latest_step() == 1
    assert not (tmp_path / "step-000002").exists()


def test_overlap_is_a_named_mode(tmp_path):
    with pytest.raises(ValueError, match="async_save='later' is invalid; use False .* True .* or 'overlap'"):
        f2.Checkpointer(tmp_path, async_save="later")


_EXIT_SCRIPT = """
import sys, torch, fsdp2_strategy as f2
ckpt = f2.Checkpointer(sys.argv[1], async_save=True)
ckpt.save(1, model=torch.nn.Linear(4, 4))
if sys.argv[2] == "shutdown":
    f2.shutdown()
"""


@pytest.mark.parametrize("ending", ["shutdown", "plain exit"])
def test_shutdown_commits_the_save_in_flight_and_a_plain_exit_warns(tmp_path, ending):
    """A script ending with `f2.shutdown()` keeps its last asynchronous save; one that just ends
    loses it (the write thread dies with the process) and is told so."""
    run = launch("python", "-c", _EXIT_SCRIPT, tmp_path, ending, cwd=tmp_path, timeout=120)
    if ending == "shutdown":
        assert f2.Checkpointer(tmp_path).latest_step() == 1
    else:
        assert f2.Checkpointer(tmp_path).latest_step() is None
        assert "was not committed before the process ended" in run.stderr


def _mlp() -> nn.Module:
    # No BatchNorm: the bias before it has a zero gradient in exact arithmetic, only float noise.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 1))


def _preempted_world(root: str) -> None:
    """Rank 1 receives SIGTERM in the middle of step 3 (between forward and backward); saves are
    asynchronous every 2 steps. Every rank must stop after step 3 with step 3 committed."""
    model = f2.shard_model(_mlp(), wrap_policy=[nn.Linear], log_plan=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = f2.Checkpointer(root, async_save=True, save_on_preemption=True)
    for step in range(1, 9):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        if step == 3 and torch.distributed.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # the default action would kill this rank here
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 2 == 0:
            ckpt.save(step, model=model, optimizer=opt, extra={"step": step})
        ckpt.exit_if_preempted(step, model=model, optimizer=opt, extra={"step": step})


def test_sigterm_to_one_rank_mid_step_saves_that_step_and_every_rank_exits_143(tmp_path):
    start = time.perf_counter()
    # Each rank must end its process with 143: one that exits otherwise, raises or hangs is named.
    run_distributed(_preempted_world, 2, str(tmp_path), timeout=60, exit_codes=f2.PREEMPTION_EXIT_CODE)
    # No rank waited for a timeout: a collective's (60 s) or f2.shutdown's final barrier's (60 s, after
    # which a rank still exits 143).
    assert time.perf_counter() - start < 30
    ckpt = f2.Checkpointer(tmp_path)
    assert ckpt.latest_step() == 3 and sorted(p.name for p in tmp_path.iterdir()) == ["step-000002", "step-000003"]
    # The state after three steps of one process on the same batches (every rank saw the whole batch).
    ref = _mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(1, 4):
        _step(ref, ref_opt, step)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert ckpt.load(model=model, optimizer=opt) == {"step": 3}
    for (name, got), want in zip(full_state(model, opt).items(), full_state(ref, ref_opt).values()):
        assert ((got - want).norm() / want.norm().clamp_min(1e-12)).item() < 1e-5, name
