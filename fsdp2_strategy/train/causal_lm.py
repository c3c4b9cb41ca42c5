"""`FSDP2Config.chunked_loss`: a Hugging Face causal LM computes its training loss in chunks.

A causal LM given `labels` builds the logits of every position (tokens x vocabulary, kept for
backward) and takes their cross-entropy. With the chunked loss installed, a training forward
(`model.train()`, gradients enabled, `labels=` passed) hands the output layer a zero-length slice
of the hidden states instead and computes the loss from the whole hidden states with
`chunked_causal_lm_loss`, inside the output layer's call, so FSDP has its weight gathered
(and reduces its gradient) as for any forward. Everything else about the forward is the model's
own: masks, positions, caches, extra inputs. The output's `loss` is the chunked loss, and its
`logits` a `LogitsNotBuilt` that raises an error naming the switch when used. Evaluation, forwards
without labels and generation run the model's forward unchanged.

The model's class and instance stay untouched but for two hooks on the output layer and an instance
`forward` (as torch's `register_fsdp_forward_method` sets one). `shard_model` installs it on the
model it shards, and the memory planner on its meta-device copy, so that the estimate counts the
loss the step will run.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from .chunked_loss import IGNORE_INDEX, chunked_causal_lm_loss

SCALED_LOGITS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")
"""Config attributes of models whose logits are changed after the output layer (softcapping,
scaling): the chunked loss does not reproduce them, so such models keep their own loss."""

_NOT_BUILT = (
    "The logits were not built: FSDP2Config(chunked_loss=...) computes a causal LM's training loss "
    "(model.train(), labels= passed) in chunks without them, and outputs.loss holds it. To read the logits "
    "in training, pass chunked_loss=False (they then take tokens x vocabulary memory), or run the forward "
    "without labels= and compute the loss yourself."
)


class LogitsNotBuiltError(AttributeError):
    """Raised when a training step uses `outputs.logits` of a causal LM whose loss was computed in
    chunks (`FSDP2Config.chunked_loss`), which never built them. The message names the fix:
    `chunked_loss=False`, or a forward without `labels=`. An `AttributeError`, so that code probing
    the outputs (`hasattr(outputs.logits, "dtype")`) reads "no" instead of failing."""


class LogitsNotBuilt:
    """Stands in `outputs.logits` for the logits the chunked loss never built; any use raises
    `LogitsNotBuiltError`, whose message says how to get them."""

    def __getattr__(self, name: str) -> Any:
        raise LogitsNotBuiltError(_NOT_BUILT)

    def __getitem__(self, key: Any) -> Any:
        raise LogitsNotBuiltError(_NOT_BUILT)

    def __repr__(self) -> str:
        return "LogitsNotBuilt(see FSDP2Config.chunked_loss)"


@dataclass
class _Pending:
    """One training forward's labels, and the hidden states and loss the output layer's hooks take."""

    labels: Tensor
    shift_labels: Tensor | None
    num_items_in_batch: Any
    ignore_index: int
    hidden: Tensor | None = None
    loss: Tensor | None = None


class ChunkedLoss:
    """The hooks and the instance `forward` that make `model` compute its training loss in chunks."""

    def __init__(self, model: nn.Module, head: nn.Linear):
        self.model, self.head = model, head
        self.pending: _Pending | None = None
        # After FSDP's pre-forward hook (it prepends): the hidden states arrive cast and hooked for
        # FSDP's post-backward. Before FSDP's post-forward hook (prepended here), which may reshard.
        head.register_forward_pre_hook(self._take_hidden_states)
        head.register_forward_hook(self._compute_loss, prepend=True)
        original = model.forward
        model.forward = functools.wraps(original)(functools.partial(self._forward, original))

    def _forward(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        labels = kwargs.get("labels")
        if labels is None or not self.model.training or not torch.is_grad_enabled() or kwargs.get("fused_lm_head"):
            return original(*args, **kwargs)  # evaluation, generation, TRL's own fused head: the model's path
        kwargs = dict(kwargs)
        del kwargs["labels"]
        self.pending = _Pending(
            labels,
            kwargs.get("shift_labels"),
            kwargs.get("num_items_in_batch"),
            kwargs.get("ignore_index", IGNORE_INDEX),
        )
        try:
            outputs = original(*args, **kwargs)
            loss = self.pending.loss
        finally:
            self.pending = None
        if loss is None:
            raise RuntimeError(
                f"FSDP2Config.chunked_loss: {_class_name(self.model)}'s forward did not call its output layer "
                f"({type(self.head).__name__}); pass chunked_loss=False for this model."
            )
        return _with_loss(outputs, loss)

    def _take_hidden_states(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        pending = self.pending
        if pending is None or pending.hidden is not None or not args:
            return None
        pending.hidden = args[0]
        return (args[0][..., :0, :], *args[1:])  # the layer projects nothing: the loss is computed below

    def _compute_loss(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        pending = self.pending
        if pending is None or pending.hidden is None or pending.loss is not None:
            return
        pending.loss = chunked_causal_lm_loss(
            pending.hidden,
            self.head.weight,  # gathered: FSDP's pre-forward ran, its post-forward has not
            pending.labels.to(pending.hidden.device),
            bias=self.head.bias,
            shift_labels=pending.shift_labels,
            num_items_in_batch=pending.num_items_in_batch,
            ignore_index=pending.ignore_index,
        )


_INSTALLED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""The causal LMs that have the chunked loss installed."""


