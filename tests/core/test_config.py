"""FSDP2Config validation, YAML/dict construction and policy resolution (no process group)."""

from __future__ import annotations

import pytest
import torch
from helpers.models import Block, TinyGPT
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, ShardingStrategy

import fsdp2_strategy as f2
from fsdp2_strategy.mesh import check_reshard_factor, strategy_mesh_shape
from fsdp2_strategy.precision import resolve_mixed_precision
from fsdp2_strategy.wrap_policy import auto_block_classes, describe_auto_choice, select_wrapped


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(sharding_strategy="FULLSHARD"), "sharding_strategy"),
        (dict(reshard_after_forward=0), "reshard_after_forward"),
        (dict(reshard_after_forward="yes"), "reshard_after_forward"),
        (dict(mesh_shape=(2, 0)), "mesh_shape"),
        (dict(mesh_shape=(1, 2, 2)), "mesh_shape"),
        (dict(wrap_policy=0), "wrap_policy"),
        (dict(wrap_policy=True), "wrap_policy"),
        (dict(wrap_policy=[3.5]), "wrap_policy"),
        (dict(mixed_precision="int8"), "mixed_precision"),
        (dict(cpu_offload="yes"), "cpu_offload"),
        (dict(activation_checkpointing=5), "activation_checkpointing"),
        (dict(ignored_modules=7), "ignored_modules"),
        (dict(compile="max"), "compile"),
        (dict(forward_prefetch=-1), "forward_prefetch"),
        (dict(blocks_per_group=0), "blocks_per_group"),
        (dict(blocks_per_group=True), "blocks_per_group"),
        (dict(backward_prefetch=1.5), "backward_prefetch"),
        (dict(module_overrides={"blocks.*": {"precision": "bf16"}}), "module_overrides"),
        (dict(module_overrides={"blocks.*": {"sharding_strategy": "ZERO"}}), "sharding_strategy"),
        (dict(module_overrides=["blocks"]), "module_overrides"),
        (dict(collectives="mpi"), "collectives"),
        (dict(host_allocator="jemalloc"), "host_allocator"),
        (dict(frozen_dtype="int4"), "frozen_dtype.*'auto'"),
        (dict(checkpoint_trainable_only="yes"), "checkpoint_trainable_only"),
    ],
)
def test_invalid_field_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        f2.FSDP2Config(**kwargs)


def test_unknown_field_lists_valid_ones():
    with pytest.raises(ValueError, match="Unknown FSDP2Config fields \\['wrap'\\].*wrap_policy"):
        f2.FSDP2Config.from_dict({"wrap": "auto"})


def test_every_bad_field_is_reported_at_once_with_the_closest_name():
    with pytest.raises(ValueError) as info:
        f2.FSDP2Config(sharding_strategy="FULL_SHARDD", mixed_precision="bf32", accumulation="sync_lst")
    message = str(info.value)
    assert message.startswith("FSDP2Config has 3 invalid fields:\n- ")
    assert "sharding_strategy='FULL_SHARDD' is not supported" in message and "Did you mean 'FULL_SHARD'?" in message
    # "bf32" is one letter from "bf16" and from "fp32": the one of its family is offered, alone.
    assert "mixed_precision='bf32' is invalid" in message and "Did you mean 'bf16'?" in message
    assert "accumulation='sync_lst' is invalid" in message and "Did you mean 'sync_last'?" in message
    # One bad field: its own message, as before; nothing close: no guess.
    with pytest.raises(ValueError, match=r"^FSDP2Config.collectives='rings' is invalid; .* Did you mean 'ring'\?$"):
        f2.FSDP2Config(collectives="rings")
    with pytest.raises(ValueError) as info:
        f2.FSDP2Config(sharding_strategy="zzz")
    assert "Did you mean" not in str(info.value)
    with pytest.raises(ValueError, match=r"Unknown FSDP2Config fields \['wrap_polcy'\].* Did you mean 'wrap_policy'\?"):
        f2.FSDP2Config(wrap_polcy="auto")
    # The same through a dict (what YAML files and the adapters' keyword arguments become).
    with pytest.raises(ValueError, match="has 2 invalid fields"):
        f2.FSDP2Config.from_dict({"cpu_offload": "yes", "forward_prefetch": -1})


