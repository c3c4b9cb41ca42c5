"""What torch 2.11-2.12 lack, rebuilt on their private state; used through `_torch_compat`, which
checks every name used here at import (`_ATTRIBUTES_BEFORE_2_13`, `DefaultStager._stage`) and
calls these only on those releases.

- `reset_iter_state_before_2_13`: torch 2.13's `FSDPModule.reset_iter_state()` (the recovery after an exception
  aborted a forward or backward), its steps as 2.13 takes them.
- `StagerKeepingBuffers`: torch 2.11-2.12's `DefaultStager` closes its state-dict stager at the end
  of every stage (to break a reference cycle), which empties its copy table and its cached host
  buffers: a second stage fails (`KeyError: <class 'type'>`), and a new stager per save would
  allocate and pin the whole state's host memory at every save.

A leaf: imports only torch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager


def reset_iter_state_before_2_13(state: Any, groups_per_state: list[list[Any]], training_state: Any) -> None:
    """Reset the root FSDP `state` after an aborted forward or backward (see module docstring).

    Args:
        state: the root module's `FSDPState`.
        groups_per_state: the parameter groups of each of `state._state_ctx.all_states`, in order.
        training_state: FSDP's `TrainingState` enum.
    """
    stream = state._device_handle.current_stream()
    comm = state._comm_ctx
    if (all_gather := comm.all_gather_state) is not None:
        if all_gather.event is not None:
            stream.wait_event(all_gather.event)
        comm.all_gather_state = None
    if (reduce_scatter := getattr(comm, "reduce_scatter_state", None)) is not None:
        if reduce_scatter.event is not None:
            stream.wait_event(reduce_scatter.event)
        comm.reduce_scatter_state = None
    comm.post_forward_order.clear()
    for each, groups in zip(state._state_ctx.all_states, groups_per_state):
        each._modules_to_run_forward.clear()
        each._training_state = training_state.IDLE
        for group in groups:
            _reset_group(group, stream, training_state)
    state._state_ctx.iter_forward_root = None
    state._state_ctx.post_backward_final_callback_queued = False


def _reset_group(group: Any, stream: Any, training_state: Any) -> None:
    result = group._all_gather_result
    if result is not None:
        if result.all_gather_event is not None:
            stream.wait_event(result.all_gather_event)
        if isinstance(result.all_gather_work, torch.distributed.distributed_c10d.Work):
            result.all_gather_work.wait()
        group._all_gather_result = None
    if group._post_reduce_event is not None:
        stream.wait_event(group._post_reduce_event)
        group._post_reduce_event = None
    if group._all_reduce_state is not None and group._all_reduce_state.event is not None:
        stream.wait_event(group._all_reduce_state.event)
    group._all_reduce_state = None
    if group._reshard_after_forward_event is not None:
        group._wait_all_gather_streams_on_event(group._reshard_after_forward_event)
        group._reshard_after_forward_event = None
    group._partial_reduce_output = None
    group._post_forward_indices.clear()
    group._training_state = training_state.IDLE
    group._to_sharded()


class StagerKeepingBuffers(DefaultStager):
    """torch 2.11-2.12's `DefaultStager`, its state-dict stager closed only by `close()` (as from 2.13)."""

    def _stage(self, state_dict: Any, **kwargs: Any) -> Any:
        inner = self._state_dict_stager
        inner.close = _keep_open  # type: ignore[method-assign]  # an instance attribute: the `close()` ending `_stage` does nothing
        try:
            return super()._stage(state_dict, **kwargs)
        finally:
            del inner.close


def _keep_open() -> None:
    return None
