"""Gradient accumulation modes: what the non-final micro-batches of an optimizer step skip.

`shard_model` records `FSDP2Config.accumulation` on the model; `no_sync` and
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
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

from .. import _torch_compat as tc
from ..config import ACCUMULATION_MODES
from ..config_checks import check_choice
from .replicated import replicated_params_of

MODE_ATTR = "_fsdp2_accumulation"
DEFAULT_MODE = "sync_last"
_KEPT_ATTR = "_fsdp2_kept_gathered"
_PREPARED_ATTR = "_fsdp2_accumulation_ready"


def record_mode(model: nn.Module, mode: str) -> None:
    """Remember the accumulation mode `no_sync` follows for `model`."""
    check_choice(mode, ACCUMULATION_MODES, "accumulation")
    setattr(model, MODE_ATTR, mode)


def mode_of(model: nn.Module) -> str:
    """The mode recorded by `shard_model` ("sync_last" for models sharded some other way)."""
    return getattr(model, MODE_ATTR, DEFAULT_MODE)


def _fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    """One module per FSDP group (the modules of a group sharded together share its state)."""
    return tc.fsdp_groups(model)


def _set_replicated_sync(model: nn.Module, enabled: bool) -> None:
    replicated = replicated_params_of(model)
    if replicated is not None:
        replicated.requires_sync = enabled


# --------------------------------------------------------------------------- sync_last
def _gather_each_group_once(model: nn.Module) -> None:
    """Gather and free every group once before the first unsynchronised backward ("sync_last").

    torch 2.13 with a mixed-precision policy fails in the backward of a micro-batch that does
    not use some group which has never been gathered ("'FSDPParam' object has no attribute
    '_unsharded_param'"), e.g. a block first used on the last micro-batch. One unshard/reshard
    per group creates what that code path expects; it costs one all-gather of the model, once
    per model. "sync_each" never switches sync off, so it does not need it; "sync_last" and
    "keep_gathered" do (tests/test_accumulation.py: a block first used on a later micro-batch).
    """
    if getattr(model, _PREPARED_ATTR, False):
        return
    for module in _fsdp_modules(model):
        module.unshard()
        module.reshard()
    setattr(model, _PREPARED_ATTR, True)


# --------------------------------------------------------------------------- keep_gathered
def gathers_up_front(device_type: str) -> bool:
    """Whether "keep_gathered" gathers every group when a step's first `no_sync` begins, rather than
    each in its own forward (`_KeptGroups.keep` says why: on CPU). `estimate.simulate` plays the same rule."""
    return device_type == "cpu"


class _KeptGroups:
    """The groups "keep_gathered" holds unsharded, with their own reshard-after-forward choice.

    torch's `set_reshard_after_forward` takes only a bool, while a group's choice can be an int
    (reshard onto a smaller group): the choice is saved and restored as torch stores it
    (`post_forward_mesh_info` of each parameter group), after the root's lazy init has fixed it.
    """

    def __init__(self, modules: list[FSDPModule]):
        self.modules = modules
        self.saved = [[(g, tc.post_forward_mesh_info(g)) for g in tc.param_groups(m)] for m in modules]
        self.pending: list[Any] = []
        groups = [g for m in modules for g in tc.param_groups(m)]
        self.gather_up_front = any(gathers_up_front(g.device.type) for g in groups)

    def keep(self) -> None:
        """Every group stays gathered until the last backward; on CPU, all are gathered now.

        Why up front on CPU: the first forward of a step otherwise runs one all-gather per group,
        each a blocking exchange with the other ranks in turn; started together they stream back
        to back, which makes the step faster (`benchmarks/accumulation.py`). All
        of them are waited for here, because FSDP drops an all-gather nobody waited for at the end
        of a backward (a group this micro-batch does not use), which would gather it twice.
        Memory: the all-gather outputs and the gathered parameters reach at most twice the gathered
        parameters, no more than the backward holds (gathered parameters and unsharded gradients of
        at least their size); `estimate.simulate` plays it. On an accelerator each group is gathered by its
        own forward, where FSDP overlaps the next group's all-gather with compute. Groups already
        gathered do nothing.
        """
        self.drop_pending()
        for module in self.modules:
            module.set_reshard_after_backward(False, recurse=False)
            for group in tc.param_groups(module):
                tc.set_post_forward_mesh_info(group, None)  # what set_reshard_after_forward(False) writes
        if self.gather_up_front:
            for handle in [module.unshard(async_op=True) for module in self.modules]:
                if handle is not None:  # always a handle with async_op=True
                    handle.wait()

    def release_after_last_backward(self) -> None:
        """Reshard after the coming backward; restore each group's forward choice after its next forward."""
        self.drop_pending()
        for module, saved in zip(self.modules, self.saved):
            module.set_reshard_after_backward(True, recurse=False)
            # FSDP's post-forward of modules sharded together runs at the end of the last one.
            last = tc.group_modules(module)[-1]
            handle = last.register_forward_hook(_restore_hook(saved), always_call=True)
            self.pending.append(handle)

    def restore_flags(self) -> None:
        """Each group's own reshard choices back at once (after an exception)."""
        self.drop_pending()
        for module, saved in zip(self.modules, self.saved):
            module.set_reshard_after_backward(True, recurse=False)
            _restore(saved)

    def drop_pending(self) -> None:
        for handle in self.pending:
            handle.remove()
        self.pending = []


def _restore(saved) -> None:
    for group, info in saved:
        tc.set_post_forward_mesh_info(group, info)


def _restore_hook(saved):
    def hook(module, args, output):
        # Runs after FSDP's own post-forward (registered later), so this forward kept the
        # group gathered for its backward; later forwards use the group's own choice.
        _restore(saved)
        return None

    return hook


def _kept_groups(model: nn.Module) -> _KeptGroups:
    kept = getattr(model, _KEPT_ATTR, None)
    if kept is None:
        modules = _fsdp_modules(model)
        if modules:
            # The root's lazy init (normally at its first forward) decides its reshard choice;
            # run it now so the saved choices are the final ones. It is idempotent.
            tc.lazy_init(modules[0])
        kept = _KeptGroups(modules)
        setattr(model, _KEPT_ATTR, kept)
    return kept


# --------------------------------------------------------------------------- entry points
def pause_sync(model: nn.Module) -> None:
    """Before a non-final micro-batch: skip what the model's mode skips."""
    mode = mode_of(model)
    modules = _fsdp_modules(model)
    if mode == "sync_each":
        for module in modules:
            module.set_requires_all_reduce(False, recurse=False)
        # Replicated parameters (0-dim, or `f2.replicate`'s) stay averaged on every micro-batch, as the
        # sharded gradients are reduce-scattered: a scalar's all-reduce is a few bytes. (Averaging the
        # accumulated gradient again is exact: the part from earlier micro-batches is equal on all ranks.)
        return
    _gather_each_group_once(model)
    if mode == "keep_gathered":
        _kept_groups(model).keep()
    for module in modules:
        module.set_requires_gradient_sync(False, recurse=False)
    _set_replicated_sync(model, False)


def resume_sync(model: nn.Module) -> None:
    """Before the last micro-batch: reduce everything accumulated in its backward."""
    for module in _fsdp_modules(model):
        module.set_requires_gradient_sync(True, recurse=False)  # also turns the all-reduce back on
    _set_replicated_sync(model, True)
    kept = getattr(model, _KEPT_ATTR, None)
    if kept is not None and mode_of(model) == "keep_gathered":
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
    kept = getattr(model, _KEPT_ATTR, None)
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
