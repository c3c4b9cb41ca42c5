"""Lightning adapter: Trainer(strategy="fsdp2") on 2 CPU ranks under torchrun, plus construction checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

from fsdp2_strategy.integrations.lightning import FSDP2Strategy  # noqa: E402

SCRIPTS = Path(__file__).parent / "lightning_scripts"
REPO = Path(__file__).resolve().parents[1]


def _torchrun(script: str, *args: str, timeout: int = 80) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SCRIPTS / script), *args]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"


@pytest.fixture(scope="module")
def fit_result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("lightning") / "fit.json"
    _torchrun("fit_fsdp2.py", str(out))
    return json.loads(out.read_text())


def test_strategy_string_shards_blocks(fit_result):
    assert fit_result["strategy"] == "FSDP2Strategy"
    assert fit_result["mesh_dims"] == ["data_parallel", "tensor_parallel"]
    assert fit_result["mesh_shape"] == [2, 1]
    assert fit_result["root_is_fsdp"]
    assert fit_result["block_params_dtensor"] and all(fit_result["block_params_dtensor"])
    assert all(fit_result["optimizer_params_dtensor"])
    assert fit_result["plan_groups"] == ["<root>", "blocks.0", "blocks.1", "blocks.2"]


def test_one_step_matches_single_process(fit_result):
    assert fit_result["changed"]
    worst = max(fit_result["max_rel_diff"].values())
    assert worst < 1e-5, fit_result["max_rel_diff"]
    a, b = fit_result["per_rank_indices"]
    assert len(a) == len(b) and not set(a) & set(b)


def test_unknown_wrap_class_names_close_match(fit_result):
    message = fit_result["typo_error"]
    assert message is not None and "Blok" in message and "Block" in message


def test_invalid_config_raises_core_error():
    with pytest.raises(ValueError, match="FSDP2Config.sharding_strategy"):
        FSDP2Strategy(sharding_strategy="FULLY")
    with pytest.raises(ValueError, match="state_dict_type"):
        FSDP2Strategy(state_dict_type="zip")


def test_state_dict_type_maps_to_distributed_checkpoint():
    assert FSDP2Strategy()._save_distributed_checkpoint is True
    assert FSDP2Strategy(state_dict_type="full")._save_distributed_checkpoint is False


def test_registered_names():
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["fsdp2"]["strategy"] is FSDP2Strategy
    assert StrategyRegistry["fsdp2_hybrid"]["init_params"] == {"sharding_strategy": "HYBRID_SHARD"}
    assert StrategyRegistry.get("fsdp2_cpu_offload").fsdp2_config.cpu_offload is True
