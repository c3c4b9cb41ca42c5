"""Every public entry point refuses bad input with a message that names what to change.

`ROWS` is the table: one bad input per row, across the core (`FSDP2Config`, `shard_model`,
`fully_shard`, `load_full_weights`, `Checkpointer`, `export_full`), the Lightning strategy and
precision strings, and the Accelerate config keys and plugin. Each row states the exception
type and phrases its message must hold (the offending field, file or key, and the fix); the
runner also asserts that nothing changed: the model's weights, and every file and folder
under the fixture directory (`helpers.bad_inputs.Env`). The command line's table is in
`test_bad_inputs_cli.py`, the rows that need a process group in `test_bad_inputs_world.py`
(one 2-rank world). Rows for the Fabric and Ray adapters are `FABRIC_ROWS` / `RAY_ROWS`.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import pytest
import torch
from helpers.bad_inputs import Env, Row, assert_unchanged, environ_restored
from helpers.models import TinyGPT
from torch.distributed.fsdp import CPUOffload, MixedPrecision

import fsdp2_strategy as f2


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Env:
    return Env(tmp_path_factory.mktemp("bad_inputs"))


def _lightning():
    pytest.importorskip("lightning")
    import fsdp2_strategy.integrations.lightning as adapter

    return adapter


def _accelerate():
    pytest.importorskip("accelerate")
    import fsdp2_strategy.integrations.accelerate as adapter

    return adapter


def _trainer(precision: str):
    _lightning()
    import lightning.pytorch as pl

    return pl.Trainer(
        strategy="fsdp2",
        precision=precision,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _accelerate_env(**variables: str):
    """`FSDP2Plugin()` as `accelerate launch --config_file` starts it: the YAML's keys as `FSDP_*`
    variables (the row runs inside `environ_restored`)."""
    os.environ.update(variables)
    return _accelerate().FSDP2Plugin()


def _plugin(**kwargs):
    return _accelerate().FSDP2Plugin(read_env=False, **kwargs)


def _stock_accelerator(e: Env):
    plugin = _plugin()
    import accelerate

    return accelerate.Accelerator(fsdp_plugin=plugin, cpu=True)


_WEIGHTS_FIX = "download or export the file again"
_CKPT_FIX = "earlier step"

CONFIG_ROWS = [
    Row(
        "config.sharding_strategy",
        lambda e: f2.FSDP2Config(sharding_strategy="FULL"),
        ValueError,
        ("sharding_strategy='FULL'", "FULL_SHARD, SHARD_GRAD_OP"),
    ),
    Row(
        "config.reshard_after_forward",
        lambda e: f2.FSDP2Config(reshard_after_forward=0),
        ValueError,
        ("reshard_after_forward=0", "positive int"),
    ),
    Row(
        "config.mesh_shape",
        lambda e: f2.FSDP2Config(mesh_shape=(2, 2, 2)),
        ValueError,
        ("mesh_shape=(2, 2, 2)", "(replicate, shard)"),
    ),
    Row(
        "config.wrap_policy",
        lambda e: f2.FSDP2Config(wrap_policy=3.5),
        ValueError,
        ("wrap_policy=3.5", "class-name strings"),
    ),
    Row(
        "config.mixed_precision",
        lambda e: f2.FSDP2Config(mixed_precision="bf17"),
        ValueError,
        ("mixed_precision='bf17'", "'bf16'"),
    ),
    Row(
        "config.mixed_precision dict",
        lambda e: f2.FSDP2Config(mixed_precision={"param_dtyp": "bf16"}),
        ValueError,
        ("mixed_precision has unknown keys ['param_dtyp']", "accepted keys", "param_dtype"),
    ),
    Row(
        "config.cpu_offload",
        lambda e: f2.FSDP2Config(cpu_offload="yes"),
        ValueError,
        ("cpu_offload='yes'", "True or False"),
    ),
    Row(
        "config.activation_checkpointing",
        lambda e: f2.FSDP2Config(activation_checkpointing=5),
        ValueError,
        ("activation_checkpointing=5", "class-name strings"),
    ),
    Row(
        "config.ignored_modules",
        lambda e: f2.FSDP2Config(ignored_modules=5),
        ValueError,
        ("ignored_modules=5", "class names"),
    ),
    Row("config.compile", lambda e: f2.FSDP2Config(compile="max"), ValueError, ("compile='max'", "True, False")),
    Row(
        "config.forward_prefetch",
        lambda e: f2.FSDP2Config(forward_prefetch=-1),
        ValueError,
        ("forward_prefetch=-1", "int >= 0"),
    ),
    Row(
        "config.module_overrides key",
        lambda e: f2.FSDP2Config(module_overrides={"blocks.*": {"reshard": 1}}),
        ValueError,
        ("module_overrides['blocks.*']", "['reshard']", "accepted keys"),
    ),
    Row(
        "config unknown keyword",
        lambda e: f2.FSDP2Config(wrap=["Block"]),
        ValueError,
        ("['wrap']", "valid fields", "wrap_policy"),
    ),
    Row(
        "config.from_dict unknown key",
        lambda e: f2.FSDP2Config.from_dict({"offload": True}),
        ValueError,
        ("['offload']", "cpu_offload"),
    ),
    Row(
        "config.from_yaml missing file",
        lambda e: f2.FSDP2Config.from_yaml(e.root / "none.yaml"),
        FileNotFoundError,
        ("none.yaml", "does not exist"),
    ),
    Row(
        "config.from_yaml invalid YAML",
        lambda e: f2.FSDP2Config.from_yaml(e.root / "bad.yaml"),
        ValueError,
        ("bad.yaml", "not valid YAML", "line 1"),
    ),
    Row(
        "config.from_yaml not a mapping",
        lambda e: f2.FSDP2Config.from_yaml(e.root / "list.yaml"),
        ValueError,
        ("list.yaml", "mapping of FSDP2Config fields"),
    ),
]

SHARDING_ROWS = [
    Row(
        "shard_model unknown keyword",
        lambda e: f2.shard_model(e.model, wrap=["Block"]),
        ValueError,
        ("['wrap']", "wrap_policy"),
    ),
    Row(
        "shard_model config type",
        lambda e: f2.shard_model(e.model, 5),
        ValueError,
        ("config must be an FSDP2Config, a dict or a YAML path",),
    ),
    Row(
        "shard_model without a process group",
        lambda e: f2.shard_model(e.model),
        RuntimeError,
        ("process group", "init_process_group"),
    ),
    Row(
        "fully_shard FSDP1 process_group",
        lambda e: f2.fully_shard(e.model, process_group=object()),
        ValueError,
        ("process_group", "mesh=DeviceMesh"),
    ),
    Row(
        "fully_shard FSDP1 param_init_fn",
        lambda e: f2.fully_shard(e.model, param_init_fn=print),
        ValueError,
        ("param_init_fn", "meta device"),
    ),
    Row(
        "fully_shard FSDP1 keep_low_precision_grads",
        lambda e: f2.fully_shard(
            e.model, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True)
        ),
        ValueError,
        ("keep_low_precision_grads", "Drop keep_low_precision_grads"),
    ),
    Row(
        "fully_shard FSDP1 cpu_offload",
        lambda e: f2.fully_shard(e.model, cpu_offload="yes"),
        ValueError,
        ("cpu_offload='yes'", "CPUOffload(offload_params=True)"),
    ),
    Row(
        "fully_shard FSDP1 sharding_strategy",
        lambda e: f2.fully_shard(e.model, sharding_strategy="FULL"),
        ValueError,
        ("sharding_strategy='FULL'", "FULL_SHARD"),
    ),
    Row(
        "fully_shard FSDP1+FSDP2 for one setting",
        lambda e: f2.fully_shard(e.model, cpu_offload=CPUOffload(offload_params=True), offload_policy=None),
        ValueError,
        ("('cpu_offload', 'offload_policy')", "keep one of each pair"),
    ),
    Row(
        "fully_shard unknown keyword",
        lambda e: f2.fully_shard(e.model, wrap_policy="auto"),
        ValueError,
        ("['wrap_policy']", "auto_wrap_policy", "mesh"),
    ),
    Row(
        "fully_shard FSDP2 mesh",
        lambda e: f2.fully_shard(e.model, mesh="cpu"),
        ValueError,
        ("mesh='cpu'", "DeviceMesh"),
    ),
    Row(
        "fully_shard FSDP2 mp_policy",
        lambda e: f2.fully_shard(e.model, mp_policy="bf16"),
        ValueError,
        ("mp_policy='bf16'", "MixedPrecisionPolicy"),
    ),
    Row(
        "fully_shard FSDP2 offload_policy",
        lambda e: f2.fully_shard(e.model, offload_policy=True),
        ValueError,
        ("offload_policy=True", "CPUOffloadPolicy()"),
    ),
    Row(
        "fully_shard FSDP2 reshard_after_forward",
        lambda e: f2.fully_shard(e.model, reshard_after_forward="yes"),
        ValueError,
        ("reshard_after_forward='yes'", "True, False"),
    ),
    Row(
        "fully_shard without a process group",
        lambda e: f2.fully_shard(e.model),
        RuntimeError,
        ("process group", "f2.init_distributed()"),
    ),
]

WEIGHTS_ROWS = [
    Row(
        "load_full_weights empty safetensors",
        lambda e: f2.load_full_weights(e.model, e.root / "empty.safetensors"),
        ValueError,
        ("empty.safetensors", "0 bytes", "damaged", _WEIGHTS_FIX),
    ),
    Row(
        "load_full_weights random bytes",
        lambda e: f2.load_full_weights(e.model, e.root / "random.safetensors"),
        ValueError,
        ("random.safetensors", "header length", "damaged", _WEIGHTS_FIX),
    ),
    Row(
        "load_full_weights truncated",
        lambda e: f2.load_full_weights(e.model, e.root / "truncated.safetensors"),
        ValueError,
        ("truncated.safetensors", "data_offsets", "truncated?", _WEIGHTS_FIX),
    ),
    Row(
        "load_full_weights header not JSON",
        lambda e: f2.load_full_weights(e.model, e.root / "not_json.safetensors"),
        ValueError,
        ("not_json.safetensors", "not JSON", _WEIGHTS_FIX),
    ),
    Row(
        "load_full_weights overlapping tensors",
        lambda e: f2.load_full_weights(e.model, e.root / "overlap.safetensors"),
        ValueError,
        ("overlap.safetensors", "'a' and 'b' overlap", _WEIGHTS_FIX),
    ),
    Row(
        "load_full_weights offsets vs shape",
        lambda e: f2.load_full_weights(e.model, e.root / "wrong_size.safetensors"),
        ValueError,
        ("wrong_size.safetensors", "needs 16 bytes", "span 8", _WEIGHTS_FIX),
    ),
    Row(
        "load_full_weights unsupported dtype",
        lambda e: f2.load_full_weights(e.model, e.root / "float8.safetensors"),
        ValueError,
        ("float8.safetensors", "dtype 'F8_E4M3'", "supported: F64, F32", "Convert the file"),
    ),
    Row(
        "load_full_weights damaged torch file",
        lambda e: f2.load_full_weights(e.model, e.root / "random.pt"),
        ValueError,
        ("random.pt", "not a readable torch checkpoint", "torch.save"),
    ),
    Row(
        "load_full_weights missing path",
        lambda e: f2.load_full_weights(e.model, e.root / "nope.safetensors"),
        FileNotFoundError,
        ("nope.safetensors", "does not exist", "a folder with model.safetensors.index.json"),
    ),
    Row(
        "load_full_weights folder of two files",
        lambda e: f2.load_full_weights(e.model, e.root / "two_files"),
        FileNotFoundError,
        ("two_files", "2 .safetensors files but no model.safetensors.index.json"),
    ),
    Row(
        "load_full_weights index not JSON",
        lambda e: f2.load_full_weights(e.model, e.root / "index_bad"),
        ValueError,
        ("index_bad/model.safetensors.index.json", "weight_map", "write the index again"),
    ),
    Row(
        "load_full_weights index names a missing file",
        lambda e: f2.load_full_weights(e.model, e.root / "index_gap"),
        FileNotFoundError,
        ("model-00001-of-00002.safetensors", "Copy the whole folder"),
    ),
    Row(
        "load_full_weights other architecture",
        lambda e: f2.load_full_weights(e.other_model(), e.root / "good.safetensors"),
        ValueError,
        ("good.safetensors", "shape mismatch", "pos: checkpoint (16, 32), model (16, 16)", "same architecture"),
    ),
]

CHECKPOINT_ROWS = [
    Row(
        "Checkpointer keep_last",
        lambda e: f2.Checkpointer(e.root / "ckpt", keep_last=0),
        ValueError,
        ("keep_last", "int >= 1"),
    ),
    Row(
        "Checkpointer.save negative step",
        lambda e: f2.Checkpointer(e.root / "ckpt").save(-1, model=e.model),
        ValueError,
        ("step must be an int >= 0", "-1"),
    ),
    Row(
        "Checkpointer.save committed step",
        lambda e: f2.Checkpointer(e.root / "ckpt").save(1, model=e.model),
        ValueError,
        ("step 1 already exists", "never rewritten", "new step number"),
    ),
    Row(
        "Checkpointer.save model not a module",
        lambda e: f2.Checkpointer(e.root / "ckpt").save(2, model={"w": 1}),
        ValueError,
        ("model= must be an nn.Module", "dict"),
    ),
    Row(
        "Checkpointer.save optimizer without model",
        lambda e: f2.Checkpointer(e.root / "ckpt").save(2, optimizer=torch.optim.SGD(e.model.parameters(), lr=0.1)),
        ValueError,
        ("needs model= with optimizer=",),
    ),
    Row(
        "Checkpointer.load nothing saved",
        lambda e: f2.Checkpointer(e.root / "empty_root").load(model=e.model),
        FileNotFoundError,
        ("No committed checkpoint under", "empty_root", "check the path"),
    ),
    Row(
        "Checkpointer.load step not committed",
        lambda e: f2.Checkpointer(e.root / "ckpt").load(model=e.model, step=7),
        FileNotFoundError,
        ("step 7 is not committed", "committed steps: [1]"),
    ),
    Row(
        "Checkpointer.load step spelling",
        lambda e: f2.Checkpointer(e.root / "ckpt").load(model=e.model, step="last"),
        ValueError,
        ("'last'", "'latest'"),
    ),
    Row(
        "Checkpointer.load other architecture",
        lambda e: f2.Checkpointer(e.root / "ckpt").load(model=e.other_model()),
        ValueError,
        ("does not match the model", "shape mismatch", "blocks.0.attn.proj.bias: checkpoint (32,) vs model (16,)"),
    ),
    Row(
        "Checkpointer.load damaged shard",
        lambda e: f2.Checkpointer(e.root / "damaged").load(model=e.model),
        ValueError,
        ("damaged and was not loaded", ".distcp: corrupted", "Load an earlier step"),
    ),
    Row(
        "Checkpointer.load unreadable .metadata",
        lambda e: f2.Checkpointer(e.root / "garbage").load(model=e.model),
        ValueError,
        ("garbage/step-000001/.metadata is unreadable", "damaged", _CKPT_FIX),
    ),
    Row(
        "Checkpointer.load a .metadata that runs code",
        lambda e: f2.Checkpointer(e.root / "crafted").load(model=e.model),
        f2.UntrustedCheckpointError,
        ("crafted/step-000001/.metadata holds the type posix.getcwd", "trusted=True", "add_safe_globals"),
    ),
    Row(
        "convert_fsdp1_checkpoint a file that runs code",
        lambda e: f2.convert_fsdp1_checkpoint(e.root / "crafted.pt", e.root / "out"),
        f2.UntrustedCheckpointError,
        ("crafted.pt holds the type posix.getcwd", "trusted=True", "--trust"),
    ),
    Row(
        "inspect_checkpoint a .metadata that runs code",
        lambda e: f2.inspect_checkpoint(e.root / "crafted"),
        f2.UntrustedCheckpointError,
        (".metadata holds the type posix.getcwd", "trusted=True"),
    ),
    Row(
        "export_full format",
        lambda e: f2.export_full(e.root / "ckpt", e.root / "out", format="onnx"),
        ValueError,
        ("format='onnx'", "'safetensors' or 'torch'"),
    ),
    Row(
        "export_full dtype",
        lambda e: f2.export_full(e.root / "ckpt", e.root / "out", dtype="int8"),
        ValueError,
        ("dtype='int8'", "'bf16'"),
    ),
    Row(
        "export_full missing checkpoint",
        lambda e: f2.export_full(e.root / "nowhere", e.root / "out"),
        FileNotFoundError,
        ("nowhere", "No committed checkpoint"),
    ),
    Row(
        "export_full damaged shard",
        lambda e: f2.export_full(e.root / "damaged", e.root / "out"),
        ValueError,
        ("damaged and was not exported", ".distcp: corrupted", "--step N"),
    ),
    Row(
        "export_full missing shards",
        lambda e: f2.export_full(e.root / "shardless", e.root / "out"),
        ValueError,
        ("Reading the shards of", "__0_0.distcp", "damaged or incomplete", _CKPT_FIX),
    ),
    Row(
        "export_full out_dir is a file",
        lambda e: f2.export_full(e.root / "ckpt", e.root / "a_file.txt"),
        ValueError,
        ("a_file.txt is a file", "pass a folder"),
    ),
]

LIGHTNING_ROWS = [
    Row(
        "FSDP2Strategy unknown field",
        lambda e: _lightning().FSDP2Strategy(wrap=["Block"]),
        ValueError,
        ("['wrap']", "wrap_policy"),
    ),
    Row(
        "FSDP2Strategy field value",
        lambda e: _lightning().FSDP2Strategy(cpu_offload="yes"),
        ValueError,
        ("FSDP2Config.cpu_offload='yes'", "True or False"),
    ),
    Row(
        "FSDP2Strategy state_dict_type",
        lambda e: _lightning().FSDP2Strategy(state_dict_type="local"),
        ValueError,
        ("state_dict_type='local'", "'sharded' or 'full'"),
    ),
    Row(
        "FSDP2Strategy start_method",
        lambda e: _lightning().FSDP2Strategy(start_method="thread"),
        ValueError,
        ("start_method='thread'", "'spawn'"),
    ),
    Row(
        "FSDP2Strategy config file missing",
        lambda e: _lightning().FSDP2Strategy(config=str(e.root / "none.yaml")),
        FileNotFoundError,
        ("none.yaml", "does not exist"),
    ),
    Row(
        "Trainer precision 64-true",
        lambda e: _trainer("64-true"),
        ValueError,
        ("precision='64-true'", "32-true, bf16-mixed, 16-mixed, bf16-true, 16-true"),
    ),
    Row(
        "FSDP2MixedPrecision string",
        lambda e: _lightning().FSDP2MixedPrecision("32-true"),
        ValueError,
        ("precision='32-true'", "'bf16-mixed' or '16-mixed'"),
    ),
]

ACCELERATE_ROWS = [
    Row(
        "accelerate fsdp_version",
        lambda e: _accelerate_env(FSDP_VERSION="1"),
        ValueError,
        ("FSDP_VERSION", "`fsdp_version`", "fsdp_version: 2"),
    ),
    Row(
        "accelerate fsdp_auto_wrap_policy",
        lambda e: _accelerate_env(FSDP_AUTO_WRAP_POLICY="LAYER_WRAP"),
        ValueError,
        ("`fsdp_auto_wrap_policy`", "'LAYER_WRAP'", "TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP, NO_WRAP"),
    ),
    Row(
        "accelerate fsdp_min_num_params",
        lambda e: _accelerate_env(FSDP_AUTO_WRAP_POLICY="SIZE_BASED_WRAP", FSDP_MIN_NUM_PARAMS="lots"),
        ValueError,
        ("`fsdp_min_num_params`", "'lots'", "positive int"),
    ),
    Row(
        "accelerate fsdp_offload_params",
        lambda e: _accelerate_env(FSDP_OFFLOAD_PARAMS="maybe"),
        ValueError,
        ("`fsdp_offload_params`", "'maybe'", "true or false"),
    ),
    Row(
        "accelerate fsdp_reshard_after_forward",
        lambda e: _accelerate_env(FSDP_RESHARD_AFTER_FORWARD="sometimes"),
        ValueError,
        ("`fsdp_reshard_after_forward`", "'sometimes'", "a positive int"),
    ),
    Row(
        "accelerate fsdp_sharding_strategy",
        lambda e: _accelerate_env(FSDP_SHARDING_STRATEGY="ZERO3"),
        ValueError,
        ("`fsdp_sharding_strategy`", "'ZERO3'", "FULL_SHARD"),
    ),
    Row(
        "accelerate fsdp_state_dict_type",
        lambda e: _accelerate_env(FSDP_STATE_DICT_TYPE="LOCAL_STATE_DICT"),
        ValueError,
        ("`fsdp_state_dict_type`", "SHARDED_STATE_DICT", "FSDP1-only"),
    ),
    Row(
        "accelerate mixed_precision",
        lambda e: _accelerate_env(ACCELERATE_MIXED_PRECISION="fp8"),
        ValueError,
        ("`mixed_precision`", "'fp8'", "no, bf16, fp16"),
    ),
    Row(
        "accelerate activation checkpointing offload",
        lambda e: _accelerate_env(FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD="true"),
        ValueError,
        ("fsdp_activation_checkpointing_offload", "set it to false"),
    ),
    Row("FSDP2Plugin unknown field", lambda e: _plugin(wrap=["Block"]), ValueError, ("['wrap']", "wrap_policy")),
    Row(
        "FSDP2Plugin config type",
        lambda e: _plugin(config=5),
        ValueError,
        ("FSDP2Plugin(config=...)", "a dict or a YAML path"),
    ),
    Row(
        "FSDP2Plugin state_dict_type",
        lambda e: _plugin(state_dict_type="local"),
        ValueError,
        ("state_dict_type='local'", "'sharded'", "'full'"),
    ),
    Row("FSDP2Plugin keep_last", lambda e: _plugin(keep_last=0), ValueError, ("keep_last=0", "int >= 1")),
    Row(
        "FSDP2Plugin cpu_ram_efficient_loading",
        lambda e: _plugin(cpu_ram_efficient_loading="yes"),
        ValueError,
        ("cpu_ram_efficient_loading='yes'", "True or False"),
    ),
    Row(
        "FSDP2Plugin with Accelerator(mixed_precision=fp8)",
        lambda e: _plugin().with_precision("fp8"),
        ValueError,
        ("mixed_precision='fp8'", "no, bf16, fp16"),
    ),
    Row(
        "FSDP2Plugin handed to the stock Accelerator",
        _stock_accelerator,
        TypeError,
        ("accelerate.Accelerator", "FSDP2Accelerator(fsdp_plugin=FSDP2Plugin()"),
    ),
]


def _fabric():
    pytest.importorskip("lightning")
    import fsdp2_strategy.integrations.fabric as adapter

    return adapter


def _fabric_precision(precision: str):
    _fabric()
    from lightning.fabric import Fabric

    return Fabric(strategy="fsdp2", precision=precision, accelerator="cpu", devices=1)


FABRIC_ROWS = [
    Row(
        "FSDP2FabricStrategy unknown field",
        lambda e: _fabric().FSDP2FabricStrategy(wrap=["Block"]),
        ValueError,
        ("['wrap']", "wrap_policy"),
    ),
    Row(
        "FSDP2FabricStrategy start_method",
        lambda e: _fabric().FSDP2FabricStrategy(start_method="thread"),
        ValueError,
        ("start_method='thread'", "'spawn'"),
    ),
    Row(
        "FSDP2FabricStrategy sharding_strategy",
        lambda e: _fabric().FSDP2FabricStrategy(sharding_strategy="ZERO3"),
        ValueError,
        ("sharding_strategy='ZERO3'", "FULL_SHARD"),
    ),
    Row(
        "Fabric precision 64-true",
        lambda e: _fabric_precision("64-true"),
        ValueError,
        ("precision='64-true'", "32-true, bf16-mixed, 16-mixed, bf16-true, 16-true"),
    ),
]


def _accelerate_yaml(text: str) -> Path:
    """An accelerate config file outside the row's folder (which must stay unchanged)."""
    folder = Path(tempfile.mkdtemp(prefix="bad-accelerate-yaml-"))
    (folder / "accelerate.yaml").write_text(text)
    return folder / "accelerate.yaml"


