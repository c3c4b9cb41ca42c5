"""Flows of `FSDP2Trainer` under `accelerate launch --config_file fsdp2_sharded.yaml` (2 CPU processes).

Usage: accelerate launch --config_file CONFIG flows.py OUT.json WORK_DIR [flow,flow,...]

Each flow checks what it claims on every rank (`helpers.checks.Checks`) and every rank writes its report
(OUT.rankN.json); tests/integrations/transformers/test_transformers.py launches and reports.
"""

from __future__ import annotations

import copy
import math
import os
import shutil
import signal
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from common import (
    TOL,
    Snapshots,
    Tokens,
    args,
    bert,
    cast_copy,
    checkpoint_args,
    full_params,
    gather,
    main,
    missing,
    policy_grads,
    rank0s,
    reference_sgd,
    vector_rel_diff,
)
from helpers.checks import Checks
from helpers.untrusted import plant

import fsdp2_strategy as f2
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
    entry["saved_files"], entry["saved_rel_diff"] = rank0s([entry.get("saved_files"), entry.get("saved_rel_diff")])
    check = Checks(entry)
    check.equal("2 processes", entry["num_processes"], 2)
    check.equal("world size 2", entry["world_size"], 2)
    check.equal("FSDP distributed type", entry["distributed_type"], "DistributedType.FSDP")
    # Training moved the weights: the comparison is not vacuous.
    check.that("training moved the weights (relative update > 1e-4)", entry["update_size"] > 1e-4, entry["update_size"])
    check.below("parameters equal one process's (relative)", entry["param_rel_diff"], TOL)
    check.below("the update equals one process's (relative)", entry["update_rel_diff"], TOL)
    # max_grad_norm: the global norm before clipping is the one-process norm, and clipping happened.
    check.that("clipping happened on every step (norms > 0.05)", all(n > 0.05 for n in norms), norms)
    check.equal("3 logged gradient norms", len(entry["grad_norms"]), 3)
    check.close("the norms before clipping are one process's", entry["grad_norms"], norms, TOL)
    # evaluate() sees every sample once.
    check.close(
        "evaluate before train equals the initial model's loss",
        entry["eval_before_train"],
        entry["ref_eval_before_train"],
        TOL,
    )
    # Saving after evaluate() prepared the model first (the Trainer's free_memory() forgets it).
    check.equal("the checkpoint after evaluate() is saved", entry["checkpoints"], ["checkpoint-3"])
    check.equal("evaluate sees the 11 samples once (the padded duplicate dropped)", seen, list(range(11)))
    check.close("evaluate's loss is one process's", entry["eval"]["eval_ce"], entry["ref_eval"]["ce"], TOL)
    check.within(
        "evaluate's accuracy is one process's (abs diff)",
        abs(entry["eval"]["eval_acc"] - entry["ref_eval"]["acc"]),
        0,
        1e-7,
    )
    # save_model() reads back with from_pretrained.
    check.equal(
        "save_model wrote config and weights", missing(["config.json", "model.safetensors"], entry["saved_files"]), []
    )
    check.below("from_pretrained loads the trained weights (relative)", entry["saved_rel_diff"], 1e-7)


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
    check = Checks(entry)
    entry["partial_error"] = check.raises(
        "resuming a partial checkpoint is refused",
        lambda: resumed.train(resume_from_checkpoint=str(run2 / "checkpoint-6")),
        FileNotFoundError,
        "not a committed FSDP2Trainer checkpoint",
    )
    # A scheduler.pt that runs code when unpickled (checksums rewritten to match): refused on every
    # rank naming the file, nothing run, the model unchanged.
    untrusted, marker = work / "untrusted", work / "untrusted_ran"
    if _rank0():
        shutil.copytree(run2 / "checkpoint-4", untrusted / "checkpoint-4")
        plant(untrusted / "checkpoint-4" / "scheduler.pt", marker)
    dist.barrier()
    before = full_params(resumed.model)
    entry["untrusted_error"] = check.raises(
        "a scheduler.pt that runs code is refused, naming the file, the type and the switch",
        lambda: resumed.train(resume_from_checkpoint=str(untrusted / "checkpoint-4")),
        f2.UntrustedCheckpointError,
        "scheduler.pt",
        "system",
        "add_safe_globals",
    )
    entry["untrusted_ran"] = marker.exists()
    entry["untrusted_changed"] = vector_rel_diff(full_params(resumed.model), before)
    check.that("the payload did not run", not entry["untrusted_ran"])
    check.equal("the model is unchanged", entry["untrusted_changed"], 0.0)
    resumed.train(resume_from_checkpoint=True)
    entry["resume_rel_diff"] = vector_rel_diff(snaps2.params[6], snaps.params[6])
    entry["resume_global_step"] = resumed.state.global_step
    entry["committed_run2"] = sorted(committed_checkpoints(run2))
    # Checkpoints rotate among the committed ones and keep the best.
    check.equal("save_total_limit=2 keeps the newest and the best (step 2)", entry["committed_run1"], [2, 6])
    check.equal("the best checkpoint is step 2's", entry["best"], "checkpoint-2")
    check.equal("the best is loaded at the end (relative diff)", entry["best_loaded_rel_diff"], 0.0)
    check.that("loading the best changed the weights", entry["step6_vs_step2"] > 1e-3, entry["step6_vs_step2"])
    files = [".metadata", "checksums.json", "trainer_state.json", "scheduler.pt", "rng_state_1.pth"]
    check.equal("a checkpoint holds every file", missing(files, entry["files"]), [])
    # A resume skips the partial checkpoint and continues exactly.
    check.equal("the newest committed is checkpoint-4 (checkpoint-6 is partial)", entry["latest_run2"], "checkpoint-4")
    check.equal("the resumed run ends at step 6", entry["resume_global_step"], 6)
    check.below("the resumed run ends where the uninterrupted one did (relative)", entry["resume_rel_diff"], TOL)
    check.equal("the partial checkpoint-6 was replaced by a committed one", entry["committed_run2"], [4, 6])


