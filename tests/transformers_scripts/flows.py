"""Flows of `FSDP2Trainer` under `accelerate launch --config_file fsdp2_sharded.yaml` (2 CPU processes).

Usage: accelerate launch --config_file CONFIG flows.py OUT.json WORK_DIR [flow,flow,...]

Each flow measures and records numbers in OUT.json (rank 0); tests/test_transformers.py asserts on them.
"""

from __future__ import annotations

import copy
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from common import (
    Snapshots,
    Tokens,
    args,
    bert,
    cast_copy,
    checkpoint_args,
    full_params,
    gather,
    main,
    policy_grads,
    reference_sgd,
    vector_rel_diff,
)

from fsdp2_strategy.integrations.accelerate import FSDP2Plugin
from fsdp2_strategy.integrations.transformers import FSDP2Trainer, committed_checkpoints, latest_checkpoint

CLIP = 0.05  # below every step's gradient norm here: clipping happens on each step
STEPS, GLOBAL_BATCH = 3, 8  # 2 per device x 2 processes x 2 accumulation steps


def _rank0() -> bool:
    return dist.get_rank() == 0


def parity(entry: dict, work: Path) -> None:
    """2 processes x accumulation 2 x max_grad_norm against one process on the same global batches;
    then evaluate() against the reference model, and save_model() read back by from_pretrained."""
    model = bert(0)
    initial = copy.deepcopy(model)
    train, evals = Tokens(STEPS * GLOBAL_BATCH, 1), Tokens(11, 2)  # 11: the last eval batch is padded
    seen: list[int] = []

    def metrics(p) -> dict:
        seen[:] = sorted((torch.as_tensor(p.inputs)[:, 0] - 10).tolist())
        logits, labels = torch.as_tensor(p.predictions), torch.as_tensor(p.label_ids)
        return {
            "ce": F.cross_entropy(logits, labels).item(),
            "acc": (logits.argmax(-1) == labels).float().mean().item(),
        }

    trainer = FSDP2Trainer(
        model=model,
        args=args(
            work / "parity",
            gradient_accumulation_steps=2,
            max_steps=STEPS,
            max_grad_norm=CLIP,
            train_sampling_strategy="sequential",
            include_for_metrics=["inputs"],
            save_strategy="steps",  # a checkpoint after evaluate() sharded the model and train() freed the registry
            save_steps=STEPS,
        ),
        train_dataset=train,
        eval_dataset=evals,
        compute_metrics=metrics,
    )
    entry["num_processes"] = trainer.accelerator.num_processes
    entry["world_size"] = trainer.args.world_size
    entry["distributed_type"] = str(trainer.accelerator.distributed_type)
    entry["eval_before_train"] = trainer.evaluate()["eval_ce"]  # shards the model before train() does
    with torch.no_grad():
        entry["ref_eval_before_train"] = F.cross_entropy(initial(input_ids=evals.x).logits, evals.y).item()
    trainer.train()
    entry["checkpoints"] = sorted(p.name for p in (work / "parity").iterdir() if p.name.startswith("checkpoint-"))
    got = full_params(trainer.model)
    want, norms, ref_model = reference_sgd(initial, train, STEPS, GLOBAL_BATCH, 0.1, CLIP)
    start = {n: p.detach() for n, p in initial.named_parameters()}
    entry["param_rel_diff"] = vector_rel_diff(got, want)
    entry["update_rel_diff"] = vector_rel_diff(got, want, start)
    entry["update_size"] = vector_rel_diff(start, want)  # how far training moved: the check is not vacuous
    entry["grad_norms"] = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    entry["ref_norms"] = norms
    entry["eval"] = trainer.evaluate()
    entry["seen"] = seen
    with torch.no_grad():
        logits = ref_model(input_ids=evals.x).logits
    entry["ref_eval"] = {
        "ce": F.cross_entropy(logits, evals.y).item(),
        "acc": (logits.argmax(-1) == evals.y).float().mean().item(),
    }
    out = work / "parity_saved"
    trainer.save_model(str(out))
    if _rank0():
        loaded = transformers.BertForSequenceClassification.from_pretrained(out)
        entry["saved_files"] = sorted(p.name for p in out.iterdir())
        entry["saved_rel_diff"] = vector_rel_diff({n: p.detach() for n, p in loaded.named_parameters()}, got)


