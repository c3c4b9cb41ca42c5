"""bitsandbytes-quantised layers (QLoRA's base): the quantised weights stay whole and untouched on
every rank, everything else is sharded, and training the rest on 2 ranks equals one process;
checkpoints round-trip; a layer not yet quantised is refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
from _harness import run_distributed
from _models import rel_diff
from torch import nn

bnb = pytest.importorskip("bitsandbytes")

import fsdp2_strategy as f2  # noqa: E402

STEPS, LR = 2, 0.1


class QLoRANet(nn.Module):
    """Input layer, a frozen 4-bit layer with a trainable low-rank adapter beside it, output layer."""

    def __init__(self, quantise: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        source = nn.Linear(16, 16)
        self.base = bnb.nn.Linear4bit(16, 16, compute_dtype=torch.float32, quant_type="nf4")
        self.base.weight = bnb.nn.Params4bit(source.weight.data.clone(), requires_grad=False, quant_type="nf4")
        self.base.bias = nn.Parameter(source.bias.data.clone(), requires_grad=False)
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
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)) for _ in range(STEPS)]


def _train(model: nn.Module, rank: int, world: int) -> None:
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=LR, momentum=0.9)
    for x, y in _batches():
        rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def _world(root: str) -> dict:
    import torch.distributed as dist

    model = QLoRANet()
    packed, absmax = model.base.weight.data.clone(), model.base.weight.quant_state.absmax.clone()
    f2.shard_model(model, f2.FSDP2Config(wrap_policy=[nn.Linear], log_plan=False))  # Linear4bit is a Linear too
    _train(model, dist.get_rank(), dist.get_world_size())
    weight = model.base.weight
    kept = (type(weight).__name__, torch.equal(weight.data, packed), torch.equal(weight.quant_state.absmax, absmax))
    ck = f2.Checkpointer(root)
    ck.save(STEPS, model=model)
    again = f2.shard_model(QLoRANet(), f2.FSDP2Config(wrap_policy=[nn.Linear], log_plan=False))
    ck.load(model=again)
    reloaded = max(rel_diff(a, b) for a, b in zip(_full(model).values(), _full(again).values()))
    with torch.no_grad():
        x = _batches()[0][0]
        same_output = torch.equal(model(x), again(x))
    return {
        "params": _full(model),
        "kept": kept,
        "plan": str(f2.sharding_plan(model)),
        "reloaded": reloaded,
        "same_output": same_output,
        "sharded": sorted(n for n, p in model.named_parameters() if hasattr(p, "full_tensor")),
    }


def test_quantised_base_stays_whole_and_the_rest_trains_like_one_process(tmp_path):
    single = QLoRANet()
    reference = copy.deepcopy(single)
    _train(reference, 0, 1)
    expected = _full(reference)
    for r in run_distributed(_world, 2, str(tmp_path)):
        assert r["kept"] == ("Params4bit", True, True)  # packed data and quantisation state untouched
        assert sorted(r["params"]) == sorted(expected)
        assert max(rel_diff(r["params"][n], expected[n]) for n in expected) < 1e-5
        assert "base.weight" not in r["sharded"] and "lora_a.weight" in r["sharded"] and "inp.weight" in r["sharded"]
        assert "quantised" in r["plan"] and "kept whole and frozen" in r["plan"]
        assert r["reloaded"] == 0.0 and r["same_output"]


def _unquantised_world() -> str:
    try:
        f2.shard_model(QLoRANet(quantise=False), f2.FSDP2Config(log_plan=False))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a_layer_not_yet_quantised_is_refused_by_name():
    message = run_distributed(_unquantised_world, 1)[0]
    assert "base.weight (Params4bit, torch.float32, cpu) is not quantised yet" in message
    assert "model.to(device)" in message


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
    try:
        f2.save_merged(model, f"{root}/merged")
        merged_error = "no error"
    except ValueError as exc:
        merged_error = str(exc)
    return {
        "params": _full(model),
        "reloaded": max(rel_diff(a, b) for a, b in zip(_full(model).values(), _full(again).values())),
        "merged_error": merged_error,
    }


def test_qlora_with_peft_trains_like_one_process_and_saves_the_adapter(tmp_path):
    from safetensors.torch import load_file

    reference = qlora_model()
    _train(reference, 0, 1)
    expected = _full(reference)
    results = run_distributed(_qlora_world, 2, str(tmp_path))
    for r in results:
        assert sorted(r["params"]) == sorted(expected) and all("lora_" in n for n in expected)
        assert max(rel_diff(r["params"][n], expected[n]) for n in expected) < 1e-5
        assert r["reloaded"] == 0.0
        assert "blocks.0 (quantised base)" in r["merged_error"] and "base=" in r["merged_error"]
    saved = f2.inspect_checkpoint(tmp_path).tensors
    assert sorted(k for k in saved if k.startswith("model.")) == sorted(f"model.{n}" for n in expected)
    adapter = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert len(adapter) == len(expected) and all(".default" not in k for k in adapter)
