"""bitsandbytes-quantised layers (QLoRA's base): 4-bit weights sharded as packed bytes (1/N per rank,
either storage dtype) or kept whole (`quantised_weights="replicate"`), everything else sharded as
usual; the model computes what one process computes, trains like it, and checkpoints round-trip;
what cannot be sharded is refused by name."""

from __future__ import annotations

import pytest
import torch
from helpers.harness import run_distributed
from helpers.models import rel_diff
from torch import nn

bnb = pytest.importorskip("bitsandbytes")

import fsdp2_strategy as f2  # noqa: E402
from fsdp2_strategy.shard.quantised import packed_storage  # noqa: E402

STEPS, LR, BATCH = 2, 0.1, 12  # 12 rows: an equal share on 1, 2 or 3 ranks
STORAGES = (torch.uint8, torch.bfloat16)
PACKED = packed_storage(None)
"""What shard_model stores packed bytes in without mixed precision: uint8, bf16 words on torch 2.11-2.12."""


class QLoRANet(nn.Module):
    """Input layer, a frozen 4-bit layer with a trainable low-rank adapter beside it, output layer."""

    def __init__(self, quantise: bool = True, storage: torch.dtype = torch.uint8):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        source = nn.Linear(16, 16)
        self.base = bnb.nn.Linear4bit(16, 16, compute_dtype=torch.float32, quant_type="nf4", quant_storage=storage)
        self.base.weight = bnb.nn.Params4bit(
            source.weight.data.clone(), requires_grad=False, quant_type="nf4", quant_storage=storage
        )
        self.base.bias = nn.Parameter(source.bias.data.clone(), requires_grad=False)
        # bitsandbytes' CPU inference kernel (eval, no grad) needs 32 | out_features; a sharded layer
        # uses the portable one anyway (shard/quantised.py says why).
        self.base.support_avx512bf16_for_cpu = False
        self.lora_a = nn.Linear(16, 4, bias=False)
        self.lora_b = nn.Linear(4, 16, bias=False)
        self.out = nn.Linear(16, 1)
        if quantise:
            self.to("cpu")  # bitsandbytes quantises when the module is moved to its device

    def forward(self, x):
        h = self.inp(x)
        return self.out(self.base(h) + self.lora_b(self.lora_a(h)))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 1, generator=g)) for _ in range(STEPS)]


def _train(model: nn.Module, rank: int, world: int) -> None:
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=LR, momentum=0.9)
    for x, y in _batches():
        rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def _outputs(model: nn.Module) -> list[torch.Tensor]:
    """Training-mode and eval (no-grad) outputs on the first batch."""
    x = _batches()[0][0]
    train = model(x).detach()
    model.eval()
    with torch.no_grad():
        evaluated = model(x)
    model.train()
    return [train, evaluated]


def _reference(storage: torch.dtype) -> dict:
    model = QLoRANet(storage=storage)
    before = _outputs(model)
    _train(model, 0, 1)
    return {"outputs": before, "params": _full(model), "bytes": model.base.weight.data.nbytes}


def _sharded_run(root: str, storage: torch.dtype, **config) -> dict:
    import torch.distributed as dist

    config = {"wrap_policy": [nn.Linear], "log_plan": False, **config}  # Linear4bit is a Linear too
    model = f2.shard_model(QLoRANet(storage=storage), config)
    weight = model.base.weight
    local = weight.to_local() if hasattr(weight, "to_local") else weight.data
    # On a model of its own: after a forward with no backward the last block stays gathered, and an
    # optimizer built then would hold its gathered parameters.
    outputs = _outputs(f2.shard_model(QLoRANet(storage=storage), config))
    _train(model, dist.get_rank(), dist.get_world_size())
    ck = f2.Checkpointer(f"{root}/{storage}-{config.get('quantised_weights', 'shard')}-{config.get('cpu_offload')}")
    ck.save(STEPS, model=model)
    again = f2.shard_model(QLoRANet(storage=storage), config)
    ck.load(model=again)
    return {
        "local_bytes": local.nbytes,
        "local_dtype": str(local.dtype),
        "type": type(weight).__name__,
        "outputs": outputs,
        "params": _full(model),
        "reloaded": max(rel_diff(a, b) for a, b in zip(_full(model).values(), _full(again).values())),
        "same_output": all(torch.equal(a, b) for a, b in zip(_outputs(model), _outputs(again))),
        "plan": str(f2.sharding_plan(model)),
        "sharded": sorted(n for n, p in model.named_parameters() if hasattr(p, "full_tensor")),
    }


def _world(root: str) -> dict:
    runs = {str(s): _sharded_run(root, s) for s in STORAGES}
    runs["replicate"] = _sharded_run(root, torch.uint8, quantised_weights="replicate")
    runs["offload"] = _sharded_run(root, torch.bfloat16, cpu_offload=True)  # the packed shards offloaded too
    return runs


