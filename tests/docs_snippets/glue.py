"""What a user writes around each documented snippet, and how it is launched.

`GLUE[(page, name)]` holds, for the snippet `<!-- snippet: name -->` of `page`: `setup`, the code a
user has before it (a model, data, a loss): it may bind only the names the page declares as the user's
("`model` and `loader` are yours", `docs_snippets.pages.user_names`), and run.py hands the snippet
nothing else (no imports, no `f2.init_distributed()`: a snippet shows those itself); `check`, asserts
on what the snippet did, and `launch`: "torchrun" (2 CPU processes), "accelerate" (`accelerate launch`
of 2 processes with the accelerate config file `config`, a path under tests/), "python" (one process), or "skip" with `reason`
(needs a GPU or a cluster). The set-up code uses the small models and data below.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from helpers.models import tiny_llama  # noqa: F401  (the snippets' set-up imports it from here)
from torch import nn


@dataclass(frozen=True)
class Glue:
    setup: str = ""
    check: str = ""
    launch: str = "torchrun"
    config: str = ""  # an accelerate config file, relative to tests/
    reason: str = ""


# ----- what the set-up code builds --------------------------------------------------------------


class Settings:
    """A user's own type saved in a checkpoint's `extra` (docs/guides/security.md)."""

    def __init__(self, lr: float) -> None:
        self.lr = lr


class Block(nn.Module):
    """A residual MLP block: the repeated unit `wrap_policy="auto"` finds."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(x)


class Net(nn.Module):
    """A 4-class classifier of 16 features: input layer, two blocks, head."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(16, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(2))
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g))


def loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset(), batch_size=8)


def lightning_module() -> nn.Module:
    import lightning.pytorch as pl

    class LitNet(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return LitNet()


def lm_dataset(vocab: int = 32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (16, 12), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def text_dataset():
    from datasets import Dataset

    texts = ["the cat sat on the mat", "a dog ran under the log", "the big red dog sat", "a small blue cat ran"]
    return Dataset.from_dict({"text": texts * 4})


def train_step_fn():
    """`train_step(model, optimizer)`: one forward, backward and optimizer step on random data."""

    def train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    return train_step


class GPTLike(nn.Module):
    """FSDP1-era layout: an embedding, `gpt_layers` (sharded by hand), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.gpt_layers = nn.Sequential(Block(32), Block(32))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gpt_layers(self.embed(x)))


def pretrained_llama() -> str:
    """A tiny Llama saved as a Hugging Face folder by rank 0 (bf16; 128 wide: bitsandbytes' CPU 4-bit
    kernels want widths divisible by their block size): the snippet's `pretrained`."""
    import os

    import torch.distributed as dist

    if dist.is_initialized():  # one folder, written by rank 0
        folder = "pretrained"
        if dist.get_rank() == 0:
            tiny_llama(64, hidden_size=128, intermediate_size=256).to(torch.bfloat16).save_pretrained(folder)
        dist.barrier()
        return folder
    folder = f"pretrained-{os.environ.get('RANK', '0')}"  # no process group yet: one folder per rank
    torch.manual_seed(0)
    tiny_llama(64, hidden_size=128, intermediate_size=256).to(torch.bfloat16).save_pretrained(folder)
    return folder


def tiny_bert() -> nn.Module:
    import transformers

    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, num_labels=2
    )
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


# ----- the glue per snippet ---------------------------------------------------------------------
# A set-up binds only the names its page declares as the user's (`docs_snippets.pages.user_names`);
# whatever else it needs it imports or names with a leading underscore, which run.py does not hand on.

_CLASSIFIER = """
import torch as _torch
from docs_snippets.glue import Net as _Net, loader as _loader
_torch.manual_seed(0)
model, loader = _Net(), _loader()
loss_fn = _torch.nn.functional.cross_entropy
"""
_OPTIMIZER = "optimizer = _torch.optim.AdamW(model.parameters())\n"
_LONG_LLAMA = (
    "import torch as _torch\nfrom docs_snippets.glue import tiny_llama as _tiny_llama\n"
    "model = _tiny_llama(max_position_embeddings=64, attn_implementation='sdpa')\n"
    "_ids = _torch.randint(3, 32, (2, 64), generator=_torch.Generator().manual_seed(0))\n"
)
"""A Hugging Face Llama with SDPA attention and two 64-token sequences (docs/guides/long-sequences.md)."""

