"""Writing a converted checkpoint one tensor at a time: the state handed to DCP holds meta tensors
(`lazy`), and each real tensor is made by its loader when DCP's writer asks for it, written into a
file of its own and dropped (`StreamingWriter`). The converters (`convert_deepspeed`, `convert_fsdp1`)
write through it, so their peak memory is about one tensor whatever the model's size.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem

from ..checkpoint import EXTRA_FILE, directory

Loaders = dict[str, Callable[[], torch.Tensor]]
"""Flattened DCP key ("model.<name>", "optim.state.<name>.<key>") -> the function making its tensor."""


def lazy(
    loaders: Loaders,
    fqn: str,
    shape: torch.Size,
    load: Callable[[], torch.Tensor],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """A meta tensor standing in for the tensor `load()` makes when DCP writes `fqn`."""
    loaders[fqn] = load
    return torch.empty(shape, dtype=dtype, device="meta")


class _Resolving(SavePlanner):
    """DCP's planner, but the tensors under `loaders` are made when the writer asks for them."""

    def __init__(self, inner: SavePlanner, loaders: Loaders, done: Callable[[int], Any]):
        self._inner, self._loaders, self._done = inner, loaders, done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        self._inner.set_up_planner(*args, **kwargs)

    def create_local_plan(self) -> SavePlan:
        return self._inner.create_local_plan()

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Any]:
        return self._inner.create_global_plan(all_plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return self._inner.finish_plan(new_plan)

    def resolve_data(self, write_item: WriteItem) -> Any:
        load = self._loaders.get(write_item.index.fqn)
        if load is None:
            return self._inner.resolve_data(write_item)
        tensor = load()
        self._done(1)
        return tensor


class StreamingWriter(FileSystemWriter):
    """One file per tensor (DCP's writer keeps every tensor of a file alive until the file is
    closed), each tensor made on demand by its loader.

    Args:
        path: the (uncommitted) directory to write.
        loaders: the tensors to make (`lazy`).
        done: called with 1 after each tensor is made (a progress bar's `update`).
    """

    def __init__(self, path: Path, loaders: Loaders, done: Callable[[int], Any]):
        super().__init__(str(path), single_file_per_rank=False)
        self._loaders, self._done = loaders, done

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Any:
        return super().write_data(plan, _Resolving(planner, self._loaders, self._done))


def progress_bar(total: int, enabled: bool) -> Any:
    """A tqdm bar over `total` tensors (silent unless `enabled`)."""
    from tqdm import tqdm  # optional dependency: only a conversion's progress bar needs it

    return tqdm(total=total, desc="Converting", unit="tensor", disable=not enabled)


def write_converted(final: Path, state: dict, extra: dict, loaders: Loaders, progress: bool) -> None:
    """One committed checkpoint step at `final`: `state`'s tensors made by `loaders` one at a time
    (`StreamingWriter`), `extra` beside them, a progress bar over the tensors."""
    with progress_bar(len(loaders), progress) as bar:
        directory.save_dir(
            final,
            state,
            files={EXTRA_FILE: extra},
            make_writer=lambda path: StreamingWriter(path, loaders, bar.update),
        )
