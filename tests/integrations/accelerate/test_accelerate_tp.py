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