_SHARDED = """
import torch.distributed as _dist
from torch.distributed.tensor import DTensor as _DTensor
assert _dist.get_world_size() == 2
assert all(isinstance(p, _DTensor) for p in model.parameters()), "not sharded"
"""
_UNLABELLED = """
import torch as _torch
from docs_snippets.glue import Net as _Net
_torch.manual_seed(0)
model = _Net()
loader = [_torch.randn(8, 16) for _ in range(4)]
def loss_fn(out):
    return out.float().pow(2).mean()
"""
_NET_AND_TRAIN_STEP = """
import torch as _torch
from docs_snippets.glue import Net as _Net, train_step_fn as _train_step_fn
_torch.manual_seed(0)
model = _Net()
train_step = _train_step_fn()
"""
# accelerate configs (paths under tests/): the suite's own, and one with bf16 for the README's snippet
_BF16_BLOCK = "docs_snippets/fsdp2_bf16.yaml"
_BLOCK = "integrations/accelerate/scripts/fsdp2.yaml"  # fp32, one group per Block
_HF = "integrations/transformers/scripts/fsdp2_sharded.yaml"  # fp32, groups from the model's _no_split_modules
_EXAMPLE = "../examples/accelerate_fsdp2.yaml"  # the one the pages name: auto wrap, any model
_LIGHTNING = """
from docs_snippets.glue import lightning_module as _lightning_module, loader as _loader
model, loader = _lightning_module(), _loader()
"""
_NET_AND_BATCH = """
import torch as _torch
from docs_snippets.glue import Net as _Net
_torch.manual_seed(0)
model, batch = _Net(), _torch.randn(8, 16)
"""
_PRETRAINED = "from docs_snippets.glue import pretrained_llama as _pretrained_llama\npretrained = _pretrained_llama()"

