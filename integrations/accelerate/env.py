"""Accelerate's FSDP config, as `accelerate launch --config_file` hands it to each process.

`accelerate launch` turns the keys of an accelerate YAML into environment variables (`keys.KEYS`
lists each key, its variable and what it becomes; the docs' Accelerate reference shows that
table). This module is the one place that reads them: `read_accelerate_env()` validates every
value and returns `FSDP2Config` fields plus the adapter's own options. Every error names the
variable, the YAML key it comes from, and the values it accepts. A DeepSpeed launch
(`distributed_type: DEEPSPEED`) is read as its FSDP2 equivalent (`deepspeed_env`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from fsdp2_strategy.sharding_strategies import NAMES as STRATEGIES

from .deepspeed_env import deepspeed_launch
from .keys import FALSE, TRUE, flag, where

WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
# torch's FSDP1 StateDictType values, which accelerate also accepts as digits.
STATE_DICT_TYPES = {"FULL_STATE_DICT": "full", "SHARDED_STATE_DICT": "sharded", "1": "full", "3": "sharded"}
PRECISIONS = {"no": None, "bf16": "bf16", "fp16": "fp16"}

ADAPTER_KEYS = ("state_dict_type", "cpu_ram_efficient_loading", "deepspeed")
"""Keys of `read_accelerate_env()`'s result that are not `FSDP2Config` fields."""


def _lookup(
    env: Mapping[str, str], var: str, field: str, table: Mapping[str, Any], normalise: Any, problem: str
) -> dict[str, Any]:
    """`{field: table[normalise(value)]}` for a set variable `var` ({} when unset or blank); a value
    not in the table raises ValueError naming the variable, its config key and `problem`."""
    raw = env.get(var)
    if raw is None or not raw.strip():
        return {}
    key = normalise(raw.strip())
    if key not in table:
        raise ValueError(f"{where(var)}={raw!r} {problem}")
    return {field: table[key]}


def _choice(env: Mapping[str, str], var: str, choices: tuple[str, ...]) -> str | None:
    raw = env.get(var)
    if raw is None or raw.strip() == "":
        return None
    value = raw.strip().upper()
    if value not in choices:
        raise ValueError(f"{where(var)}={raw!r} is invalid; use one of {', '.join(choices)}.")
    return value


def _positive_int(env: Mapping[str, str], var: str) -> int:
    raw = env.get(var, "")
    try:
        value = int(raw.strip())
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(
            f"{where(var)}={raw!r} is invalid; SIZE_BASED_WRAP needs a positive int (parameters per group)."
        )
    return value


def _wrap_policy(env: Mapping[str, str]) -> dict[str, Any]:
    policy = _choice(env, "FSDP_AUTO_WRAP_POLICY", WRAP_POLICIES)
    if policy is None:
        return {}  # not in the YAML: the core's "auto" (Hugging Face `_no_split_modules`, else repeated blocks)
    if policy == "NO_WRAP":
        return {"wrap_policy": None}
    if policy == "SIZE_BASED_WRAP":
        return {"wrap_policy": _positive_int(env, "FSDP_MIN_NUM_PARAMS")}
    names = [n.strip() for n in env.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "").split(",") if n.strip()]
    # Without class names Accelerate falls back to the model's `_no_split_modules`: so does "auto".
    return {"wrap_policy": names or "auto"}


