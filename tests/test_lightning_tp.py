"""Lightning with tensor parallelism: 2 dp x 2 tp on 4 CPU ranks (one torchrun launch of
tests/lightning_scripts/tensor_parallel.py, every rank reporting) equals one process, for a module
written for ModelParallelStrategy (hand-written TP + fully_shard in configure_model) and for a plain
module given `tensor_parallel_plan`."""

from __future__ import annotations

from pathlib import Path

import pytest
from _harness import agreed_report, launch, rank_reports

pytest.importorskip("lightning")

SCRIPTS = Path(__file__).parent / "lightning_scripts"
TOL = 1e-5  # fp32 parity, relative


@pytest.fixture(scope="module")
def flows(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("lightning_tp") / "tp.json"
    launch("torchrun", "tensor_parallel.py", out, cwd=SCRIPTS, nproc=4, timeout=300, reports=out)
    # Every rank's report (a flow that raised on any rank fails naming it and the rank), equal on all 4.
    return agreed_report(rank_reports(out, 4))


@pytest.mark.parametrize("flow", ["hand_tp", "plan"])
def test_two_by_two_matches_one_process(flows, flow):
    r = flows[flow]
    assert r["same_names"] and r["global_batch_sizes"] == [8, 8]  # 2 dp ranks x 4 samples, 2 steps
    assert r["max_rel_diff"] < TOL, r["max_rel_diff"]


@pytest.mark.parametrize("flow", ["hand_tp", "plan"])
def test_lightning_mesh_and_2d_parameters(flows, flow):
    r = flows[flow]
    assert r["mesh_dims"] == ["data_parallel", "tensor_parallel"] and r["mesh_shape"] == [2, 2]
    assert r["dp_size"] == 2  # the sampler splits data over the data-parallel dim only
    assert r["params_dtensor"] and r["tp_weights_2d"]  # TP weights: FSDP over dp on top of TP
    assert r["q_dim0_over_dp_and_tp"]  # column-wise q: dim 0 split over tp, FSDP splits it again over dp


def test_plan_shows_tensor_parallel_styles(flows):
    assert "colwise" in flows["plan"]["plan"] and "rowwise" in flows["plan"]["plan"]
    assert "user" in flows["hand_tp"]["plan"]  # the module's own TP, left as it was


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
