"""What `FSDP2Config(sharding_strategy="auto", objective="throughput")` needs from the Trainer: one
micro-batch of the train dataloader and the loss `training_step` computes. The core tunes with
them (`shard_model`'s `example_batch` and `loss_fn`); nothing here measures or decides.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

import fsdp2_strategy as f2
from fsdp2_strategy.train import register_step_method
from fsdp2_strategy.tuning import example_batch_from

from ._compat import request_dataloader


def throughput_inputs(strategy: Any, config: f2.FSDP2Config) -> dict[str, Any]:
    """`example_batch` and `loss_fn` for the core when `config` asks for the throughput objective
    (else nothing). The batch is the train dataloader's first `batch_size` samples, through the
    module's batch-transfer hooks; the dataloader hook is called once more for it, and the loader
    is not iterated (`example_batch_from`), so training sees the same data in the same order."""
    if config.sharding_strategy != "auto" or config.objective != "throughput":
        return {}
    module = strategy.lightning_module
    if not module.automatic_optimization:
        raise ValueError(
            "FSDP2Strategy(objective='throughput') times training_step under automatic optimization; with manual "
            "optimization run f2.tune(model, batch, loss_fn=...) and pass the fields of its best_config."
        )
    source = module.trainer.fit_loop._data_source
    if not source.is_defined():
        raise ValueError(
            "FSDP2Strategy(objective='throughput') takes its example batch from the train dataloader, and this "
            "entry point has none: pass one to trainer.fit (or define train_dataloader), or use objective='memory'."
        )
    batch = example_batch_from(request_dataloader(source))
    return {"example_batch": strategy.batch_to_device(batch), "loss_fn": training_step_loss}


def training_step_loss(module: nn.Module, batch: Any) -> torch.Tensor:
    """The loss `module.training_step(batch, 0)` returns (a tensor or a dict's "loss"), on one of the
    tuner's sharded copies (the root gathered around the step, as the strategy does). The copy has no
    Trainer (Lightning drops it when copying), so its `self.log` calls do nothing."""
    if "training_step" not in vars(module):
        register_step_method(module, "training_step")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*self\.log\(\)")
        try:
            out = module.training_step(batch, 0)  # type: ignore[operator]
        except NotImplementedError as exc:
            if "meta tensor" not in str(exc):
                raise
            raise ValueError(
                "objective='throughput' estimates each candidate's memory by running training_step on meta tensors, "
                "and this training_step reads tensor values (.item(), .tolist(), ...): skip that for meta tensors "
                "(`if not loss.is_meta`), or run f2.tune(model, batch, loss_fn=...) and pass its best_config's fields."
            ) from exc
        except RuntimeError as exc:
            if "not attached to a `Trainer`" not in str(exc):
                raise
            raise ValueError(
                "objective='throughput' runs training_step on copies of the module that have no Trainer, and this "
                "training_step reads self.trainer: guard that use, or run f2.tune(model, batch, loss_fn=...) and pass "
                "the fields of its best_config."
            ) from exc
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            f"objective='throughput': training_step returned {type(out).__name__}, not a loss tensor or a dict "
            "with 'loss'; run f2.tune(model, batch, loss_fn=...) and pass the fields of its best_config."
        )
    return loss
