"""Ray Train adapter (optional extra `[ray]`): fsdp2_strategy inside `ray.train.torch.TorchTrainer`.

Inside a Ray train function Ray has already started the process group (gloo on CPU workers,
its `TorchConfig(backend=...)` otherwise); `f2.init_distributed()` finds it and starts none.
Do not call `f2.shutdown()` there: Ray owns the worker process and the group.

    from fsdp2_strategy.integrations.ray import resume, save_and_report

    def train_fn(config):
        device = f2.init_distributed()
        model = f2.shard_model(make_model(), config=f2.FSDP2Config(...))
        optimizer = torch.optim.AdamW(model.parameters())
        ckpt = f2.Checkpointer(config["checkpoint_root"])   # storage every worker shares
        start = (resume(ckpt, model=model, optimizer=optimizer) or {}).get("step", 0)
        for step in range(start + 1, total + 1):
            ...
            if step % every == 0:
                save_and_report(ckpt, step, {"loss": loss}, model=model, optimizer=optimizer, extra={"step": step})

Lightning: `fsdp2_strategy.integrations.ray.lightning.RayFSDP2Strategy` (accepted by
`ray.train.lightning.prepare_trainer`). Accelerate: `fsdp2_strategy.integrations.ray.accelerate`.
"""

from .checkpoint import report_step, resume, save_and_report

__all__ = ["report_step", "resume", "save_and_report"]
