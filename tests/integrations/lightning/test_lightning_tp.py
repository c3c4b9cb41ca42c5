"""Lightning with tensor parallelism: 2 dp x 2 tp on 4 CPU ranks (one torchrun launch of
tests/integrations/lightning/scripts/tensor_parallel.py, every rank checking and reporting) equals one process,
for a module written for ModelParallelStrategy (hand-written TP + fully_shard in configure_model)
and for a plain module given `tensor_parallel_plan`."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.checks import FlowReports
from helpers.harness import launch, rank_reports

pytest.importorskip("lightning")

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture(scope="module")
def flows(tmp_path_factory) -> FlowReports:
    out = tmp_path_factory.mktemp("lightning_tp") / "tp.json"
    launch("torchrun", "tensor_parallel.py", out, cwd=SCRIPTS, nproc=4, timeout=300, reports=out)
    # Every rank's report (a flow that raised on any rank fails naming it and the rank), equal on all 4.
    return FlowReports(rank_reports(out, 4))


@pytest.mark.parametrize("flow", ["hand_tp", "plan"])
def test_two_by_two_matches_one_process(flows, flow):
    """Parity with one process, Lightning's 2-D mesh and parameters, the plan's TP styles."""
    flows.assert_passed(flow)


def test_hybrid_sharding_with_tensor_parallel_is_refused_by_name():
    """Lightning's mesh has no replicate dim: HSDP x TP would need a second mesh beside it."""
    import lightning.pytorch as pl

    from fsdp2_strategy.integrations.lightning import FSDP2Strategy

    strategy = FSDP2Strategy(sharding_strategy="HYBRID_SHARD", tensor_parallel_size=2)
    pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False)  # not launched: no process group
    with pytest.raises(
        ValueError,
        match=r"(?s)FSDP2Strategy\(sharding_strategy='HYBRID_SHARD'.*"
        r"tensor_parallel_size=2\) is not supported.*FULL_SHARD",
    ):
        strategy.setup_environment()
