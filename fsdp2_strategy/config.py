"""`FSDP2Config`: every setting of the engine in one validated dataclass, composed of sections by owner.

`ShardingOptions` (here: how `shard_model` shards) and the sections of `config_options`
(`HostOptions`, `CheckpointOptions`, `ChoiceOptions`, `StepOptions`) each hold their fields, documentation and
checks; `FSDP2Config` inherits them all, so users still write one flat config. A config is built
from keyword arguments, a dict (`FSDP2Config.from_dict`) or a YAML file (`FSDP2Config.from_yaml`).
Validation happens once, in `__post_init__`, section by section into one error, and every error
names the field and the values it accepts. Values stay close to what the user
wrote (strings, classes, callables); they are resolved against a concrete model and mesh
later, by `wrap_policy.py`, `precision.py` and `mesh.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml
from torch import nn

from . import sharding_strategies as strategies
from .config_checks import (
    PRECISION_NAMES,  # noqa: F401  (part of this module's names)
    FieldErrors,
    _check_mixed_precision,
    _check_module_list,
    _check_nonneg_int,
    _check_positive_int,
    _check_reshard,
    _check_wrap_policy,
    _strategy_name,
    check_bool,
    check_choice,
    check_compile,
    check_context_parallel,
    check_frozen_dtype,
    check_tensor_parallel,
    did_you_mean,
    mesh_shape_of,
)
from .config_options import (  # noqa: F401  (the sections' accepted values are this module's names too)
    COLLECTIVES,
    HOST_ALLOCATORS,
    OBJECTIVES,
    CheckpointOptions,
    ChoiceOptions,
    HostOptions,
    StepOptions,
)

SHARDING_STRATEGIES = strategies.NAMES
"""Accepted names for `FSDP2Config.sharding_strategy` (FSDP1's vocabulary; see `sharding_strategies`)."""

ACCUMULATION_MODES = ("sync_each", "sync_last", "keep_gathered")
"""Accepted values for `FSDP2Config.accumulation` (see its docstring for the trade-off)."""


QUANTISED_WEIGHTS = ("shard", "replicate")
"""Accepted values for `FSDP2Config.quantised_weights` (see `shard.quantised`)."""

T = TypeVar("T")
WrapPolicy = str | int | Callable[[nn.Module, str], bool] | Sequence[str | type] | type | None


def _unknown_field_names(cls: type, values: Mapping[str, Any]) -> str | None:
    """What is wrong with the keys of `values` that are no field of `cls` (each with its closest
    field name, and the valid ones listed); None when every key is a field."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - names
    if not unknown:
        return None
    hints = "".join(did_you_mean(name, names) for name in sorted(unknown))
    return f"Unknown {cls.__name__} fields {sorted(unknown)}; valid fields: {sorted(names)}.{hints}"


@dataclass
class ModuleOverride:
    """Per-module settings applied to modules whose qualified name matches a glob.

    Any field left as None inherits the global `FSDP2Config` value.
    """

    sharding_strategy: Any = None
    """Strategy for this module's group (e.g. "HYBRID_SHARD" while the rest is "FULL_SHARD")."""
    reshard_after_forward: bool | int | None = None
    """Reshard choice for this group; overrides the strategy's default."""
    mixed_precision: Any = None
    """Precision for this group: same forms as `FSDP2Config.mixed_precision`."""
    cpu_offload: bool | None = None
    """Offload this group's parameters to CPU."""

    def validate(self, pattern: str) -> None:
        prefix = f"FSDP2Config.module_overrides[{pattern!r}]"
        if self.sharding_strategy is not None:
            self.sharding_strategy = _strategy_name(self.sharding_strategy)
        _check_reshard(self.reshard_after_forward, f"{prefix}.reshard_after_forward")
        _check_mixed_precision(self.mixed_precision, f"{prefix}.mixed_precision")
        if self.cpu_offload is not None and not isinstance(self.cpu_offload, bool):
            raise ValueError(f"{prefix}.cpu_offload={self.cpu_offload!r} is invalid; use True or False.")


def _names_unknown_fields(cls: type[T]) -> type[T]:
    """Class decorator: the dataclass `__init__` names the valid fields on an unknown keyword (the
    generated one says only "unexpected keyword argument"), in one error with whatever is wrong with
    the values of the known ones (a user fixes both at once). `functools.wraps` keeps its signature,
    which LightningCLI/jsonargparse read to offer the fields as options."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        unknown = _unknown_field_names(type(self), kwargs)
        if unknown is None:
            return init(self, *args, **kwargs)
        names = {f.name for f in dataclasses.fields(type(self))}
        try:
            init(self, *args, **{k: v for k, v in kwargs.items() if k in names})
        except ValueError as exc:
            raise ValueError(f"{unknown}\nAnd: {exc}") from None
        raise ValueError(unknown)

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


@dataclass
class ShardingOptions:
    """How `shard_model` shards a model: strategy, groups, precision, offload, recomputation,
    accumulation (the core's section of `FSDP2Config`)."""

    sharding_strategy: Any = "FULL_SHARD"
    """"auto" (the memory planner picks the strategy with the least communication that fits
    `memory_budget`; see `f2.compare_strategies`), FULL_SHARD (ZeRO-3), SHARD_GRAD_OP (ZeRO-2: parameters stay gathered between forward and
    backward), HYBRID_SHARD (shard inside a node, replicate across nodes), HYBRID_SHARD_ZERO2,
    or NO_SHARD (replicate everywhere, DDP-like). torch's FSDP1 `ShardingStrategy` is accepted."""

    reshard_after_forward: bool | int | None = None
    """Overrides the strategy: True frees gathered parameters after forward, False keeps them
    until backward, an int reshards to groups of that many ranks (must divide the shard size)."""

    mesh_shape: tuple[int, ...] | None = None
    """Device-mesh shape: `(shard,)` or `(replicate, shard)` for hybrid strategies. Default: the
    world size for full/grad-op sharding; `(num_nodes, ranks_per_node)` for hybrid ones."""

    wrap_policy: WrapPolicy = "auto"
    """Which submodules become their own FSDP group: "auto" (repeated blocks: Hugging Face
    `_no_split_modules`, else the class repeated most among the children of a ModuleList or
    Sequential, a block with submodules before a single layer; the plan says what it chose),
    module classes, class-name strings, an int min-params threshold, a callable
    `(module, qualified_name) -> bool`, or None (only the root)."""

    blocks_per_group: int = 1
    """Consecutive blocks sharded together as one FSDP group (one `fully_shard` call on the list):
    top-level groups of `wrap_policy` with the same parent and the same `module_overrides` entry,
    taken this many at a time (the last group of a run may hold fewer). Fewer, larger collectives,
    for more gathered memory: between per block (1, the default) and one group (`wrap_policy=None`).
    Activation checkpointing, compile and the blocks themselves stay per block."""

    mixed_precision: Any = None
    """None (keep parameter dtype), "bf16"/"fp16" (low-precision compute, fp32 master weights and
    fp32 gradient reduction), "fp32", a dict of `MixedPrecisionPolicy` fields (dtype names
    allowed), or a `torch.distributed.fsdp.MixedPrecisionPolicy`."""

    frozen_dtype: Any = "auto"
    """Storage dtype of frozen parameters (`requires_grad=False`, e.g. the base model under LoRA):
    "auto" (default: the compute dtype of the group that owns them, `mixed_precision`'s
    `param_dtype`, when that is set; else kept), None (keep), or a dtype ("bf16", "fp16", "fp32",
    a `torch.dtype`). Frozen weights get no gradients and no optimizer state, so an fp32 copy of
    them only costs memory: under "bf16" mixed precision FSDP casts them to bf16 before every
    all-gather anyway, and storing them in bf16 computes the same numbers with half the bytes.
    Trainable parameters keep their dtype (fp32 master weights and optimizer state)."""

    quantised_weights: str = "shard"
    """What `shard_model` does with bitsandbytes-quantised weights (a QLoRA base):

    - "shard" (default): 4-bit weights (`Params4bit`, either `bnb_4bit_quant_storage`) are
      sharded like any frozen parameter, as their packed bytes: each rank stores 1/N of them, the
      forward all-gathers the bytes and bitsandbytes dequantises inside the layer. The small
      quantisation state (absmax, code map) stays whole on every rank. 8-bit weights are refused
      (their row scales come from the whole weight).
    - "replicate": quantised weights are left out of FSDP and kept whole on every rank (each rank
      holds the whole base; no all-gather of it in forward).

    Either way they stay frozen and are not in checkpoints (the base comes from its pretrained weights)."""

    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state on CPU. Pinned memory is used only
    where an accelerator exists."""

    activation_checkpointing: Any = None
    """Recompute activations in backward for: None (off), "auto" (the wrapped blocks), or module
    classes / class names."""

    ignored_modules: Any = None
    """Module classes, class names, or module instances whose parameters FSDP leaves alone (not
    sharded, not reduced: the user owns their synchronisation)."""

    compile: bool | dict = False
    """`torch.compile` each wrapped block (True, or a dict of `torch.compile` keyword arguments)."""

    forward_prefetch: int = 0
    """How many blocks ahead to all-gather explicitly during forward (0: torch's implicit order)."""

    backward_prefetch: int = 0
    """How many blocks ahead to all-gather explicitly during backward (0: torch's default of one)."""

    module_overrides: dict = field(default_factory=dict)
    """Glob on a module's qualified name -> partial config (`sharding_strategy`,
    `reshard_after_forward`, `mixed_precision`, `cpu_offload`). A matching module becomes its
    own group with those settings; the first matching glob wins."""

    tensor_parallel_size: int = 1
    """Ranks one tensor-parallel group spans (1: none). The world size must be a multiple of it;
    the rest is data parallel: FSDP (or HSDP) over `world_size // tensor_parallel_size` ranks.
    TP groups are consecutive ranks (inside a node), applied before FSDP."""

    context_parallel_size: int = 1
    """Ranks each sequence is split across (1: none): context parallelism, for sequences whose
    activations do not fit one rank. The world size must be a multiple of
    `context_parallel_size * tensor_parallel_size`. Attention runs as a ring over the "cp" ranks
    inside `f2.context_parallel(model, batch)`, which hands each rank its part of every sequence;
    FSDP shards parameters over the data-parallel x context-parallel ranks and averages gradients
    over them. Needs a model whose attention calls `scaled_dot_product_attention` (Hugging Face:
    `attn_implementation="sdpa"`) with a causal mask or none."""

    tensor_parallel_plan: Any = "auto"
    """With `tensor_parallel_size > 1`, how modules are split: "auto" (the plan a Hugging Face
    model declares in `base_model_tp_plan` / `_tp_plan`), a dict of module-name globs to
    "colwise", "rowwise", "sequence_parallel" (or "colwise_rep"/"rowwise_rep", and Hugging Face's
    "colwise_gather_output"/"embedding_rowwise"/"embedding_colwise") or a torch
    `ParallelStyle`, or a callable `(model, tp_mesh)` that parallelises the model itself.
    Modules whose parameters are DTensors already (parallelised by the user) are left alone."""
    accumulation: str = "sync_last"
    """What the micro-batches of one optimizer step communicate under `f2.no_sync` (k micro-batches,
    N shard ranks, P the bytes of all parameters, G of their gradients at the reduce dtype):

    - "sync_each": reduce-scatter after every micro-batch; gradients stay sharded. Gradient
      memory G/N per rank (the lowest); communication per step: k reduce-scatters of G and 2k
      all-gathers of P (forward and backward, as without accumulation). What torchtitan does.
    - "sync_last" (default): reduce-scatter on the last micro-batch only; unsharded gradients
      (G per rank) are held across the micro-batches. 1 reduce-scatter of G and 2k all-gathers
      of P per step.
    - "keep_gathered": "sync_last", and parameters also stay unsharded from the first forward
      of the step to the last backward (ZeRO-1/2 style; on CPU every group is gathered when the
      step's first `no_sync` begins, the all-gathers started together). Memory of DDP: P + G per
      rank during the step; 1 all-gather of P and 1 reduce-scatter of G per step (the bytes of
      DDP's one all-reduce).

    With HSDP the all-reduce across replicas runs on the last micro-batch only, in every mode.
    Without `no_sync` (k = 1) the modes do not differ."""

    log_plan: bool = True
    """Log the sharding plan table on rank 0 after `shard_model`."""

    def _check_sharding(self, errors: FieldErrors) -> str | None:
        """Check (and normalise) this section's fields; returns the strategy's name, None if invalid."""
        strategy = errors.check(_strategy_name, self.sharding_strategy, True)
        self.sharding_strategy = strategy if strategy is not None else self.sharding_strategy
        errors.check(_check_reshard, self.reshard_after_forward, "FSDP2Config.reshard_after_forward")
        self.mesh_shape = errors.check(mesh_shape_of, self.mesh_shape, keep=self.mesh_shape)
        errors.check(_check_wrap_policy, self.wrap_policy, "FSDP2Config.wrap_policy")
        errors.check(
            _check_positive_int, self.blocks_per_group, "FSDP2Config.blocks_per_group", "blocks per FSDP group"
        )
        errors.check(_check_mixed_precision, self.mixed_precision, "FSDP2Config.mixed_precision")
        errors.check(check_frozen_dtype, self.frozen_dtype, "FSDP2Config.frozen_dtype")
        errors.check(check_choice, self.quantised_weights, QUANTISED_WEIGHTS, "FSDP2Config.quantised_weights")
        errors.check(check_bool, self.cpu_offload, "FSDP2Config.cpu_offload")
        errors.check(_check_module_list, self.activation_checkpointing, "FSDP2Config.activation_checkpointing", True)
        errors.check(self._validate_ignored_modules)
        errors.check(check_compile, self.compile, "FSDP2Config.compile")
        errors.check(_check_nonneg_int, self.forward_prefetch, "FSDP2Config.forward_prefetch")
        errors.check(_check_nonneg_int, self.backward_prefetch, "FSDP2Config.backward_prefetch")
        self.module_overrides = errors.check(self._validated_overrides, self.module_overrides, keep={})
        errors.check(check_choice, self.accumulation, ACCUMULATION_MODES, "FSDP2Config.accumulation")
        return strategy

    def _validate_ignored_modules(self) -> None:
        value = self.ignored_modules
        if value is None:
            return
        items = [value] if isinstance(value, (str, type, nn.Module)) else value
        if not isinstance(items, (list, tuple, set, frozenset)) or not all(
            isinstance(v, (str, nn.Module)) or (isinstance(v, type) and issubclass(v, nn.Module)) for v in items
        ):
            raise ValueError(
                f"FSDP2Config.ignored_modules={value!r} is invalid; use module classes, class names or module instances."
            )

    @staticmethod
    def _validated_overrides(overrides: Any) -> dict[str, ModuleOverride]:
        if overrides is None:
            return {}
        if not isinstance(overrides, Mapping):
            raise ValueError(
                "FSDP2Config.module_overrides must map a glob on module names to a partial config, "
                "e.g. {'layers.1': {'sharding_strategy': 'HYBRID_SHARD'}}."
            )
        allowed = {f.name for f in dataclasses.fields(ModuleOverride)}
        result: dict[str, ModuleOverride] = {}
        for pattern, spec in overrides.items():
            if isinstance(spec, ModuleOverride):
                override = spec
            elif isinstance(spec, Mapping):
                unknown = set(spec) - allowed
                if unknown:
                    raise ValueError(
                        f"FSDP2Config.module_overrides[{pattern!r}] has unknown keys {sorted(unknown)}; "
                        f"accepted keys: {sorted(allowed)}."
                    )
                override = ModuleOverride(**spec)
            else:
                raise ValueError(
                    f"FSDP2Config.module_overrides[{pattern!r}]={spec!r} is invalid; use a dict with keys {sorted(allowed)}."
                )
            override.validate(pattern)
            result[str(pattern)] = override
        return result


@_names_unknown_fields
@dataclass
class FSDP2Config(StepOptions, ChoiceOptions, CheckpointOptions, HostOptions, ShardingOptions):
    """How `shard_model` applies FSDP2 to a model; every field is optional.

    One flat set of fields (keywords, `from_dict`, `from_yaml`, the adapters' keywords), composed of
    sections by owner: `ShardingOptions` (the core's sharding), `HostOptions` (the CPU runtime),
    `CheckpointOptions` (the adapters' checkpoints), `ChoiceOptions` (how "auto" is chosen) and
    `StepOptions` (the training step's loss).
    """

    def __post_init__(self) -> None:
        # Every field is checked before raising: one error lists all the bad ones.
        errors = FieldErrors("FSDP2Config")
        strategy = self._check_sharding(errors)
        self._check_choice(errors, strategy)
        self._check_host(errors)
        self._check_checkpoint(errors)
        self._check_step(errors)
        errors.raise_if_any()
        check_tensor_parallel(self)  # reads several fields: only once they are all valid
        check_context_parallel(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> FSDP2Config:
        """Build a config from a mapping; unknown keys raise `ValueError` listing the valid ones
        (with the known keys' bad values, if any)."""
        return cls(**{str(k): v for k, v in values.items()})

    @classmethod
    def from_yaml(cls, path: str | Path) -> FSDP2Config:
        """Read a YAML file holding a mapping of field names (optionally under a `fsdp2:` key)."""
        return cls.from_dict(cls.yaml_fields(path))

    @staticmethod
    def yaml_fields(path: str | Path) -> dict[str, Any]:
        """The fields a YAML file sets, as `from_yaml` reads them (not yet validated)."""
        if not Path(path).is_file():
            raise FileNotFoundError(
                f"FSDP2Config YAML file {path} does not exist; pass the path of a YAML mapping "
                "of FSDP2Config fields (or a dict / an FSDP2Config)."
            )
        try:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        except yaml.YAMLError as exc:
            raise ValueError(f"{path} is not valid YAML; fix the file:\n{exc}") from None
        if isinstance(data, Mapping) and set(data) == {"fsdp2"}:
            data = data["fsdp2"]
        if not isinstance(data, Mapping):
            raise ValueError(f"{path}: expected a mapping of FSDP2Config fields, got {type(data).__name__}.")
        if isinstance(data.get("mesh_shape"), list):
            data = {**data, "mesh_shape": tuple(data["mesh_shape"])}
        return dict(data)

    @classmethod
    def coerce(cls, config: FSDP2Config | Mapping[str, Any] | str | Path | None, **overrides: Any) -> FSDP2Config:
        """Accept a config, a dict, a YAML path or None, with keyword overrides on top."""
        if config is None:
            base: dict[str, Any] = {}
        elif isinstance(config, FSDP2Config):
            base = {f.name: getattr(config, f.name) for f in dataclasses.fields(cls)}
        elif isinstance(config, Mapping):
            base = dict(config)
        elif isinstance(config, (str, Path)):
            return cls.coerce(cls.from_yaml(config), **overrides)
        else:
            raise ValueError(f"config must be an FSDP2Config, a dict or a YAML path, got {type(config).__name__}.")
        base.update(overrides)
        return cls.from_dict(base)
