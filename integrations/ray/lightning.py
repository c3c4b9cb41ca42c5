"""`Trainer(strategy=RayFSDP2Strategy())` inside a Ray train function.

Ray's `ray.train.lightning.prepare_trainer` accepts only Ray's own strategy classes (it checks
`isinstance` against `RayDDPStrategy`, `RayFSDPStrategy`, `RayDeepSpeedStrategy`) and a
`RayLightningEnvironment`. `RayFSDP2Strategy` is `FSDP2Strategy` with what Ray requires:

- the `RayLightningEnvironment` (ranks and world size from Ray's train context; Ray started
  the processes and the process group, so Lightning launches and initialises nothing);
- the world Ray made as the data-parallel size and the device Ray assigned as root device
  (the Trainer sees one device per process: `devices="auto"`);
- every checkpoint Lightning saves (ModelCheckpoint, `trainer.save_checkpoint`) reported to
  Ray once committed, with `trainer.callback_metrics`;
- registration as a virtual subclass of `RayFSDPStrategy` (Lightning's strategies are ABCs),
  which is all `prepare_trainer` checks. Lightning then also treats it as an `FSDPStrategy`
  (FSDP1): it picks `FSDPPrecision`, translated back here; evaluation runs under `no_grad`
  instead of `inference_mode`, as for FSDP1. No sharding or checkpoint logic lives here.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch
import torch
from lightning.pytorch.plugins.precision import FSDPPrecision, HalfPrecision, MixedPrecision, Precision
from ray.train.lightning import RayFSDPStrategy, RayLightningEnvironment

from fsdp2_strategy.distributed import barrier, rank
from fsdp2_strategy.integrations._lightning_shared import META_FILE, is_sharded_checkpoint, read_meta
from fsdp2_strategy.integrations.lightning import FSDP2Strategy

from .checkpoint import report_dir

__all__ = ["RayFSDP2Strategy", "checkpoint_path"]


class RayFSDP2Strategy(FSDP2Strategy):
    """`FSDP2Strategy` for a Trainer built inside a Ray train function (accepted by `prepare_trainer`).

    Args:
        report_checkpoints: report every saved checkpoint to Ray (`ray.train.report`) with the
            trainer's `callback_metrics` (default True). Saves are collective, so every worker
            reports the same number of times, as Ray requires.
        *args: `FSDP2Strategy`'s positional arguments.
        **kwargs: `FSDP2Strategy`'s keyword arguments (`FSDP2Config` fields, `state_dict_type`, ...).
    """

    def __init__(self, *args: Any, report_checkpoints: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cluster_environment = RayLightningEnvironment()
        self.report_checkpoints = report_checkpoints

    @property
    def precision_plugin(self) -> Precision:
        return FSDP2Strategy.precision_plugin.fget(self)

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Being a (virtual) RayFSDPStrategy, this strategy is an FSDPStrategy to Lightning, which
        # then picks FSDPPrecision (FSDP1's) for `Trainer(precision=...)`: read its precision
        # string as the plain plugin Lightning would otherwise have picked.
        if isinstance(plugin, FSDPPrecision):
            plugin = _plain_precision(plugin.precision, self.root_device.type)
        FSDP2Strategy.precision_plugin.fset(self, plugin)

    @property
    def root_device(self) -> torch.device:
        """The device Ray assigned to this worker (CPU, or its accelerator)."""
        return ray.train.torch.get_device()

    def setup_environment(self) -> None:
        """Take the world size and nodes from Ray's context instead of the Trainer's device count."""
        context = ray.train.get_context()
        local = context.get_local_world_size()
        self.num_nodes = context.get_world_size() // local
        self.parallel_devices = [self.root_device] * local
        super().setup_environment()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Save as `FSDP2Strategy` does and report the checkpoint to Ray once committed: a sharded one
        at its commit (later, with `checkpoint_async_save`), a full file when this returns."""
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if self.report_checkpoints and not self._save_distributed_checkpoint:
            _report_file(Path(filepath), _metrics(self.lightning_module))

    def _on_commit(self) -> Callable[[Path], None] | None:
        # The metrics of the moment of the save, reported when the directory is committed.
        return (
            functools.partial(report_dir, metrics=_metrics(self.lightning_module)) if self.report_checkpoints else None
        )


def checkpoint_path(dirpath: str | Path | None = None) -> str | None:
    """The `ckpt_path` for `trainer.fit` that resumes after Ray restarted the workers (None on a first start).

    Ray's latest checkpoint (`ray.train.get_checkpoint()`): a sharded checkpoint is the directory
    Ray stored, a full one ("full" `state_dict_type`) the one `.ckpt` file inside it. With
    `dirpath` (the ModelCheckpoint's folder), a committed sharded checkpoint there with a larger
    `global_step` wins: Ray registers a report only when its controller next polls the workers,
    so a worker that died just after a save leaves a committed checkpoint Ray never heard of.
    """
    candidates = []
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        candidates.append(_ray_checkpoint_file(Path(checkpoint.path)))
    if dirpath is not None and Path(dirpath).is_dir():
        candidates += [p for p in Path(dirpath).iterdir() if is_sharded_checkpoint(p)]
    if not candidates:
        return None
    return str(max(candidates, key=_global_step))


def _ray_checkpoint_file(path: Path) -> Path:
    if (path / META_FILE).is_file():
        return path
    files = sorted(path.glob("*.ckpt"))
    if len(files) != 1:
        raise ValueError(
            f"Ray checkpoint {path} holds {len(files)} .ckpt files; expected one Lightning checkpoint "
            "reported by RayFSDP2Strategy."
        )
    return files[0]


def _global_step(path: Path) -> int:
    """The `global_step` Lightning recorded in a checkpoint (read as data, memory-mapped: no tensor is read)."""
    return int(read_meta(path, weights_only=None).get("global_step", -1))


def _plain_precision(precision: str, device_type: str) -> Precision:
    """Lightning's plugin for `precision` on a non-FSDP strategy (what `to_fsdp2_precision` translates)."""
    if precision == "32-true":
        return Precision()
    if precision.endswith("-mixed"):
        return MixedPrecision(precision, device_type)
    return HalfPrecision(precision)


def _metrics(module: Any) -> dict[str, Any]:
    trainer = getattr(module, "trainer", None) if module is not None else None
    metrics = dict(trainer.callback_metrics) if trainer is not None else {}
    return {k: (v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v) for k, v in metrics.items()}


def _report_file(path: Path, metrics: dict[str, Any]) -> None:
    """Collective: rank 0 hands Ray a folder holding the full checkpoint file just saved."""
    barrier()  # rank 0 wrote the file
    if rank() != 0:
        ray.train.report(metrics, checkpoint=None)
        return
    with tempfile.TemporaryDirectory() as folder:  # Ray stores directories; a full save is one file
        shutil.copy2(path, Path(folder) / path.name)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder), checkpoint_dir_name=path.stem)


# `prepare_trainer` checks isinstance against Ray's strategies only; Lightning's Strategy is an
# ABC, so registering is the supported way to be one of them without inheriting FSDP1 code.
RayFSDPStrategy.register(RayFSDP2Strategy)