def _config_env(path: Path):
    from fsdp2_strategy.integrations.accelerate.config_file import accelerate_config_env

    return accelerate_config_env(path)


# Ray Train's Accelerate entry point (`accelerator_from_config`) reads the accelerate config file
# through `accelerate_config_env`, which needs no ray; the Ray adapter's own rows need ray installed.
RAY_ROWS = [
    Row(
        "accelerate config file missing (Ray)",
        lambda e: _config_env(e.root / "none.yaml"),
        FileNotFoundError,
        ("none.yaml", "does not exist", "accelerate config"),
    ),
    Row(
        "accelerate config file not a mapping (Ray)",
        lambda e: _config_env(_accelerate_yaml("- a\n")),
        ValueError,
        ("accelerate.yaml", "must hold a mapping"),
    ),
    Row(
        "accelerate config fsdp_config not a mapping (Ray)",
        lambda e: _config_env(_accelerate_yaml("fsdp_config: [1]\n")),
        ValueError,
        ("`fsdp_config` must be a mapping", "fsdp_* keys"),
    ),
    Row(
        "accelerate config key without fsdp_ (Ray)",
        lambda e: _config_env(_accelerate_yaml("fsdp_config:\n  version: 2\n")),
        ValueError,
        ("'version'", "must start with 'fsdp_'"),
    ),
]

