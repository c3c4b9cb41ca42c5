"""PEFT LoRA on the core: frozen base in the compute dtype, gradients and reductions for the adapter
only, trainable-only checkpoints that refuse another base, and the adapter / merged weights written
from a live sharded model and from a checkpoint, loaded back by PEFT and transformers.

One 2-rank world builds a tiny BERT classifier with LoRA on query/value (the classifier trained
through `modules_to_save`) and checks everything against one process on the same global batch.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from helpers.comm import observe_collectives
from helpers.harness import run_distributed
from helpers.models import rel_diff

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import fsdp2_strategy as f2  # noqa: E402
from fsdp2_strategy.checkpoint.trainable import FROZEN_BASE  # noqa: E402

STEPS, LR, GLOBAL_BATCH, SEQ, VOCAB = 3, 0.5, 8, 12, 100
TOL = 1e-5


def tiny_bert(seed: int = 0) -> torch.nn.Module:
    """A BERT classifier built from a config (no download), dropout off so runs compare exactly."""
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
    )
    return transformers.BertForSequenceClassification(config)


def lora(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["query", "value"], lora_dropout=0.0, task_type="SEQ_CLS"
    )
    return peft.get_peft_model(model, config)


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g), torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)


def train(model, optimizer, ids, labels, steps: int = STEPS) -> list[float]:
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(input_ids=ids).logits, labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def sgd(model) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.9)


def local_rows(tensor: torch.Tensor) -> torch.Tensor:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    per = tensor.shape[0] // world
    return tensor[rank * per : (rank + 1) * per]


def full_params(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        out[name] = (t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t).clone()
    return out


def padded_numel(p: torch.Tensor, world: int) -> int:
    rows = -(-p.shape[0] // world) * world
    return rows * (p.numel() // p.shape[0])


def _lora_world(tmp: str) -> dict:
    from torch.distributed.tensor import DTensor

    tmp_path = Path(tmp)
    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    ids, labels = batch()
    if rank == 0:
        tiny_bert().save_pretrained(tmp_path / "base")  # the "pretrained" base, for export_peft(base=)
    out: dict = {}

    # 1. fp32 parity with one process; reduce-scatter bytes are the adapter's only.
    ref = lora(tiny_bert())
    model = f2.shard_model(copy.deepcopy(ref), log_plan=False)
    ref_losses = train(ref, sgd(ref), ids, labels)
    sizes = []
    with observe_collectives(
        lambda name, args, kw: sizes.append(args[1].numel()) if name.startswith("reduce_scatter") else None
    ):
        opt = sgd(model)
        train(model, opt, local_rows(ids), local_rows(labels), steps=1)
    train(model, opt, local_rows(ids), local_rows(labels), steps=STEPS - 1)
    got, want = full_params(model), dict(ref.named_parameters())
    trainable = [n for n, p in ref.named_parameters() if p.requires_grad]
    out["parity"] = max(rel_diff(got[n], want[n].detach()) for n in trainable)
    out["frozen_unchanged"] = all(
        torch.equal(got[n], want[n].detach()) for n, p in ref.named_parameters() if not p.requires_grad
    )
    out["reduce_scatter_numel"] = sum(sizes)
    out["trainable_padded_numel"] = sum(padded_numel(p, world) for p in ref.parameters() if p.requires_grad)
    out["frozen_numel"] = sum(p.numel() for p in ref.parameters() if not p.requires_grad)
    out["trainable_numel"] = sum(p.numel() for p in ref.parameters() if p.requires_grad)
    out["ref_losses"] = ref_losses

    # 2. save_pretrained is guarded; the adapter and merged weights from the live model.
    try:
        model.save_pretrained(tmp_path / "bad")
        out["guard"] = "no error"
    except RuntimeError as exc:
        out["guard"] = str(exc)
    f2.save_peft_adapter(model, tmp_path / "adapter")
    f2.save_merged(model, tmp_path / "merged")
    # The weight stream an inference engine loads: merged per layer as it goes, one gather per tensor.
    gathers, full_tensor = [], DTensor.full_tensor
    DTensor.full_tensor = lambda self, *a, **kw: gathers.append(1) or full_tensor(self, *a, **kw)
    try:
        stream = f2.full_weights(model, device="cpu")
        out["stream_gathers_before_first"] = len(gathers)
        first = next(stream)
        out["stream_gathers_for_first"] = len(gathers)
        streamed = dict([first, *stream])
    finally:
        DTensor.full_tensor = full_tensor
    merged_ref = copy.deepcopy(ref).merge_and_unload().state_dict()
    out["stream_names"] = sorted(streamed) == sorted(merged_ref)
    out["stream_err"] = max(rel_diff(streamed[n], merged_ref[n]) for n in merged_ref)
    plain = tiny_bert()
    plain_sharded = f2.shard_model(copy.deepcopy(plain), log_plan=False)
    plain_stream = dict(f2.full_weights(plain_sharded))
    out["plain_stream_exact"] = plain_stream.keys() == plain.state_dict().keys() and all(
        torch.equal(plain_stream[k], v) for k, v in plain.state_dict().items()
    )
    # rank0_only: the merged stream gathered on rank 0 alone (no all-gather; the others get None), into a
    # plain transformers model there, which then equals the merged reference.
    DTensor.full_tensor = lambda self, *a, **kw: gathers.append(1) or full_tensor(self, *a, **kw)
    try:
        gathers.clear()
        to_rank0 = dict(f2.full_weights(model, device="cpu", rank0_only=True))
        out["rank0_stream_all_gathers"] = len(gathers)
    finally:
        DTensor.full_tensor = full_tensor
    if rank == 0:
        engine = copy.deepcopy(ref).merge_and_unload()
        engine.load_state_dict(to_rank0)
        out["rank0_stream_err"] = max(rel_diff(v, merged_ref[k]) for k, v in engine.state_dict().items())
    else:
        out["rank0_stream_none"] = sorted(to_rank0) == sorted(merged_ref) and all(v is None for v in to_rank0.values())

    # 3. Trainable-only checkpoint ("auto" for PEFT): resume continues exactly; another base is refused.
    ckpt = f2.Checkpointer(tmp_path / "ckpt")
    ckpt.save(STEPS, model=model, optimizer=opt)
    full = f2.Checkpointer(tmp_path / "ckpt_full", trainable_only=False)
    full.save(STEPS, model=model, optimizer=opt)
    resumed = f2.shard_model(lora(tiny_bert(), seed=7), log_plan=False)  # other adapter init, same base
    resumed_opt = sgd(resumed)
    ckpt.load(model=resumed, optimizer=resumed_opt)
    more = train(model, opt, local_rows(ids), local_rows(labels), steps=2)
    more_resumed = train(resumed, resumed_opt, local_rows(ids), local_rows(labels), steps=2)
    a, b = full_params(model), full_params(resumed)
    out["resume"] = max(rel_diff(a[n], b[n]) for n in a)
    out["resume_losses"] = (more, more_resumed)
    other_base = f2.shard_model(lora(tiny_bert(seed=5)), log_plan=False)
    try:
        ckpt.load(model=other_base)
        out["other_base"] = "loaded"
    except ValueError as exc:
        out["other_base"] = str(exc)
    # 4. bf16 compute: the frozen base stored in bf16 computes what an fp32-stored base computes.
    losses, frozen_bytes = {}, {}
    for frozen_dtype in (None, "auto"):
        m = f2.shard_model(lora(tiny_bert()), mixed_precision="bf16", frozen_dtype=frozen_dtype, log_plan=False)
        losses[str(frozen_dtype)] = train(m, sgd(m), local_rows(ids), local_rows(labels))
        frozen_bytes[str(frozen_dtype)] = sum(
            p.to_local().numel() * p.element_size() for p in m.parameters() if not p.requires_grad
        )
        out[f"dtypes_{frozen_dtype}"] = sorted(
            {(p.requires_grad, str(p.dtype).removeprefix("torch.")) for p in m.parameters()}
        )
    out["bf16_losses"], out["frozen_bytes"] = losses, frozen_bytes
    return out


@pytest.fixture(scope="module")
def lora_world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peft")
    return tmp, run_distributed(_lora_world, 2, str(tmp), timeout=300)


def test_lora_trains_like_one_process_and_reduces_only_the_adapter(lora_world):
    _, results = lora_world
    for rank, r in enumerate(results):
        assert r["parity"] < TOL, (rank, r["parity"])
        assert r["frozen_unchanged"], rank
        # FSDP2 reduce-scatters only gradients that exist: the adapter's and the classifier copy's.
        assert r["reduce_scatter_numel"] == r["trainable_padded_numel"], (rank, r)
        assert r["reduce_scatter_numel"] * 10 < r["frozen_numel"], rank


def test_frozen_base_in_bf16_computes_the_same(lora_world):
    _, results = lora_world
    for rank, r in enumerate(results):  # each rank's own batch, shards and bytes
        assert r["bf16_losses"]["None"] == r["bf16_losses"]["auto"], rank  # bitwise: FSDP casts to bf16 either way
        assert r["frozen_bytes"]["auto"] * 2 == r["frozen_bytes"]["None"], (rank, r["frozen_bytes"])
        assert r["dtypes_auto"] == [(False, "bfloat16"), (True, "float32")], rank
        assert r["dtypes_None"] == [(False, "float32"), (True, "float32")], rank


def test_trainable_only_checkpoint_resumes_and_refuses_another_base(lora_world):
    tmp, results = lora_world
    for rank, r in enumerate(results):
        assert r["resume"] == 0.0, (rank, r["resume"])
        assert r["resume_losses"][0] == r["resume_losses"][1], rank  # this rank's batch, continued and resumed
        assert "trained on another frozen base" in r["other_base"] and "different values" in r["other_base"], rank
    r = results[0]
    info = f2.inspect_checkpoint(tmp / "ckpt")
    saved = [k for k in info.tensors if k.startswith("model.")]
    assert saved and all(("lora_" in k or "modules_to_save" in k) for k in saved), saved
    assert f"{FROZEN_BASE}.model" in info.other_keys
    # The model's stored tensors are exactly the trainable parameters (the full save: all of them).
    stored = sum(torch.Size(shape).numel() for k, (shape, _) in info.tensors.items() if k.startswith("model."))
    assert stored == r["trainable_numel"], (stored, r["trainable_numel"])
    full = f2.inspect_checkpoint(tmp / "ckpt_full").tensors
    assert sum(torch.Size(s).numel() for k, (s, _) in full.items() if k.startswith("model.")) == (
        r["trainable_numel"] + r["frozen_numel"]
    )


def test_save_pretrained_on_a_sharded_model_names_what_to_call(lora_world):
    _, results = lora_world
    for r in results:
        assert "save_peft_adapter" in r["guard"] and "save_merged" in r["guard"]


def _reference(steps: int = STEPS):
    ids, labels = batch()
    ref = lora(tiny_bert())
    train(ref, sgd(ref), ids, labels, steps)
    return ref.eval(), ids


def test_full_weight_stream_is_the_merged_model_one_tensor_at_a_time(lora_world):
    _, results = lora_world
    for rank, r in enumerate(results):
        # The same names and values as PEFT's merge_and_unload of the one-process run (trained alike).
        assert r["stream_names"] and r["stream_err"] < TOL, (rank, r["stream_err"])
        # Lazy: nothing gathered by the call, one tensor for the first item (the embedding).
        assert (r["stream_gathers_before_first"], r["stream_gathers_for_first"]) == (0, 1), (rank, r)
        assert r["plain_stream_exact"], rank
        # rank0_only: gathered on rank 0 alone (dist.gather, no all-gather), loaded there into a plain
        # transformers model equal to the merged reference; the other rank receives nothing.
        assert r["rank0_stream_all_gathers"] == 0, (rank, r["rank0_stream_all_gathers"])
        if rank == 0:
            assert r["rank0_stream_err"] < TOL, r["rank0_stream_err"]
        else:
            assert r["rank0_stream_none"]


def test_adapter_and_merged_weights_load_in_peft_and_transformers(lora_world, tmp_path):
    tmp, _ = lora_world
    ref, ids = _reference()
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        for folder in (tmp / "adapter", f2.export_peft(tmp / "ckpt", tmp_path / "adapter_from_ckpt")):
            loaded = peft.PeftModel.from_pretrained(tiny_bert(), folder).eval()
            assert rel_diff(loaded(input_ids=ids).logits, want) < TOL, folder
        cls = transformers.AutoModelForSequenceClassification
        merged_dirs = (
            tmp / "merged",
            f2.export_peft(tmp / "ckpt", tmp_path / "m1", merged=True, base=tmp / "base"),
            f2.export_peft(tmp / "ckpt_full", tmp_path / "m2", merged=True),
        )
        for folder in merged_dirs:
            if not (folder / "config.json").exists():
                ref.get_base_model().config.save_pretrained(folder)
            merged = cls.from_pretrained(folder).eval()
            assert rel_diff(merged(input_ids=ids).logits, want) < TOL, folder
    config = json.loads((tmp / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["query", "value"]


def test_export_peft_refuses_what_it_cannot_do(lora_world, tmp_path):
    tmp, _ = lora_world
    with pytest.raises(ValueError, match="trainable-only checkpoint .* pass base="):
        f2.export_peft(tmp / "ckpt", tmp_path / "x", merged=True)
    with pytest.raises(ValueError, match="adapters \\['default'\\], not 'other'"):
        f2.export_peft(tmp / "ckpt", tmp_path / "y", adapter_name="other")


def test_trainable_only_checkpoint_loads_on_one_process(lora_world):
    """Saved by 2 ranks, loaded without a process group: the fingerprint does not depend on the world."""
    tmp, _ = lora_world
    ref, _ = _reference()
    model = lora(tiny_bert(), seed=7)
    f2.Checkpointer(tmp / "ckpt").load(model=model)
    for name, p in ref.named_parameters():
        assert rel_diff(model.get_parameter(name).detach(), p.detach()) < TOL, name
    with pytest.raises(ValueError, match="another frozen base"):
        f2.Checkpointer(tmp / "ckpt").load(model=lora(tiny_bert(seed=3)))


def test_export_command(lora_world, tmp_path, capsys):
    from fsdp2_strategy.cli import main

    tmp, _ = lora_world
    assert main(["export", str(tmp / "ckpt"), str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "adapter_model.safetensors").is_file()
    assert main(["export", str(tmp / "ckpt"), str(tmp_path / "m"), "--merged"]) == 2
    assert "pass base= (--base)" in capsys.readouterr().err
    assert main(["export", str(tmp / "ckpt"), str(tmp_path / "m"), "--merged", "--base", str(tmp / "base")]) == 0
    assert (tmp_path / "m" / "model.safetensors").is_file() and (tmp_path / "m" / "config.json").is_file()


def test_export_full_of_a_peft_checkpoint_points_to_export_peft(lora_world, tmp_path, caplog):
    tmp, _ = lora_world
    with caplog.at_level("WARNING"):
        f2.export_full(tmp / "ckpt_full", tmp_path / "full")
    assert "holds a PEFT model" in caplog.text and "export_peft" in caplog.text
