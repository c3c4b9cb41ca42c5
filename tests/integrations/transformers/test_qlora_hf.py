"""QLoRA as users run it: a Hugging Face Llama loaded in NF4 with `BitsAndBytesConfig` (both quant
storages), PEFT LoRA on q_proj/v_proj, `shard_model(mixed_precision="bf16")` on 2 ranks. Each rank
holds half of the packed base; the model computes and trains like the same model in one process;
the merged export loads with `AutoModelForCausalLM.from_pretrained` as a float model."""

from __future__ import annotations

import pytest
import torch
from helpers.harness import run_distributed
from helpers.models import rel_diff, tiny_llama

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import fsdp2_strategy as f2  # noqa: E402

STORAGES = ("uint8", "bfloat16")
STEPS, LR, BATCH, SEQ, VOCAB = 2, 0.5, 4, 8, 64
# bf16 compute: the sharded model and one process run the same bf16 kernels but FSDP casts the fp32
# LoRA weights to bf16 before the forward (PEFT alone computes the adapters in fp32), so values agree
# to a few bf16 roundings (2**-8 = 0.4 % each), not bitwise. Measured (2 CPU ranks, both storages):
# logits 0.76 %, LoRA weights after 2 SGD steps 1.4 %, merged export vs the trained model 0.44 %.
BF16_TOL = 3e-2


def _save_base(folder: str) -> None:
    # 128 wide: bitsandbytes' CPU 4-bit matmul wants widths divisible by its block size.
    tiny_llama(VOCAB, hidden_size=128, intermediate_size=256).to(torch.bfloat16).save_pretrained(folder)


def _qlora(folder: str, storage: str):
    import peft

    quantisation = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=getattr(torch, storage),
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=quantisation, dtype=torch.bfloat16
    )
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian")
    return peft.get_peft_model(model, config)


def _batch():
    g = torch.Generator().manual_seed(2)
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _train(model, rank: int, world: int) -> list[float]:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    ids = _batch()[rank * BATCH // world : (rank + 1) * BATCH // world]
    losses = []
    for _ in range(STEPS):
        loss = _loss(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _lora(model) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def _packed_bytes(model) -> int:
    """Bytes of the 4-bit weights this process holds (a sharded one: its local shard)."""
    names = f2.shard.quantised_param_names(model)
    params = dict(model.named_parameters())
    return sum((params[n].to_local() if hasattr(params[n], "to_local") else params[n]).nbytes for n in names)


def _logits(model) -> torch.Tensor:
    # On a model of its own in both runs: after a no-grad forward this Hugging Face + PEFT + bitsandbytes
    # model gets no LoRA gradients in the next backward, sharded or not (seen with transformers 5.24).
    with torch.no_grad():
        return model(input_ids=_batch()).logits.float()


def _one_process(folder: str, storage: str) -> dict:
    model = _qlora(folder, storage)
    logits = _logits(_qlora(folder, storage))
    return {"bytes": _packed_bytes(model), "logits": logits, "losses": _train(model, 0, 1), "lora": _lora(model)}


def _world(folder: str, out: str) -> dict:
    import torch.distributed as dist

    results = {}
    for storage in STORAGES:
        model = f2.shard_model(_qlora(folder, storage), mixed_precision="bf16", log_plan=False)
        packed = _packed_bytes(model)
        logits = _logits(f2.shard_model(_qlora(folder, storage), mixed_precision="bf16", log_plan=False))
        losses = _train(model, dist.get_rank(), dist.get_world_size())
        f2.save_merged(model, f"{out}/{storage}")
        merged_logits = _logits(model)
        results[storage] = {
            "bytes": packed,
            "logits": logits,
            "losses": losses,
            "lora": _lora(model),
            "merged_logits": merged_logits,
        }
    return results


def test_a_hugging_face_qlora_model_shards_its_4bit_base_and_trains_like_one_process(tmp_path):
    folder = str(tmp_path / "base")
    _save_base(folder)
    reference = {s: _one_process(folder, s) for s in STORAGES}
    results = run_distributed(_world, 2, folder, str(tmp_path / "merged"), timeout=300)
    for storage in STORAGES:
        ref = reference[storage]
        assert ref["bytes"] > 0
        for r in (res[storage] for res in results):
            assert r["bytes"] <= 0.55 * ref["bytes"]  # half the packed base per rank (+ rounding)
            assert rel_diff(r["logits"], ref["logits"]) < BF16_TOL
            assert r["losses"][-1] < r["losses"][0]
            assert sorted(r["lora"]) == sorted(ref["lora"])
            assert max(rel_diff(r["lora"][n], ref["lora"][n]) for n in ref["lora"]) < BF16_TOL
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged" / storage))
        assert getattr(merged.config, "quantization_config", None) is None
        assert all(p.dtype == torch.bfloat16 for p in merged.parameters())  # dequantised to the loaded dtype
        with torch.no_grad():
            logits = merged(input_ids=_batch()).logits.float()
        # The merged float model computes what the trained QLoRA model computes (NF4 dequantised
        # exactly; the delta rounded to bf16 once).
        assert rel_diff(logits, results[0][storage]["merged_logits"]) < BF16_TOL


# --------------------------------------------------------------------------- quantised on load
QUANTISATION = dict(bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)


def _packed_weights(model) -> dict[str, torch.Tensor]:
    """Every 4-bit weight's packed bytes (a sharded one gathered), by the base model's name."""
    out = {}
    for name, p in model.named_parameters():
        if name in f2.shard.quantised_param_names(model):
            whole = p.full_tensor() if hasattr(p, "full_tensor") else p.data
            out[name.replace("base_model.model.", "").replace(".base_layer", "")] = whole.view(torch.uint8).reshape(-1)
    return out


def _quantised_on_load_world(folder: str) -> dict:
    import peft

    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    f2.to_4bit(model)  # nf4, double quantisation, bf16 compute, lm_head kept: as QUANTISATION says
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    model = f2.shard_model(model, mixed_precision="bf16", log_plan=False)
    f2.load_full_weights(model, folder)
    lora_b = [p.full_tensor() for n, p in model.named_parameters() if "lora_B" in n]
    return {
        "local_bytes": _packed_bytes(model),
        "packed": _packed_weights(model),
        "logits": _logits(model),
        "lora_b_max": max(b.abs().max().item() for b in lora_b),
    }


def test_a_qlora_model_built_on_meta_is_quantised_on_load_into_each_ranks_shards(tmp_path):
    folder = str(tmp_path / "base")
    _save_base(folder)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        folder,
        quantization_config=transformers.BitsAndBytesConfig(load_in_4bit=True, **QUANTISATION),
        dtype=torch.bfloat16,
    )
    # Before any eval forward: on CPU bitsandbytes' inference kernel repacks a weight in place.
    expected = _packed_weights(reference)
    reference.train()  # the portable 4-bit kernel, as the sharded layers use
    logits = _logits(reference)
    results = run_distributed(_quantised_on_load_world, 2, folder, timeout=300)
    total = sum(t.numel() for t in expected.values())
    for r in results:
        # The same bytes bitsandbytes writes for the whole model, half of them on each rank.
        assert sorted(r["packed"]) == sorted(expected) and len(expected) == 14  # 7 projections x 2 layers
        assert all(torch.equal(r["packed"][n], expected[n]) for n in expected)
        assert r["local_bytes"] <= 0.55 * total
        assert r["lora_b_max"] == 0.0  # PEFT's initialisation: the adapter starts as the identity
        assert rel_diff(r["logits"], logits) < BF16_TOL
