"""Gradient accumulation modes as objects: what each one skips, and what that costs per step.

`FSDP2Config.accumulation` names a mode ("sync_each", "sync_last", "keep_gathered": the spelling users
write). Everything that depends on the mode asks its `AccumulationMode` instead of comparing names:
`no_sync` (what to switch off), the memory estimator and the simulator (collectives, gathered bytes),
the step-time model, the sharding report and the tuner (which modes are worth trying). Changing how a
mode behaves means changing its fields here (and, for the runtime, `train.accumulation`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ACCUMULATION_MODES
from ..config_checks import check_choice


@dataclass(frozen=True)
class AccumulationMode:
    """One gradient accumulation mode: what the non-final micro-batches of an optimizer step skip.

    Obtain one with `f2.accumulation_mode(name)`; `str()` of it is the name `FSDP2Config.accumulation`
    takes. The counts below are per optimizer step of `micro_batches` micro-batches and per FSDP group.
    """

    name: str
    """The user-facing spelling (`FSDP2Config.accumulation`)."""
    reduces_every_micro_batch: bool
    """Gradients are reduce-scattered on every micro-batch (sharded between micro-batches); otherwise
    they accumulate unreduced on the unsharded parameters until the last micro-batch."""
    keeps_gathered: bool
    """Parameters stay gathered from the step's first forward to its last backward (gathered once per
    step instead of once per forward and backward)."""
    summary: str
    """One line for the sharding plan: what is reduced when, and what is held."""

    def __str__(self) -> str:
        return self.name

    @property
    def pauses_gradient_sync(self) -> bool:
        """Whether `no_sync` switches FSDP's gradient reduction off (the reduce-scatter; every mode
        defers HSDP's replicate all-reduce to the last micro-batch)."""
        return not self.reduces_every_micro_batch

    @property
    def saves_time(self) -> bool:
        """Whether the mode can make a step faster than the others ("sync_each" only adds
        reduce-scatters to "sync_last": it saves memory, never time). The tuner tries the modes that
        can, and "sync_each" only when the base configuration asks for it."""
        return not self.reduces_every_micro_batch

    def stays_gathered(self, micro_batches: int) -> bool:
        """Whether parameters stay gathered across the step (only with more than one micro-batch)."""
        return self.keeps_gathered and micro_batches > 1

    def syncs_on(self, index: int, micro_batches: int) -> bool:
        """Whether micro-batch `index` (0-based) of `micro_batches` reduce-scatters its gradients."""
        return self.reduces_every_micro_batch or index == micro_batches - 1

    def reduce_scatters(self, micro_batches: int) -> int:
        """Reduce-scatters per group per step: one per micro-batch, or one on the last."""
        return micro_batches if self.reduces_every_micro_batch else 1

    def all_reduces(self, micro_batches: int) -> int:
        """HSDP replicate all-reduces per group per step: always one, on the last micro-batch (`no_sync`
        defers it in every mode, `set_requires_all_reduce`)."""
        return 1

    def gathering_forwards(self, micro_batches: int) -> int:
        """Forwards per step that all-gather a group: every forward, or the first only when the mode
        keeps parameters gathered."""
        return 1 if self.stays_gathered(micro_batches) else micro_batches

    def unshards(self, micro_batches: int, keep_after_forward: bool) -> int:
        """All-gathers per group per step: one per forward, one more per backward unless the group
        stays gathered after forward; one in all when the mode keeps parameters gathered."""
        if self.stays_gathered(micro_batches):
            return 1
        return micro_batches * (1 if keep_after_forward else 2)

    def kept_through(self, index: int, micro_batches: int) -> tuple[bool, bool]:
        """Whether micro-batch `index` keeps every group gathered after its forward, and after its
        backward: the forwards all do, the backwards all but the last."""
        kept = self.stays_gathered(micro_batches)
        return kept, kept and index < micro_batches - 1

    def gathers_up_front(self, device_type: str) -> bool:
        """Whether the first `no_sync` of a step gathers every group at once instead of each in its own
        forward: on CPU, where back-to-back all-gathers beat one blocking exchange per group
        (`benchmarks/accumulation.py`); on an accelerator FSDP overlaps each with compute."""
        return self.keeps_gathered and device_type == "cpu"


SYNC_EACH = AccumulationMode(
    "sync_each",
    reduces_every_micro_batch=True,
    keeps_gathered=False,
    summary="reduce-scatter every micro-batch, sharded gradients",
)
SYNC_LAST = AccumulationMode(
    "sync_last",
    reduces_every_micro_batch=False,
    keeps_gathered=False,
    summary="reduce on the last micro-batch, unsharded gradients held",
)
KEEP_GATHERED = AccumulationMode(
    "keep_gathered",
    reduces_every_micro_batch=False,
    keeps_gathered=True,
    summary="reduce on the last micro-batch, parameters gathered for the whole step",
)
MODES: dict[str, AccumulationMode] = {m.name: m for m in (SYNC_EACH, SYNC_LAST, KEEP_GATHERED)}
"""Every mode by name, in the order `FSDP2Config.accumulation` lists them."""
DEFAULT_MODE = SYNC_LAST
assert tuple(MODES) == ACCUMULATION_MODES, "config.ACCUMULATION_MODES and the modes defined here must agree"


def accumulation_mode(mode: str | AccumulationMode) -> AccumulationMode:
    """The `AccumulationMode` of a name `FSDP2Config.accumulation` accepts.

    Args:
        mode: "sync_each", "sync_last" or "keep_gathered" (or a mode, returned as it is).

    Returns:
        The mode object, which answers what the mode skips and costs.

    Raises:
        ValueError: `mode` is not one of the names (the message lists them).
    """
    if isinstance(mode, AccumulationMode):
        return mode
    check_choice(mode, ACCUMULATION_MODES, "accumulation")
    return MODES[mode]
