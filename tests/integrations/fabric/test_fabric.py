"""Fabric adapter end to end: real `Fabric(strategy="fsdp2")` runs on 2 CPU processes (`fabric run`,
and spawn through `fabric.launch(fn)`) and on 1 (2 -> 1 resume), each in a subprocess with a timeout;
plus the checks that need no processes (registry, precision choice, constructor errors).

The scripts in tests/integrations/fabric/scripts/ check what they claim where they run (named checks,
`helpers.checks.Checks`, on every rank); this file launches them and reports each flow's failed checks
(`FlowReports.assert_passed`). The checks that need no processes assert here.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from helpers.checks import FlowReports  # noqa: E402
from helpers.collect import rank_path  # noqa: E402
from helpers.harness import free_port, launch, rank_reports  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.plugins.precision import DoublePrecision  # noqa: E402
from lightning.fabric.strategies import STRATEGY_REGISTRY  # noqa: E402

from fsdp2_strategy.integrations.fabric import (  # noqa: E402
    FSDP2FabricHalfPrecision,
    FSDP2FabricMixedPrecision,
    FSDP2FabricPrecision,
    FSDP2FabricStrategy,
)

SCRIPTS = Path(__file__).parent / "scripts"


# Values each rank of flows.py measures on its own (left out of the rank agreement; the checks are
# judged on every rank); everything else every rank reports alike.
PER_RANK = ["overlap_save.returned", "overlap_save.waited"]

# `fabric run --accelerator cpu --devices N ...` (its rank processes share the launch's environment).
_FABRIC_RUN = ["lightning.fabric.cli", "--accelerator", "cpu", "--devices"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """`fabric run` x2 (every flow, a checkpoint) -> 1 process resuming it (checked against flows.py's
    report) -> spawn x2."""
    work = tmp_path_factory.mktemp("fabric")
    flows, single, spawn = work / "flows.json", work / "single.json", work / "spawn.json"
    cli = [*_FABRIC_RUN, "2", "--main-port", free_port()]
    launch("python", "-m", *cli, "flows.py", flows, work, cwd=SCRIPTS, timeout=300, reports=flows)
    launch("python", "single.py", single, work, rank_path(flows, 0), cwd=SCRIPTS, timeout=180, reports=single, nproc=1)
    launch("python", "spawn.py", spawn, work, cwd=SCRIPTS, reports=spawn, nproc=1)
    # Every rank's report (a flow that raised on any rank fails here, naming it), equal on every rank.
    return {
        "flows": FlowReports(rank_reports(flows, 2), PER_RANK),
        "single": FlowReports(rank_reports(single, 1)),
        "spawn": FlowReports(rank_reports(spawn, 1)),
    }


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory) -> FlowReports:
    """`fabric run` x4: 2 data parallel x 2 tensor parallel."""
    out = tmp_path_factory.mktemp("fabric_tp") / "tp.json"
    cli = [*_FABRIC_RUN, "4", "--main-port", free_port()]
    launch("python", "-m", *cli, "tensor_parallel.py", out, cwd=SCRIPTS, timeout=300, nproc=4, reports=out)
    # Every rank's report (a flow that raised on any rank fails naming it and the rank), equal on all 4.
    return FlowReports(rank_reports(out, 4))


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
    # Everything wrong at once, in one error: the strategy's own arguments and the config's names and values.
    with pytest.raises(ValueError) as info:
        FSDP2FabricStrategy(start_method="threads", data_parallel_size=0, wrap_polcy="auto", mixed_precision="bf32")
    message = str(info.value)
    assert message.startswith("FSDP2FabricStrategy has 3 invalid fields:"), message
    for part in ("start_method='threads'", "data_parallel_size=0", "Did you mean 'wrap_policy'", "Did you mean 'bf16'"):
        assert part in message, (part, message)


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
def test_setup_shards_by_policy_and_rebinds_the_optimizer_and_equals_one_process(flows):
    flows.assert_passed("parity")


def test_validate_first_then_build_the_optimizer_trains_as_one_process(flows):
    flows.assert_passed("validate_first")


def test_no_backward_sync_reduces_once_per_step(flows):
    flows.assert_passed("accumulation")


def test_clip_gradients_matches_one_process(flows):
    """By norm (fabric.clip_gradients returns the global norm) and by value."""
    flows.assert_passed("clipping")


def test_precision_strings_map_to_fsdp2_policies(flows):
    flows.assert_passed("precision")


def test_init_module_empty_init_builds_on_meta(flows):
    flows.assert_passed("meta_init")


def test_save_load_resume_exactly_refusals_and_load_raw(flows):
    """save -> load resumes exactly and returns the rest; damaged, partial and unsupported checkpoints
    are refused (naming what to load instead); load_raw loads full weights into shards."""
    flows.assert_passed("checkpoints")


def test_parallelize_fn_tp_and_full_single_file_checkpoints(flows):
    """A parallelize_fn runs first and the engine shards the rest; full single-file checkpoints (ours
    with save_distributed_checkpoint=False, and one process's) load into the shards."""
    flows.assert_passed("model_parallel")


# ---------------------------------------------------------------------- 1 process, spawn
def test_resume_on_one_process_continues_exactly(runs):
    runs["single"].assert_passed("resume_on_one_process")


def test_spawn_launch_trains_like_one_process(runs):
    runs["spawn"].assert_passed("spawn")


def test_what_fabric_allows_but_sharded_checkpoints_cannot_do_is_refused():
    strategy = FSDP2FabricStrategy()
    with pytest.raises(TypeError, match=r"storage_options=.*not supported with strategy='fsdp2'"):
        strategy.save_checkpoint("ckpt", {}, storage_options={"bucket": "x"})
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(NotImplementedError, match=r"load_raw\(path, optimizer\).*fabric.save"):
        strategy.load_checkpoint("ckpt", optimizer)


def test_tensor_parallel_two_by_two_matches_one_process(tp_run):
    tp_run.assert_passed("plan")


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
    flows.assert_passed("trainable_only")


def test_overlap_save_holds_the_state_of_the_call_and_load_commits_it(flows):
    flows.assert_passed("overlap_save")


def test_a_checkpoint_that_runs_code_is_refused_and_weights_only_false_trusts_it(flows):
    flows.assert_passed("untrusted")


def test_context_parallel_halves_every_sequence_and_matches_one_process(flows):
    flows.assert_passed("context_parallel")