def _check_parity(run: dict, reference: dict) -> None:
    for got, expected in zip(run["outputs"], reference["outputs"]):
        assert torch.equal(got, expected)  # the same bytes dequantised by the same kernel
    assert sorted(run["params"]) == sorted(reference["params"])
    assert max(rel_diff(run["params"][n], reference["params"][n]) for n in reference["params"]) < 1e-5
    assert run["reloaded"] == 0.0 and run["same_output"]


def test_a_4bit_base_is_sharded_as_packed_bytes_and_trains_like_one_process(tmp_path):
    references = {str(s): _reference(s) for s in STORAGES}
    results = run_distributed(_world, 2, str(tmp_path))
    for r in results:
        for storage in STORAGES:
            run, reference = r[str(storage)], references[str(storage)]
            # Half the packed bytes per rank, whatever the storage dtype (the same 128 bytes either way).
            assert reference["bytes"] == 128 and run["local_bytes"] == 64 and run["local_dtype"] == str(PACKED)
            assert run["type"] == "DTensor" and "base.weight" in run["sharded"]
            _check_parity(run, reference)
            assert "1 4-bit weights sharded as packed bytes" in run["plan"]
            # The plan counts the layer's 256 weights (+16 bias), not its 128 packed bytes.
            base_row = next(line for line in run["plan"].splitlines() if line.startswith("base "))
            assert base_row.split()[2] == "272"
        kept = r["replicate"]  # the switch: the old behaviour, each rank holds the whole base
        assert kept["type"] == "Params4bit" and kept["local_bytes"] == 128 and "base.weight" not in kept["sharded"]
        assert "quantised" in kept["plan"] and "kept whole and frozen" in kept["plan"]
        _check_parity(kept, references[str(torch.uint8)])
        assert r["offload"]["local_bytes"] == 64
        _check_parity(r["offload"], references[str(torch.bfloat16)])


def _uneven_world(root: str) -> dict:
    # 128 packed bytes on 3 ranks: shards of 43, 43 and 42 bytes (64 bf16 words on torch 2.11-2.12:
    # chunks of 22, 22 and 20 words, as torch.chunk splits).
    return _sharded_run(root, torch.bfloat16)


def test_packed_bytes_that_do_not_divide_by_the_world_size(tmp_path):
    reference = _reference(torch.bfloat16)
    results = run_distributed(_uneven_world, 3, str(tmp_path))
    expected = [43, 43, 42] if PACKED == torch.uint8 else [44, 44, 40]
    assert [r["local_bytes"] for r in results] == expected
    for r in results:
        _check_parity(r, reference)


class Int8Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.int8 = bnb.nn.Linear8bitLt(16, 16, has_fp16_weights=False)
        self.int8.weight = bnb.nn.Int8Params(torch.zeros(16, 16, dtype=torch.int8), requires_grad=False)


class StrayParams4bit(nn.Module):
    """A Params4bit on a module that is not a bitsandbytes 4-bit layer (nothing rebuilds it in forward)."""

    def __init__(self):
        super().__init__()
        layer = QLoRANet().base
        self.inp = nn.Linear(8, 16)
        self.packed = layer.weight


def _refusals_world() -> dict:
    messages = {}
    for name, build in (
        ("unquantised", lambda: QLoRANet(quantise=False)),
        ("int8", Int8Net),
        ("stray", StrayParams4bit),
    ):
        try:
            f2.shard_model(build(), f2.FSDP2Config(log_plan=False))
            messages[name] = "no error"
        except ValueError as exc:
            messages[name] = str(exc)
    kept = f2.shard_model(Int8Net(), f2.FSDP2Config(log_plan=False, quantised_weights="replicate"))
    messages["int8 kept"] = type(kept.int8.weight).__name__
    return messages


def test_what_cannot_be_sharded_is_refused_by_name():
    messages = run_distributed(_refusals_world, 1)[0]
    # bnb_4bit_quant_storage=torch.bfloat16 is quantised data in a float dtype: asked by flag, not dtype.
    assert "base.weight (Params4bit, torch.float32, cpu) is not quantised yet" in messages["unquantised"]
    assert "model.to(device)" in messages["unquantised"]
    assert "int8.weight (Int8Params, torch.int8, cpu) is 8-bit" in messages["int8"]
    assert "load_in_4bit=True" in messages["int8"] and "quantised_weights='replicate'" in messages["int8"]
    assert "packed (Params4bit, torch.uint8, cpu) belongs to StrayParams4bit.packed" in messages["stray"]
    assert messages["int8 kept"] == "Int8Params"