BF16_LR = 1.0  # large enough that the second step's loss shows the first step's update


def bf16(entry: dict, work: Path) -> None:
    """bf16=True: the FSDP2 bf16 policy (bf16 compute, fp32 parameters and gradient reduction), no
    autocast; the losses of two SGD steps against the policy written out in one process on the samples
    each rank saw (tests/helpers/precision.py: each rank's batch on a bf16 copy, fp32 gradients averaged)."""
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
    check = Checks(entry)
    check.equal("accelerator precision bf16", entry["accelerator_precision"], "bf16")
    check.equal("the bf16 policy", entry["policy"], "bf16")
    check.equal("bf16 compute", entry["compute_dtypes"], ["torch.bfloat16"])
    check.equal("fp32 parameters", entry["param_dtypes"], ["torch.float32"])
    # Each step's loss (the mean over the ranks) is the policy's, written out in one process on the samples
    # each rank saw, up to one bf16 rounding (measured: equal); the second step shows the first's update
    # (without it, or with the gradients twice or half as large, the second loss moves by 0.06 or more).
    check.equal("2 logged losses", len(entry["losses"]), 2)
    check.close("each step's loss is the policy's, within one bf16 rounding", entry["losses"], ref_losses, 2**-7)
    check.close("the train loss is the mean of the policy's", entry["train_loss"], sum(ref_losses) / 2, 2**-7)


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
    check = Checks(entry)
    check.equal("every rank stops at step 3", entry["global_step"], [3, 3])
    check.equal("every rank is preempted", entry["preempted"], [True, True])
    check.equal("checkpoint-3 committed", entry["committed"], [3])


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
    check = Checks(entry)
    check.that("off by default", entry["off_by_default"])
    for rank, logs in enumerate(entry["logs"]):  # each rank's log history
        check.equal(f"rank {rank}: a log row per step", [row["step"] for row in logs], [1, 2, 3, 4])
        # The first step starts the clock: nothing to report yet.
        check.that(f"rank {rank}: no mfu at the first step", "mfu" not in logs[0], logs[0])
        for row in logs[1:]:
            at = f"rank {rank}, step {row['step']}"
            # 2 sequences of 8 tokens a step on each rank, counted by the model's forward.
            tokens = row.get("tokens_per_s", math.nan) * row.get("step_time_s", math.nan)
            check.close(f"{at}: tokens_per_s x step_time_s = 16 tokens", tokens, 16, 1e-6)
            check.that(f"{at}: 0 < mfu < 1", 0 < row.get("mfu", math.nan) < 1, row.get("mfu"))
            check.that(f"{at}: peak memory > 0", row.get("peak_memory_gib", 0) > 0, row.get("peak_memory_gib"))


CP_SEQ = 128


class LongRows(torch.utils.data.Dataset):
    """4 sequences of a causal LM; the first 20 labels of row 0 have no target (uneven token counts)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(3, 64, (4, CP_SEQ), generator=g)
        self.labels = self.ids.clone()
        self.labels[0, :20] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def context_parallel(entry: dict, work: Path) -> None:
    """`TrainingArguments(parallelism_config=ParallelismConfig(cp_size=2))`: each rank's step holds
    half of every sequence; 2 SGD steps equal one process on whole sequences (a Llama, SDPA, GQA)."""
    from accelerate.parallelism_config import ParallelismConfig
    from helpers.models import tiny_llama

    check = Checks(entry)

    def llama():
        return tiny_llama(
            64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CP_SEQ, attn_implementation="sdpa"
        )

    data = LongRows()
    shapes, rows = [], []
    trainer = FSDP2Trainer(
        model=llama(),
        args=args(
            work / "cp",
            parallelism_config=ParallelismConfig(dp_shard_size=1, cp_size=2),
            max_steps=2,
            max_grad_norm=0.0,
        ),
        train_dataset=data,
    )
    stock_split, stock_loss = trainer._prepare_context_parallel_inputs, trainer.compute_loss

    def whole(model, inputs):  # the whole batch, before the split: which rows this step trains on
        rows.append([next(i for i in range(len(data)) if torch.equal(data.ids[i], r)) for r in inputs["input_ids"]])
        return stock_split(model, inputs)

    def split(model, inputs, *a, **kw):
        shapes.append(list(inputs["input_ids"].shape))
        return stock_loss(model, inputs, *a, **kw)

    trainer._prepare_context_parallel_inputs, trainer.compute_loss = whole, split
    trainer.train()
    reference = llama()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in rows:  # one process on the same global batches, whole sequences
        reference(input_ids=data.ids[step], labels=data.labels[step]).loss.backward()
        opt.step()
        opt.zero_grad()
    check.equal("each rank's step holds half of every sequence", shapes, [[2, CP_SEQ // 2]] * 2)
    check.below(
        "parameters after 2 steps equal one process on whole sequences (relative)",
        vector_rel_diff(full_params(trainer.model), {n: p.detach() for n, p in reference.named_parameters()}),
        TOL,
    )


FLOWS = [parity, checkpoints, bf16, preemption, throughput, context_parallel]


if __name__ == "__main__":
    main(FLOWS)