ROWS = (
    CONFIG_ROWS
    + SHARDING_ROWS
    + WEIGHTS_ROWS
    + CHECKPOINT_ROWS
    + LIGHTNING_ROWS
    + ACCELERATE_ROWS
    + FABRIC_ROWS
    + RAY_ROWS
)


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input_is_named_with_its_fix_and_changes_nothing(row: Row, env: Env):
    before = env.snapshot()
    with environ_restored(), pytest.raises(Exception) as info:
        row.call(env)
    assert isinstance(info.value, row.error), f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    for phrase in row.says:
        assert phrase in message, (phrase, message)
    assert_unchanged(before, env.snapshot())


def test_unverified_checkpoint_is_said_once_per_directory(env: Env, caplog, tmp_path):
    """No checksums.json: loading and exporting work, with one warning naming the directory."""
    caplog.set_level(logging.WARNING, logger="fsdp2_strategy")
    for _ in range(2):
        f2.Checkpointer(env.root / "plain").load(model=TinyGPT(tied=False))
    f2.export_full(env.root / "plain", tmp_path / "export")
    f2.Checkpointer(env.root / "ckpt").load(model=TinyGPT(tied=False))  # verified: no warning
    said = [r.getMessage() for r in caplog.records if "checksums.json" in r.getMessage()]
    assert len(said) == 1, said
    assert f"{env.root / 'plain' / 'step-000001'} has no checksums.json" in said[0]
    assert "without verifying" in said[0]
