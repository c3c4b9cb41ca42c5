"""Fabric adapter end to end: real `Fabric(strategy="fsdp2")` runs on 2 CPU processes (`fabric run`,
and spawn through `fabric.launch(fn)`) and on 1 (2 -> 1 resume), each in a subprocess with a timeout;
plus the checks that need no processes (registry, precision choice, constructor errors).

The scripts in tests/fabric_scripts/ measure and write JSON; the assertions live here.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from _harness import agreed_report, free_port, launch, rank_reports  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.plugins.precision import DoublePrecision  # noqa: E402
from lightning.fabric.strategies import STRATEGY_REGISTRY  # noqa: E402

from fsdp2_strategy.integrations.fabric import (  # noqa: E402
    FSDP2FabricHalfPrecision,
    FSDP2FabricMixedPrecision,
    FSDP2FabricPrecision,
    FSDP2FabricStrategy,
)

SCRIPTS = Path(__file__).parent / "fabric_scripts"
TOL = 1e-5  # fp32 parity, relative


# Values each rank of flows.py measures on its own (the tests read them on every rank); everything
# else every rank reports alike.
PER_RANK = ["overlap_save.returned", "overlap_save.waited"]

# `fabric run --accelerator cpu --devices N ...` (its rank processes share the launch's environment).
_FABRIC_RUN = ["lightning.fabric.cli", "--accelerator", "cpu", "--devices"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """`fabric run` x2 (every flow, a checkpoint) -> 1 process resuming it -> spawn x2."""
    work = tmp_path_factory.mktemp("fabric")
    flows = work / "flows.json"
    cli = [*_FABRIC_RUN, "2", "--main-port", free_port()]
    launch("python", "-m", *cli, "flows.py", flows, work, cwd=SCRIPTS, timeout=300, reports=flows)
    launch("python", "single.py", work / "single.json", work, cwd=SCRIPTS, timeout=180)
    launch("python", "spawn.py", work / "spawn.json", work, cwd=SCRIPTS)
    out = {name: json.loads((work / f"{name}.json").read_text()) for name in ("single", "spawn")}
    # Every rank's report (a flow that raised on any rank fails here, naming it), equal on every rank.
    out["flow_ranks"] = rank_reports(flows, 2)
    out["flows"] = agreed_report(out["flow_ranks"], PER_RANK)
    return out


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory) -> dict:
    """`fabric run` x4: 2 data parallel x 2 tensor parallel."""
    out = tmp_path_factory.mktemp("fabric_tp") / "tp.json"
    cli = [*_FABRIC_RUN, "4", "--main-port", free_port()]
    launch("python", "-m", *cli, "tensor_parallel.py", out, cwd=SCRIPTS, timeout=300, nproc=4, reports=out)
    # Every rank's report (a flow that raised on any rank fails naming it and the rank), equal on all 4.
    return agreed_report(rank_reports(out, 4))["plan"]


# ---------------------------------------------------------------------- no processes needed
def test_import_registers_the_trainer_adapters_names():
    assert {"fsdp2", "fsdp2_hybrid", "fsdp2_cpu_offload", "fsdp2_spawn"} <= set(
        STRATEGY_REGISTRY.available_strategies()
    )
    assert isinstance(Fabric(strategy="fsdp2", accelerator="cpu", devices=2).strategy, FSDP2FabricStrategy)
    assert (
        Fabric(strategy="fsdp2_hybrid", accelerator="cpu", devices=2).strategy.fsdp2_config.sharding_strategy
        == "HYBRID_SHARD"
    )
    assert Fabric(strategy="fsdp2_cpu_offload", accelerator="cpu", devices=2).strategy.fsdp2_config.cpu_offload is True
    assert Fabric(strategy="fsdp2_spawn", accelerator="cpu", devices=2).strategy._start_method == "spawn"


def test_strategy_takes_every_config_field_and_refuses_bad_ones():
    fields = dict(wrap_policy=["Block"], reshard_after_forward=False, forward_prefetch=1, mixed_precision="bf16")
    strategy = FSDP2FabricStrategy(**fields)
    assert all(getattr(strategy.fsdp2_config, k) == v for k, v in fields.items())
    assert FSDP2FabricStrategy(config={"cpu_offload": True}).fsdp2_config.cpu_offload
    with pytest.raises(ValueError, match="sharding_strategy"):
        FSDP2FabricStrategy(sharding_strategy="FULLY")
    with pytest.raises(ValueError, match="start_method='threads' is invalid"):
        FSDP2FabricStrategy(start_method="threads")


def test_strategy_takes_model_parallel_strategys_constructor():
    def fn(module, mesh):
        return module

    timeout = timedelta(minutes=3)
    strategy = FSDP2FabricStrategy(
        fn,
        data_parallel_size=2,
        tensor_parallel_size=2,
        save_distributed_checkpoint=False,
        process_group_backend="gloo",
        timeout=timeout,
    )
    assert strategy._user_parallelize_fn is fn and strategy._parallel_args.data_parallel_size == 2
    assert strategy.fsdp2_config.tensor_parallel_size == 2 and not strategy._save_distributed_checkpoint
    assert strategy.process_group_backend == "gloo" and strategy._timeout == timeout
    auto = FSDP2FabricStrategy(fn, tensor_parallel_size="auto")  # ModelParallelStrategy's default, asked for
    assert auto._parallel_args.auto_tensor_parallel and auto.fsdp2_config.tensor_parallel_size == 1
    with pytest.raises(ValueError, match=r"data_parallel_size=0 is invalid; use 'auto' or an int >= 1"):
        FSDP2FabricStrategy(fn, data_parallel_size=0)
    with pytest.raises(TypeError, match="parallelize_fn must be callable.*config=..."):
        FSDP2FabricStrategy({"cpu_offload": True})  # a config given where parallelize_fn now stands


def test_precision_strings_choose_fsdp2_plugins():
    def plugin(precision):
        return Fabric(strategy="fsdp2", accelerator="cpu", devices=2, precision=precision).strategy.precision

    assert type(plugin("32-true")) is FSDP2FabricPrecision
    assert type(plugin("bf16-true")) is FSDP2FabricHalfPrecision
    bf16 = plugin("bf16-mixed")
    assert type(bf16) is FSDP2FabricMixedPrecision and bf16.fsdp2_mixed_precision == "bf16"
    # Fabric refuses "16-mixed" for ModelParallelStrategy (no sharded scaler); FSDP2 has one.
    fp16 = plugin("16-mixed")
    assert fp16.fsdp2_mixed_precision == "fp16" and type(fp16.scaler).__name__ == "ShardedGradScaler"
    with pytest.raises(ValueError, match=r"precision='64-true'.*32-true, bf16-mixed, 16-mixed, bf16-true, 16-true"):
        plugin("64-true")
    with pytest.raises(ValueError, match="cannot honour the precision plugin DoublePrecision"):
        Fabric(strategy="fsdp2", accelerator="cpu", devices=2, plugins=DoublePrecision())


def test_other_strategies_keep_fabrics_precision_choice():
    # The precision hook is scoped to FSDP2FabricStrategy: Fabric's own ModelParallelStrategy still refuses 16-mixed.
    from lightning.fabric.strategies import ModelParallelStrategy

    with pytest.raises(ValueError, match="ModelParallelStrategy` does not support"):
        Fabric(strategy=ModelParallelStrategy(lambda m, mesh: m), accelerator="cpu", devices=2, precision="16-mixed")


# ---------------------------------------------------------------------- 2 ranks (fabric run)
def test_setup_shards_by_policy_and_rebinds_the_optimizer(flows):
    r = flows["parity"]
    assert r["strategy"] == "FSDP2FabricStrategy" and r["root_is_fsdp"]
    assert r["plan_groups"] == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
    assert r["mesh_dims"] == ["data_parallel", "tensor_parallel"] and r["mesh_shape"] == [2, 1]
    assert all(r["optimizer_params_dtensor"])  # built before setup, pointed at the shards


def test_two_ranks_equal_one_process(flows):
    assert flows["parity"]["max_rel_diff"] < TOL


def test_no_backward_sync_reduces_once_per_step(flows):
    r = flows["accumulation"]
    assert r["reduce_scatters"] == r["groups"] == 4  # without it: one per group per micro-batch
    assert r["reduce_scatters_plain"] == 2 * r["groups"]
    assert r["max_rel_diff"] < TOL  # two accumulated micro-batches equal one step on the whole batch


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_clip_gradients_matches_one_process(flows, algorithm):
    r = flows["clipping"][algorithm]
    assert r["max_rel_diff"] < TOL and r["unclipped_diff"] > 0.1  # the clip was active
    if algorithm == "norm":  # fabric.clip_gradients returns the global norm
        assert all(abs(a - b) <= TOL * b for a, b in zip(r["norms"], r["ref_norms"])) and len(r["norms"]) == 2


def test_precision_strings_map_to_fsdp2_policies(flows):
    p = flows["precision"]
    assert p["bf16-mixed"]["plan_precision"] == ["bf16/fp32"] and p["bf16-mixed"]["compute_dtype"] == "torch.bfloat16"
    assert p["bf16-mixed"]["stored_dtypes"] == ["torch.float32"]
    fp16 = p["16-mixed"]
    assert (
        fp16["sharded_scaler"]
        and fp16["compute_dtype"] == "torch.float16"
        and fp16["stored_dtypes"] == ["torch.float32"]
    )
    assert fp16["scale"] == 2.0**10  # the step ran: a skipped step would have halved the scale
    assert p["bf16-true"]["stored_dtypes"] == ["torch.bfloat16"] and p["bf16-true"]["compute_dtype"] == "torch.bfloat16"
    assert p["32-true"]["compute_dtype"] == "torch.float32" and p["32-true"]["plan_precision"] == ["param"]
    assert p["bf16-mixed"]["plugin"] == "FSDP2FabricMixedPrecision" and p["32-true"]["plugin"] == "FSDP2FabricPrecision"
    # One step against the policy written out without the engine (tests/_precision.py; "-true": one
    # bf16 process; "32-true": one fp32 process): the same arithmetic up to fp32 summation order
    # (measured <= 2.2e-08; bf16-true 0). Gradients reduce-scattered in the policy's reduce dtype.
    for name, reduce_dtype in (
        ("bf16-mixed", "float32"),
        ("16-mixed", "float32"),
        ("bf16-true", "bfloat16"),
        ("32-true", "float32"),
    ):
        assert p[name]["update_diff"] < TOL, (name, p[name])
        scatters = {d for n, d in p[name]["reductions"] if n.startswith("reduce_scatter")}
        assert scatters == {reduce_dtype}, (name, p[name]["reductions"])


def test_init_module_empty_init_builds_on_meta(flows):
    r = flows["meta_init"]
    assert r["meta_before"] and not r["meta_after"]
    # The modules' own reset_parameters() draws, as in one process (shards of one draw, not each
    # rank's own), and one step from them matches one process.
    assert r["init_diff"] == 0.0 and r["max_rel_diff"] < TOL


def test_save_load_resumes_exactly_and_returns_the_rest(flows):
    c = flows["checkpoints"]
    assert c["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "checksums.json", "meta.pt"]
    assert c["step"] == 1 and c["counter"] == 7 and c["remainder"] == {"note": "hello"}
    assert c["resume_diff"] == 0.0 and c["resumed_losses"] == c["continued_losses"]
    # fabric.save after an evaluation forward: the root was gathered, the save left only shards.
    assert "inp.weight" in c["gathered_before_save"] and c["plain_after_save"] == []


def test_damaged_partial_and_unsupported_checkpoints_refused(flows):
    c = flows["checkpoints"]
    assert "damaged and was not loaded" in c["damaged_error"] and "__0_0.distcp" in c["damaged_error"]
    # What to load instead: the committed checkpoint beside it (not the partial copy), and how.
    hint = c["damaged_error"].split("Committed checkpoints beside it")[1]
    assert "fabric_ckpt" in hint and "partial_ckpt" not in hint and "the same load call with its path" in hint
    assert "not a committed fsdp2 checkpoint" in c["partial_error"]
    assert c["unchanged_after_refusals"] == 0.0
    assert c["missing_key_error"].startswith("KeyError") and "'absent'" in c["missing_key_error"]
    assert "filter=" in c["filter_error"] and "not supported with strategy='fsdp2'" in c["filter_error"]
    assert "needs the model in `state`" in c["no_model_error"]


def test_load_raw_loads_full_weights_into_shards(flows):
    assert flows["checkpoints"]["load_raw_diff"] == 0.0


def test_parallelize_fn_runs_first_and_the_engine_shards_the_rest(flows):
    r = flows["model_parallel"]["tp"]
    assert r["mesh_shape"] == [1, 2]  # tensor_parallel_size="auto": the node's 2 devices in TP
    # The function's column-/row-wise TP, kept as it left it (16 x 8 weight: 8 rows and 8 columns per rank).
    assert r["w1"] == {"placements": ["Shard(0)"], "dims": ["tensor_parallel"], "local_shape": [8, 8]}
    assert r["w2"] == {"placements": ["Shard(1)"], "dims": ["tensor_parallel"], "local_shape": [8, 8]}
    # What it left, sharded by the engine on the data-parallel dim (one rank here).
    assert r["root_is_fsdp"] and r["head"]["dims"] == ["data_parallel"]
    assert r["max_rel_diff"] < TOL  # two SGD steps equal one process


def test_full_single_file_checkpoints_load_into_the_shards(flows):
    f, one = flows["model_parallel"]["full_file"], flows["model_parallel"]["one_process"]
    # save_distributed_checkpoint=False: Lightning's single file, filter= applied.
    assert f["is_file"] and f["keys"] == ["model", "optimizer", "step"]
    assert f["filtered_keys"] == [f"{n}.bias" for n in ("blocks.0.fc", "blocks.1.fc", "blocks.2.fc", "inp", "out")]
    # fabric.load of it into a sharded model: the saved weights exactly, then Adam continues exactly.
    assert f["step"] == 1 and f["remainder"] == {} and f["loaded_diff"] == 0.0
    assert f["resume_diff"] < TOL and f["resumed_losses"] == pytest.approx(f["continued_losses"], rel=TOL)
    # A one-process checkpoint (plain state dicts, optimizer keyed by index) continues like that process.
    assert one["step"] == 5 and one["resume_diff"] < TOL


# ---------------------------------------------------------------------- 1 process, spawn
def test_resume_on_one_process_continues_exactly(runs):
    s, c = runs["single"], runs["flows"]["checkpoints"]
    assert s["world"] == 1 and s["step"] == 1 and s["counter"] == 7 and s["remainder"] == {"note": "hello"}
    assert s["resume_diff"] < TOL  # 2 ranks -> 1: DCP resharded model and Adam state
    assert abs(s["losses"][0] - s["continued_losses"][0]) <= TOL * s["continued_losses"][0]
    assert s["continued_losses"] == c["continued_losses"]


def test_spawn_launch_trains_like_one_process(runs):
    s = runs["spawn"]
    assert s["world"] == 2 and s["strategy"] == "FSDP2FabricStrategy" and not s["parent_has_process_group"]
    assert s["max_rel_diff"] < TOL and s["committed"]


def test_what_fabric_allows_but_sharded_checkpoints_cannot_do_is_refused():
    strategy = FSDP2FabricStrategy()
    with pytest.raises(TypeError, match=r"storage_options=.*not supported with strategy='fsdp2'"):
        strategy.save_checkpoint("ckpt", {}, storage_options={"bucket": "x"})
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(NotImplementedError, match=r"load_raw\(path, optimizer\).*fabric.save"):
        strategy.load_checkpoint("ckpt", optimizer)


def test_tensor_parallel_two_by_two_matches_one_process(tp_run):
    assert tp_run["same_names"] and tp_run["max_rel_diff"] < TOL, tp_run["max_rel_diff"]
    assert tp_run["mesh_dims"] == ["data_parallel", "tensor_parallel"] and tp_run["mesh_shape"] == [2, 2]
    assert tp_run["q_2d_dtensor"]  # column-wise q: TP over "tensor_parallel", FSDP over "data_parallel"
    assert "colwise" in tp_run["plan"] and "rowwise" in tp_run["plan"]


def test_hybrid_sharding_with_tensor_parallel_is_refused_by_name():
    strategy = FSDP2FabricStrategy(sharding_strategy="HYBRID_SHARD", tensor_parallel_size=2)
    Fabric(accelerator="cpu", devices=4, strategy=strategy)  # not launched: no process group
    with pytest.raises(
        ValueError,
        match=r"(?s)FSDP2FabricStrategy\(sharding_strategy='HYBRID_SHARD'.*"
        r"tensor_parallel_size=2\) is not supported.*FULL_SHARD",
    ):
        strategy.setup_environment()


def test_trainable_only_checkpoints_resume_exactly_and_refuse_another_base(flows):
    r = flows["trainable_only"]
    assert r["saved_model_keys"] == ["model.out.bias", "model.out.weight"], r["saved_model_keys"]
    assert r["resume_diff"] < 1e-6, r["resume_diff"]
    assert "another frozen base" in r["other_base_error"] and "inp.weight" in r["other_base_error"]


def test_overlap_save_holds_the_state_of_the_call_and_load_commits_it(runs, flows):
    r = flows["overlap_save"]
    assert not r["copied_before_return"], r  # save returned before the copy
    for rank, each in enumerate(runs["flow_ranks"]):
        assert each["overlap_save"]["waited"] >= 0.45, (rank, each["overlap_save"])  # the step waited for the copy
    assert r["changed_by_next_step"] == r["keys"] and not r["committed_before_load"], r
    assert r["differs"] == [] and r["step"] == 1, r