def _sharding(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    strategy = _choice(env, "FSDP_SHARDING_STRATEGY", STRATEGIES)
    if strategy is not None:
        out["sharding_strategy"] = strategy
    raw = env.get("FSDP_RESHARD_AFTER_FORWARD")
    if raw is None or raw.strip() == "":
        return out
    value = raw.strip()
    if value.lower() in TRUE + FALSE:
        out["reshard_after_forward"] = value.lower() in TRUE
    elif value.isdigit() and int(value) >= 1:
        out["reshard_after_forward"] = int(value)  # reshard to groups of that many ranks
    elif value.upper() in STRATEGIES + ("NO_RESHARD",):
        # FSDP1 spelling of the same choice: a sharding strategy name.
        out["sharding_strategy"] = "SHARD_GRAD_OP" if value.upper() == "NO_RESHARD" else value.upper()
    else:
        raise ValueError(
            f"{where('FSDP_RESHARD_AFTER_FORWARD')}={raw!r} is invalid; use true, false, a positive int, "
            f"or a strategy name ({', '.join(STRATEGIES)})."
        )
    return out


def read_accelerate_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`FSDP2Config` fields and adapter options from Accelerate's launch environment.

    Only variables that are set contribute; the result is empty outside `accelerate launch`.
    Adapter options (`ADAPTER_KEYS`) are included when set.

    Args:
        environ: The variables to read (None: `os.environ`).

    Returns:
        `FSDP2Config` field names and adapter options mapped to the values the variables give
        (a DeepSpeed config is translated, and its `DeepSpeedLaunch` is the option "deepspeed"; an
        FSDP config in the same launch wins).

    Raises:
        ValueError: If a variable holds a value the plugin cannot honour (FSDP1, activation
            checkpointing offload, a value outside its choices, ...); the message names the variable and
            its accelerate config key.
    """
    env = os.environ if environ is None else environ
    version = env.get("FSDP_VERSION")
    if version is not None and version.strip() not in ("", "2"):
        raise ValueError(
            f"{where('FSDP_VERSION')}={version!r}: FSDP2Plugin runs FSDP2 only; set `fsdp_version: 2` in the "
            "fsdp_config of your accelerate config file (or drop the plugin to use Accelerate's FSDP1)."
        )
    if flag(env, "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD"):
        raise ValueError(
            f"{where('FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD')}=true is not supported by FSDP2Plugin; set it to "
            "false (use fsdp_activation_checkpointing: true and fsdp_offload_params for memory savings)."
        )
    # distributed_type: DEEPSPEED: its config translated; an FSDP config in the same launch wins.
    deepspeed = deepspeed_launch(env)
    out: dict[str, Any] = {**(deepspeed.fields() if deepspeed else {}), **_wrap_policy(env), **_sharding(env)}
    offload = flag(env, "FSDP_OFFLOAD_PARAMS")
    if offload is not None:
        out["cpu_offload"] = offload
    checkpointing = flag(env, "FSDP_ACTIVATION_CHECKPOINTING")
    if checkpointing is not None:
        out["activation_checkpointing"] = "auto" if checkpointing else None
    if flag(env, "FSDP_FORWARD_PREFETCH"):
        out["forward_prefetch"] = 1
    precision_env = dict(env)
    if deepspeed is not None and deepspeed.mixed_precision is not None:
        precision_env["ACCELERATE_MIXED_PRECISION"] = deepspeed.mixed_precision  # the DeepSpeed config's decides
    out.update(
        _lookup(
            precision_env,
            "ACCELERATE_MIXED_PRECISION",
            "mixed_precision",
            PRECISIONS,
            str.lower,
            f"is not supported with FSDP2Plugin; use one of {', '.join(PRECISIONS)} (fp8 is not available "
            "through this plugin).",
        )
    )
    out.update(
        _lookup(
            env,
            "FSDP_STATE_DICT_TYPE",
            "state_dict_type",
            STATE_DICT_TYPES,
            str.upper,
            "is invalid; use SHARDED_STATE_DICT (DCP shards, resumable on any world size) or FULL_STATE_DICT "
            "(also consolidated weights); LOCAL_STATE_DICT is FSDP1-only.",
        )
    )
    ram = flag(env, "FSDP_CPU_RAM_EFFICIENT_LOADING")
    if ram is not None:
        out["cpu_ram_efficient_loading"] = ram
    if deepspeed is not None:
        out["deepspeed"] = deepspeed
    return out


def accelerate_cpu_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the accelerate config says `use_cpu: true` (or `accelerate launch --cpu`)."""
    return bool(flag(os.environ if environ is None else environ, "ACCELERATE_USE_CPU"))
