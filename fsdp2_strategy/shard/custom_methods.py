"""A sharded module's own methods called as entry points (`model.score(x)`): torch's error, explained.

FSDP gathers a group's parameters in the hooks of `module(x)` only. A method of the user's class
that computes with the parameters without going through `forward` (a scoring head, an encoder
entry point) meets the shards and fails inside an op with torch's `RuntimeError: aten.addmm.default
got mixed torch.Tensor and DTensor`. Each such method of a sharded module is wrapped (an instance
attribute, the class untouched): that error becomes a ValueError naming the registration that fixes
it. Methods a library base class defines (`training_step`, `generate`, ...) are left alone: trainers
look them up and call them by their own protocols.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..groups import own_named_params

_MIXED = "mixed torch.Tensor and DTensor"
_LIBRARIES = ("torch", "transformers", "peft", "lightning", "pytorch_lightning", "accelerate", "trl", "fsdp2_strategy")

_UNREGISTERED_METHOD = (
    "{cls}.{name}() computed on the sharded parameters: FSDP gathers them only when the module is called, "
    "model(inputs). Register {name} as an entry point once, after sharding: "
    "torch.distributed.fsdp.register_fsdp_forward_method(model, {name!r}). torch's own error: {error}"
)


def guard_custom_methods(model: nn.Module) -> None:
    """Wrap the public methods of the user's classes on each sharded module of `model` that holds
    parameters, so that torch's mixed-tensor error names the registration that fixes it."""
    for module in model.modules():
        if not isinstance(module, FSDPModule) or not any(True for _ in own_named_params(module)):
            continue
        for name in _user_methods(type(module)):
            if name in module.__dict__:  # registered already, or guarded
                continue
            module.__dict__[name] = _explained(getattr(module, name), type(module).__name__, name)


def _user_methods(cls: type) -> list[str]:
    """Public functions defined by classes of `cls`'s hierarchy outside the libraries, and not by any
    library class (a user's override of a framework hook keeps the framework's protocol)."""
    library = {n for c in cls.__mro__ if _is_library(c) for n in vars(c)}
    names = {
        n
        for c in cls.__mro__
        if not _is_library(c)
        for n, v in vars(c).items()
        if inspect.isfunction(v) and not n.startswith("_")
    }
    return sorted(names - library - {"forward"})


def _is_library(cls: type) -> bool:
    return cls.__module__.split(".")[0] in _LIBRARIES or cls.__module__ == "builtins"


def _explained(method: Callable[..., Any], cls: str, name: str) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except RuntimeError as exc:
            if _MIXED not in str(exc):
                raise
            raise ValueError(_UNREGISTERED_METHOD.format(cls=cls, name=name, error=exc)) from exc

    return call
