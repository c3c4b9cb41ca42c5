"""Flows of TRL's reinforcement-learning trainers on the engine under `accelerate launch --config_file
fsdp2_sharded.yaml` (2 CPU processes): GRPOTrainer (a rule-based reward, a reference model TRL builds
from the policy's path) and DPOTrainer (a reference model given as an object).

Each flow records, on every rank, the inputs and the loss of the first `compute_loss` and recomputes
that loss with TRL's own `compute_loss` on unsharded copies of the initial models (the same completions
and preference pairs: the sharded forward against the one-process forward); the collectives every
`generate` call ran; the reference model's groups, trainability and values before and after training;
and checks on every rank what it claims (`helpers.checks.Checks`): tests/integrations/transformers/test_trl_rl.py launches and reports.

Usage: accelerate launch --config_file fsdp2_sharded.yaml flows_rl.py OUT.json WORK_DIR [flow,flow,...]
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from common import TOL, main, tiny_llama, word_tokenizer
from helpers.checks import Checks
from helpers.comm import count_collectives

import fsdp2_strategy as f2
from fsdp2_strategy.integrations.transformers import fsdp2_trainer

PROMPTS = ["the cat", "a dog", "the big", "a small"]
DPO_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")  # what DPOTrainer asks its fused LM head for
# TOL: fp32, the sharded forward against the unsharded one (measured equal to the last digit).


def _check_reference_and_loss(check: Checks, entry: dict) -> None:
    """The reference model sharded per block for forward only and unchanged by training; the second step's
    loss equals TRL's own on unsharded models (at the first, GRPO's loss is 0 and DPO's log 2 whatever the
    models compute)."""
    # 3 decoder layers + the root, as the policy (TRL's own preparation: 1 group, the root).
    check.equal("the reference model is sharded per block (groups)", entry["ref_groups"], 4)
    check.equal("the reference model has no trainable parameter", entry["ref_trainable"], 0)
    check.that("the reference model is unchanged by training", entry["ref_unchanged"])
    loss, ref = entry["loss"], entry["ref_loss"]
    check.that(
        "the second step's loss equals TRL's on unsharded models (relative TOL)",
        abs(loss - ref) <= TOL * abs(ref),
        {"loss": loss, "ref_loss": ref},
    )


def _policy_folder(work: Path) -> Path:
    """A tiny Llama and its tokenizer saved by rank 0: TRL builds GRPO's reference model from this path."""
    folder = work / "policy"
    f2.init_distributed()
    if dist.get_rank() == 0:
        tok = word_tokenizer()
        llama = tiny_llama(len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, num_hidden_layers=3)
        llama.save_pretrained(folder)
        tok.save_pretrained(folder)
    dist.barrier()
    return folder


def _loss_at(trainer, call: int) -> dict:
    """Wrap `trainer.compute_loss`: the inputs and loss of its `call`-th call (from 0) land in the
    returned dict with the policy's weights then (gathered: every rank makes the same calls), and
    `again(model)` computes that call's loss with `model` holding those weights."""
    seen: dict = {}
    original, calls = trainer.compute_loss, [0]

    def recorded(model, inputs, *args, **kwargs):
        if calls[0] == call:
            kept = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in inputs.items()}
            weights = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}

            def again(other):
                other.load_state_dict(weights, strict=False)
                return original(other, kept, *args, **kwargs).item()

            seen["again"] = again
        loss = original(model, inputs, *args, **kwargs)
        if calls[0] == call:
            seen["loss"] = (loss[0] if isinstance(loss, tuple) else loss).item()
        calls[0] += 1
        return loss

    trainer.compute_loss = recorded
    return seen


def _generate_counts(model) -> list[dict]:
    """Wrap `model.generate`: the collectives of each call, and the tokens it generated."""
    calls: list[dict] = []
    original = model.generate

    def counted(*args, **kwargs):
        with count_collectives() as counts:
            out = original(*args, **kwargs)
        prompt = (kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).shape[1]
        calls.append({"gathers": counts["all_gather_single"], "tokens": out.shape[1] - prompt})
        return out

    model.generate = counted
    return calls


def _reference_report(ref) -> dict:
    return {
        "groups": sum(isinstance(m, torch.distributed.fsdp.FSDPModule) for m in ref.modules()),
        "trainable": sum(p.requires_grad for p in ref.parameters()),
        "values": {n: p.full_tensor().clone() for n, p in ref.named_parameters()},
    }