@pytest.mark.parametrize("build", ["keywords", "from_dict", "coerce"])
def test_a_misspelt_name_and_bad_values_are_reported_in_one_error(build):
    """One round of fixes: the unknown name with its closest field, and every known field's bad value."""
    values = {"wrap_polcy": "auto", "mixed_precision": "bf32", "cpu_offload": "yes"}
    make = {
        "keywords": lambda: f2.FSDP2Config(**values),
        "from_dict": lambda: f2.FSDP2Config.from_dict(values),
        "coerce": lambda: f2.FSDP2Config.coerce(None, **values),
    }[build]
    with pytest.raises(ValueError) as info:
        make()
    message = str(info.value)
    assert message.startswith("Unknown FSDP2Config fields ['wrap_polcy']") and "Did you mean 'wrap_policy'?" in message
    assert "\nAnd: FSDP2Config has 2 invalid fields:" in message
    assert "mixed_precision='bf32' is invalid" in message and "Did you mean 'bf16'?" in message
    assert "FSDP2Config.cpu_offload='yes'" in message
    # With good values, the name alone, as before.
    with pytest.raises(ValueError) as info:
        f2.FSDP2Config(wrap_polcy="auto", mixed_precision="bf16")
    assert "And:" not in str(info.value)


def test_did_you_mean_prefers_the_family_and_offers_near_ties():
    from fsdp2_strategy.config_checks import did_you_mean

    assert did_you_mean("bf32", ["bf16", "fp16", "fp32"]) == " Did you mean 'bf16'?"
    assert did_you_mean("fp23", ["bf16", "fp16", "fp32"]) == " Did you mean 'fp32'?"
    assert (
        did_you_mean("sync", ["sync_each", "sync_last", "keep_gathered"]) == " Did you mean 'sync_last' or 'sync_each'?"
    )
    assert did_you_mean("zzz", ["bf16", "fp16", "fp32"]) == ""


def test_sections_by_owner_compose_one_flat_config(tmp_path):
    """Each owner's section holds its fields; FSDP2Config is all of them, written flat, in one order."""
    import dataclasses
    import inspect

    from fsdp2_strategy.config import ShardingOptions
    from fsdp2_strategy.config_options import CheckpointOptions, ChoiceOptions, HostOptions, StepOptions

    sections = (ShardingOptions, HostOptions, CheckpointOptions, ChoiceOptions, StepOptions)
    names = [f.name for section in sections for f in dataclasses.fields(section)]
    assert [f.name for f in dataclasses.fields(f2.FSDP2Config)] == names  # each field once, sharding first
    assert list(inspect.signature(f2.FSDP2Config).parameters) == names  # what LightningCLI reads
    assert {f.name for f in dataclasses.fields(CheckpointOptions)} == {
        "checkpoint_trainable_only",
        "checkpoint_async_save",
        "checkpoint_on_preemption",
    }
    assert {f.name for f in dataclasses.fields(HostOptions)} == {"collectives", "host_allocator"}
    assert {f.name for f in dataclasses.fields(ChoiceOptions)} == {"memory_budget", "objective"}
    assert {f.name for f in dataclasses.fields(StepOptions)} == {"chunked_loss"}
    values = {"sharding_strategy": "auto", "collectives": "ring", "checkpoint_async_save": "overlap"}
    (tmp_path / "c.yaml").write_text("".join(f"{k}: {v}\n" for k, v in values.items()) + "memory_budget: 2GiB\n")
    for config in (f2.FSDP2Config(**values, memory_budget="2GiB"), f2.FSDP2Config.from_yaml(tmp_path / "c.yaml")):
        assert all(isinstance(config, section) for section in sections)
        assert (config.collectives, config.checkpoint_async_save, config.memory_budget) == ("ring", "overlap", 2 << 30)
    # Every section's checks run into one error.
    with pytest.raises(ValueError) as info:
        f2.FSDP2Config(accumulation="x", host_allocator="x", checkpoint_on_preemption="x", objective="x")
    message = str(info.value)
    assert message.startswith("FSDP2Config has 4 invalid fields:")
    for name in ("accumulation", "host_allocator", "checkpoint_on_preemption", "objective"):
        assert f"FSDP2Config.{name}='x'" in message


def test_fsdp1_enum_and_yaml(tmp_path):
    assert f2.FSDP2Config(sharding_strategy=ShardingStrategy.HYBRID_SHARD).sharding_strategy == "HYBRID_SHARD"
    path = tmp_path / "fsdp2.yaml"
    path.write_text(
        "fsdp2:\n  sharding_strategy: shard_grad_op\n  mesh_shape: [2]\n  wrap_policy: [Block]\n"
        "  mixed_precision: {param_dtype: bf16, reduce_dtype: float32}\n"
        "  module_overrides:\n    'blocks.1': {mixed_precision: fp16}\n"
    )
    cfg = f2.FSDP2Config.from_yaml(path)
    assert cfg.sharding_strategy == "SHARD_GRAD_OP" and cfg.mesh_shape == (2,)
    assert cfg.module_overrides["blocks.1"].mixed_precision == "fp16"
    mp = resolve_mixed_precision(cfg.mixed_precision)
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
    (tmp_path / "bad.yaml").write_text("wrap_policy: [Block]\nprecision: bf16\n")
    with pytest.raises(ValueError, match="precision"):
        f2.FSDP2Config.from_yaml(tmp_path / "bad.yaml")


