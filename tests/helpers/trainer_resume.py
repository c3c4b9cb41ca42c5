"""Trainers resuming a converted checkpoint (a `Checkpointer` step): Lightning's `fit(ckpt_path=...)`
continues the shared DeepSpeed test model M steps, each step on the batch its global step names, so
that a global step not continued from the converted one trains on the wrong data."""

from __future__ import annotations

import torch

from helpers.deepspeed_models import M_STEPS, batch_for, lm_loss, make_model, make_optimizer, make_scheduler, snapshot

LIGHTNING_ENV = {"GROUP_RANK": "0", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "converted"}
"""Lightning takes the world run_distributed started as torchrun's (TorchElasticEnvironment)."""


def lightning_continue(ckpt_path: str, start: int) -> dict | None:
    """`Trainer(strategy=FSDP2Strategy()).fit(module, ckpt_path=<converted>)` for M more steps; rank 0
    returns the model's parameters and moments, the global steps seen and the learning rate."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from fsdp2_strategy.integrations.lightning import FSDP2Strategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model()  # parameter names "model.<the converted names>"
            self.steps: list[int] = []

        def training_step(self, batch, batch_idx):
            self.steps.append(self.trainer.global_step)
            idx, tgt = batch_for(self.trainer.global_step, self.global_rank, self.trainer.world_size)
            return lm_loss(self.model, idx, tgt)

        def configure_optimizers(self):
            optimizer = make_optimizer(self.model)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": make_scheduler(optimizer), "interval": "step"},
            }

        def train_dataloader(self):
            return DataLoader(range(64), batch_size=1)  # the batches come from batch_for

    module = Module()
    trainer = pl.Trainer(
        strategy=FSDP2Strategy(),
        accelerator="cpu",
        devices=2,
        max_steps=start + M_STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    optimizer = trainer.optimizers[0]
    snap = snapshot(module.model, optimizer)
    snap.update(steps=module.steps, global_step=trainer.global_step, lr=optimizer.param_groups[0]["lr"])
    return snap if trainer.global_rank == 0 else None


def hf_continue(ckpt_path: str, start: int, out_dir: str) -> dict | None:
    """`FSDP2Trainer.train(resume_from_checkpoint=<converted>)` for M more steps, the optimizer and the
    schedule of the DeepSpeed run (one AdamW group, LinearLR, no clipping); rank 0 returns the model's
    parameters and moments, the global steps seen and the learning rate."""
    import torch.distributed as dist
    from transformers import TrainingArguments

    from fsdp2_strategy.integrations.transformers import FSDP2Trainer

    class Stepped(FSDP2Trainer):
        steps: list[int] = []

        def create_optimizer(self, model=None):
            self.optimizer = make_optimizer(self.model)
            return self.optimizer

        def create_scheduler(self, num_training_steps, optimizer=None):
            self.lr_scheduler = make_scheduler(optimizer or self.optimizer)
            return self.lr_scheduler

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.steps.append(self.state.global_step)
            idx, tgt = batch_for(self.state.global_step, dist.get_rank(), dist.get_world_size())
            return lm_loss(model, idx, tgt)

    args = TrainingArguments(
        output_dir=out_dir,
        max_steps=start + M_STEPS,
        per_device_train_batch_size=1,
        max_grad_norm=0.0,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        ignore_data_skip=True,  # the batches come from batch_for, not the data set
        remove_unused_columns=False,
    )
    trainer = Stepped(model=make_model(), args=args, train_dataset=[{"x": i} for i in range(64)],
                      data_collator=lambda rows: {"x": torch.tensor([r["x"] for r in rows])})  # fmt: skip
    trainer.train(resume_from_checkpoint=ckpt_path)
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    snap = snapshot(trainer.model, optimizer)
    snap.update(steps=Stepped.steps, global_step=trainer.state.global_step, lr=optimizer.param_groups[0]["lr"])
    return snap if dist.get_rank() == 0 else None
