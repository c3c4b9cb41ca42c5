"""`FSDP2TrainerMixin`: a `transformers.Trainer` (or TRL trainer) whose accelerator is `FSDP2Accelerator`."""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any, TypeVar

import torch
import transformers
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin

import fsdp2_strategy as f2
from fsdp2_strategy.checkpoint import is_checkpointer_step, load_into, peft_models, resume_counters, step_extra
from fsdp2_strategy.distributed import log_rank_zero

from ..accelerate import FSDP2Accelerator, FSDP2Plugin
from . import _compat as compat
from . import checkpoint, rl
from .context_parallel import context_parallel_inputs, cp_size, token_count

__all__ = ["FSDP2Trainer", "FSDP2TrainerMixin", "fsdp2_trainer"]

T = TypeVar("T", bound=type)

_ENGINE_ARGS = {
    "deepspeed": "DeepSpeed is another engine; move the file to FSDP2Trainer(deepspeed=...), which translates it "
    "into FSDP2 settings, and drop TrainingArguments(deepspeed=...)",
    "fsdp": "the FSDP settings come from the accelerate config file (fsdp_config: with fsdp_version: 2) or "
    "FSDP2Trainer(fsdp_plugin=FSDP2Plugin(...)); drop TrainingArguments(fsdp=..., fsdp_config=...)",
    "save_only_model": "FSDP2Trainer checkpoints are the whole training state (committed DCP directories); "
    "drop save_only_model and call trainer.save_model() for weights alone",
    "auto_find_batch_size": "a sharded model is not re-sharded for a new batch size; set the batch size and drop "
    "auto_find_batch_size",
}


class _SaveOnPreemption(transformers.TrainerCallback):
    """`checkpoint_on_preemption`: after each optimizer step, Accelerate's trigger (set by SIGTERM on any
    process, `FSDP2Accelerator.check_trigger`) makes the Trainer save that step and stop training."""

    def __init__(self, accelerator: FSDP2Accelerator) -> None:
        self.accelerator, self.stopped = accelerator, False

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.accelerator.check_trigger():  # collective: every process runs callbacks
            self.stopped = control.should_save = control.should_training_stop = True


def _refuse_other_engines(args: Any) -> None:
    """ValueError naming each TrainingArguments option FSDP2Trainer cannot honour, and the fix."""
    refused = [f"{name}: {why}" for name, why in _ENGINE_ARGS.items() if getattr(args, name, None)]
    if refused:
        raise ValueError("FSDP2Trainer cannot run with TrainingArguments " + "; ".join(refused) + ".")


def _check_deepspeed_agrees(translation: Any, args: Any, world_size: int) -> None:
    """ValueError listing each DeepSpeed value (not "auto") that differs from `TrainingArguments`' own."""
    hf = {
        "max_grad_norm": args.max_grad_norm,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "train_batch_size": args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size,
    }
    differ = [
        f"DeepSpeed {translation.source_key(name)}={value} vs TrainingArguments {name}={hf[name]}"
        for name, value in translation.trainer.items()
        if name in hf and value != hf[name]
    ]
    stated, hf_precision = translation.precision, "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
    if stated is not None and stated != hf_precision:
        ds = f"{stated}.enabled=true" if stated != "no" else "bf16/fp16 disabled (fp32)"
        differ.append(f"DeepSpeed {ds} vs TrainingArguments bf16={args.bf16}, fp16={args.fp16}")
    if differ:
        raise ValueError(
            "The DeepSpeed config given as FSDP2Trainer(deepspeed=...) disagrees with TrainingArguments: "
            + "; ".join(differ)
            + '. Set those DeepSpeed values to "auto" (TrainingArguments decide) or make them equal.'
        )


def _launched_world_size() -> int:
    value = os.environ.get("WORLD_SIZE", "1")
    return int(value) if value.isdigit() else 1


