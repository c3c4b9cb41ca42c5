"""A checkpoint from someone else is read as data: a file crafted to run code when unpickled (here: to
create a marker file) is refused naming the file and the type, the marker never appears, the model is
unchanged, and `trusted=True` or torch's safe globals load what the user trusts. One process, no group."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.untrusted import Payload
from torch import nn

import fsdp2_strategy as f2
from fsdp2_strategy.checkpoint import integrity, load_step_dir, read_full_model_state
from fsdp2_strategy.checkpoint.safe_load import UntrustedCheckpointError


class Settings:
    """A user's own harmless type in `extra` (a plain class, not a container)."""

    def __init__(self, lr: float) -> None:
        self.lr = lr


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))


def _saved(root: Path, extra=None, **group_extras) -> tuple[f2.Checkpointer, Path]:
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.param_groups[0].update(group_extras)  # a non-tensor entry of the shard files
    ckpt = f2.Checkpointer(root)
    ckpt.save(1, model=model, optimizer=opt, extra=extra)
    return ckpt, ckpt.step_path(1)


def _rewrite(step: Path, name: str, data: bytes) -> None:
    """Replace one file and rewrite `checksums.json` to match, as whoever crafted it can."""
    (step / name).write_bytes(data)
    assert integrity.write_checksums(step, 0) is None


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _refused_everywhere(ckpt: f2.Checkpointer, step: Path, marker: Path, file: str, what: str) -> None:
    target = _model(1)
    before = _params(target)
    calls = {
        "Checkpointer.load": lambda: ckpt.load(model=target),
        "load_step_dir": lambda: load_step_dir(step, model=target),
        "inspect": lambda: f2.inspect_checkpoint(step),
        "read_full_model_state": lambda: read_full_model_state(step),
    }
    for name, call in calls.items():
        with pytest.raises(UntrustedCheckpointError, match=rf"(?s){file}.*{what}.*add_safe_globals.*trusted=True") as e:
            call()
        assert isinstance(e.value, ValueError), name
        assert not marker.exists(), f"{name} ran the payload"
    assert all(torch.equal(a, b) for a, b in zip(before, _params(target))), "the model changed"


def test_a_metadata_file_that_runs_code_is_refused_on_every_path(tmp_path):
    marker = tmp_path / "ran"
    ckpt, step = _saved(tmp_path / "ckpt")
    _rewrite(step, ".metadata", pickle.dumps(Payload(marker)))
    _refused_everywhere(ckpt, step, marker, r"\.metadata", r"the type (posix|os)\.system")
    # Deleting checksums.json makes it no more trusted: still refused.
    (step / "checksums.json").unlink()
    with pytest.raises(UntrustedCheckpointError):
        ckpt.load(model=_model(1))
    assert not marker.exists()


def test_an_extra_file_that_runs_code_is_refused_before_the_model_changes(tmp_path):
    marker = tmp_path / "ran"
    ckpt, step = _saved(tmp_path / "ckpt", extra={"epoch": 3})
    buffer = io.BytesIO()
    torch.save({"epoch": 3, "hook": Payload(marker)}, buffer)
    _rewrite(step, "extra.pt", buffer.getvalue())
    target = _model(1)
    before = _params(target)
    with pytest.raises(UntrustedCheckpointError, match=r"extra\.pt holds the type (posix|os)\.system"):
        ckpt.load(model=target)
    assert not marker.exists()
    assert all(torch.equal(a, b) for a, b in zip(before, _params(target)))


def test_a_shard_entry_that_runs_code_is_refused_before_the_model_changes(tmp_path):
    """A non-tensor entry of a `.distcp` file (here an optimizer group's value) is unpickled by DCP's
    planner with the full unpickler; it is read as data first."""
    marker = tmp_path / "ran"
    ckpt, step = _saved(tmp_path / "ckpt", note=Payload(marker))
    assert not marker.exists()  # saving pickles the payload; only unpickling would run it
    target = _model(1)
    target_opt = torch.optim.SGD(target.parameters(), lr=0.5, momentum=0.9)
    before = _params(target)
    with pytest.raises(UntrustedCheckpointError, match=r"its entry 'optim\.param_groups\.0\.note'.*(posix|os)\.system"):
        ckpt.load(model=target, optimizer=target_opt)
    assert not marker.exists()
    assert all(torch.equal(a, b) for a, b in zip(before, _params(target)))
    assert target_opt.param_groups[0]["lr"] == 0.5


def test_what_trainers_save_loads_as_data_and_a_users_type_with_a_switch(tmp_path):
    extra = {
        "step": 7,
        "rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state(),
        "best": np.float64(0.25),
        "history": [1.5, 1.25],
    }
    ckpt, _ = _saved(tmp_path / "plain", extra=extra)
    target = _model(1)
    got = ckpt.load(model=target)
    assert got["step"] == 7 and got["best"] == 0.25 and torch.equal(got["rng"], extra["rng"])
    assert np.array_equal(got["numpy_rng"][1], extra["numpy_rng"][1])
    assert all(torch.equal(a, b) for a, b in zip(_params(target), _params(_saved_model())))
    custom, _ = _saved(tmp_path / "custom", extra={"settings": Settings(0.5)})
    with pytest.raises(UntrustedCheckpointError, match=r"extra\.pt holds the type .*Settings"):
        custom.load(model=_model(1))
    assert custom.load(model=_model(1), trusted=True)["settings"].lr == 0.5
    with torch.serialization.safe_globals([Settings]):
        assert custom.load(model=_model(1))["settings"].lr == 0.5


def _saved_model() -> nn.Module:
    """The weights `_saved` wrote (the same seed and step)."""
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model


def test_damaged_metadata_is_a_value_error_naming_the_file(tmp_path):
    ckpt, step = _saved(tmp_path / "ckpt")
    data = (step / ".metadata").read_bytes()
    for damaged in (data[: len(data) // 2], b"\x80\x04not a pickle", pickle.dumps({"a": 1})):
        _rewrite(step, ".metadata", damaged)
        with pytest.raises(ValueError, match=r"\.metadata (is unreadable|holds a dict)") as e:
            ckpt.load(model=_model(1))
        assert not isinstance(e.value, UntrustedCheckpointError)
