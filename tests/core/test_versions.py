"""Supported versions: the private torch names the core uses are checked at import, the tested range is
stated once (`fsdp2_strategy.versions.TESTED`), the declared floors equal it, and a newer release than
the tested range is warned about once, on rank 0."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import tomllib
import torch
from helpers import ROOT

import fsdp2_strategy
from fsdp2_strategy import _torch_compat as tc
from fsdp2_strategy import versions


def test_every_private_torch_name_is_present_on_this_torch():
    assert tc.missing_private_names() == []


def test_a_moved_private_name_is_named_with_the_tested_releases(monkeypatch):
    monkeypatch.delattr(tc.FSDPState, "_lazy_init")
    with pytest.raises(ImportError) as err:
        tc.check_private_api()
    message = str(err.value)
    assert "FSDPState._lazy_init" in message
    low, high = versions.TESTED["torch"]
    assert f"tested with torch {low} to {high}" in message and torch.__version__ in message
    assert f"torch>={low},<" in message  # what to install


def test_instance_attributes_are_found_in_the_class_source():
    # Set in __init__, so not class attributes: found through `self.<name> =` in the source.
    assert tc._declares(tc.FSDPParamGroup, "post_forward_mesh_info")
    assert tc._declares(tc.FSDPMeshInfo, "shard_process_group")
    assert not tc._declares(tc.FSDPParamGroup, "no_such_attribute_anywhere")


def test_unreduced_gradients_are_reported_once():
    class Param:  # torch 2.15's shape: unsharded_accumulated_grad is a view of the unsharded .grad
        pass

    grad = torch.ones(3)
    param = Param()
    param._unsharded_param = torch.nn.Parameter(torch.zeros(3))
    param._unsharded_param.grad = grad
    param.unsharded_accumulated_grad = grad
    assert len(tc.unreduced_grads(param)) == 1
    param.unsharded_accumulated_grad = torch.ones(3)  # torch <= 2.14: a tensor of its own
    assert len(tc.unreduced_grads(param)) == 2


def test_declared_floors_are_the_oldest_tested_releases():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + [d for deps in project["optional-dependencies"].values() for d in deps]
    floors = {}
    for requirement in declared:
        match = re.match(r"([A-Za-z0-9_-]+)(\[[^\]]*\])?>=([0-9.]+)", requirement)
        if match and match.group(1) in versions.TESTED:
            floors.setdefault(match.group(1), set()).add(match.group(3))
    assert set(floors) == set(versions.TESTED), floors
    for name, found in floors.items():
        assert found == {versions.TESTED[name][0]}, (name, found, versions.TESTED[name])


def test_compatibility_matrix_names_the_tested_range():
    page = (ROOT / "docs" / "compatibility.md").read_text()
    section = page[page.index("## Tested versions") :]
    section = section[: section.index("\n## ", 4)]
    for name, (low, high) in versions.TESTED.items():
        assert name in section.lower(), name
        assert low in section and high in section, (name, low, high)


@pytest.mark.parametrize("name", versions.WARNED_AT_IMPORT)
@pytest.mark.parametrize("rank, warned", [("0", True), ("1", False)])
def test_newer_release_is_warned_once_on_rank_zero(monkeypatch, caplog, name, rank, warned):
    major, minor = versions.minor(versions.TESTED[name][1])
    monkeypatch.setattr(versions, "installed", lambda dist: f"{major}.{minor + 1}.0" if dist == name else None)
    monkeypatch.setattr(versions, "_warned", False)
    monkeypatch.setenv("RANK", rank)
    with caplog.at_level(logging.WARNING, logger="fsdp2_strategy"):
        versions.warn_untested_versions()
        versions.warn_untested_versions()
    records = [r for r in caplog.records if "version matrix" in r.getMessage()]
    assert len(records) == (1 if warned else 0)
    if warned:
        assert f"{name} {major}.{minor + 1}.0 (tested {versions.tested_range(name)})" in records[0].getMessage()


def test_tested_releases_are_not_warned(monkeypatch, caplog):
    monkeypatch.setattr(versions, "installed", lambda name: versions.TESTED[name][1] + "+cpu")
    monkeypatch.setattr(versions, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="fsdp2_strategy"):
        versions.warn_untested_versions()
    assert not caplog.records
    assert versions.minor("2.15.0+cu132") == (2, 15) and versions.minor("2.6") == (2, 6)


def test_import_checks_torch_before_anything_else():
    source = Path(fsdp2_strategy.__file__).read_text()
    imports = [line for line in source.splitlines() if line.startswith("from .")]
    assert imports[0].startswith("from . import _torch_compat")


def test_find_private_collects_every_moved_name():
    missing: list[str] = []
    assert versions.find_private("json:dumps", missing) is json.dumps
    assert versions.find_private("json:JSONDecoder.decode", missing) is json.JSONDecoder.decode
    assert versions.find_private("json:_gone", missing) is None
    assert versions.find_private("no_such_module_f2:Thing", missing) is None
    assert missing == ["json:_gone", "no_such_module_f2:Thing"]


def test_each_lightning_adapter_names_every_moved_name(monkeypatch):
    pytest.importorskip("lightning")
    from fsdp2_strategy.integrations._lightning_shared import _compat as shared_compat
    from fsdp2_strategy.integrations.fabric import _compat as fabric_compat
    from fsdp2_strategy.integrations.lightning import _compat as lightning_compat

    for compat in (shared_compat, fabric_compat, lightning_compat):
        assert compat._missing == []  # the installed Lightning has every name
        monkeypatch.setattr(compat, "_missing", ["lightning.x:_A", "lightning.y:_B.c"])
        with pytest.raises(
            ImportError, match=r"cannot find lightning\.x:_A; lightning\.y:_B\.c in lightning .*install lightning>="
        ):
            compat.check_private_api()
