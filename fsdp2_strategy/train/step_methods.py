"""Entry points other than `forward` into a sharded root: a trainer's step methods.

A trainer calls `training_step(batch, ...)` on the root module, not `forward`, so FSDP must
gather the root's parameters around that method too. torch's `register_fsdp_forward_method`
does so, but it also applies the mixed-precision policy's `cast_forward_inputs` to the
method's arguments, and for a step method those are the whole batch, targets included:
under a bf16 policy, float regression targets would be rounded to bf16 before the loss saw
them. `register_step_method` gathers without touching
the arguments; inputs are still cast where they enter the model (`module(x)` and every
wrapped block), as FSDP2 does for any forward.
"""

from __future__ import annotations

import functools
import types

from torch import nn
from torch.distributed.fsdp import FSDPModule

from .. import _torch_compat as tc

# The arguments handed to FSDP's pre/post-forward instead of the step's own: one placeholder,
# because torch 2.11's root pre-forward on an accelerator indexes what moving the arguments
# to the device returns, which is empty for no arguments (IndexError; 2.13 guards it).
_PLACEHOLDER_ARGS = (None,)


def register_step_method(module: nn.Module, method_name: str) -> None:
    """Make `module.<method_name>()` gather and free the root's parameters like `forward`,
    passing its arguments through unchanged. A no-op for a module that is not sharded.
    """
    if not isinstance(module, FSDPModule):
        return
    original = getattr(module, method_name)

    @functools.wraps(original)
    def gathered(self, *args, **kwargs):
        tc.pre_forward(self, _PLACEHOLDER_ARGS, {})  # not the step's arguments: nothing cast or moved
        return tc.post_forward(self, _PLACEHOLDER_ARGS, original(*args, **kwargs))

    setattr(module, method_name, types.MethodType(gathered, module))
