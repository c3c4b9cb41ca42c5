"""How "keep_gathered" holds every FSDP group unsharded across the micro-batches of one step.

`train.accumulation` asks `KeptGroups` to keep the groups gathered before the non-final
micro-batches (`keep`), to let them reshard after the last backward (`release_after_last_backward`),
or to put every choice back at once after an exception (`restore_flags`).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.fsdp import FSDPModule

from .. import _torch_compat as tc
from .accumulation_mode import KEEP_GATHERED


class KeptGroups:
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
        self.gather_up_front = any(KEEP_GATHERED.gathers_up_front(g.device.type) for g in groups)

    def keep(self, gather_now: bool | None = None) -> None:
        """Every group stays gathered until the last backward; on CPU (or with `gather_now`), all are
        gathered now.

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
        if self.gather_up_front if gather_now is None else gather_now:
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
