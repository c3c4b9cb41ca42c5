"""The settings of `FSDP2Config` that belong to an owner other than sharding, one section each.

Users write one flat config (keywords, a dict, a YAML file, an adapter's keywords); `FSDP2Config`
is composed of these sections and the sharding one (`config.ShardingOptions`), so each owner's
settings, their documentation and their checks live together, and code that needs one section can
say so in its signature:

- `HostOptions`: how the CPU runtime runs collectives and keeps host memory (`shard.ring_comms`,
  `shard.host_memory`);
- `CheckpointOptions`: what the adapters' sharded checkpoints store and how they are written
  (`f2.Checkpointer` takes the same choices as arguments);
- `ChoiceOptions`: how `sharding_strategy="auto"` is chosen (the memory planner or the tuner);
- `StepOptions`: how the training step computes what the model does not decide (its loss).

Each section's `_check_*` method adds its fields' errors to the config's one `FieldErrors`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config_checks import (
    FieldErrors,
    check_async_save,
    check_bool,
    check_choice,
    check_objective,
    check_trainable_only,
    parse_bytes,
)

COLLECTIVES = ("auto", "ring", "torch")
"""Accepted values for `FSDP2Config.collectives` (see `shard.ring_comms`)."""

HOST_ALLOCATORS = ("auto", "cache", "system")
"""Accepted values for `FSDP2Config.host_allocator` (see `shard.host_memory`)."""

OBJECTIVES = ("memory", "throughput")
"""Accepted values for `FSDP2Config.objective`."""


@dataclass
class HostOptions:
    """How the CPU runtime runs FSDP's collectives and keeps host memory."""

    collectives: str = "auto"
    """How FSDP's all-gather and reduce-scatter run:

    - "auto" (default): as point-to-point rings (`ring_comms`) on groups whose process group is
      gloo (CPU), torch's collectives elsewhere (NCCL and other accelerator backends).
    - "ring": the rings on every sharded group, whatever the backend.
    - "torch": torch's collectives everywhere.

    Why: gloo has no reduce-scatter (it all-reduces a copy of the whole input) and its all-gather
    is slower than an all-reduce; the rings send the least bytes through `isend`/`irecv`, and on
    CPU they are faster than gloo's collectives (`benchmarks/ring_collectives.py`). Results equal
    torch's (bitwise on 2 ranks; on more, the sum runs in another order)."""

    host_allocator: str = "auto"
    """Whether glibc's malloc keeps freed host memory for reuse (`host_memory`), process-wide:

    - "auto" (default): yes when the mesh is on CPU and the C library is glibc; else untouched.
    - "cache": yes, whatever the device (an error where the C library is not glibc).
    - "system": leave malloc's settings as they are.

    Why: every step FSDP frees and re-allocates its gathered parameters and gradient buffers, and
    glibc's defaults give them back to the OS and page-fault them in again every step, which DDP,
    keeping its buffers, does not pay. The cost: resident memory stays at its high-water mark;
    tensor memory is unchanged."""

    def _check_host(self, errors: FieldErrors) -> None:
        errors.check(check_choice, self.collectives, COLLECTIVES, "FSDP2Config.collectives")
        errors.check(check_choice, self.host_allocator, HOST_ALLOCATORS, "FSDP2Config.host_allocator")