class FSDP2TrainerMixin:
    """Put before a `transformers.Trainer` subclass: `class MySFT(FSDP2TrainerMixin, SFTTrainer)`.

    The Trainer then builds `FSDP2Accelerator` (with `FSDP2Plugin()`, which reads the FSDP config that
    `accelerate launch --config_file` sets, unless `fsdp_plugin=` is given) instead of the stock
    `Accelerator`, and its checkpoints are the accelerator's committed, checksummed `save_state`
    directories. Every other argument and method is the Trainer's.

    Args:
        *args: the Trainer's own positional arguments.
        **kwargs: the Trainer's own keyword arguments.
        fsdp_plugin: an `FSDP2Plugin` (settings the accelerate config cannot carry); default `FSDP2Plugin()`.
        deepspeed: the DeepSpeed config (a JSON path or a dict) a run used as `TrainingArguments(deepspeed=...)`:
            translated by `f2.translate_deepspeed` into the plugin's `FSDP2Config` (ZeRO stage, offload,
            precision; keys without an equivalent are warned about once). Its values that are not
            "auto" for the batch size, accumulation, clipping and precision must equal
            `TrainingArguments`', as the stock DeepSpeed integration requires. Not with `fsdp_plugin`.
        log_throughput: add `tokens_per_s`, `step_time_s`, `mfu` and `peak_memory_gib` (this rank's,
            of the last optimizer step) to the Trainer's training logs (every `logging_steps`, to
            every `report_to` integration). Default False: off (it synchronises the device each step).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        if transformers.Trainer in mro and mro.index(transformers.Trainer) < mro.index(FSDP2TrainerMixin):
            raise TypeError(
                f"{cls.__name__}: FSDP2TrainerMixin must come before the Trainer class in the bases "
                f"(class {cls.__name__}(FSDP2TrainerMixin, <Trainer>)), or the stock methods win."
            )

    def __init__(
        self,
        *args: Any,
        fsdp_plugin: FSDP2Plugin | None = None,
        deepspeed: str | os.PathLike | dict | None = None,
        log_throughput: bool = False,
        **kwargs: Any,
    ) -> None:
        if not isinstance(self, transformers.Trainer):
            raise TypeError(
                f"FSDP2TrainerMixin is a mixin for transformers.Trainer subclasses; {type(self).__name__} is not "
                "one. Use FSDP2Trainer, or fsdp2_trainer(YourTrainerClass)."
            )
        if fsdp_plugin is not None and not isinstance(fsdp_plugin, FSDP2Plugin):
            raise TypeError(f"fsdp_plugin must be an FSDP2Plugin, got {type(fsdp_plugin).__name__}.")
        if deepspeed is not None and fsdp_plugin is not None:
            raise ValueError(
                "FSDP2Trainer got both fsdp_plugin= and deepspeed=; give one (deepspeed= becomes the plugin's config)."
            )
        self._fsdp2_plugin = fsdp_plugin
        self._deepspeed = (
            None if deepspeed is None else f2.translate_deepspeed(deepspeed, world_size=_launched_world_size())
        )
        self._log_throughput = log_throughput
        super().__init__(*args, **kwargs)
        self._preemption = _SaveOnPreemption(self.accelerator)
        if self.accelerator.fsdp2_config.checkpoint_on_preemption:
            self.add_callback(self._preemption)

    # ------------------------------------------------------------------ TRL's RL trainers
    # Properties, because TRL assigns both in its __init__ after the accelerator exists: what it
    # assigns is adapted on the way in (rl.py says why).
    @property
    def _dist(self) -> Any:
        return self.__dict__.get("_f2_dist")

    @_dist.setter
    def _dist(self, backend: Any) -> None:
        self.__dict__["_f2_dist"] = rl.GatheringBackend(backend)

    @property
    def ref_model(self) -> Any:
        """TRL's reference (or teacher) model: sharded for forward only when TRL sets it."""
        return self.__dict__.get("_f2_ref_model")

    @ref_model.setter
    def ref_model(self, model: Any) -> None:
        # precompute_ref_log_probs: DPOTrainer hashes the reference's parameters first, which DTensors refuse.
        if getattr(self, "accelerator", None) is not None and not getattr(self.args, "precompute_ref_log_probs", False):
            model = rl.shard_reference(model, self.accelerator.fsdp2_config, self.accelerator.state.device_mesh)
        self.__dict__["_f2_ref_model"] = model

    @property
    def preempted(self) -> bool:
        """Whether the last `train()` stopped because a process received SIGTERM (with
        `checkpoint_on_preemption`; the step it stopped at is a committed checkpoint): end the script
        with `sys.exit(f2.PREEMPTION_EXIT_CODE)` then, so the scheduler restarts it."""
        return self._preemption.stopped

    # ------------------------------------------------------------------ the accelerator
    def create_accelerator_and_postprocess(self) -> None:
        """Build `FSDP2Accelerator` from the Trainer's arguments (the stock method builds `Accelerator`)."""
        args = self.args
        _refuse_other_engines(args)
        _ = args.device  # TrainingArguments sets Accelerate's process state up now, once (it resets it first)
        if _launched_world_size() > 1 and args.world_size != _launched_world_size():
            # No GPU and no `use_cpu`: Accelerate decided every rank trains alone. Drop that state;
            # FSDP2Accelerator starts the gloo group and the state the launch asked for.
            compat.reset_accelerate_state()
        plugin = self._fsdp2_plugin
        if self._deepspeed is not None:
            _check_deepspeed_agrees(self._deepspeed, args, _launched_world_size())
            plugin = FSDP2Plugin(config=self._deepspeed.config)
        self.accelerator = FSDP2Accelerator(
            fsdp_plugin=plugin or FSDP2Plugin(),
            # Every step: the Trainer's logs carry the latest report (its own cadence is logging_steps).
            log_throughput_every=1 if self._log_throughput else None,
            **self._fsdp2_accelerator_args(),
        )
        self.gather_function = self.accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(self.gather_function).parameters:
            self.gather_function = functools.partial(
                self.gather_function, use_gather_object=args.eval_use_gather_object
            )
        self.is_deepspeed_enabled = False
        self.is_fsdp_enabled = True  # the Trainer's FSDP paths: optimizer after prepare, model reference updates
        if self.accelerator.fsdp_plugin.activation_checkpointing and args.activation_checkpointing:
            raise ValueError(
                "The accelerate config's fsdp_activation_checkpointing and TrainingArguments(activation_checkpointing="
                "True) are both set; keep one (fsdp_activation_checkpointing checkpoints each FSDP2-wrapped block)."
            )
        log_rank_zero(
            "FSDP2Trainer: %d process(es), global batch %d (per device %d x accumulation %d)",
            self.accelerator.num_processes,
            args.per_device_train_batch_size * self.accelerator.num_processes * args.gradient_accumulation_steps,
            args.per_device_train_batch_size,
            args.gradient_accumulation_steps,
        )

    def _fsdp2_accelerator_args(self) -> dict[str, Any]:
        """The stock method's `Accelerator` arguments: data-loader config, accumulation handled by the Trainer."""
        args = self.args
        grad_acc_kwargs = dict(args.accelerator_config.gradient_accumulation_kwargs or {})
        if "num_steps" in grad_acc_kwargs:
            if args.gradient_accumulation_steps > 1:
                raise ValueError(
                    "AcceleratorConfig's gradient_accumulation_kwargs sets num_steps and TrainingArguments sets "
                    "gradient_accumulation_steps > 1; set one of them."
                )
            args.gradient_accumulation_steps = grad_acc_kwargs["num_steps"]
        grad_acc_kwargs["num_steps"] = 1  # the Trainer accumulates itself
        config = args.accelerator_config.to_dict()
        dataloader_config = DataLoaderConfiguration(
            **{k: config.pop(k) for k in ("split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler")}
        )
        dataloader_config.data_seed = args.data_seed
        dataloader_config.non_blocking = config.pop("non_blocking")
        built = self._build_accelerator_args(
            dataloader_config=dataloader_config,
            gradient_accumulation_plugin=GradientAccumulationPlugin(**grad_acc_kwargs),
        )
        built.pop("deepspeed_plugin", None)  # None: refused above
        built.pop("fsdp_plugin", None)
        return built

    def get_cp_size(self) -> int:
        """The context-parallel size of the accelerator (`TrainingArguments(parallelism_config=...)`)."""
        return cp_size(self.accelerator)

    def _prepare_context_parallel_inputs(self, model: Any, inputs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The step's context-parallel split (the stock method reads Accelerate's parallelism_config)."""
        return context_parallel_inputs(self.accelerator, model, inputs)

    def _get_num_items_in_batch(self, batch_samples: list, device: Any) -> Any:
        """The stock token count, per context-parallel rank on every transformers release (`token_count`)."""
        return token_count(super()._get_num_items_in_batch(batch_samples, device), cp_size(self.accelerator))

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's `log`; training logs also get the last step's throughput (`log_throughput=True`)."""
        tracker = getattr(self.accelerator, "throughput", None)
        if tracker is not None and tracker.meter.last is not None and "loss" in logs:
            logs = {**logs, **tracker.meter.last.as_log()}
        super().log(logs, *args, **kwargs)  # type: ignore[misc]

    def _has_mixed_mesh_grads(self, model: Any) -> bool:
        # The core's clip_grad_norm_ (FSDP2Accelerator.clip_grad_norm_) spans meshes and plain tensors itself.
        return False

    # ------------------------------------------------------------------ checkpoints
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's `train`; `resume_from_checkpoint=True` resumes from the newest *committed*
        checkpoint; a path may also be a step converted from DeepSpeed or FSDP1 (`fsdp2-strategy
        convert-deepspeed` / `convert-fsdp1`), which has no `trainer_state.json`: the global step comes
        from what the converter stored, model and optimizer state are loaded after preparation."""
        self._f2_converted = None
        if resume_from_checkpoint is True:
            resume_from_checkpoint = checkpoint.latest_checkpoint(self.args.output_dir)
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)) and is_checkpointer_step(resume_from_checkpoint):
            self._f2_converted, resume_from_checkpoint = str(resume_from_checkpoint), None
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
            resume_from_checkpoint = checkpoint.check_resumable(resume_from_checkpoint)
        output = super().train(resume_from_checkpoint, *args, **kwargs)
        self.accelerator.wait_for_checkpoint()  # the last asynchronous save is committed with the run
        return output

    def _init_training_state(self, max_steps: int, steps_per_epoch: int, *args: Any, **kwargs: Any) -> Any:
        epochs, steps_in_epoch = super()._init_training_state(max_steps, steps_per_epoch, *args, **kwargs)  # type: ignore[misc]
        if getattr(self, "_f2_converted", None) is None:
            return epochs, steps_in_epoch
        # A converted step: the stock loop skips the same data as after its own checkpoint at that step.
        step, _ = resume_counters(step_extra(self._f2_converted))
        self.state.global_step = step
        skipped = 0 if self.args.ignore_data_skip else (step % steps_per_epoch) * self.args.gradient_accumulation_steps
        return step // steps_per_epoch, skipped

    def _prepare_for_training(self, *args: Any, **kwargs: Any) -> Any:
        prepared = super()._prepare_for_training(*args, **kwargs)  # type: ignore[misc]
        if getattr(self, "_f2_converted", None) is not None:
            optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # Accelerate's wrapper
            extra = load_into(self._f2_converted, self.model, optimizer)
            scheduler = extra.get("lr_scheduler") if isinstance(extra, dict) else None
            if isinstance(scheduler, dict) and self.lr_scheduler is not None:
                self.lr_scheduler.load_state_dict(scheduler)
            log_rank_zero(
                "FSDP2Trainer: resumed the converted step %s at global step %d",
                self._f2_converted,
                self.state.global_step,
            )
        return prepared

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        checkpoint.save_checkpoint(self, trial)

    def _finalize_training(self, trial: Any, *args: Any, **kwargs: Any) -> Any:
        # The stock method deletes, with save_total_limit=1, every checkpoint but the best by
        # shutil.rmtree, which a crash can stop half-way with a directory still looking committed:
        # they are pruned crash-safely first, and the stock loop finds none left.
        checkpoint.keep_only_best(self, trial)
        return super()._finalize_training(trial, *args, **kwargs)  # type: ignore[misc]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        path = checkpoint.check_resumable(resume_from_checkpoint)
        # Read as data before anything loads: a refused scheduler.pt leaves the model unchanged.
        self._f2_scheduler_state = checkpoint.read_scheduler(path)
        # Model, optimizer, accelerate's RNG and step: all prepared objects, resharded to this world size.
        self.accelerator.load_state(path)

    def _load_optimizer_and_scheduler(self, checkpoint_dir: str | None) -> None:
        # The optimizer came with load_state; the scheduler from what _load_from_checkpoint read.
        state, self._f2_scheduler_state = getattr(self, "_f2_scheduler_state", None), None
        if checkpoint_dir is None or self.lr_scheduler is None:
            return
        state = state if state is not None else checkpoint.read_scheduler(checkpoint_dir)
        if state is not None:
            self.lr_scheduler.load_state_dict(state)

    def _load_best_model(self) -> None:
        self.accelerator.wait_for_checkpoint()  # the best may be the save still being written
        checkpoint.load_model_weights(self, self.state.best_model_checkpoint)

    # ------------------------------------------------------------------ weights out
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Hugging Face weights `from_pretrained` loads (or a PEFT adapter), whatever the state-dict type.

        Collective: call it on every rank (the Trainer does). Full weights are gathered to rank 0 one
        tensor at a time; a PEFT model writes only its adapter (`adapter_model.safetensors`)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if peft_models(self.model):
            f2.save_peft_adapter(self.model, output_dir)
            if self.args.should_save:
                self._save_side_files(output_dir)
        else:
            state_dict = self.accelerator.get_state_dict(self.model)
            self._save(output_dir, state_dict=state_dict)
        self.accelerator.wait_for_everyone()
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_side_files(self, output_dir: str) -> None:
        """Rank 0: the tokenizer and the training arguments, as the stock `_save` writes beside the weights."""
        os.makedirs(output_dir, exist_ok=True)
        if self.processing_class is not None and hasattr(self.processing_class, "save_pretrained"):
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, compat.TRAINING_ARGS_NAME))


class FSDP2Trainer(FSDP2TrainerMixin, transformers.Trainer):
    """`transformers.Trainer` on the fsdp2_strategy engine: `from ... import FSDP2Trainer as Trainer`."""


def fsdp2_trainer(cls: T) -> T:
    """Make a Trainer class run on the fsdp2_strategy engine, with `FSDP2TrainerMixin` in front.

    Args:
        cls: A `transformers.Trainer` subclass, e.g. `trl.SFTTrainer`.

    Returns:
        `FSDP2<name>`, a subclass of `FSDP2TrainerMixin` and `cls` (`cls` itself when it already
        has the mixin).

    Raises:
        TypeError: If `cls` is not a `transformers.Trainer` subclass.
    """
    if not (isinstance(cls, type) and issubclass(cls, transformers.Trainer)):
        raise TypeError(f"fsdp2_trainer() takes a transformers.Trainer subclass (e.g. trl.SFTTrainer), got {cls!r}.")
    if issubclass(cls, FSDP2TrainerMixin):
        return cls
    return type(
        f"FSDP2{cls.__name__}", (FSDP2TrainerMixin, cls), {"__module__": cls.__module__, "__doc__": cls.__doc__}
    )
