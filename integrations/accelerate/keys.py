"""The one table of accelerate config keys this adapter reads: YAML key <-> launch variable <-> meaning.

`accelerate launch --config_file` turns each key of an accelerate YAML into an environment variable
for every process; `FSDP2Plugin()` reads those variables. `KEYS` says, per key, both spellings and
what the engine makes of it, and every direction reads it: `config_file` (YAML -> variables, where no
launcher runs), `env` (variables -> `FSDP2Config` fields; every error names the variable and its
YAML key), `deepspeed_env` (variables -> a DeepSpeed config), and the docs' Accelerate reference
(the table rendered). A key not listed is passed on as `accelerate launch` would name it and, if
FSDP2 has no use for it, ignored (as Accelerate's own FSDP2 path ignores it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

FSDP = "fsdp_config"
DEEPSPEED = "deepspeed_config"
TOP = ""
"""Sections of an accelerate config file (`TOP`: keys at the top level)."""

TRUE = ("true", "1", "yes", "y", "on")
FALSE = ("false", "0", "no", "n", "off")
"""How a boolean variable may be spelt (case-insensitive)."""


@dataclass(frozen=True)
class ConfigKey:
    """One key of an accelerate config file."""

    section: str
    """`FSDP`, `DEEPSPEED` or `TOP`."""
    key: str
    """The YAML key inside its section."""
    var: str
    """The environment variable `accelerate launch` sets from it."""
    becomes: str
    """What the engine makes of it (shown in the docs)."""
    deepspeed_path: tuple[str, ...] = ()
    """For `deepspeed_config` keys: where the value sits in a DeepSpeed JSON config."""
    number: type | None = None
    """For numeric DeepSpeed values: the type DeepSpeed wants (int or float)."""

    @property
    def yaml(self) -> str:
        """The key as written in the file: `fsdp_config.fsdp_version`, `mixed_precision`."""
        return f"{self.section}.{self.key}" if self.section else self.key


KEYS: tuple[ConfigKey, ...] = (
    ConfigKey(FSDP, "fsdp_version", "FSDP_VERSION", "must be 2"),
    ConfigKey(
        FSDP,
        "fsdp_auto_wrap_policy",
        "FSDP_AUTO_WRAP_POLICY",
        '`wrap_policy`: TRANSFORMER_BASED_WRAP the class names below (none given: `"auto"`, the model\'s '
        "`_no_split_modules`), SIZE_BASED_WRAP a parameter count, NO_WRAP `None`",
    ),
    ConfigKey(
        FSDP,
        "fsdp_transformer_layer_cls_to_wrap",
        "FSDP_TRANSFORMER_CLS_TO_WRAP",
        "the class names of TRANSFORMER_BASED_WRAP",
    ),
    ConfigKey(FSDP, "fsdp_min_num_params", "FSDP_MIN_NUM_PARAMS", "the parameter count of SIZE_BASED_WRAP"),
    ConfigKey(FSDP, "fsdp_sharding_strategy", "FSDP_SHARDING_STRATEGY", "`sharding_strategy`"),
    ConfigKey(
        FSDP,
        "fsdp_reshard_after_forward",
        "FSDP_RESHARD_AFTER_FORWARD",
        "`reshard_after_forward` (true, false, an int), or a strategy name",
    ),
    ConfigKey(FSDP, "fsdp_offload_params", "FSDP_OFFLOAD_PARAMS", "`cpu_offload` (pinned only with an accelerator)"),
    ConfigKey(
        FSDP,
        "fsdp_activation_checkpointing",
        "FSDP_ACTIVATION_CHECKPOINTING",
        '`activation_checkpointing="auto"` (each wrapped block)',
    ),
    ConfigKey(
        FSDP,
        "fsdp_activation_checkpointing_offload",
        "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD",
        "refused when true (not supported)",
    ),
    ConfigKey(FSDP, "fsdp_forward_prefetch", "FSDP_FORWARD_PREFETCH", "`forward_prefetch=1`"),
    ConfigKey(
        FSDP,
        "fsdp_state_dict_type",
        "FSDP_STATE_DICT_TYPE",
        "`SHARDED_STATE_DICT`: `save_state` writes DCP shards; `FULL_STATE_DICT`: also `model.safetensors` "
        "(consolidated from the shards, not gathered in memory)",
    ),
    ConfigKey(
        FSDP,
        "fsdp_cpu_ram_efficient_loading",
        "FSDP_CPU_RAM_EFFICIENT_LOADING",
        "weights exist on rank 0 only (others may be on the meta device); `prepare` broadcasts them into the shards",
    ),
    ConfigKey(
        TOP,
        "mixed_precision",
        "ACCELERATE_MIXED_PRECISION",
        '`"bf16"`/`"fp16"`: FSDP2 policies (low-precision compute, fp32 weights and reduction); fp16 adds '
        "`ShardedGradScaler` (`GradScalerKwargs` honoured)",
    ),
    ConfigKey(TOP, "use_cpu", "ACCELERATE_USE_CPU", "train on CPU (gloo)"),
    ConfigKey(
        DEEPSPEED,
        "zero_stage",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE",
        "`sharding_strategy` (0: NO_SHARD, 1 and 2: SHARD_GRAD_OP, 3: FULL_SHARD)",
        ("zero_optimization", "stage"),
        int,
    ),
    ConfigKey(
        DEEPSPEED,
        "offload_optimizer_device",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
        '`cpu_offload=True` for "cpu"',
        ("zero_optimization", "offload_optimizer", "device"),
    ),
    ConfigKey(
        DEEPSPEED,
        "offload_param_device",
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
        '`cpu_offload=True` for "cpu"',
        ("zero_optimization", "offload_param", "device"),
    ),
    ConfigKey(
        DEEPSPEED,
        "gradient_accumulation_steps",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
        "the trainer's accumulation steps",
        ("gradient_accumulation_steps",),
        int,
    ),
    ConfigKey(
        DEEPSPEED,
        "gradient_clipping",
        "ACCELERATE_GRADIENT_CLIPPING",
        "the trainer's gradient clipping",
        ("gradient_clipping",),
        float,
    ),
    ConfigKey(
        DEEPSPEED,
        "zero3_init_flag",
        "ACCELERATE_DEEPSPEED_ZERO3_INIT",
        "nothing: build the model on the meta device instead (the translation's warning says so)",
        ("zero3_init_flag",),
    ),
    ConfigKey(
        DEEPSPEED,
        "zero3_save_16bit_model",
        "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
        "nothing: full weights come from `save_model` / `f2.export_full` (the translation's warning says so)",
        ("zero3_save_16bit_model",),
    ),
    ConfigKey(
        DEEPSPEED,
        "deepspeed_config_file",
        "ACCELERATE_DEEPSPEED_CONFIG_FILE",
        "the DeepSpeed config, translated (`f2.translate_deepspeed`)",
    ),
)

_BY_VAR = {k.var: k for k in KEYS}
_BY_YAML = {(k.section, k.key): k for k in KEYS}


def var_for(section: str, key: str) -> str:
    """The variable `accelerate launch` sets for `key` of `section` (listed or not)."""
    listed = _BY_YAML.get((section, key))
    if listed is not None:
        return listed.var
    return f"ACCELERATE_DEEPSPEED_{key.upper()}" if section == DEEPSPEED else key.upper()


def where(var: str) -> str:
    """`var` with the YAML key it comes from, for error messages."""
    listed = _BY_VAR.get(var)
    return f"{var} (accelerate config key `{listed.key if listed else var.lower()}`)"


def flag(env: Mapping[str, str], var: str) -> bool | None:
    """A boolean variable: None when unset or blank.

    Raises:
        ValueError: The value is neither true nor false; names the variable and its YAML key.
    """
    raw = env.get(var)
    if raw is None or raw.strip() == "":
        return None
    value = raw.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise ValueError(f"{where(var)}={raw!r} is invalid; use true or false.")


def deepspeed_keys() -> tuple[ConfigKey, ...]:
    """The inline `deepspeed_config` keys that carry a value of a DeepSpeed config."""
    return tuple(k for k in KEYS if k.deepspeed_path)


def markdown_table() -> str:
    """`KEYS` as a Markdown table (the docs' Accelerate reference renders it)."""
    rows = ["| accelerate config key | variable `accelerate launch` sets | becomes |", "|---|---|---|"]
    rows += [f"| `{k.yaml}` | `{k.var}` | {k.becomes} |" for k in KEYS]
    return "\n".join(rows)
