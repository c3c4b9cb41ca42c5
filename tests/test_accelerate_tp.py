"""Accelerate's ParallelismConfig through FSDP2Accelerator: dp_shard 2 x tp 2 on 4 CPU ranks (one
torchrun launch of tests/accelerate_scripts/tensor_parallel.py, every rank reporting) equals one
process, given as an object and as `accelerate launch`'s PARALLELISM_CONFIG_* environment; cp and a
wrong product are refused with the field named."""

from __future__ import annotations

from pathlib import Path

import pytest
from _harness import agreed_report, launch, rank_reports

pytest.importorskip("accelerate")

SCRIPTS = Path(__file__).parent / "accelerate_scripts"
TOL = 1e-5  # fp32 parity, relative


@pytest.fixture(scope="module")
def flows(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("accelerate_tp") / "tp.json"
    # Accelerate's CPU environment (no FSDP_*/ACCELERATE_*/PARALLELISM_CONFIG_* from outside) under torchrun.
    launch("torchrun", "tensor_parallel.py", out, cwd=SCRIPTS, nproc=4, timeout=300, accelerate_cpu=True, reports=out)
    # Every rank's report (a flow that raised on any rank fails naming it and the rank), equal on all 4.
    return agreed_report(rank_reports(out, 4))


@pytest.mark.parametrize("flow", ["object", "env"])
def test_dp2_tp2_matches_one_process(flows, flow):
    r = flows[flow]
    assert r["global_batch_sizes"] == [8, 8]  # 2 data-parallel ranks x 4
    assert r["tp_group_same_rows"]  # Accelerate's loader gives both ranks of a TP group one batch
    assert r["max_rel_diff"] < TOL, r["max_rel_diff"]


@pytest.mark.parametrize("flow", ["object", "env"])
def test_sizes_become_config_and_mesh(flows, flow):
    r = flows[flow]
    assert r["config"] == [2, [2], "FULL_SHARD"]
    assert r["mesh"] == [["dp_shard", "tp"], [2, 2]]
    assert r["q_mesh_ndim"] == 2
    assert "colwise" in r["plan"] and "rowwise" in r["plan"]


def test_unsupported_sizes_are_refused(flows):
    errors = flows["errors"]
    assert "cp_size=2" in errors["cp"] and "cp_size=1" in errors["cp"]
    assert (
        "dp_shard_size=1" in errors["product"]
        and "tp_size=2" in errors["product"]
        and "4 processes" in errors["product"]
    )
