"""A DeepSpeed config (as `deepspeed.initialize`, `TrainingArguments(deepspeed=...)`, Accelerate's
`deepspeed_config_file` and Lightning's `DeepSpeedStrategy(config=...)` take it) read as an
`FSDP2Config` and the settings that belong to the trainer.

What maps, and why:

- `zero_optimization.stage`: 3 shards parameters, gradients and optimizer state (FULL_SHARD); 2
  shards gradients and optimizer state and keeps parameters whole between forward and backward
  (SHARD_GRAD_OP); 1 shards only the optimizer state, which FSDP2 cannot do alone: SHARD_GRAD_OP,
  which also shards gradients (less memory, the same result); 0 is plain data parallelism (NO_SHARD).
- `zero_hpz_partition_size` N > 1 (ZeRO++'s parameter copies within groups of N ranks): hybrid
  sharding, sharded within groups of N and replicated across them (`mesh_shape=(world // N, N)` when
  the world size is known).
- `offload_optimizer` / `offload_param` to "cpu": `cpu_offload=True` (FSDP2 offloads parameters,
  gradients and the optimizer step together); "nvme" has no equivalent.
- `bf16.enabled` / `fp16.enabled`: `mixed_precision` "bf16" / "fp16" (fp32 master weights; fp16's
  loss scaling is the trainer's sharded grad scaler); `false` for both (or the one present) is full
  precision, stated (`DeepSpeedTranslation.precision` "no"), which a trainer must not override.
- `gradient_clipping`, `gradient_accumulation_steps`, `train_micro_batch_size_per_gpu`,
  `train_batch_size`: trainer settings (`max_grad_norm`, ...), with the names each trainer uses.

Every other key is listed, with what to do instead, in `DeepSpeedTranslation.unmapped` (and in the
one warning block of `translate_deepspeed`). Hugging Face's "auto" values are left to the trainer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..config import FSDP2Config
from ..distributed import log_rank_zero

STAGES = {0: "NO_SHARD", 1: "SHARD_GRAD_OP", 2: "SHARD_GRAD_OP", 3: "FULL_SHARD"}
"""ZeRO stage -> sharding strategy (see the module docstring for stage 1)."""

TRAINER_KEYS = {
    "gradient_clipping": "max_grad_norm",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "train_batch_size": "train_batch_size",
}
"""DeepSpeed key -> the trainer setting it becomes (the HF Trainer's names; Lightning's are in
`LIGHTNING_NAMES`)."""

LIGHTNING_NAMES = {"max_grad_norm": "gradient_clip_val", "gradient_accumulation_steps": "accumulate_grad_batches"}

_COLLECTIVE_TUNING = (
    "overlap_comm",
    "contiguous_gradients",
    "reduce_bucket_size",
    "allgather_bucket_size",
    "allgather_partitions",
    "reduce_scatter",
    "round_robin_gradients",
    "sub_group_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "zero_quantized_weights",
    "zero_quantized_gradients",
)
_ADVICE = {
    **{
        f"zero_optimization.{k}": "no equivalent: FSDP2 communicates per wrapped module (wrap_policy) and "
        "prefetches by forward_prefetch / backward_prefetch"
        for k in _COLLECTIVE_TUNING
    },
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "full weights are written by "
    "f2.export_full / the adapters' save_model, from any checkpoint",
    "optimizer": "build the optimizer yourself after sharding (e.g. torch.optim.AdamW with these params)",
    "scheduler": "build the scheduler yourself (torch.optim.lr_scheduler) or keep the trainer's",
    "activation_checkpointing": "set FSDP2Config.activation_checkpointing='auto' (or block classes)",
    "steps_per_print": "no effect here: the trainer's logging",
    "wall_clock_breakdown": "no effect here: f2.track_throughput reports step times",
    "fp16.loss_scale": "the trainer's grad scaler (dynamic by default)",
    "fp16.initial_scale_power": "the trainer's grad scaler (GradScalerKwargs(init_scale=2**N) in Accelerate)",
    "fp16.loss_scale_window": "the trainer's grad scaler (growth_interval)",
    "fp16.hysteresis": "no equivalent in torch's grad scaler",
    "fp16.min_loss_scale": "no equivalent in torch's grad scaler",
    "zero_allow_untested_optimizer": "no effect here: any torch optimizer works",
    # Accelerate's inline deepspeed_config keys (accelerate launch passes them by their own names).
    "zero3_init_flag": "no equivalent needed: build the model on the meta device; shard_model materialises "
    "each rank's shards only",
    "zero3_save_16bit_model": "full weights are written by f2.export_full / the adapters' save_model",
}


@dataclass(frozen=True)
class DeepSpeedTranslation:
    """What a DeepSpeed config becomes.

    Attributes:
        config: the `FSDP2Config`.
        trainer: trainer settings, by the HF Trainer's names (`max_grad_norm`,
            `gradient_accumulation_steps`, `per_device_train_batch_size`, `train_batch_size`).
        mapped: DeepSpeed key -> what it became.
        unmapped: DeepSpeed key -> what to do instead (no equivalent here).
        precision: the precision the config states: "bf16" or "fp16" (enabled), "no" (disabled,
            none enabled); None where it leaves it to the trainer ("auto" or no section).
    """

    config: FSDP2Config
    trainer: dict[str, Any] = field(default_factory=dict)
    mapped: dict[str, str] = field(default_factory=dict)
    unmapped: dict[str, str] = field(default_factory=dict)
    precision: str | None = None

    @staticmethod
    def source_key(name: str) -> str:
        """The DeepSpeed key a `trainer` setting comes from ("max_grad_norm" -> "gradient_clipping")."""
        return next(key for key, trainer_name in TRAINER_KEYS.items() if trainer_name == name)

    def lightning_trainer(self) -> dict[str, Any]:
        """`trainer` by Lightning `Trainer`'s argument names (batch sizes are the DataLoader's)."""
        return {LIGHTNING_NAMES[k]: v for k, v in self.trainer.items() if k in LIGHTNING_NAMES}

    def changed_fields(self) -> dict[str, Any]:
        """The config's fields that differ from `FSDP2Config()`'s (`log_plan` aside)."""
        defaults = FSDP2Config(log_plan=False)
        return {k: v for k, v in vars(self.config).items() if v != getattr(defaults, k) and k != "log_plan"}

    def summary(self) -> str:
        """What was mapped and what was not, one key a line (the text of `translate_deepspeed`'s log)."""
        lines = [f"  {k} -> {v}" for k, v in self.mapped.items()]
        lines += [f"  {k}: not translated: {advice}" for k, advice in self.unmapped.items()]
        return "\n".join(lines)

    def to_yaml(self) -> str:
        """`changed_fields()` as YAML (what `FSDP2Config.from_yaml` reads), the trainer settings and
        the unmapped keys as comments."""
        fields = {k: list(v) if isinstance(v, tuple) else v for k, v in self.changed_fields().items()}
        lines = [yaml.safe_dump(fields, sort_keys=True).rstrip() if fields else "{}"]
        lines += [f"# trainer: {k} = {v}" for k, v in self.trainer.items()]
        lines += [f"# not translated: {k}: {advice}" for k, advice in self.unmapped.items()]
        return "\n".join(lines) + "\n"


def _load(config: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config {path} does not exist; pass a JSON file or a dict.")
    try:
        loaded = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"DeepSpeed config {path} is not JSON: {exc}") from exc
    if not isinstance(loaded, dict):
        raise ValueError(f"DeepSpeed config {path} holds a {type(loaded).__name__}; a JSON object was expected.")
    return loaded


def _flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections as dotted keys, one level deep per section ("zero_optimization.stage")."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and key not in ("optimizer", "scheduler", "activation_checkpointing"):
            out.update(_flat(value, f"{name}."))
        else:
            out[name] = value
    return out


def _offload_device(flat: dict[str, Any], section: str) -> str | None:
    device = flat.get(f"zero_optimization.{section}.device")
    return None if device in (None, "none") else str(device)


def translate_deepspeed(
    config: Mapping[str, Any] | str | Path, *, world_size: int | None = None, warn: bool = True
) -> DeepSpeedTranslation:
    """Read a DeepSpeed config as an `FSDP2Config` plus trainer settings (see the module docstring).

    Args:
        config: the DeepSpeed config: a dict or the path of its JSON file.
        world_size: the number of processes, to turn `zero_hpz_partition_size` into a `mesh_shape`.
        warn: log the summary (rank 0, one WARNING block): each key, what it became or what to
            do instead.

    Returns:
        A `DeepSpeedTranslation`.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is not a JSON object; an unknown ZeRO stage; a world size that the
            hpZ partition size does not divide; bf16 and fp16 both enabled.
    """
    flat = _flat(_load(config))
    fields: dict[str, Any] = {"log_plan": False}
    mapped: dict[str, str] = {}
    trainer: dict[str, Any] = {}
    unmapped: dict[str, str] = {}
    consumed = set()

    stage = flat.get("zero_optimization.stage", 0)
    if stage not in STAGES:
        raise ValueError(f"DeepSpeed zero_optimization.stage={stage!r} is unknown; DeepSpeed's stages are 0 to 3.")
    fields["sharding_strategy"] = STAGES[stage]
    mapped["zero_optimization.stage"] = f"sharding_strategy={STAGES[stage]}"
    consumed.add("zero_optimization.stage")

    hpz = flat.get("zero_optimization.zero_hpz_partition_size", 1)
    consumed.add("zero_optimization.zero_hpz_partition_size")
    if isinstance(hpz, int) and hpz > 1:
        fields["sharding_strategy"] = "HYBRID_SHARD"
        if world_size is not None:
            if world_size % hpz:
                raise ValueError(
                    f"DeepSpeed zero_hpz_partition_size={hpz} does not divide world_size={world_size}; "
                    "use a partition size that divides the number of processes."
                )
            fields["mesh_shape"] = (world_size // hpz, hpz)
        mapped["zero_optimization.zero_hpz_partition_size"] = (
            f"sharding_strategy=HYBRID_SHARD, shard groups of {hpz} ranks"
            + (
                f" (mesh_shape={fields['mesh_shape']})"
                if "mesh_shape" in fields
                else " (set mesh_shape=(world // N, N))"
            )
        )

    for section in ("offload_optimizer", "offload_param"):
        device = _offload_device(flat, section)
        consumed |= {k for k in flat if k.startswith(f"zero_optimization.{section}.")}
        if device == "cpu":
            fields["cpu_offload"] = True
            mapped[f"zero_optimization.{section}"] = "cpu_offload=True"
        elif device is not None:
            unmapped[f"zero_optimization.{section}"] = f"device {device!r}: only 'cpu' maps (cpu_offload=True)"

    stated = _stated_precision(flat)
    for precision in ("bf16", "fp16"):
        enabled = flat.get(f"{precision}.enabled")
        consumed.add(f"{precision}.enabled")
        if enabled is True:
            fields["mixed_precision"] = precision
            mapped[f"{precision}.enabled"] = f"mixed_precision={precision}"
        elif enabled is False and stated == "no":
            mapped[f"{precision}.enabled"] = "false: full precision (fp32)"
        elif enabled == "auto":
            mapped[f"{precision}.enabled"] = "auto: the trainer's precision setting decides"

    for key, name in TRAINER_KEYS.items():
        if key in flat:
            consumed.add(key)
            if flat[key] == "auto":
                mapped[key] = f"auto: the trainer's {name}"
            else:
                trainer[name] = flat[key]
                mapped[key] = f"trainer {name}={flat[key]}"

    for key, value in flat.items():
        if key in consumed:
            continue
        advice = _ADVICE.get(key)
        if key == "optimizer" and isinstance(value, Mapping):
            advice = f"{advice}: {value.get('type')} {value.get('params', {})}"
        unmapped[key] = advice or "unknown to this translation: check what it does and set the equivalent by hand"

    result = DeepSpeedTranslation(FSDP2Config(**fields), trainer, mapped, unmapped, stated)
    if warn:
        log_rank_zero("DeepSpeed config translated to FSDP2:\n%s", result.summary(), level=30)
    return result


def _stated_precision(flat: Mapping[str, Any]) -> str | None:
    """The precision `bf16.enabled` / `fp16.enabled` state (see `DeepSpeedTranslation.precision`).

    Raises:
        ValueError: both are enabled (DeepSpeed refuses that too).
    """
    enabled = {p: flat.get(f"{p}.enabled") for p in ("bf16", "fp16")}
    on = [p for p, value in enabled.items() if value is True]
    if len(on) == 2:
        raise ValueError("DeepSpeed config enables both bf16 and fp16; enable one (or neither, for fp32).")
    if on:
        return on[0]
    given = [value for value in enabled.values() if value is not None]
    return "no" if given and all(value is False for value in given) else None