GLUE: dict[tuple[str, str], Glue] = {
    ("README.md", "lightning"): Glue(
        setup=_LIGHTNING,
        check="assert trainer.global_step == 6, trainer.global_step  # 3 epochs of 2 batches per rank\n"
        "model = model.net\n" + _SHARDED,
    ),
    ("README.md", "fabric"): Glue(
        setup=_CLASSIFIER + _OPTIMIZER,
        check=_SHARDED + "from pathlib import Path\nassert Path('ckpt/step-1/.metadata').is_file()",
    ),
    ("README.md", "accelerate"): Glue(
        setup=_CLASSIFIER + _OPTIMIZER,
        check=_SHARDED + "assert str(accelerator.distributed_type) == 'DistributedType.FSDP'\n"
        "from pathlib import Path\nassert (Path('ckpt') / '.metadata').is_file()",
        launch="accelerate",
        config=_EXAMPLE,
    ),
    ("README.md", "hf-trainer"): Glue(
        setup="from docs_snippets.glue import tiny_llama as _tiny_llama, lm_dataset as _lm_dataset\n"
        "model, dataset = _tiny_llama(), _lm_dataset()",
        check="assert trainer.state.global_step == 3\n"
        "from pathlib import Path\nassert Path('out/model.safetensors').is_file()\n" + _SHARDED,
        launch="accelerate",
        config=_EXAMPLE,
    ),
    ("README.md", "trl"): Glue(
        setup="from helpers.models import word_tokenizer as _word_tokenizer\n"
        "from docs_snippets.glue import tiny_llama as _tiny_llama, text_dataset as _text_dataset\n"
        "tokenizer = _word_tokenizer()\nmodel, text_dataset = _tiny_llama(len(tokenizer)), _text_dataset()",
        check="assert trainer.state.global_step == 3\n" + _SHARDED,
        launch="accelerate",
        config=_EXAMPLE,
    ),
    ("README.md", "pytorch"): Glue(
        setup=_CLASSIFIER,
        check=_SHARDED + "from pathlib import Path\nassert Path('ckpt/step-000001/.metadata').is_file()",
    ),
    ("docs/get-started/quickstart.md", "train-script"): Glue(
        check="assert checkpointer.latest_step() == 9 and step == 9\n" + _SHARDED,
    ),
    ("docs/integrations/lightning.md", "complete"): Glue(
        check="assert trainer.global_step == 4, trainer.global_step\n"
        "from pathlib import Path\nassert Path('final.ckpt/.metadata').is_file()\nmodel = model.net\n" + _SHARDED,
    ),
    ("docs/integrations/lightning.md", "trainer"): Glue(
        setup=_LIGHTNING,
        check="assert trainer.global_step == 3\nfrom pathlib import Path\nassert Path('last.ckpt/.metadata').is_file()\n"
        "model = model.net\n" + _SHARDED,
    ),
    ("docs/integrations/fabric.md", "complete"): Glue(
        check=_SHARDED + "assert remainder == {'step': 2}, remainder",
    ),
    ("docs/integrations/fabric.md", "loop"): Glue(
        setup=_CLASSIFIER + _OPTIMIZER,
        check=_SHARDED + "assert remainder == {'step': 100}, remainder",
    ),
    ("docs/integrations/accelerate.md", "complete"): Glue(
        check=_SHARDED + "from pathlib import Path\nassert (Path('ckpt') / '.metadata').is_file()",
        launch="accelerate",
        config=_EXAMPLE,
    ),
    ("docs/integrations/accelerate.md", "loop"): Glue(
        setup=_CLASSIFIER + _OPTIMIZER + "scheduler = _torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)",
        check=_SHARDED + "from pathlib import Path\nassert (Path('ckpt') / '.metadata').is_file()\n"
        "assert Path('weights/model.safetensors').is_file()",
        launch="accelerate",
        config=_BF16_BLOCK,
    ),
    ("docs/integrations/pytorch.md", "loop"): Glue(setup=_CLASSIFIER, check=_SHARDED),
    ("docs/integrations/transformers.md", "complete"): Glue(
        check="assert trainer.state.global_step == 4\nfrom pathlib import Path\n"
        "assert Path('out/model.safetensors').is_file()\n" + _SHARDED,
        launch="accelerate",
        config=_EXAMPLE,
    ),
    ("docs/integrations/transformers.md", "trainer"): Glue(
        setup="from docs_snippets.glue import tiny_llama as _tiny_llama, lm_dataset as _lm_dataset\n"
        "model, train, evals = _tiny_llama(), _lm_dataset(), _lm_dataset()[:4]",
        check="assert trainer.state.global_step == 2\nfrom pathlib import Path\nassert Path('out/model.safetensors').is_file()\n"
        + _SHARDED,
        launch="accelerate",
        config=_HF,
    ),
    ("docs/integrations/transformers.md", "trl"): Glue(
        check="assert SFTTrainer.__name__ == 'FSDP2SFTTrainer' and issubclass(MyDPO, FSDP2TrainerMixin)",
        launch="python",
    ),
    ("docs/guides/accumulation.md", "core"): Glue(
        setup=_CLASSIFIER,
        check=_SHARDED + "assert 'keep_gathered' in str(f2.sharding_plan(model))",
    ),
    ("docs/guides/checkpoints.md", "save-load"): Glue(
        setup=_NET_AND_TRAIN_STEP,
        check="assert extra['step'] == 9 and ckpt.latest_step() == 9",
    ),
    ("docs/guides/preemption.md", "exit-if-preempted"): Glue(
        setup=_NET_AND_TRAIN_STEP,
        check="assert ckpt.latest_step() == 9",
    ),
    ("docs/guides/peft.md", "lora"): Glue(
        setup="import torch as _torch\nfrom docs_snippets.glue import tiny_bert as _tiny_bert\nmodel = _tiny_bert()\n"
        "def train_step(model, optimizer):\n"
        "    ids = _torch.randint(0, 64, (4, 8))\n"
        "    model(input_ids=ids, labels=_torch.randint(0, 2, (4,))).loss.backward()\n"
        "    optimizer.step()\n"
        "    optimizer.zero_grad()",
        check="from pathlib import Path\nassert Path('adapter/adapter_model.safetensors').is_file()\n"
        "assert Path('ckpts/step-000001/.metadata').is_file()\nassert any(Path('merged').glob('*.safetensors'))",
    ),
    ("docs/guides/qlora.md", "qlora"): Glue(
        setup=_PRETRAINED + "\nimport torch as _torch\nloader = [_torch.randint(3, 64, (2, 12)) for _ in range(2)]",
        check="plan = str(f2.sharding_plan(model))\nassert '4-bit weights sharded as packed bytes' in plan, plan\n"
        "packed = f2.shard.quantised_param_names(model)\n"
        "assert packed and all(type(p).__name__ == 'DTensor' for n, p in model.named_parameters() if n in packed)\n"
        "from pathlib import Path\nassert Path('adapter/adapter_model.safetensors').is_file()",
    ),
    ("docs/guides/qlora.md", "quantise-on-load"): Glue(
        setup=_PRETRAINED,
        check="assert all(f2.shard.pending_4bit(m) is None for m in model.modules())\n"
        "assert 'lm_head' not in ' '.join(f2.shard.quantised_param_names(model))\n"
        "assert len(f2.shard.quantised_param_names(model)) == 14",
    ),
    ("docs/guides/generation.md", "generate"): Glue(
        setup="import torch as _torch\nfrom docs_snippets.glue import tiny_llama as _tiny_llama\nmodel = _tiny_llama()\n"
        "input_ids = _torch.randint(3, 32, (1, 8), generator=_torch.Generator().manual_seed(0))",
        check=_SHARDED + "assert tokens.shape[0] == 1 and tokens.shape[1] > 8, tokens.shape",
    ),
    ("docs/guides/performance.md", "function"): Glue(
        setup="import torch as _torch\ntokens = _torch.randint(0, 1000, (2, 16), generator=_torch.Generator().manual_seed(0))",
        check=_SHARDED + "assert _torch.isfinite(loss) and loss.item() > 0",
    ),
    ("docs/guides/long-sequences.md", "core"): Glue(
        setup=_LONG_LLAMA + "loader = [{'input_ids': _ids, 'labels': _ids.clone()}]",
        check=_SHARDED + "assert tuple(part['input_ids'].shape) == (2, 32), part['input_ids'].shape\n"
        "assert _torch.isfinite(loss)",
    ),
    ("docs/guides/long-sequences.md", "accelerate"): Glue(
        setup=_LONG_LLAMA + "loader = _torch.utils.data.DataLoader([{'input_ids': i, 'labels': i.clone(), "
        "'shift_labels': _torch.roll(i, -1), 'position_ids': _torch.arange(64)} for i in _ids], batch_size=2)",
        check=_SHARDED + "assert tuple(batch['input_ids'].shape) == (2, 32), batch['input_ids'].shape",
        launch="accelerate",
        config=_EXAMPLE,
    ),
    ("docs/guides/long-sequences.md", "lightning"): Glue(
        setup=_LONG_LLAMA + "dataset = [{'input_ids': i, 'labels': i.clone()} for i in _ids.repeat(2, 1)]",
        check="assert trainer.global_step == 2, trainer.global_step\nmodel = trainer.lightning_module.model\n"
        + _SHARDED,
    ),
    ("docs/guides/long-sequences.md", "transformers"): Glue(
        setup=_LONG_LLAMA + "dataset = [{'input_ids': i, 'labels': i.clone()} for i in _ids.repeat(2, 1)]",
        check="assert trainer.state.global_step == 2, trainer.state.global_step\nmodel = trainer.model\n" + _SHARDED,
        launch="accelerate",
        config=_EXAMPLE,
    ),
    ("docs/guides/tuner.md", "tune"): Glue(
        setup=_NET_AND_BATCH,
        check=_SHARDED + "assert other.wrap_policy is not None",
    ),
    ("docs/guides/memory-planner.md", "estimate"): Glue(
        setup=_NET_AND_BATCH,
        check="assert est.peak_bytes > 0",
        launch="python",
    ),
    ("docs/guides/memory-planner.md", "auto"): Glue(
        setup="from docs_snippets.glue import tiny_llama as _tiny_llama\nmodel = _tiny_llama()",
        check=_SHARDED,
    ),
    ("docs/guides/metrics.md", "core"): Glue(
        setup="import torch as _torch\nfrom docs_snippets.glue import tiny_llama as _tiny_llama\nmodel = _tiny_llama()\n"
        "loader = [_torch.randint(3, 32, (4, 12)) for _ in range(11)]  # the first step starts the clock, 10 more: one report",
        check="assert tracker.meter.last is not None and tracker.meter.last.tokens_per_s > 0",
    ),
    ("docs/migration/fsdp1.md", "replicate"): Glue(
        setup="import torch as _torch\nfrom docs_snippets.glue import GPTLike as _GPTLike\n"
        "_torch.manual_seed(0)\nmodel = _GPTLike()\nloss_fn = _torch.nn.functional.cross_entropy\n"
        "x0, x1 = _torch.randn(8, 16), _torch.randn(8, 16)\ny0, y1 = _torch.randint(0, 4, (8,)), _torch.randint(0, 4, (8,))",
        check="assert 'REPLICATED' in str(f2.sharding_plan(model))",
    ),
    ("docs/migration/fsdp1.md", "ddp"): Glue(
        setup="import torch as _torch\nfrom docs_snippets.glue import GPTLike as _GPTLike\n"
        "_torch.manual_seed(0)\nmodel = _GPTLike()",
        check="import torch\nmodel(torch.randn(8, 16)).sum().backward()\nassert model.module.embed.weight.grad is not None",
    ),
    ("docs/guides/mixed-precision.md", "precision-forms"): Glue(
        check="assert with_bn.module_overrides and custom.mixed_precision['reduce_dtype'] == 'bf16'",
        launch="python",
    ),
    ("docs/guides/mixed-precision.md", "native-bf16"): Glue(
        check="assert precision == ('bf16-mixed' if f2.native_low_precision() else '32-true')", launch="python"
    ),
    ("docs/guides/mixed-precision.md", "fp16-scaler"): Glue(setup=_UNLABELLED, check=_SHARDED),
    ("docs/guides/multi-node.md", "hybrid-train"): Glue(
        setup=_UNLABELLED,
        check=_SHARDED + "assert ckpt.latest_step() == 0 and 'HYBRID_SHARD' in str(f2.sharding_plan(model))",
    ),
    ("docs/migration/lightning.md", "strategy-object"): Glue(
        setup=_LIGHTNING,
        check="assert trainer.global_step > 0\nmodel = model.net\n" + _SHARDED,
    ),
    ("docs/migration/accelerate.md", "accelerator-swap"): Glue(
        setup=_UNLABELLED + _OPTIMIZER,
        check=_SHARDED + "from pathlib import Path\nassert (Path('ckpt') / '.metadata').is_file()",
        launch="accelerate",
        config=_BLOCK,
    ),
    ("docs/migration/deepspeed.md", "hf-trainer"): Glue(
        setup="import json as _json, os as _os\n"
        "from docs_snippets.glue import tiny_llama as _tiny_llama, lm_dataset as _lm_dataset\n"
        "model, data = _tiny_llama(), _lm_dataset()\n"
        "_ds = {'zero_optimization': {'stage': 2}, 'train_micro_batch_size_per_gpu': 'auto'}\n"
        "_tmp = f'ds_config.json.{_os.getpid()}'\n_json.dump(_ds, open(_tmp, 'w'))\n"
        "_os.replace(_tmp, 'ds_config.json')  # the user's DeepSpeed config file; each rank writes the same file whole",
        check="assert trainer.state.global_step == 2\n"
        "assert trainer.accelerator.fsdp2_config.sharding_strategy == 'SHARD_GRAD_OP'\n" + _SHARDED,
        launch="accelerate",
        config=_HF,
    ),
    ("docs/migration/deepspeed.md", "resume"): Glue(
        launch="skip",
        reason="needs a DeepSpeed checkpoint, which DeepSpeed (not in this environment) writes; "
        "tests/core/migrate/test_convert_deepspeed.py runs these lines on DeepSpeed's own ZeRO-1/2/3 saves",
    ),
    ("docs/concepts/fsdp2.md", "sharding-plan"): Glue(
        setup="import torch as _torch\nfrom docs_snippets.glue import Net as _Net\n_torch.manual_seed(0)\nmodel = _Net()",
        check=_SHARDED,
    ),
    ("docs/concepts/memory-model.md", "estimate-fields"): Glue(
        setup=_NET_AND_BATCH,
        check="assert est.peak_bytes > 0",
        launch="python",
    ),
    ("docs/guides/security.md", "trust"): Glue(
        setup="from docs_snippets.glue import Net as _Net, Settings\nmodel = _Net()",
        check="assert extra['settings'].lr == 3e-4\n"
        "try:\n    ckpt.load(model=model)\n    raise AssertionError('a type of its own loaded without a switch')\n"
        "except f2.UntrustedCheckpointError as exc:\n    assert 'Settings' in str(exc), exc",
    ),
}
