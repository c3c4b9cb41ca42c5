"""`Checkpointer(async_save="overlap")`: `save()` returns before the state is copied, training goes on,
and the checkpoint still holds the state of the moment `save()` was called, bit for bit.

The copy is slowed down (a stager that sleeps before copying) so that the next forward, backward and
optimizer step really start while it runs: without the optimizer's wait the saved parameters would be
the next step's. A BatchNorm's running statistics (changed by every forward) are in the model too.
Killed during the copy, the save leaves no committed step: the previous one stays the latest.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from _harness import DistributedTestError, run_distributed
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.tensor import DTensor

import fsdp2_strategy as f2

DELAY = 0.6  # seconds the copy is held back


class SlowStager(DefaultStager):
    def _stage(self, state_dict, **kwargs):
        time.sleep(DELAY)
        return super()._stage(state_dict, **kwargs)


class SlowCheckpointer(f2.Checkpointer):
    def _make_stager(self):
        stager = super()._make_stager()
        stager.__class__ = SlowStager
        return stager


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


def _snapshot(model, opt) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and optimizer state tensor, whole (collective)."""
    out = {}
    for name, t in [*model.state_dict().items()]:
        out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
    for i, state in enumerate(opt.state.values()):
        for k, t in state.items():
            if torch.is_tensor(t):
                out[f"opt{i}.{k}"] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
    return out


def _overlap_world(root: str) -> dict:
    model = f2.shard_model(_model(), wrap_policy=[nn.Linear], log_plan=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    _step(model, opt, 0)
    ckpt = SlowCheckpointer(root, async_save="overlap")
    at_save = _snapshot(model, opt)
    start = time.perf_counter()
    ckpt.save(1, model=model, optimizer=opt)
    returned = time.perf_counter() - start
    in_flight = ckpt._saver._staging is not None and not ckpt._saver._staging.done()
    _step(model, opt, 1)  # forward (BatchNorm statistics change), backward, then a step that must wait
    waited = time.perf_counter() - start
    after = _snapshot(model, opt)
    ckpt.wait()
    fresh = f2.shard_model(_model(), wrap_policy=[nn.Linear], log_plan=False)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)
    _step(fresh, fresh_opt, 5)  # other values everywhere, the same state keys
    ckpt.load(model=fresh, optimizer=fresh_opt)
    loaded = _snapshot(fresh, fresh_opt)
    return {
        "returned": returned,
        "waited": waited,
        "in_flight": in_flight,
        "differs": sorted(k for k in at_save if not torch.equal(loaded[k], at_save[k])),
        "changed_by_next_step": sorted(k for k in at_save if not torch.equal(after[k], at_save[k])),
        "keys": sorted(at_save),
    }


def test_overlap_save_returns_at_once_and_holds_the_state_of_the_call(tmp_path):
    for r in run_distributed(_overlap_world, 2, str(tmp_path)):
        assert r["in_flight"] and r["returned"] < DELAY / 2, r  # save() did not wait for the copy
        assert r["waited"] >= DELAY * 0.9, r  # the optimizer step waited for it
        assert r["differs"] == []  # bit for bit the state at save()
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
    with pytest.raises(DistributedTestError, match="exited with code"):
        run_distributed(_killed_world, 2, str(tmp_path), timeout=60)
    assert f2.Checkpointer(tmp_path).latest_step() == 1
    assert not (tmp_path / "step-000002").exists()


def test_overlap_is_a_named_mode(tmp_path):
    with pytest.raises(ValueError, match="async_save='later' is invalid; use False .* True .* or 'overlap'"):
        f2.Checkpointer(tmp_path, async_save="later")
