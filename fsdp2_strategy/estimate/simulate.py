"""The meta-device simulation behind `estimate_memory`.

`LiveBytes` counts the storages that ops create (a `TorchDispatchMode`; a weak-reference
finaliser subtracts a storage when it dies) plus "virtual" bytes that FSDP2 would hold and the
meta run does not (shards, gathered groups, communication buffers). `run_step` drives one
training step of a meta copy with hooks that play FSDP2's schedule: all-gather before a
group's forward and backward, reshard after forward by the group's choice, reduce-scatter and
free the unsharded gradients when a group's backward is done, prefetch one group ahead in
backward (torch's default) or as configured. What depends on the training device (attention
kernels, gloo's reduce-scatter copy) lives in `sim_device`; the meta copy of model and batch in
`sim_model`; each group's sizes from the parameter shapes in `sim_sizes`.
"""

from __future__ import annotations

import weakref
from typing import Any, cast

import torch
from torch import nn

from .. import _torch_compat as tc
from ..config import FSDP2Config
from ..train import AccumulationMode
from .sim_device import attention_kernels, reduce_scatter_scratch
from .sim_model import default_loss
from .sim_sizes import GroupSizes


class LiveBytes(tc.TorchDispatchMode):
    """Peak of live tensor bytes created under the mode, plus virtual bytes noted by hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.virtual: dict[str, int] = {}
        self.peak = 0
        self.peak_phase = "forward"
        self.phase = "forward"
        self.at_peak: dict[str, int] = {}
        self.activation_peak = 0
        self.unsharded_grads = 0
        """Real (meta) gradient bytes alive: excluded from the activation figure."""
        self._sizes: dict[int, int] = {}
        self._preexisting: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tc.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        self.note_virtual(0, None)
        return out

    def ignore(self, tensors) -> None:
        """Storages that exist before the step (parameters, buffers, inputs): views of them are free."""
        for t in tensors:
            self._preexisting.add(tc.storage_key(t.untyped_storage()))

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = tc.storage_key(storage)
        if key in self._sizes or key in self._preexisting:
            return
        self._sizes[key] = storage.nbytes()
        self.live += storage.nbytes()
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def add(self, category: str, nbytes: int) -> None:
        """Add (or with a negative value, remove) virtual bytes of one category."""
        self.virtual[category] = self.virtual.get(category, 0) + nbytes

    def note_virtual(self, transient: int, phase: str | None) -> None:
        """Update the peak with the current total plus `transient` bytes alive for an instant."""
        total = self.live + sum(self.virtual.values()) + transient
        activations = self.live - self.unsharded_grads
        self.activation_peak = max(self.activation_peak, activations)
        if total > self.peak:
            self.peak = total
            self.peak_phase = phase or self.phase
            self.at_peak = {
                "gathered": self.virtual.get("gathered", 0),
                "mp": self.virtual.get("mp", 0),
                "grads": self.virtual.get("grads", 0) + self.unsharded_grads,
                "activations": activations,
                "transient": transient,
            }


class _Schedule:
    """FSDP2's gather / reshard / reduce schedule, played with hooks on the meta copy."""

    def __init__(
        self, model: nn.Module, sizes: dict[str, GroupSizes], tracker: LiveBytes, config: FSDP2Config, device_type: str
    ):
        self.model, self.sizes, self.tracker = model, sizes, tracker
        self.gathered: dict[str, int] = {}
        self.sharded_grads: set[str] = set()
        self.post_forward_order: list[str] = []
        self.backward_prefetch = config.backward_prefetch or 1
        self.forward_prefetch = config.forward_prefetch
        self.sync = True
        self.keep_forward = self.keep_backward = False
        """"keep_gathered": no reshard after forward (every micro-batch) / after backward (all but the last)."""
        self.pending: dict[str, int] = {}
        self.upcast: dict[str, int] = {}
        """Extra bytes of unsynced gradients held in the reduce dtype, per group."""
        self.offload = config.cpu_offload
        self.device_type, self.collectives = device_type, config.collectives
        self.handles: list = []

    # --- gathering -------------------------------------------------------------------
    def gather(self, name: str, outputs_alive: int | None = None) -> None:
        g = self.sizes[name]
        held = self.gathered.get(name, 0)
        if held >= g.gathered or not g.gathered:
            return
        # All-gather output (flat, padded; `outputs_alive`: all outputs still in flight) alive while
        # it is copied out into the parameters; an offloaded shard is first copied to the device.
        transient = (g.gathered if outputs_alive is None else outputs_alive) + (g.sharded if self.offload else 0)
        self.tracker.add("gathered", g.gathered - held)
        self.tracker.add("mp", g.mp_copy - (g.mp_copy * held // g.gathered))
        self.gathered[name] = g.gathered
        self.tracker.note_virtual(transient, None)

    def reshard(self, name: str, to: int = 0) -> None:
        held = self.gathered.get(name, 0)
        if not held:
            return
        g = self.sizes[name]
        keep = g.gathered // to if to else 0
        self.tracker.add("gathered", keep - held)
        self.tracker.add("mp", (g.mp_copy // to if to else 0) - g.mp_copy * held // g.gathered)
        self.gathered[name] = keep

    # --- hooks -------------------------------------------------------------------------
    def install(self) -> None:
        for name, g in self.sizes.items():
            # As torch's hooks for modules sharded together: the first to run gathers the group,
            # the last one's end reshards it (and its output's gradient starts the group's backward).
            for member in g.members:
                module = self.model.get_submodule(member)
                self.handles.append(module.register_forward_pre_hook(lambda m, a, n=name: self.pre_forward(n)))
            last = self.model.get_submodule(g.members[-1])
            self.handles.append(last.register_forward_hook(lambda m, a, o, n=name: self.post_forward(n, o)))
            for pname in g.params:
                p = self.model.get_parameter(pname)
                if p.requires_grad:
                    self.handles.append(p.register_post_accumulate_grad_hook(lambda p, n=name: self.grad_ready(n, p)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def pre_forward(self, name: str) -> None:
        if self.tracker.phase == "backward":
            return  # activation-checkpoint recomputation: already gathered by pre_backward
        self.gather(name)
        if self.forward_prefetch:
            blocks = [n for n in self.sizes if n]
            if name in blocks:
                i = blocks.index(name)
                for nxt in blocks[i + 1 : i + 1 + self.forward_prefetch]:
                    self.gather(nxt)

    def post_forward(self, name: str, output: Any) -> None:
        if self.tracker.phase == "backward":
            return
        g = self.sizes[name]
        if name not in self.post_forward_order:
            self.post_forward_order.append(name)
        if not g.keep_after_forward and not self.keep_forward:
            self.reshard(name, g.reshard_to)
        fired: list[bool] = []

        def hook(grad, n=name):
            if not fired:
                fired.append(True)
                self.pre_backward(n)
            return grad

        for t in tc.tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(hook)

    def pre_backward(self, name: str) -> None:
        self.gather(name)
        if name in self.post_forward_order:
            i = self.post_forward_order.index(name)
            for prev in reversed(self.post_forward_order[max(0, i - self.backward_prefetch) : i]):
                self.gather(prev)

    def grad_ready(self, name: str, p: torch.Tensor) -> None:
        if self.pending.get(name) is None:
            self.pending[name] = len([n for n in self.sizes[name].params if self.model.get_parameter(n).requires_grad])
        if id(p) not in self._counted:
            self._counted.add(id(p))
            self.tracker.unsharded_grads += cast(torch.Tensor, p.grad).untyped_storage().nbytes()
        self.pending[name] -= 1
        if self.pending[name] == 0:
            self.post_backward(name)

    def post_backward(self, name: str) -> None:
        g = self.sizes[name]
        # FSDP2 reshards a group before reducing its gradients.
        if not self.keep_backward:
            self.reshard(name)
        if self.sync:
            new_shard = 0 if name in self.sharded_grads or self.offload else g.trainable_sharded
            # Copy-in: the unsharded gradients and the flat reduce-scatter input are alive together;
            # then the gradients are dropped and the output shard is allocated; the collective's
            # scratch (gloo's copy of the input, the ring's receive buffer) is alive meanwhile.
            self.tracker.note_virtual(g.reduce_input, "backward")
            for pname in g.params:
                p = self.model.get_parameter(pname)
                if p.grad is not None:
                    self.tracker.unsharded_grads -= p.grad.untyped_storage().nbytes()
                    p.grad = None
            in_flight = g.reduce_input + reduce_scatter_scratch(
                self.device_type, self.collectives, g.reduce_input, g.shard_size
            )
            self.tracker.note_virtual(in_flight + new_shard, "backward")
            if new_shard:
                self.tracker.add("grads", new_shard)
                self.sharded_grads.add(name)
            self.tracker.add("grads", -self.upcast.pop(name, 0))
        elif name not in self.upcast:
            # Without sync, FSDP2 accumulates a low-precision gradient in the reduce dtype.
            grads = [self.model.get_parameter(n).grad for n in g.params]
            held = sum(grad.untyped_storage().nbytes() for grad in grads if grad is not None)
            self.upcast[name] = max(g.reduce_bytes - held, 0)
            self.tracker.add("grads", self.upcast[name])
        self.tracker.note_virtual(0, "backward")

    def start_micro_batch(self, mode: AccumulationMode, index: int, micro_batches: int) -> None:
        """Micro-batch `index` of `micro_batches`: whether it reduces and what it keeps gathered, as
        `mode` says (its last backward reshards; "keep_gathered" on CPU gathers every group first)."""
        self.sync = mode.syncs_on(index, micro_batches)
        self.keep_forward, self.keep_backward = mode.kept_through(index, micro_batches)
        self.pending = {}
        self._counted: set[int] = set()
        if self.keep_backward and mode.gathers_up_front(self.device_type):
            self.gather_all()

    def gather_all(self) -> None:
        """ "keep_gathered" on CPU (`train.kept_gathered.KeptGroups.keep`): every group's all-gather
        starts at once, then each is copied out in turn, its output freed after its copy-out."""
        names = [n for n, g in self.sizes.items() if g.gathered and self.gathered.get(n, 0) < g.gathered]
        alive = sum(self.sizes[n].gathered for n in names)
        for name in names:
            self.gather(name, outputs_alive=alive)
            alive -= self.sizes[name].gathered

    def flush(self) -> None:
        """Groups whose parameters got no gradient still reshard at the end of backward."""
        for name in self.sizes:
            if self.pending.get(name) != 0:
                self.post_backward(name)


def states_without_batch(
    sizes: dict[str, GroupSizes],
    tracker: LiveBytes,
    resident: int,
    prefetch: int,
    offload: bool,
    device_type: str,
    collectives: str = "auto",
) -> None:
    """Without an example batch: the moment late in backward when the groups kept gathered, the
    largest resharded group and its prefetched neighbours, an all-gather and a reduce-scatter buffer
    and the sharded gradients are alive together (activations are not counted)."""
    tracker.add("resident", resident)
    kept = sum(g.gathered for g in sizes.values() if g.keep_after_forward)
    moving = sorted((g.gathered for g in sizes.values() if not g.keep_after_forward), reverse=True)
    tracker.add("gathered", kept + sum(moving[: 1 + prefetch]))
    tracker.add("grads", 0 if offload else sum(g.trainable_sharded for g in sizes.values()))
    # An all-gather (prefetch) and the previous group's reduce-scatter can be in flight together.
    reduce = max(
        (
            g.reduce_input
            + reduce_scatter_scratch(device_type, collectives, g.reduce_input, g.shard_size)
            + g.trainable_sharded
            for g in sizes.values()
        ),
        default=0,
    )
    tracker.note_virtual(max(moving, default=0) + reduce, "backward")


def run_step(
    model: nn.Module,
    batch: Any,
    loss_fn,
    sizes: dict[str, GroupSizes],
    tracker: LiveBytes,
    resident: int,
    config: FSDP2Config,
    accumulation: AccumulationMode,
    micro_batches: int,
    device_type: str,
) -> None:
    """Play forward and backward of up to two micro-batches (the second looks like every later one)
    as on `device_type` (its attention kernels and collective buffers: `sim_device`)."""
    schedule = _Schedule(model, sizes, tracker, config, device_type)
    schedule.install()
    tracker.add("resident", resident)
    tracker.ignore(
        [*model.parameters(), *model.buffers(), *(t for t in tc.tree_flatten(batch)[0] if isinstance(t, torch.Tensor))]
    )
    loss_fn = loss_fn or default_loss
    runs = min(micro_batches, 2)
    try:
        with attention_kernels(device_type), tracker:
            for i in range(runs):
                tracker.phase = "forward"
                # Up to two micro-batches are played: the second stands for the last one.
                schedule.start_micro_batch(accumulation, micro_batches - runs + i, micro_batches)
                loss = loss_fn(model, batch)
                tracker.phase = "backward"
                loss.backward()
                del loss
                schedule.flush()
    finally:
        schedule.remove()
