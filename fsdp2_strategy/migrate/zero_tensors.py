"""Each parameter of a DeepSpeed ZeRO checkpoint, assembled on demand from the ranks' flat partitions.

ZeRO keeps, per parameter group, one flat fp32 vector per rank, and the optimizer's state
(`exp_avg`, `exp_avg_sq`) as flat vectors of the same layout; DeepSpeed's `zero_to_fp32.py`
rebuilds the weights from them, and `ZeroLayout.gather` does the same for the weights and for every
element-wise optimizer state, one parameter at a time:
- ZeRO-1/2: the group's parameters lie one after another (plus `param_alignment_paddings`) in the
  concatenation of the ranks' partitions; a parameter may straddle two ranks.
- ZeRO-3: every parameter is cut into `ceil(numel / world)` elements per rank (the last rank padded),
  at the same offset in every rank's flat vector.
Only the slices of one parameter are read (the files are memory-mapped), so assembling one costs
that parameter's size, whatever the model's.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .zero_files import ZeroFiles, load_file, plain_int

ADAM_STATE = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Slot:
    """Where one trainable parameter lives: its group and offset in that group's flat vector (ZeRO-1/2:
    in the ranks' concatenation; ZeRO-3: in each rank's own vector)."""

    name: str
    shape: torch.Size
    group: int
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class ZeroLayout:
    """A DeepSpeed ZeRO save read: the trainable parameters' slots, frozen parameters, buffers, tied
    names, the optimizer's groups and state keys, and the engine's own records.

    Args:
        files: the save's files (`zero_files.find_files`).
        trusted: unpickle any type in them (`zero_files.load_file`).

    Raises:
        ValueError: naming the file and key when the save is not one this converter reads.
    """

    def __init__(self, files: ZeroFiles, *, trusted: bool = False):
        self.files = files
        self.trusted = trusted
        self.model_states = load_file(files.model_files[0], trusted=trusted)
        optim = [load_file(f, trusted=trusted) for f in files.optim_files]
        self._osd = [self._optimizer_dict(f, o) for f, o in zip(files.optim_files, optim)]
        first = self._osd[0]
        self.stage = plain_int(first["zero_stage"]) if "zero_stage" in first else 1  # bf16 optimizer: ZeRO-1 like
        if self.stage not in (1, 2, 3):
            raise ValueError(f"{files.optim_files[0]}: zero_stage {self.stage} is not 1, 2 or 3")
        self.world = len(files.optim_files)
        counts = first.get("partition_count", self.world)
        counts = max(counts) if isinstance(counts, (list, tuple)) else int(counts)
        if counts != self.world:
            raise ValueError(
                f"{files.optim_files[0]}: saved by {counts} data-parallel ranks, but {self.world} "
                "*_optim_states.pt files are there: the folder mixes saves or lacks files"
            )
        self.fp32 = [o["fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"] for o in self._osd]
        self.base = [self._base_state(f, o) for f, o in zip(files.optim_files, self._osd)]
        self.shapes = self._param_shapes()
        self.slots = self._place_params()
        self.shared: dict[str, str] = dict(self.model_states.get("shared_params") or {})

    # ------------------------------------------------------------------ reading the files
    @staticmethod
    def _optimizer_dict(path: Any, state: dict) -> dict:
        osd = state.get("optimizer_state_dict")
        if not isinstance(osd, dict):
            raise ValueError(f"{path} has no 'optimizer_state_dict': not a DeepSpeed ZeRO optimizer-state file")
        if not any(k in osd for k in ("fp32_flat_groups", "single_partition_of_fp32_groups")):
            raise ValueError(
                f"{path}: optimizer_state_dict holds neither 'fp32_flat_groups' (ZeRO-3) nor "
                f"'single_partition_of_fp32_groups' (ZeRO-1/2); keys: {sorted(osd)}"
            )
        return osd

    def _base_state(self, path: Any, osd: dict) -> dict:
        """The base (torch) optimizer's state dict over the flat partitions."""
        key = "optimizer_state_dict" if self.stage == 3 else "base_optimizer_state"
        base = osd.get(key)
        if not isinstance(base, dict) or "state" not in base or "param_groups" not in base:
            raise ValueError(
                f"{path}: optimizer_state_dict[{key!r}] is not a torch optimizer state dict "
                f"(got {type(base).__name__}); written by an unsupported DeepSpeed version "
                f"({osd.get('ds_version', 'unknown')}). Convert the weights only (weights_only=True)."
            )
        return base

    def _param_shapes(self) -> list[dict[str, torch.Size]]:
        shapes = self.model_states.get("param_shapes")
        if not isinstance(shapes, list) or not shapes:
            raise ValueError(f"{self.files.model_files[0]} has no 'param_shapes': not a ZeRO model-states file")
        if len(shapes) != len(self.fp32[0]):
            raise ValueError(
                f"{self.files.model_files[0]}: {len(shapes)} parameter groups in 'param_shapes', but "
                f"{len(self.fp32[0])} flat groups in {self.files.optim_files[0]}"
            )
        return [{name: torch.Size(shape) for name, shape in group.items()} for group in shapes]

    def _place_params(self) -> list[Slot]:
        """Every trainable parameter's slot; checks the offsets consume each group exactly (as
        `zero_to_fp32.py` does), so a layout this code misreads fails here, not silently."""
        paddings = self._osd[0].get("param_alignment_paddings")
        slots = []
        for g, group in enumerate(self.shapes):
            offset = 0
            for i, (name, shape) in enumerate(group.items()):
                slots.append(Slot(name, shape, g, offset))
                numel = math.prod(shape)
                offset += math.ceil(numel / self.world) if self.stage == 3 else numel
                if self.stage < 3 and paddings is not None:
                    offset += paddings[g][i]
            self._check_consumed(g, offset)
        return slots

    def _check_consumed(self, group: int, offset: int) -> None:
        if self.stage == 3:
            have = [len(flats[group]) for flats in self.fp32]
            ok = all(n == offset for n in have)
        else:  # ZeRO-2 pads to a multiple of 2 * world (zero_to_fp32's rule)
            align = 2 * self.world
            have = [sum(len(flats[group]) for flats in self.fp32)]
            ok = math.ceil(offset / align) == math.ceil(have[0] / align)
        if not ok:
            raise ValueError(
                f"{self.files.step_dir}: parameter group {group} holds {have} flat elements per rank file, "
                f"but its parameters (param_shapes) place {offset}: the layout is not one this converter "
                "knows (another DeepSpeed version?)"
            )

    # ------------------------------------------------------------------ assembling tensors
    def gather(self, slot: Slot, flats: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor of `slot` from the ranks' flat vectors `flats` (of its group), as a new tensor."""
        if self.stage == 3:
            part = math.ceil(slot.numel / self.world)
            pieces = [flat.narrow(0, slot.offset, part) for flat in flats]
        else:
            pieces = _read_range(flats, slot.offset, slot.numel)
        return torch.cat(pieces)[: slot.numel].view(slot.shape).clone()

    def weight(self, slot: Slot) -> torch.Tensor:
        """The fp32 master weight of `slot`."""
        return self.gather(slot, [flats[slot.group] for flats in self.fp32])

    def state_keys(self) -> dict[int, dict[str, str]]:
        """Per group: each optimizer-state key and its kind ("flat": one element per parameter element,
        "scalar": one value for the group, such as Adam's `step`)."""
        kinds: dict[int, dict[str, str]] = {}
        for g in range(len(self.shapes)):
            state = self.base[0]["state"].get(g, {})
            flat_len = len(self.fp32[0][g])
            kinds[g] = {
                key: "flat" if isinstance(v, torch.Tensor) and v.ndim == 1 and len(v) == flat_len else "scalar"
                for key, v in state.items()
            }
        return kinds

    def state_value(self, slot: Slot, key: str) -> torch.Tensor:
        """Optimizer state `key` of `slot` (a flat kind, see `state_keys`)."""
        return self.gather(slot, [base["state"][slot.group][key] for base in self.base])

    def group_scalar(self, group: int, key: str) -> Any:
        return self.base[0]["state"][group][key]

    def param_groups(self) -> list[dict[str, Any]]:
        """The base optimizer's hyperparameters per group (without `params`)."""
        return [{k: v for k, v in group.items() if k != "params"} for group in self.base[0]["param_groups"]]

    # ------------------------------------------------------------------ the rest of the model
    def buffers(self) -> dict[str, torch.Tensor]:
        """The persistent buffers (from the model states' `module`)."""
        names = set(self.model_states.get("buffer_names") or [])
        module = self.model_states.get("module") or {}
        return {k: v for k, v in module.items() if k in names}

    def frozen_shapes(self) -> dict[str, torch.Size]:
        """Frozen parameters' shapes by name. ZeRO-1 records none: there every entry of the (full)
        `module` state that is neither trainable, a buffer nor a tied name is a frozen parameter."""
        shapes = self.model_states.get("frozen_param_shapes")
        if shapes is None and self.stage < 3:
            known = {s.name for s in self.slots} | set(self.buffers()) | set(self.shared)
            module = self.model_states.get("module") or {}
            return {k: v.shape for k, v in module.items() if k not in known}
        return {name: torch.Size(shape) for name, shape in (shapes or {}).items()}

    def frozen(self) -> dict[str, Callable[[], torch.Tensor]]:
        """Frozen parameters (no optimizer state) by name, each as a loader of its full tensor."""
        shapes = self.frozen_shapes()
        if not shapes:
            return {}
        if self.stage < 3:  # full tensors: ZeRO-2's fragments, or ZeRO-1's module state
            fragments = self.model_states.get("frozen_param_fragments") or self.model_states.get("module") or {}
            return {name: functools.partial(_copy, fragments[name]) for name in shapes}
        per_rank = [
            load_file(f, trusted=self.trusted).get("frozen_param_fragments") or {} for f in self.files.model_files
        ]

        def full(name: str) -> torch.Tensor:
            numel = math.prod(shapes[name])
            return torch.cat([frags[name] for frags in per_rank])[:numel].view(shapes[name]).clone()

        return {name: functools.partial(full, name) for name in shapes}


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float().clone()


def _read_range(flats: Sequence[torch.Tensor], start: int, length: int) -> list[torch.Tensor]:
    """Slices of the concatenation of `flats` covering `[start, start + length)`, without concatenating."""
    pieces, base = [], 0
    for flat in flats:
        lo, hi = max(start, base), min(start + length, base + len(flat))
        if lo < hi:
            pieces.append(flat.narrow(0, lo - base, hi - lo))
        base += len(flat)
    if sum(len(p) for p in pieces) != length:
        raise ValueError(f"flat range [{start}, {start + length}) runs past the partitions' {base} elements")
    return pieces
