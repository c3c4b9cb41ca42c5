"""Flows of `FSDP2Trainer` under `accelerate launch --config_file fsdp2_full.yaml` (2 CPU processes):
FULL_STATE_DICT checkpoints and save_model, a PEFT (LoRA) model, and TRL's SFTTrainer; each flow checks
what it claims on every rank (`helpers.checks.Checks`), tests/integrations/transformers/test_transformers.py launches and reports.

Usage: accelerate launch --config_file fsdp2_full.yaml flows_full.py OUT.json WORK_DIR [flow,flow,...]
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
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
    tiny_llama,
    vector_rel_diff,
    word_tokenizer,
)
from helpers.checks import Checks

from fsdp2_strategy.integrations.transformers import (
    FSDP2Trainer,
    committed_checkpoints,
    fsdp2_trainer,
    latest_checkpoint,
)


def _rank0() -> bool:
    return dist.get_rank() == 0


def _loaded(model: torch.nn.Module) -> dict:
    return {n: p.detach() for n, p in model.named_parameters()}


def full_state_dict(entry: dict, work: Path) -> None:
    """fsdp_state_dict_type: FULL_STATE_DICT: the first checkpoint is written (with model.safetensors) and
    both it and save_model() load with from_pretrained."""
    training_args = args(work / "full", max_steps=2, save_strategy="steps", save_steps=2)
    # Without ACCELERATE_USE_CPU (and no GPU) TrainingArguments alone sees one process: the stock Trainer
    # would train each rank alone on all the data.
    entry["args_world_size_before"] = training_args.world_size
    trainer = FSDP2Trainer(model=bert(0), args=training_args, train_dataset=Tokens(8, 1))
    entry["world_size"] = training_args.world_size
    entry["num_processes"] = trainer.accelerator.num_processes
    entry["state_dict_type"] = trainer.accelerator.fsdp_plugin.state_dict_type.name
    trainer.train()
    got = full_params(trainer.model)
    trainer.save_model(str(work / "full_saved"))
    if _rank0():
        checkpoint = work / "full" / "checkpoint-2"
        entry["checkpoint_files"] = sorted(p.name for p in checkpoint.iterdir())
        from_ckpt = transformers.BertForSequenceClassification.from_pretrained(checkpoint)
        entry["checkpoint_rel_diff"] = vector_rel_diff(_loaded(from_ckpt), got)
        saved = transformers.BertForSequenceClassification.from_pretrained(work / "full_saved")
        entry["saved_files"] = sorted(p.name for p in (work / "full_saved").iterdir())
        entry["saved_rel_diff"] = vector_rel_diff(_loaded(saved), got)
    for key in ("checkpoint_files", "checkpoint_rel_diff", "saved_files", "saved_rel_diff"):
        entry[key] = rank0s(entry.get(key))
    check = Checks(entry)
    check.equal("world size 2", entry["world_size"], 2)
    check.equal("2 processes", entry["num_processes"], 2)
    if not torch.cuda.is_available():  # launched without ACCELERATE_USE_CPU, as a user's launch without GPU
        check.equal("TrainingArguments alone saw one process", entry["args_world_size_before"], 1)
    check.equal("FULL_STATE_DICT", entry["state_dict_type"], "FULL_STATE_DICT")
    files = [".metadata", "checksums.json", "model.safetensors", "config.json"]
    check.equal("the checkpoint holds the shards and the full weights", missing(files, entry["checkpoint_files"]), [])
    check.below("the checkpoint loads with from_pretrained (relative)", entry["checkpoint_rel_diff"], 1e-7)
    check.below("save_model loads with from_pretrained (relative)", entry["saved_rel_diff"], 1e-7)
    check.equal(
        "save_model wrote config and weights", missing(["config.json", "model.safetensors"], entry["saved_files"]), []
    )


def peft_lora(entry: dict, work: Path) -> None:
    """A LoRA model trains through FSDP2Trainer like one process (the adapters and the classifier copy,
    against SGD on the same global batches) and save_model() writes an adapter PeftModel loads."""
    from peft import LoraConfig, PeftModel, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], task_type="SEQ_CLS")
    model = get_peft_model(bert(0), lora)
    initial, data = copy.deepcopy(model), Tokens(12, 2)
    training_args = args(work / "peft", max_steps=3, learning_rate=0.5, train_sampling_strategy="sequential")
    trainer = FSDP2Trainer(model=model, args=training_args, train_dataset=data)
    trainer.train()
    after = full_params(trainer.model)
    # 3 steps of 2 per device x 2 processes, clipped at the default max_grad_norm=1.0, in one process.
    want, _, _ = reference_sgd(initial, data, 3, 4, 0.5, training_args.max_grad_norm)
    start = {n: p.detach() for n, p in initial.named_parameters()}
    trained = [n for n, p in initial.named_parameters() if p.requires_grad]
    entry["trained"] = trained
    entry["update_rel_diff"] = vector_rel_diff(*({n: d[n] for n in trained} for d in (after, want, start)))
    entry["update_size"] = vector_rel_diff({n: start[n] for n in trained}, {n: want[n] for n in trained})
    entry["frozen_unchanged"] = max(
        (after[n] - p.detach()).abs().max().item()
        for n, p in get_peft_model(bert(0), lora).named_parameters()
        if "lora_" not in n and "classifier" not in n
    )
    out = work / "peft_saved"
    trainer.save_model(str(out))
    if _rank0():
        entry["saved_files"] = sorted(p.name for p in out.iterdir())
        loaded = PeftModel.from_pretrained(bert(0), out)
        trained = {n: after[n] for n, _ in loaded.named_parameters() if "lora_" in n}
        entry["adapter_rel_diff"] = vector_rel_diff(_loaded(loaded), trained)
        entry["adapter_tensors"] = len(trained)
    for key in ("saved_files", "adapter_rel_diff", "adapter_tensors"):
        entry[key] = rank0s(entry.get(key))
    check = Checks(entry)
    # The adapters (LoRA A and B of query and value in both layers) and the classifier copy after 3 steps:
    # SGD in one process on the same global batches (measured 1.8e-07 of the update, which moved 10 %).
    check.equal("8 LoRA tensors trained", sum("lora_" in n for n in entry["trained"]), 8)
    check.that("the classifier copy trained", any("modules_to_save" in n for n in entry["trained"]), entry["trained"])
    check.below("the update equals one process's (relative)", entry["update_rel_diff"], TOL)
    check.that(
        "training moved the adapters (relative update > 0.01)", entry["update_size"] > 0.01, entry["update_size"]
    )
    check.equal("the base weights stayed frozen (max abs diff)", entry["frozen_unchanged"], 0.0)
    adapter = ["adapter_config.json", "adapter_model.safetensors"]
    check.equal("save_model wrote the adapter", missing(adapter, entry["saved_files"]), [])
    check.that(
        "save_model wrote no full weights", "model.safetensors" not in entry["saved_files"], entry["saved_files"]
    )
    check.equal("PeftModel loads 8 adapter tensors", entry["adapter_tensors"], 8)
    check.below("the loaded adapter equals the trained one (relative)", entry["adapter_rel_diff"], 1e-7)


SFT_LR = 0.5


def _sft_reference(initial: torch.nn.Module, fed: list, sft_args) -> tuple[list[float], dict]:
    """What SFTTrainer's steps promise, written out in one process: per step, the loss is the mean over
    every label token of the global batch (each rank's batch as the model received it); the gradients
    are those of each rank's batch on a bf16 copy (the bf16 policy, tests/helpers/precision.py), summed in fp32
    and divided by the global token count; SGD. Returns the losses and the parameters."""
    import torch.nn.functional as F

    ref = copy.deepcopy(initial)
    opt = torch.optim.SGD(ref.parameters(), lr=sft_args.learning_rate)
    dtype = torch.bfloat16 if sft_args.bf16 else torch.float32

    def loss(low, batch, scale):  # a rank's summed token losses x scale
        logits = low(**{k: v for k, v in batch.items() if k != "labels"}).logits[:, :-1]
        labels = batch["labels"][:, 1:]  # -100 (padding) is ignored
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum") * scale

    losses = []
    for batches in zip(*gather(fed)):  # each step: every rank's batch
        # / the global token count, x ranks: policy_grads averages over the ranks.
        scale = len(batches) / sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        with torch.no_grad():
            low = cast_copy(ref, dtype)
            losses.append(sum(loss(low, b, scale).item() for b in batches) / len(batches))
        grads = policy_grads(ref, [[(b, scale)] for b in batches], loss, dtype)
        for name, p in ref.named_parameters():
            p.grad = grads[name]
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach() for n, p in ref.named_parameters()}


def sft(entry: dict, work: Path) -> None:
    """TRL's SFTTrainer through fsdp2_trainer() on a tiny Llama: its losses and weights against the same
    steps written out in one process (`_sft_reference`), on the batches each rank's model received."""
    import trl
    from datasets import Dataset

    tokenizer = word_tokenizer()
    model = tiny_llama(len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    initial, fed = copy.deepcopy(model), []
    model.register_forward_pre_hook(
        lambda m, args, kwargs: fed.append({k: v for k, v in kwargs.items() if k != "num_items_in_batch"}),
        with_kwargs=True,
    )
    texts = ["the cat sat on the mat", "a dog ran under the log", "the big red dog sat", "a small blue cat ran"]
    dataset = Dataset.from_dict({"text": texts * 4})
    sft_args = trl.SFTConfig(
        output_dir=str(work / "sft"),
        max_steps=8,
        per_device_train_batch_size=2,
        optim="sgd",  # (not TRL's AdamW): its update scales with the gradients, so the reference sees their size
        learning_rate=SFT_LR,
        max_grad_norm=0.0,  # no clipping either, for the same reason
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to=[],
        max_length=16,
        disable_tqdm=True,
        save_strategy="no",
        dataloader_pin_memory=False,
        use_cpu=True,  # TRL defaults to bf16=True, which TrainingArguments accepts on CPU only with use_cpu
    )
    SFTTrainer = fsdp2_trainer(trl.SFTTrainer)
    trainer = SFTTrainer(model=model, args=sft_args, train_dataset=dataset, processing_class=tokenizer)
    entry["class"] = type(trainer).__name__
    entry["accelerator"] = type(trainer.accelerator).__name__
    trainer.train()
    entry["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    entry["ref_losses"], want = _sft_reference(initial, fed, sft_args)
    start = {n: p.detach() for n, p in initial.named_parameters()}
    entry["update_rel_diff"] = vector_rel_diff(full_params(trainer.model), want, start)
    entry["update_size"] = vector_rel_diff(start, want)
    entry["fed_keys"] = sorted(fed[0])
    out = work / "sft_saved"
    trainer.save_model(str(out))
    if _rank0():
        entry["reloads"] = type(transformers.AutoModelForCausalLM.from_pretrained(out)).__name__
    entry["reloads"] = rank0s(entry.get("reloads"))
    check = Checks(entry)
    check.equal("fsdp2_trainer builds FSDP2SFTTrainer", entry["class"], "FSDP2SFTTrainer")
    check.equal("on FSDP2Accelerator", entry["accelerator"], "FSDP2Accelerator")
    # Every step's loss and the trained weights are those of the same 8 SGD steps written out in one process
    # on the batches each rank's model received (bf16 policy, token mean over the global batch): measured
    # equal, the weights bitwise. The loss falls (2.83 to 1.50) and the weights moved 34 %.
    check.equal("8 logged losses", len(entry["losses"]), 8)
    check.close("every step's loss is one process's", entry["losses"], entry["ref_losses"], TOL)
    check.below("the update equals one process's (relative)", entry["update_rel_diff"], TOL)
    check.that("training moved the weights (relative update > 0.1)", entry["update_size"] > 0.1, entry["update_size"])
    check.that("the loss falls", entry["losses"][-1] < entry["losses"][0], entry["losses"])
    check.equal("save_model reloads as LlamaForCausalLM", entry["reloads"], "LlamaForCausalLM")


def resume_after_kill(entry: dict, work: Path) -> None:
    """Resume what killed.py left (run first, in the same WORK_DIR): the newest committed checkpoint, then
    the same end as an uninterrupted run."""
    killed = work / "killed"
    entry["left"] = sorted(p.name for p in killed.iterdir())
    entry["latest"] = Path(latest_checkpoint(killed)).name
    resumed = Snapshots((6,))
    FSDP2Trainer(
        model=bert(7),
        args=checkpoint_args(killed, save_total_limit=3),
        train_dataset=Tokens(48, 3),
        callbacks=[resumed],
    ).train(resume_from_checkpoint=True)
    whole = Snapshots((6,))
    FSDP2Trainer(
        model=bert(0), args=checkpoint_args(work / "whole"), train_dataset=Tokens(48, 3), callbacks=[whole]
    ).train()
    entry["resume_rel_diff"] = vector_rel_diff(resumed.params[6], whole.params[6])
    entry["committed_after"] = sorted(committed_checkpoints(killed))
    entry["left_after"] = sorted(p.name for p in killed.iterdir() if p.name.startswith("."))
    died = sorted(p.name for p in work.glob(f"{killed.name}.died_in_save.rank*"))
    check = Checks(entry)
    check.equal(
        "both processes died inside the save of checkpoint-6",
        died,
        [f"{killed.name}.died_in_save.rank{r}" for r in (0, 1)],
    )
    check.equal(
        "left: two committed checkpoints and the unfinished one",
        entry["left"],
        [".tmp-checkpoint-6", "checkpoint-2", "checkpoint-4"],
    )
    check.equal("the newest committed is checkpoint-4", entry["latest"], "checkpoint-4")
    check.below("the resumed run ends where the uninterrupted one did (relative)", entry["resume_rel_diff"], TOL)
    check.equal("checkpoint-6 committed after the resume", entry["committed_after"], [2, 4, 6])
    check.equal("nothing unfinished left", entry["left_after"], [])


FLOWS = [full_state_dict, peft_lora, sft, resume_after_kill]


if __name__ == "__main__":
    main(FLOWS)