def checkpoints(entry: dict, work: Path) -> None:
    """save_steps + save_total_limit + load_best_model_at_end; then a resume from the newest committed
    checkpoint (a partial checkpoint-6 beside it) must end where the uninterrupted run ended."""
    run1, run2 = work / "run1", work / "run2"
    calls = []

    def first_eval_best(p) -> dict:  # the first evaluation (step 2) scores best: the best is not the last
        calls.append(1)
        return {"score": 1.0 if len(calls) == 1 else 0.0}

    snaps = Snapshots((2, 6), copy_step=4, copy_to=run2)
    if _rank0():
        run2.mkdir(parents=True)
    trainer = FSDP2Trainer(
        model=bert(0),
        args=checkpoint_args(
            run1,
            eval_strategy="steps",
            eval_steps=2,
            load_best_model_at_end=True,
            metric_for_best_model="score",
            greater_is_better=True,
        ),
        train_dataset=Tokens(48, 3),
        eval_dataset=Tokens(6, 4),
        compute_metrics=first_eval_best,
        callbacks=[snaps],
    )
    trainer.train()
    entry["committed_run1"] = sorted(committed_checkpoints(run1))
    entry["best"] = Path(trainer.state.best_model_checkpoint).name
    entry["best_loaded_rel_diff"] = vector_rel_diff(full_params(trainer.model), snaps.params[2])
    entry["step6_vs_step2"] = vector_rel_diff(snaps.params[6], snaps.params[2])
    entry["files"] = sorted(p.name for p in (run1 / "checkpoint-6").iterdir())

    if _rank0():  # what a killed non-atomic writer leaves, and an unfinished save of ours
        (run2 / "checkpoint-6").mkdir()
        (run2 / "checkpoint-6" / "model.safetensors").write_bytes(b"")
        (run2 / ".tmp-checkpoint-8").mkdir()
    dist.barrier()
    entry["latest_run2"] = Path(latest_checkpoint(run2)).name
    snaps2 = Snapshots((6,))
    resumed = FSDP2Trainer(model=bert(123), args=checkpoint_args(run2), train_dataset=Tokens(48, 3), callbacks=[snaps2])
    try:
        resumed.train(resume_from_checkpoint=str(run2 / "checkpoint-6"))
    except FileNotFoundError as exc:
        entry["partial_error"] = str(exc)
    resumed.train(resume_from_checkpoint=True)
    entry["resume_rel_diff"] = vector_rel_diff(snaps2.params[6], snaps.params[6])
    entry["resume_global_step"] = resumed.state.global_step
    entry["committed_run2"] = sorted(committed_checkpoints(run2))


BF16_LR = 1.0  # large enough that the second step's loss shows the first step's update


def bf16(entry: dict, work: Path) -> None:
    """bf16=True: the FSDP2 bf16 policy (bf16 compute, fp32 parameters and gradient reduction), no
    autocast; the losses of two SGD steps against the policy written out in one process on the samples
    each rank saw (tests/_precision.py: each rank's batch on a bf16 copy, fp32 gradients averaged)."""
    model = bert(0)
    initial, data = copy.deepcopy(model), Tokens(8, 5)
    dtypes, seen = [], []
    model.classifier.register_forward_pre_hook(lambda m, inp: dtypes.append(str(inp[0].dtype)))
    model.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append((kwargs["input_ids"][:, 0] - 10).tolist()), with_kwargs=True
    )  # token 0 of sample i is 10 + i
    training_args = args(
        work / "bf16", bf16=True, use_cpu=True, max_steps=2, learning_rate=BF16_LR, max_grad_norm=0.0
    )  # max_grad_norm=0: no clipping, which would hide a wrong scale of the gradients
    trainer = FSDP2Trainer(model=model, args=training_args, train_dataset=data)
    entry["accelerator_precision"] = trainer.accelerator.mixed_precision
    entry["policy"] = str(trainer.accelerator.fsdp2_config.mixed_precision)
    out = trainer.train()
    entry["train_loss"] = out.training_loss
    entry["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    entry["compute_dtypes"] = sorted(set(dtypes))
    entry["param_dtypes"] = sorted({str(p.dtype) for p in trainer.model.parameters()})

    def loss(low, ids, labels):
        return low(input_ids=ids, labels=labels).loss

    ref, ref_losses = copy.deepcopy(initial), []
    for step_samples in zip(*gather(seen)):  # each step: every rank's samples
        batches = [[(data.x[rows], data.y[rows])] for rows in step_samples]
        with torch.no_grad():
            low = cast_copy(ref, torch.bfloat16)
            ref_losses.append(sum(loss(low, *b[0]).item() for b in batches) / len(batches))  # the logged mean
        grads = policy_grads(ref, batches, loss, torch.bfloat16)
        with torch.no_grad():
            for name, p in ref.named_parameters():
                p -= BF16_LR * grads[name]
    entry["ref_losses"] = ref_losses


class _SignalRank1(transformers.TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 2 and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # in step 3; the default action would kill this rank


def preemption(entry: dict, work: Path) -> None:
    """checkpoint_on_preemption: SIGTERM to rank 1 during step 3 -> every rank saves checkpoint-3 and stops."""
    trainer = FSDP2Trainer(
        model=bert(0),
        args=args(work / "preempt", max_steps=6),
        train_dataset=Tokens(48, 3),
        callbacks=[_SignalRank1()],
        fsdp_plugin=FSDP2Plugin(checkpoint_on_preemption=True),
    )
    trainer.train()
    trainer.accelerator._preemption.close()  # the flows after this one run in the same processes
    entry["global_step"], entry["preempted"] = gather(trainer.state.global_step), gather(trainer.preempted)
    entry["committed"] = sorted(committed_checkpoints(work / "preempt"))


def throughput(entry: dict, work: Path) -> None:
    """log_throughput=True, 4 steps of 2 sequences of 8 tokens per device: the training logs of each rank."""
    trainer = FSDP2Trainer(
        model=bert(0), args=args(work / "throughput", max_steps=4), train_dataset=Tokens(16, 6), log_throughput=True
    )
    trainer.train()
    entry["logs"] = gather([row for row in trainer.state.log_history if "loss" in row])
    plain = FSDP2Trainer(model=bert(0), args=args(work / "plain", max_steps=1), train_dataset=Tokens(4, 6))
    plain.train()
    entry["off_by_default"] = plain.accelerator.throughput is None and "mfu" not in plain.state.log_history[0]


FLOWS = [parity, checkpoints, bf16, preemption, throughput]


if __name__ == "__main__":
    main(FLOWS)