def _with_loss(outputs: Any, loss: Tensor) -> Any:
    """The model's outputs with `loss` set and the logits replaced by `LogitsNotBuilt`."""
    if isinstance(outputs, tuple):  # return_dict=False: (logits, ...) without a loss
        return (loss, LogitsNotBuilt(), *outputs[1:])
    fields = {**dict(outputs.items()), "loss": loss, "logits": LogitsNotBuilt()}
    return type(outputs)(**fields)  # rebuilt, so `loss` comes first as in the model's own output


def causal_lms(model: nn.Module) -> list[nn.Module]:
    """The outermost Hugging Face causal LMs (`*ForCausalLM` classes) in `model`, itself included: a
    PEFT model's base, the model a LightningModule holds."""
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if any(outer == "" or name.startswith(f"{outer}.") for outer in found):
            continue  # inside a causal LM found already
        if _class_name(module).endswith("ForCausalLM") and any(
            c.__name__ == "PreTrainedModel" for c in type(module).__mro__
        ):
            found[name] = module
    return list(found.values())


def chunked_loss_head(target: nn.Module) -> nn.Linear | str:
    """The output layer of the causal LM `target` if the chunked loss gives its own numbers; else why
    not (a sentence naming what is in the way)."""
    name = _class_name(target)
    if getattr(target, "loss_type", None) not in (None, "ForCausalLM") or _custom_loss_function(target):
        return f"{name} computes its own loss (loss_type={getattr(target, 'loss_type', None)!r})"
    config: Any = getattr(target, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    scaled = [attr for attr in SCALED_LOGITS if getattr(config, attr, None) not in (None, 1, 1.0)]
    if scaled:
        return f"{name} changes its logits after the output layer ({', '.join(scaled)})"
    get_head = getattr(target, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        kind = type(head).__name__ if head is not None else "none"
        return f"{name}'s output layer is not a plain nn.Linear ({kind}: e.g. adapted by PEFT or quantised)"
    return head


def _class_name(module: nn.Module) -> str:
    """The user's class name (not FSDP's `FSDP<name>` subclass)."""
    return next(c.__name__ for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def _custom_loss_function(model: nn.Module) -> bool:
    """Whether `model.loss_function` was set or overridden (not transformers' own property)."""
    if getattr(model, "_loss_function", None) is not None:
        return True
    definer = next((c for c in type(model).__mro__ if "loss_function" in c.__dict__), None)
    return definer is not None and definer.__name__ != "PreTrainedModel"


def install_chunked_loss(model: nn.Module, setting: bool | str, tensor_parallel: bool) -> str:
    """Install the chunked loss on `model` per `FSDP2Config.chunked_loss`; returns what was chosen, as
    the sharding plan shows it.

    Raises:
        ValueError: `setting` is True and the chunked loss does not apply to `model` (the reason named).
    """
    if setting is False:
        return "the model's own (chunked_loss=False)"
    targets = causal_lms(model)
    heads = [chunked_loss_head(target) for target in targets]
    reasons = [head for head in heads if isinstance(head, str)]
    if not targets:
        reasons = [f"{_class_name(model)} holds no Hugging Face causal LM (a *ForCausalLM class)"]
    elif tensor_parallel:
        reasons = ["its output layer may be split by tensor parallelism"]
    if reasons:
        if setting is True:
            raise ValueError(f"FSDP2Config.chunked_loss=True: {reasons[0]}; use chunked_loss='auto' or False.")
        return f"the model's own: {reasons[0]}"
    for target, head in zip(targets, heads):
        if target not in _INSTALLED:  # once per model, however often it is sharded or planned
            ChunkedLoss(target, cast(nn.Linear, head))
            _INSTALLED.add(target)
    return "chunked cross-entropy in training (the full logits are not built; FSDP2Config.chunked_loss)"
