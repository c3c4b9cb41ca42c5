"""Checkpoints written by an earlier layout of the package still load.

`fixtures/checkpoint_v0_1/` was written on 2 ranks by the flat-module layout (commit 6867f42,
`fixtures/make_checkpoint_v0_1.py`): model, SGD momentum and `extra`. It must load, exactly, on
one process without a process group and on 2 sharded ranks, and `inspect` / `export_full` read it.
"""

from __future__ import annotations

import os
import shutil

import torch
from helpers import TESTS
from helpers.harness import run_distributed
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

import fsdp2_strategy as f2

FIXTURES = str(TESTS / "fixtures")
CKPT = os.path.join(FIXTURES, "checkpoint_v0_1")


def _model() -> nn.Module:
    torch.manual_seed(5)  # not the saved weights: everything must come from the checkpoint
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _loaded(model: nn.Module) -> tuple[dict, dict, dict]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    extra = f2.Checkpointer(CKPT).load(model=model, optimizer=opt)
    params = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return extra, params, {k: s["momentum_buffer"] for k, s in osd["state"].items()}


def _two_rank_load() -> tuple:
    return _loaded(f2.shard_model(_model(), f2.FSDP2Config(wrap_policy=[nn.Linear], log_plan=False)))


def _assert_expected(extra: dict, params: dict, momentum: dict) -> None:
    expected = torch.load(os.path.join(FIXTURES, "checkpoint_v0_1_expected.pt"))
    assert extra == {"layout": "v0.1", "seen": 12}
    assert sorted(params) == sorted(expected["params"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    for k, v in expected["params"].items():
        assert torch.equal(params[k], v), k
    assert sorted(momentum) == sorted(expected["momentum"]) and len(momentum) == 4
    for k, v in expected["momentum"].items():
        assert torch.equal(momentum[k], v), k


def test_v0_1_checkpoint_loads_in_one_process():
    assert f2.Checkpointer(CKPT).latest_step() == 2
    _assert_expected(*_loaded(_model()))


def test_v0_1_checkpoint_loads_on_two_ranks():
    for result in run_distributed(_two_rank_load, 2, timeout=120):
        _assert_expected(*result)


def test_v0_1_checkpoint_inspects_and_exports(tmp_path):
    from safetensors.torch import load_file

    info = f2.inspect_checkpoint(CKPT)
    assert info.world_size == 2 and info.problems == [] and info.checksummed
    assert "model.2.weight                        [3, 8]  float32" in str(info)
    copy = tmp_path / "ckpt"
    shutil.copytree(CKPT, copy)  # export must not need to write into the fixture
    f2.export_full(copy / "step-000002", tmp_path / "out")
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    expected = torch.load(os.path.join(FIXTURES, "checkpoint_v0_1_expected.pt"))["params"]
    assert sorted(weights) == sorted(expected)
    assert all(torch.equal(weights[k], v) for k, v in expected.items())
