"""An accelerate config YAML turned into the variables `accelerate launch --config_file` would set.

Where no `accelerate launch` starts the processes (Ray Train, a cluster manager, a notebook),
`FSDP2Plugin()` still reads its configuration from the `FSDP_*` variables (see `env`):
`accelerate_config_env(path)` returns them for one config file, and `apply_accelerate_config(path)`
puts them into this process's environment. Only the keys that reach the FSDP2 path are mapped:
`fsdp_config:` keys, `mixed_precision`, `use_cpu`, `distributed_type`, and for
`distributed_type: DEEPSPEED` the `deepspeed_config:` keys, each named as `keys.KEYS` says.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from .keys import DEEPSPEED, FSDP, TOP, var_for

__all__ = ["accelerate_config_env", "apply_accelerate_config"]


def accelerate_config_env(path: str | os.PathLike) -> dict[str, str]:
    """The environment `accelerate launch --config_file path` gives each process, FSDP part only.

    The file is read, not applied; `apply_accelerate_config` sets the result in `os.environ`.

    Args:
        path: An accelerate config file (YAML, as `accelerate config` writes it).

    Returns:
        The variables the launcher would set: `fsdp_config`'s keys (FSDP_*), ACCELERATE_USE_FSDP
        or ACCELERATE_USE_DEEPSPEED with the DeepSpeed settings and ACCELERATE_CONFIG_DS_FIELDS (the
        keys the file set), ACCELERATE_MIXED_PRECISION and ACCELERATE_USE_CPU where the file sets them.

    Raises:
        FileNotFoundError: If `path` is not a file.
        ValueError: If the file is not an accelerate config (no mapping at the top, `fsdp_config`
            not a mapping, or a key under it not starting with "fsdp_").
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"accelerate config file {path} does not exist; write one with `accelerate config`.")
    config = yaml.safe_load(path.read_text()) or {}
    if not isinstance(config, dict):
        raise ValueError(f"accelerate config file {path} must hold a mapping of keys (as `accelerate config` writes).")
    fsdp = config.get(FSDP) or {}
    if not isinstance(fsdp, dict):
        raise ValueError(
            f"accelerate config file {path}: `fsdp_config` must be a mapping of fsdp_* keys, got {fsdp!r}."
        )
    env = {}
    for key, value in fsdp.items():
        if value is None:
            continue
        if not key.startswith("fsdp_"):
            raise ValueError(f"accelerate config file {path}: key {key!r} under `fsdp_config` must start with 'fsdp_'.")
        env[var_for(FSDP, key)] = _as_env(value)
    if config.get("distributed_type") == "FSDP":
        env["ACCELERATE_USE_FSDP"] = "true"
    if config.get("distributed_type") == "DEEPSPEED":  # run on this engine: deepspeed_env translates it
        env["ACCELERATE_USE_DEEPSPEED"] = "true"
        deepspeed = config.get(DEEPSPEED) or {}
        for key, value in deepspeed.items():
            if value is not None:
                env[var_for(DEEPSPEED, key)] = _as_env(value)
        # The keys the config itself set, as the launcher lists them (checked beside a DeepSpeed file).
        given = [*deepspeed, *(["mixed_precision"] if config.get("mixed_precision") is not None else [])]
        env["ACCELERATE_CONFIG_DS_FIELDS"] = ",".join(given)
    for key in ("mixed_precision", "use_cpu"):
        if config.get(key) is not None:
            env[var_for(TOP, key)] = _as_env(config[key])
    return env


def apply_accelerate_config(path: str | os.PathLike) -> dict[str, str]:
    """Set the environment of an accelerate config file in `os.environ`, as `accelerate launch` does.

    Call it before building the plugin or accelerator, in scripts started without
    `accelerate launch` (torchrun, plain python).

    Args:
        path: An accelerate config file (YAML, as `accelerate config` writes it).

    Returns:
        The variables set (`accelerate_config_env(path)`).

    Raises:
        FileNotFoundError: If `path` is not a file.
        ValueError: If the file is not an accelerate config.
    """
    env = accelerate_config_env(path)
    os.environ.update(env)
    return env


def _as_env(value: Any) -> str:
    """How `accelerate launch` writes a value: booleans lower-case, lists comma-joined."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)
