"""Gradient accumulation modes: what the non-final micro-batches of an optimizer step skip.

`shard_model` records the `AccumulationMode` of `FSDP2Config.accumulation` in the model's
`EngineState`; `no_sync` and
`set_gradient_sync` (the public switches, at the end) call `pause_sync` before the non-final
micro-batches and `resume_sync` before the last one. Per mode (see `FSDP2Config.accumulation`):

- "sync_each": only the replicate all-reduce of HSDP is deferred (`set_requires_all_reduce`);
  the reduce-scatter runs every micro-batch, and so does the average of replicated parameters.
- "sync_last": no reduction at all until the last micro-batch (`set_requires_gradient_sync`).
- "keep_gathered": "sync_last", and every group stays unsharded from its first forward of the step
  (on CPU: from the first `pause_sync`, which gathers all groups, their all-gathers started
  together) to the last backward (`set_reshard_after_backward(False)` and no reshard after
  forward). On the last micro-batch the groups reshard after backward again, and each group's own
  reshard-after-forward choice comes back once its last forward has run, so each group is
  all-gathered once per step.

An exception inside a micro-batch calls `abandon`: sync back on, every group resharded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.distributed.fsdp import FSDPModule

from .. import _torch_compat as tc
from .accumulation_mode import DEFAULT_MODE, AccumulationMode, accumulation_mode
from .kept_gathered import KeptGroups
from .state import engine_state, recorded_state


def record_mode(model: nn.Module, mode: str | AccumulationMode) -> None:
    """Remember the accumulation mode `no_sync` follows for `model` (a name or a mode).

    Raises:
        ValueError: `mode` names no mode.
    """
    engine_state(model).accumulation = accumulation_mode(mode)


def mode_of(model: nn.Module) -> AccumulationMode:
    """The mode recorded by `shard_model` ("sync_last" for models sharded some other way)."""
    state = recorded_state(model)
    return state.accumulation if state is not None else DEFAULT_MODE


def _fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    """One module per FSDP group (the modules of a group sharded together share its state)."""
    return tc.fsdp_groups(model)


def _set_replicated_sync(model: nn.Module, enabled: bool) -> None:
    state = recorded_state(model)
    if state is not None and state.replicated is not None:
        state.replicated.requires_sync = enabled


# --------------------------------------------------------------------------- sync_last
def _gather_each_group_once(model: nn.Module) -> None:
    """Gather and free every group once before the first unsynchronised backward ("sync_last").

    torch 2.13 with a mixed-precision policy fails in the backward of a micro-batch that does
    not use some group which has never been gathered ("'FSDPParam' object has no attribute
    '_unsharded_param'"), e.g. a block first used on the last micro-batch. One unshard/reshard
    per group creates what that code path expects; it costs one all-gather of the model, once
    per model. "sync_each" never switches sync off, so it does not need it; "sync_last" and
    "keep_gathered" do (tests/core/train/test_accumulation.py: a block first used on a later micro-batch).
    """
    state = engine_state(model)
    if state.gathered_once:
        return
    for module in _fsdp_modules(model):
        module.unshard()
        module.reshard()
    state.gathered_once = True


def _kept_groups(model: nn.Module) -> KeptGroups:
    state = engine_state(model)
    if state.kept_groups is None:
        modules = _fsdp_modules(model)
        if modules:
            # The root's lazy init (normally at its first forward) decides its reshard choice;
            # run it now so the saved choices are the final ones. It is idempotent.
            tc.lazy_init(modules[0])
        state.kept_groups = KeptGroups(modules)
    return state.kept_groups


def _recorded_kept_groups(model: nn.Module) -> KeptGroups | None:
    state = recorded_state(model)
    return state.kept_groups if state is not None else None


# --------------------------------------------------------------------------- entry points
def pause_sync(model: nn.Module) -> None:
    """Before a non-final micro-batch: skip what the model's mode skips."""
    mode = mode_of(model)
    modules = _fsdp_modules(model)
    if not mode.pauses_gradient_sync:
        for module in modules:
            module.set_requires_all_reduce(False, recurse=False)
        # Replicated parameters (0-dim, or `f2.replicate`'s) stay averaged on every micro-batch, as the
        # sharded gradients are reduce-scattered: a scalar's all-reduce is a few bytes. (Averaging the
        # accumulated gradient again is exact: the part from earlier micro-batches is equal on all ranks.)
        return
    _gather_each_group_once(model)
    if mode.keeps_gathered:
        _kept_groups(model).keep()
    for module in modules:
        module.set_requires_gradient_sync(False, recurse=False)
    _set_replicated_sync(model, False)


def resume_sync(model: nn.Module) -> None:
    """Before the last micro-batch: reduce everything accumulated in its backward."""
    for module in _fsdp_modules(model):
        module.set_requires_gradient_sync(True, recurse=False)  # also turns the all-reduce back on
    _set_replicated_sync(model, True)
    kept = _recorded_kept_groups(model)
    if kept is not None and mode_of(model).keeps_gathered:
        kept.release_after_last_backward()


def _drop_unreduced_grads(modules: list[FSDPModule]) -> None:
    """Forget the gradients unsynchronised backwards accumulated on the unsharded parameters.

    They live outside `model.parameters()` (so `zero_grad` misses them), and torch 2.13's
    `reset_iter_state` leaves them too: the next synchronised backward would add them to its
    reduction (the next step's gradients would double). Where they live changed in torch
    2.15 (`_torch_compat.drop_unreduced_grads`).
    """
    for module in modules:
        for group in tc.param_groups(module):
            tc.drop_unreduced_grads(group)


def abandon(model: nn.Module) -> None:
    """After an exception inside a micro-batch: sync on, nothing left gathered, FSDP's iteration reset.

    The micro-batches accumulated so far are lost (torch's `reset_iter_state` discards pending
    reductions): zero the gradients and start the step again.
    """
    modules = _fsdp_modules(model)
    for module in modules:
        module.set_requires_gradient_sync(True, recurse=False)
    _set_replicated_sync(model, True)
    kept = _recorded_kept_groups(model)
    if kept is not None:
        kept.restore_flags()
    _drop_unreduced_grads(modules)
    if modules:
        # The root (outermost group): reshards every group and clears FSDP's per-iteration
        # state, which an aborted forward or backward leaves half-way. It needs the root's lazy
        # init (idempotent), which has not run when the exception came before any forward.
        tc.lazy_init(modules[0])
        tc.reset_iter_state(modules[0])


# --------------------------------------------------------------------------- the public switches
def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn gradient reduction off before a non-final micro-batch, on before the last one.

    What "off" skips follows the model's `FSDP2Config.accumulation` mode: the reduce-scatter
    ("sync_last"), also the re-gathering of parameters ("keep_gathered"), or only HSDP's
    replicate all-reduce ("sync_each"). Replicated scalar parameters sync on the last only.

    Args:
        model: The model `shard_model` sharded.
        enabled: False before a non-final micro-batch, True before the last one.
    """
    if enabled:
        resume_sync(model)
    else:
        pause_sync(model)


@contextlib.contextmanager
def no_sync(*models: nn.Module) -> Iterator[None]:
    """Accumulate without the full reduction inside the context (all micro-batches but the last).

    Follows each model's `FSDP2Config.accumulation` mode (default "sync_last": gradients
    accumulate unreduced on each rank and the first backward outside the context reduces the
    sum). Sync is switched back on when the context exits; on an exception, parameters that
    "keep_gathered" held unsharded are also resharded.

    Args:
        *models: The sharded models whose backward passes inside the context accumulate.

    Example:
        ```python
        for i, batch in enumerate(micro_batches):
            with f2.no_sync(model) if i < len(micro_batches) - 1 else contextlib.nullcontext():
                loss_fn(model, batch).backward()
        optimizer.step()
        ```
    """
    try:
        for model in models:
            set_gradient_sync(model, False)
        yield
    except BaseException:
        for model in models:
            abandon(model)
        raise
    else:
        for model in models:
            set_gradient_sync(model, True)