def test_precision_strings():
    bf16 = resolve_mixed_precision("bf16")
    assert bf16.param_dtype == torch.bfloat16 and bf16.reduce_dtype == torch.float32
    fp16 = resolve_mixed_precision("fp16")
    assert fp16.param_dtype == torch.float16 and fp16.reduce_dtype == torch.float32
    given = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    assert resolve_mixed_precision(given) is given
    with pytest.raises(ValueError, match="param_dtyp"):
        resolve_mixed_precision({"param_dtyp": "bf16"})
    with pytest.raises(ValueError, match="reduce_dtype"):
        resolve_mixed_precision({"reduce_dtype": "int3"})


def test_mesh_shape_must_match_world_size():
    assert strategy_mesh_shape("FULL_SHARD", None, 4) == (4,)
    assert strategy_mesh_shape("NO_SHARD", None, 4) == (4, 1)
    assert strategy_mesh_shape("HYBRID_SHARD", (2, 2), 4) == (2, 2)
    with pytest.raises(ValueError, match="mesh_shape=\\(3,\\).*world size is 4"):
        strategy_mesh_shape("FULL_SHARD", (3,), 4)
    with pytest.raises(ValueError, match="mesh_shape.*HYBRID_SHARD"):
        strategy_mesh_shape("FULL_SHARD", (2, 2), 4)
    with pytest.raises(ValueError, match="two dims"):
        strategy_mesh_shape("HYBRID_SHARD", (4,), 4)


def test_int_reshard_must_divide_shard_size():
    check_reshard_factor(2, 4, "FSDP2Config.reshard_after_forward")
    with pytest.raises(
        ValueError, match="reshard_after_forward=3 does not divide the shard group size 4.*\\[1, 2, 4\\]"
    ):
        check_reshard_factor(3, 4, "FSDP2Config.reshard_after_forward")


def test_wrap_policies_resolve():
    model = TinyGPT(layers=3)
    assert auto_block_classes(model) == (Block,)
    assert select_wrapped(model, "auto") == ["blocks.0", "blocks.1", "blocks.2"]
    assert select_wrapped(model, [Block]) == select_wrapped(model, ["Block"])
    assert select_wrapped(model, lambda m, n: n == "ln_f") == ["ln_f"]
    assert select_wrapped(model, None) == []
    # min-params: the smallest subtrees reaching the threshold, children first
    by_size = select_wrapped(model, 4000)
    assert "blocks.0.mlp.0" in by_size and "blocks.0" not in by_size
    assert select_wrapped(model, "auto", skip=["blocks.1"]) == ["blocks.0", "blocks.2"]


class _Block(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(dim), nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))


@pytest.mark.parametrize("blocks", [2, 3, 4])
def test_auto_finds_the_repeated_blocks_of_a_plain_model(blocks):
    """A Sequential of input layer, blocks, head: one group per block, never per Linear, whatever
    the number of blocks (with two, the Linears repeat as often as the blocks)."""
    model = nn.Sequential(nn.Linear(4, 8), *[_Block() for _ in range(blocks)], nn.Linear(8, 1))
    assert auto_block_classes(model) == (_Block,)
    assert select_wrapped(model, "auto") == [str(i) for i in range(1, blocks + 1)]
    assert (
        describe_auto_choice(model)
        == f"'auto' made one group per _Block (the repeated block: {blocks} in one ModuleList/Sequential)"
    )
    # A plain stack of layers has no composite block: each repeated layer is its own group.
    stack = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    assert select_wrapped(stack, "auto") == ["0", "2", "4"]
    assert "per Linear (the repeated layer, no composite block repeats: 3 in" in describe_auto_choice(stack)
    assert describe_auto_choice(nn.Linear(2, 2)) == "'auto' found no repeated block: the root is the only group"


def test_unknown_class_name_suggests_close_matches():
    with pytest.raises(
        ValueError, match="wrap_policy: no module in TinyGPT has class name 'Blok'.*Did you mean 'Block'"
    ):
        select_wrapped(TinyGPT(), ["Blok"])


def test_auto_uses_hf_no_split_modules():
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

    class HFLike(nn.Module):
        _no_split_modules = ["Inner"]

        def __init__(self):
            super().__init__()
            self.a = Inner()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    assert auto_block_classes(HFLike()) == (Inner,)


def test_checkpointer_trainable_only_is_checked(tmp_path):
    with pytest.raises(ValueError, match="Checkpointer trainable_only=3 is invalid; use 'auto'"):
        f2.Checkpointer(tmp_path, trainable_only=3)
    assert f2.FSDP2Config(frozen_dtype="bf16").frozen_dtype == "bf16" and f2.FSDP2Config(frozen_dtype=None)
