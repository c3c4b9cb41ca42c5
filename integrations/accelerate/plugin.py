"""`FSDP2Plugin`: the core's `FSDP2Config` in the shape of Accelerate's FSDP plugin.

Values come from three places, later ones winning: the accelerate config file (the `FSDP_*`
variables `accelerate launch` sets, read by `_accelerate_env`), an `FSDP2Config` (object,
dict or YAML path: options the accelerate YAML cannot carry, such as prefetch depth or
module overrides), and keyword arguments.

It subclasses Accelerate's `FullyShardedDataParallelPlugin` so that Accelerate code that
inspects `accelerator.state.fsdp_plugin` finds the fields it expects (mirrored from the
config). The stock `Accelerator` refuses it by name (`_compat.refuse_in_stock_accelerator`,
and `fsdp_version` raises until `FSDP2Accelerator` claims it) instead of silently running
without FSDP.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.fsdp import StateDictType

import fsdp2_strategy as f2
from fsdp2_strategy.config_checks import FieldErrors, check_bool
from fsdp2_strategy.precision import resolve_mixed_precision, resolve_offload
from fsdp2_strategy.sharding_strategies import reshards_after_forward

from . import _compat as compat
from .deepspeed_env import DeepSpeedLaunch
from .env import ADAPTER_KEYS, PRECISIONS, read_accelerate_env

STOCK_ACCELERATOR_ERROR = (
    "FSDP2Plugin was handed to accelerate.Accelerator, which cannot run it: on CPU stock Accelerate runs an "
    "FSDP config as unsynchronised single processes (DistributedType.NO) or as DDP (MULTI_CPU), and it has no "
    "hook for another sharding engine. Use `from fsdp2_strategy.integrations.accelerate import FSDP2Accelerator` and "
    "`FSDP2Accelerator(fsdp_plugin=FSDP2Plugin(), ...)`: the same arguments and methods as Accelerator."
)
_STATE_DICT_TYPES = {
    "sharded": StateDictType.SHARDED_STATE_DICT,
    "sharded_state_dict": StateDictType.SHARDED_STATE_DICT,
    "full": StateDictType.FULL_STATE_DICT,
    "full_state_dict": StateDictType.FULL_STATE_DICT,
}


def _config_values(config: f2.FSDP2Config | Mapping[str, Any] | str | Path | None) -> dict[str, Any]:
    """The fields `config` sets: all keys of a dict or YAML file, non-default fields of an object."""
    if config is None:
        return {}
    if isinstance(config, f2.FSDP2Config):
        default = f2.FSDP2Config()
        return {
            f.name: getattr(config, f.name)
            for f in dataclasses.fields(config)
            if getattr(config, f.name) != getattr(default, f.name)
        }
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, Path)):
        data = f2.FSDP2Config.yaml_fields(config)
        f2.FSDP2Config.from_dict(data)  # full validation, errors naming the file's fields
        return data
    raise ValueError(
        f"FSDP2Plugin(config=...) must be an FSDP2Config, a dict or a YAML path, got {type(config).__name__}."
    )


def _state_dict_type(value: Any) -> StateDictType:
    if isinstance(value, StateDictType) and value in _STATE_DICT_TYPES.values():
        return value
    key = str(value).lower().removeprefix("statedicttype.")
    if key in _STATE_DICT_TYPES:
        return _STATE_DICT_TYPES[key]
    raise ValueError(
        f"FSDP2Plugin.state_dict_type={value!r} is invalid; use 'sharded' (SHARDED_STATE_DICT) or "
        "'full' (FULL_STATE_DICT)."
    )


def _check_keep_last(value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"FSDP2Plugin.keep_last={value!r} is invalid; use None or an int >= 1.")


class FSDP2Plugin(FullyShardedDataParallelPlugin):
    """Accelerate FSDP plugin backed by the fsdp2_strategy core.

    Args:
        config: an `FSDP2Config`, a dict of its fields, or the path of its YAML file; overrides
            the accelerate config file's values for the fields it sets.
        state_dict_type: "sharded" (default; `SHARDED_STATE_DICT`): `save_state` writes DCP
            shards only; "full" (`FULL_STATE_DICT`): `save_state` also writes the consolidated
            weights as `model.safetensors` beside the shards.
        cpu_ram_efficient_loading: the model's real weights exist on rank 0 only (other ranks
            may hold the model on the meta device, as `transformers` loads it when this is set);
            `prepare` shards it and broadcasts rank 0's weights into the shards.
        keep_last: with `ProjectConfiguration(automatic_checkpoint_naming=True)`, keep only the
            newest `keep_last` checkpoints (like `total_limit`, but pruned after the new one commits).
        read_env: read the `FSDP_*` variables of `accelerate launch` (default True).
        **fields: `FSDP2Config` fields (`wrap_policy`, `mixed_precision`, `forward_prefetch`, ...).

    Raises ValueError naming the field, variable or key for any invalid value.
    """

    def __init__(
        self,
        config: f2.FSDP2Config | Mapping[str, Any] | str | Path | None = None,
        *,
        state_dict_type: str | StateDictType | None = None,
        cpu_ram_efficient_loading: bool | None = None,
        keep_last: int | None = None,
        read_env: bool = True,
        **fields: Any,
    ) -> None:
        # Accelerate's dataclass __init__/__post_init__ are not run: they parse the environment
        # themselves (with FSDP1 defaults); `_accelerate_env` is the one place that does here.
        for field in dataclasses.fields(FullyShardedDataParallelPlugin):
            if field.name == "fsdp_version":
                continue
            default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
            object.__setattr__(self, field.name, None if default is dataclasses.MISSING else default)
        self._claimed = False
        env = read_accelerate_env() if read_env else {}
        adapter = {k: env.pop(k) for k in ADAPTER_KEYS if k in env}
        # Every argument is checked before raising: one error names all the bad ones.
        errors = FieldErrors("FSDP2Plugin")
        explicit = errors.check(lambda: {**_config_values(config), **fields}, keep=dict(fields))
        self.precision_from_user = "mixed_precision" in explicit
        self.fsdp2_config = errors.check(f2.FSDP2Config.from_dict, {**env, **explicit})
        self.state_dict_type = errors.check(
            _state_dict_type, state_dict_type or adapter.get("state_dict_type", "sharded")
        )
        if cpu_ram_efficient_loading is None:
            cpu_ram_efficient_loading = adapter.get("cpu_ram_efficient_loading", False)
        errors.check(check_bool, cpu_ram_efficient_loading, "FSDP2Plugin.cpu_ram_efficient_loading")
        errors.check(_check_keep_last, keep_last)
        errors.raise_if_any()
        self.cpu_ram_efficient_loading = cpu_ram_efficient_loading
        if cpu_ram_efficient_loading:
            # transformers' from_pretrained reads this to load real weights on rank 0 only.
            os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "true"
        self.keep_last = keep_last
        self.deepspeed: DeepSpeedLaunch | None = adapter.get("deepspeed")
        """The `distributed_type: DEEPSPEED` launch this plugin was read from, if any."""
        self._mirror_accelerate_fields()

    # ------------------------------------------------------------------ accelerate's view
    @property
    def fsdp_version(self) -> int:
        """2, once an `FSDP2Accelerator` owns the plugin. The stock `Accelerator` reads this first
        thing, and gets a TypeError that names `FSDP2Accelerator` instead of a silent run without FSDP."""
        if not self._claimed:
            raise TypeError(STOCK_ACCELERATOR_ERROR)
        return 2

    @fsdp_version.setter
    def fsdp_version(self, value: Any) -> None:
        if value not in (None, 2):
            raise ValueError(f"FSDP2Plugin.fsdp_version={value!r}: this plugin runs FSDP2 only.")

    def claim(self) -> None:
        """Called by `FSDP2Accelerator`: from now on Accelerate may read this plugin."""
        self._claimed = True

    @property
    def full_state_dict(self) -> bool:
        """Whether `save_state` also writes consolidated weights (`state_dict_type="full"`)."""
        return self.state_dict_type == StateDictType.FULL_STATE_DICT

    def with_precision(self, accelerate_name: str) -> None:
        """Apply `Accelerator(mixed_precision=...)` ("no", "bf16", "fp16") unless the plugin was
        given its own precision, which must then agree. A DeepSpeed launch whose config states a
        precision keeps it over "no" (stock Accelerate does) and refuses the other one."""
        if accelerate_name not in PRECISIONS:
            raise ValueError(
                f"FSDP2Accelerator(mixed_precision={accelerate_name!r}) is not supported; use one of "
                f"{', '.join(PRECISIONS)} (FSDP2 mixed-precision policies)."
            )
        value = PRECISIONS[accelerate_name]
        stated = self.deepspeed.translation.precision if self.deepspeed is not None else None
        if stated is not None and accelerate_name in ("no", stated):
            return  # as stock Accelerate with DeepSpeed: the DeepSpeed config's precision decides
        if stated is not None:
            raise ValueError(
                f"FSDP2Accelerator(mixed_precision={accelerate_name!r}) conflicts with the DeepSpeed config "
                f"({self.deepspeed.source}), whose bf16/fp16 sections say {stated!r}; drop the argument or change "
                "the DeepSpeed config."
            )
        if self.precision_from_user and self.fsdp2_config.mixed_precision != value:
            raise ValueError(
                f"FSDP2Accelerator(mixed_precision={accelerate_name!r}) conflicts with "
                f"FSDP2Plugin(mixed_precision={self.fsdp2_config.mixed_precision!r}); set it in one place."
            )
        self.fsdp2_config = f2.FSDP2Config.coerce(self.fsdp2_config, mixed_precision=value)
        self._mirror_accelerate_fields()

    def config_for(self, *, sync_each_batch: bool) -> f2.FSDP2Config:
        """The config as `GradientAccumulationPlugin(sync_each_batch=...)` asks: reducing every
        micro-batch is the "sync_each" accumulation mode.

        Raises:
            ValueError: sync_each_batch=True with a mode that keeps parameters gathered across the step.
        """
        config = self.fsdp2_config
        mode = f2.accumulation_mode(config.accumulation)
        if not sync_each_batch or mode.reduces_every_micro_batch:
            return config
        if mode.keeps_gathered:
            raise ValueError(
                "GradientAccumulationPlugin(sync_each_batch=True) reduces every micro-batch, but the FSDP2 config "
                "has accumulation='keep_gathered'; drop sync_each_batch or set accumulation='sync_each'."
            )
        return f2.FSDP2Config.coerce(config, accumulation="sync_each")

    @property
    def accelerate_precision(self) -> str:
        """The precision as Accelerate names it ("no", "bf16", "fp16"; "custom" for a policy)."""
        value = self.fsdp2_config.mixed_precision
        if value is None or value == "fp32":
            return "no"
        return value if isinstance(value, str) else "custom"

    def _mirror_accelerate_fields(self) -> None:
        """Fill Accelerate's plugin fields from the config, for code that reads them."""
        cfg = self.fsdp2_config
        self.sharding_strategy = None  # deprecated for FSDP2 in Accelerate
        if cfg.reshard_after_forward is not None:
            self.reshard_after_forward = cfg.reshard_after_forward
        else:
            # "auto": the planner picks the strategy per model in `prepare`; unknown until then.
            self.reshard_after_forward = (
                None if cfg.sharding_strategy == "auto" else reshards_after_forward(cfg.sharding_strategy)
            )
        self.mixed_precision_policy = resolve_mixed_precision(cfg.mixed_precision) if cfg.mixed_precision else None
        self.cpu_offload = resolve_offload(cfg.cpu_offload)
        self.activation_checkpointing = cfg.activation_checkpointing is not None
        self.auto_wrap_policy = None  # the core applies `cfg.wrap_policy`; Accelerate's policy is never used
        wrap = cfg.wrap_policy
        self.transformer_cls_names_to_wrap = (
            [w if isinstance(w, str) else w.__name__ for w in wrap] if isinstance(wrap, (list, tuple)) else None
        )
        self.min_num_params = wrap if isinstance(wrap, int) and not isinstance(wrap, bool) else None
        self.forward_prefetch = None
        self.backward_prefetch = None

    def __repr__(self) -> str:
        return (
            f"FSDP2Plugin(config={self.fsdp2_config!r}, state_dict_type={self.state_dict_type.name}, "
            f"cpu_ram_efficient_loading={self.cpu_ram_efficient_loading}, keep_last={self.keep_last})"
        )

    # Accelerate's dataclass compares fields (and would read `fsdp_version`); plugins are compared by identity.
    __eq__ = object.__eq__
    __hash__ = object.__hash__


compat.refuse_in_stock_accelerator(FSDP2Plugin, STOCK_ACCELERATOR_ERROR)
