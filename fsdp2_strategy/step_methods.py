"""Entry points other than `forward` into a sharded root: a trainer's step methods.

A trainer calls `training_step(batch, ...)` on the root module, not `forward`, so FSDP must
gather the root's parameters around that method too. torch's `register_fsdp_forward_method`
does so, but it also applies the mixed-precision policy's `cast_forward_inputs` to the
method's arguments, and for a step method those are the whole batch, targets included:
under a bf16 policy, float regression targets were rounded to bf16 before the loss saw
them. `register_step_method` gathers without touching
the arguments; inputs are still cast where they enter the model (`module(x)` and every
wrapped block), as FSDP2 does for any forward.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

from .distributed import log_rank_zero

# torch-private names this relies on (the same ones `register_fsdp_forward_method` calls).
_PRIVATE = ("_get_fsdp_state", "_pre_forward", "_post_forward")
_warned = False
# The arguments handed to FSDP's pre/post-forward instead of the step's own: one placeholder,
# because torch 2.11's root pre-forward on an accelerator indexes what moving the arguments
# to the device returns, which is empty for no arguments (IndexError; 2.13 guards it).
_PLACEHOLDER_ARGS = (None,)


def _private_api_present(module: FSDPModule) -> bool:
    state = getattr(module, "_get_fsdp_state", None)
    return callable(state) and all(callable(getattr(state(), name, None)) for name in _PRIVATE[1:])


def register_step_method(module: nn.Module, method_name: str) -> None:
    """Make `module.<method_name>()` gather and free the root's parameters like `forward`,
    passing its arguments through unchanged. A no-op for a module that is not sharded.

    If this torch lacks the private FSDP state methods used here, torch's
    `register_fsdp_forward_method` is used instead and a warning says that the step
    method's floating-point arguments will be cast to the compute dtype.
    """
    if not isinstance(module, FSDPModule):
        return
    global _warned
    if not _private_api_present(module):
        if not _warned:
            _warned = True
            log_rank_zero("This torch lacks FSDPState._pre_forward/_post_forward: %s() is registered with "
                          "register_fsdp_forward_method, which casts its floating-point arguments (targets too) to "
                          "the mixed-precision compute dtype.", method_name, level=30)
        register_fsdp_forward_method(module, method_name)
        return
    original = getattr(module, method_name)

    @functools.wraps(original)
    def gathered(self, *args, **kwargs):
        state = self._get_fsdp_state()
        state._pre_forward(self, _PLACEHOLDER_ARGS, {})  # not the step's arguments: nothing cast or moved
        return state._post_forward(self, _PLACEHOLDER_ARGS, original(*args, **kwargs))

    setattr(module, method_name, gathered.__get__(module, type(module)))
