"""Accelerate's ParallelismConfig through FSDP2Accelerator: dp_shard 2 x tp 2 on 4 CPU ranks (one
torchrun launch of tests/integrations/accelerate/scripts/tensor_parallel.py, every rank reporting) equals one
process, given as an object and as `accelerate launch`'s PARALLELISM_CONFIG_* environment; Accelerate's
context-parallel recipe (dp_shard 2 x cp 2) equals one process on whole sequences; sp and a wrong
product are refused with the field named. The script checks (`helpers.checks.Checks`); this file
launches it and reports its checks."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.checks import FlowReports
from helpers.harness import launch, rank_reports

pytest.importorskip("accelerate")

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture(scope="module")
def flows(tmp_path_factory) -> FlowReports:
    out = tmp_path_factory.mktemp("accelerate_tp") / "tp.json"
    # Accelerate's CPU environment (no FSDP_*/ACCELERATE_*/PARALLELISM_CONFIG_* from outside) under torchrun.
    launch("torchrun", "tensor_parallel.py", out, cwd=SCRIPTS, nproc=4, timeout=300, accelerate_cpu=True, reports=out)
    # Every rank's report (a flow that raised on any rank fails naming it and the rank), equal on all 4.
    return FlowReports(rank_reports(out, 4))


@pytest.mark.parametrize("flow", ["object", "env"])
def test_dp2_tp2_matches_one_process_and_sizes_become_config_and_mesh(flows, flow):
    flows.assert_passed(flow)


def test_accelerates_context_parallel_recipe_matches_one_process(flows):
    flows.assert_passed("cp_recipe")


def test_unsupported_sizes_are_refused(flows):
    flows.assert_passed("errors")


def test_an_accelerate_config_files_cp_size_becomes_context_parallel_size(monkeypatch):
    """The `parallelism_config` section of an accelerate config file, as `accelerate launch` passes it
    (PARALLELISM_CONFIG_*), sets the core's context_parallel_size and FSDP's data-parallel dims."""
    import fsdp2_strategy as f2
    from fsdp2_strategy.integrations.accelerate.parallelism import (
        apply_parallelism_config,
        requested_parallelism_config,
    )

    for name, value in {
        "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
        "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
        "PARALLELISM_CONFIG_CP_SIZE": "2",
    }.items():
        monkeypatch.setenv(name, value)
    config = apply_parallelism_config(f2.FSDP2Config(), requested_parallelism_config(None), 4)
    assert (config.context_parallel_size, config.mesh_shape, config.tensor_parallel_size) == (2, (2,), 1)
    with pytest.raises(ValueError, match="context_parallel_size=4.*cp_size=2"):
        apply_parallelism_config(f2.FSDP2Config(context_parallel_size=4), requested_parallelism_config(None), 4)