# --------------------------------------------------------------------------- QLoRA through PEFT
class QuantisedBlocks(nn.Module):
    """Two frozen 4-bit residual blocks between full-precision input and output layers."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList()
        for _ in range(2):
            source = nn.Linear(16, 16)
            layer = bnb.nn.Linear4bit(16, 16, compute_dtype=torch.float32, quant_type="nf4")
            layer.weight = bnb.nn.Params4bit(source.weight.data.clone(), requires_grad=False, quant_type="nf4")
            layer.bias = nn.Parameter(source.bias.data.clone(), requires_grad=False)
            self.blocks.append(layer)
        self.out = nn.Linear(16, 1)
        self.to("cpu")  # quantises

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.out(h)


def qlora_model(lora_seed: int = 1) -> nn.Module:
    """PEFT's LoRA on the 4-bit blocks (`peft.get_peft_model`, as QLoRA recipes do); only LoRA trains."""
    peft = pytest.importorskip("peft")
    model = QuantisedBlocks()
    torch.manual_seed(lora_seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["blocks.0", "blocks.1"], init_lora_weights="gaussian")
    return peft.get_peft_model(model, config)


def _qlora_world(root: str) -> dict:
    import torch.distributed as dist

    model = f2.shard_model(qlora_model(), log_plan=False)
    _train(model, dist.get_rank(), dist.get_world_size())
    ck = f2.Checkpointer(root)
    ck.save(STEPS, model=model)  # "auto": trainable-only for a PEFT model
    again = f2.shard_model(qlora_model(lora_seed=5), log_plan=False)
    ck.load(model=again)
    f2.save_peft_adapter(model, f"{root}/adapter")
    f2.save_merged(model, f"{root}/merged")
    other_base = f2.shard_model(qlora_model(lora_seed=5), log_plan=False)
    with torch.no_grad():  # another base: other packed bytes in one rank's shard of blocks.1
        other_base.base_model.model.blocks[1].base_layer.weight.to_local().view(torch.uint8)[:4].add_(
            dist.get_rank() == 0
        )
    try:
        ck.load(model=other_base)
        wrong_base = "no error"
    except ValueError as exc:
        wrong_base = str(exc)
    return {
        "params": _full(model),
        "reloaded": max(rel_diff(a, b) for a, b in zip(_full(model).values(), _full(again).values())),
        "full_weights": {n: t for n, t in f2.full_weights(model)},
        "wrong_base": wrong_base,
    }


def _merged_by_hand(model: nn.Module) -> dict[str, torch.Tensor]:
    """The float model PEFT's merge means, one process: each 4-bit weight dequantised plus scaling * B @ A."""
    merged = {}
    for name, layer in model.base_model.model.named_modules():
        if hasattr(layer, "lora_A"):
            base = layer.base_layer
            weight = bnb.functional.dequantize_4bit(base.weight.data, base.weight.quant_state)
            delta = layer.lora_B["default"].weight @ layer.lora_A["default"].weight * layer.scaling["default"]
            merged[f"{name}.weight"] = (weight + delta).detach()
    return merged


def test_qlora_with_peft_trains_like_one_process_saves_and_merges(tmp_path):
    from safetensors.torch import load_file

    reference = qlora_model()
    _train(reference, 0, 1)
    expected, merged = _full(reference), _merged_by_hand(reference)
    results = run_distributed(_qlora_world, 2, str(tmp_path))
    for r in results:
        assert sorted(r["params"]) == sorted(expected) and all("lora_" in n for n in expected)
        assert max(rel_diff(r["params"][n], expected[n]) for n in expected) < 1e-5
        assert r["reloaded"] == 0.0
        # A 4-bit base merges live: dequantised, plus the delta; no absmax/quant_map entries.
        got = r["full_weights"]
        assert sorted(got) == ["blocks.0.bias", "blocks.0.weight", "blocks.1.bias", "blocks.1.weight", "inp.bias",
                               "inp.weight", "out.bias", "out.weight"]  # fmt: skip
        assert max(rel_diff(got[n], merged[n]) for n in merged) < 1e-5
        # The trainable-only checkpoint's fingerprint covers the sharded packed bytes.
        assert "blocks.1.base_layer.weight: different values" in r["wrong_base"]
        assert "blocks.0" not in r["wrong_base"]
    saved = f2.inspect_checkpoint(tmp_path).tensors
    assert sorted(k for k in saved if k.startswith("model.")) == sorted(f"model.{n}" for n in expected)
    adapter = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert len(adapter) == len(expected) and all(".default" not in k for k in adapter)
    written = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert sorted(written) == sorted(results[0]["full_weights"])
    assert max(rel_diff(written[n], merged[n]) for n in merged) < 1e-5