def grpo(entry: dict, work: Path) -> None:
    import trl
    from datasets import Dataset
    from trl.trainer import add_fused_lm_head

    folder = _policy_folder(work)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    initial = copy.deepcopy(model)
    config = trl.GRPOConfig(
        output_dir=str(work / "grpo"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=2,
        learning_rate=1e-2,
        beta=0.1,  # a reference model: TRL builds it from the policy's path
        use_cpu=True,
        bf16=False,
        report_to=[],
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        disable_tqdm=True,
        seed=0,
    )
    GRPOTrainer = fsdp2_trainer(trl.GRPOTrainer)

    def build(model, config):
        return GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **_: [float(c.count("cat")) for c in completions],
            args=config,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}),
            processing_class=tok,
        )

    trainer = build(model, config)
    # The second step's loss: at the first, the policy is the reference and every completion has the same
    # length, so GRPO's loss is 0 whatever the model computes.
    second, calls = _loss_at(trainer, 1), _generate_counts(trainer.model_wrapped)
    before = _reference_report(trainer.ref_model)
    trainer.train()
    after = _reference_report(trainer.ref_model)
    entry["backend"] = type(trainer._dist).__name__
    entry["generate_calls"] = calls
    entry["groups"] = sum(isinstance(m, torch.distributed.fsdp.FSDPModule) for m in trainer.model.modules())
    entry["ref_groups"], entry["ref_trainable"] = before["groups"], before["trainable"]
    entry["ref_unchanged"] = all(torch.equal(before["values"][n], after["values"][n]) for n in before["values"])
    entry["rewards"] = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    # That loss on this rank's completions, recomputed by TRL on an unsharded policy with the same weights
    # (the reference's log-probabilities and the advantages are in the recorded inputs).
    add_fused_lm_head(initial, temperature=trainer.temperature, outputs=("log_probs", "entropy"))
    entry["loss"], entry["ref_loss"] = second["loss"], second["again"](initial)
    # The Trainer's own resume: a new policy from the path, checkpoint-2 restored, one more step.
    config.max_steps = 3
    resumed = build(transformers.AutoModelForCausalLM.from_pretrained(folder), config)
    resumed.train(resume_from_checkpoint=True)
    entry["resumed_step"] = resumed.state.global_step
    entry["resumed_ref_groups"] = _reference_report(resumed.ref_model)["groups"]
    check = Checks(entry)
    check.equal("generate on the gathering backend", entry["backend"], "GatheringBackend")
    # Two steps, one generate each, 6 new tokens: the groups were gathered before generate began (TRL's
    # summon_full_params is f2.gathered here) and no all-gather ran while decoding.
    check.equal("no all-gather while generating 6 tokens, twice", calls, [{"gathers": 0, "tokens": 6}] * 2)
    check.equal("the policy is sharded per block (groups)", entry["groups"], 4)
    _check_reference_and_loss(check, entry)
    check.that("the second step's loss is not 0", entry["loss"] != 0.0, entry["loss"])
    check.equal("the Trainer's resume: checkpoint-2 restored, then one more step", entry["resumed_step"], 3)
    check.equal("the resumed reference model is sharded per block", entry["resumed_ref_groups"], 4)


def dpo(entry: dict, work: Path) -> None:
    import trl
    from datasets import Dataset
    from trl.trainer import add_fused_lm_head

    folder = _policy_folder(work)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder)
    initial, initial_ref = copy.deepcopy(model), copy.deepcopy(reference)
    pairs = {
        "prompt": PROMPTS * 2,
        "chosen": [" sat on the mat", " ran under the log", " red dog sat", " blue cat ran"] * 2,
        "rejected": [" the the the", " a a a", " on on on", " mat mat mat"] * 2,
    }
    config = trl.DPOConfig(
        output_dir=str(work / "dpo"),
        per_device_train_batch_size=2,
        max_steps=2,
        learning_rate=1e-2,
        use_cpu=True,
        bf16=False,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = fsdp2_trainer(trl.DPOTrainer)(
        model=model, ref_model=reference, args=config, train_dataset=Dataset.from_dict(pairs), processing_class=tok
    )
    second = _loss_at(trainer, 1)  # at the first step the policy is the reference: the loss is log 2
    before = _reference_report(trainer.ref_model)
    trainer.train()
    after = _reference_report(trainer.ref_model)
    entry["ref_groups"], entry["ref_trainable"] = before["groups"], before["trainable"]
    entry["ref_unchanged"] = all(torch.equal(before["values"][n], after["values"][n]) for n in before["values"])
    entry["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    # That loss recomputed by TRL with both models unsharded (the policy's weights of that step), on the
    # same preference pairs; TRL patched both models' forward with its fused LM head: the copies too.
    add_fused_lm_head(initial, outputs=DPO_OUTPUTS)
    add_fused_lm_head(initial_ref)
    sharded_ref = trainer.ref_model
    trainer.__dict__["_f2_ref_model"] = initial_ref.eval()
    entry["loss"], entry["ref_loss"] = second["loss"], second["again"](initial)
    trainer.__dict__["_f2_ref_model"] = sharded_ref
    check = Checks(entry)
    _check_reference_and_loss(check, entry)
    check.that(
        "the second step's loss is not log 2 (abs diff > 1e-6)",
        abs(entry["loss"] - 0.6931471805599453) > 1e-6,
        entry["loss"],
    )


FLOWS = [grpo, dpo]


if __name__ == "__main__":
    main(FLOWS)