@dataclass
class CheckpointOptions:
    """What the adapters' sharded checkpoints store and how they are written."""

    checkpoint_trainable_only: bool | str = "auto"
    """What the adapters' sharded checkpoints (Lightning's `save_checkpoint`, Fabric's `save`,
    Accelerate's `save_state`) store of a model: True: only what training changes (parameters
    that require gradients, buffers, optimizer state) plus a fingerprint of the frozen parameters,
    checked on load; False: everything; "auto" (default): True for PEFT models, so a LoRA
    checkpoint is adapter-sized. `f2.Checkpointer(trainable_only=...)` is the core's switch."""

    checkpoint_async_save: bool | str = False
    """How the adapters' sharded checkpoints are written: False (default: before the save returns),
    True (a copy in CPU memory, then written in the background) or "overlap" (the copy too runs
    behind the next forward and backward; the next optimizer step waits for it). Each save is
    committed before the next save or load and when training ends. `f2.Checkpointer(async_save=...)`
    is the core's switch; its docstring says which mode to use when."""

    checkpoint_on_preemption: bool = False
    """On SIGTERM (Kubernetes, SLURM, spot instances), save a checkpoint after the current step and
    stop: Lightning's Trainer writes `hpc_ckpt_<N>.ckpt` (resume with `ckpt_path="hpc"`) and exits
    with 143; Accelerate sets `accelerator.set_trigger()` for the loop's `check_trigger()`; the
    Hugging Face Trainer saves and stops. `f2.Checkpointer(save_on_preemption=True)` is the core's."""

    def _check_checkpoint(self, errors: FieldErrors) -> None:
        errors.check(check_trainable_only, self.checkpoint_trainable_only, "FSDP2Config.checkpoint_trainable_only")
        errors.check(check_async_save, self.checkpoint_async_save, "FSDP2Config.checkpoint_async_save")
        errors.check(check_bool, self.checkpoint_on_preemption, "FSDP2Config.checkpoint_on_preemption")


@dataclass
class StepOptions:
    """How the training step computes what the model itself does not decide."""

    chunked_loss: bool | str = "auto"
    """How a Hugging Face causal LM (a `*ForCausalLM`, or a PEFT model of one) computes its loss in
    a training forward (`model.train()`, gradients enabled, `labels=` passed):

    - "auto" (default): in chunks of tokens (`f2.chunked_causal_lm_loss`), never building the
      tokens x vocabulary logits, where that gives the model's own numbers: its output layer is a
      plain `nn.Linear`, its loss the standard causal-LM cross-entropy, its logits neither capped
      nor scaled, no tensor parallelism. Elsewhere the model's own loss; the sharding plan says which.
    - True: the chunked loss, or an error naming what is in the way.
    - False: the model's own loss (the full logits, e.g. to read `outputs.logits` in training).

    Why: the logits of 8,192 tokens x a 32,000-token vocabulary take 1 GiB in fp32 (4 GiB at Llama
    3's 128,256), kept until backward; the chunked loss keeps one chunk's. In training the output's
    `logits` is then a `LogitsNotBuilt`, which raises an error naming this switch when used;
    evaluation, forwards without labels and generation are unchanged."""

    def _check_step(self, errors: FieldErrors) -> None:
        errors.check(_check_chunked_loss, self.chunked_loss)


def _check_chunked_loss(value: Any) -> None:
    if not (isinstance(value, bool) or value == "auto"):
        raise ValueError(f"FSDP2Config.chunked_loss={value!r} is invalid; use 'auto', True or False.")


@dataclass
class ChoiceOptions:
    """How `sharding_strategy="auto"` is resolved: the memory budget and what to optimise."""

    memory_budget: Any = None
    """Bytes per rank that `sharding_strategy="auto"` must fit (an int, or text like "80GiB").
    None: the accelerator's total memory, or on CPU the available RAM divided by the local ranks,
    minus `estimate.compare.BUDGET_MARGIN` (10%)."""

    objective: str = "memory"
    """How `sharding_strategy="auto"` chooses among the settings that fit `memory_budget`: "memory"
    (default: the least communication, from shapes alone) or "throughput" (`f2.tune` measures each
    fitting setting on the process group with the example batch `shard_model` is given and picks
    the fastest; strategy, wrapping, reshard and accumulation mode may change; the decision is
    cached in a JSON file, `fsdp2_strategy.tuning.cache_path()`, so a restarted run does not re-tune)."""

    def _check_choice(self, errors: FieldErrors, strategy: str | None) -> None:
        """`strategy`: the checked `sharding_strategy` (None when it was invalid)."""
        self.memory_budget = errors.check(parse_bytes, self.memory_budget, "FSDP2Config.memory_budget")
        if strategy is not None:
            errors.check(check_objective, self.objective, strategy, OBJECTIVES)
