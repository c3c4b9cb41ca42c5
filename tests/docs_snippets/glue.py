"""What a user writes around each documented snippet, and how it is launched.

`GLUE[(page, name)]` holds, for the snippet `<!-- snippet: name -->` of `page`: `setup`, the code a
user has before it (a model, data, a loss: the free names the page says are yours), `check`, asserts
on what the snippet did, and `launch`: "torchrun" (2 CPU processes), "accelerate" (`accelerate launch`
of 2 processes with the accelerate config `config`), "python" (one process), or "skip" with `reason`
(needs a GPU or a cluster). The set-up code uses the small models and data below.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Glue:
    setup: str = ""
    check: str = ""
    launch: str = "torchrun"
    config: str = ""
    reason: str = ""


# ----- what the set-up code builds --------------------------------------------------------------


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


def tokenizer():
    """A word-level tokenizer built here (no download)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "the cat sat on mat a dog ran under log big red small blue".split()
    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "<eos>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>"
    )


def tiny_llama(vocab: int = 32) -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        pad_token_id=0,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def lm_dataset(vocab: int = 32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (16, 12), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def text_dataset():
    from datasets import Dataset

    texts = ["the cat sat on the mat", "a dog ran under the log", "the big red dog sat", "a small blue cat ran"]
    return Dataset.from_dict({"text": texts * 4})


# ----- the glue per snippet ---------------------------------------------------------------------

_CLASSIFIER = """
import torch
from docs_snippets.glue import Net, loader as _loader
torch.manual_seed(0)
model, loader = Net(), _loader()
loss_fn = torch.nn.functional.cross_entropy
"""
_SHARDED = """
import torch.distributed as _dist
from torch.distributed.tensor import DTensor as _DTensor
assert _dist.get_world_size() == 2
assert all(isinstance(p, _DTensor) for p in model.parameters()), "not sharded"
"""
_ACCELERATE_BLOCK = """
distributed_type: FSDP
num_processes: 2
mixed_precision: {precision}
use_cpu: true
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: {layer}
  fsdp_state_dict_type: SHARDED_STATE_DICT
"""

GLUE: dict[tuple[str, str], Glue] = {
    ("README.md", "lightning"): Glue(
        setup="from docs_snippets.glue import lightning_module, loader as _loader\n"
        "model, loader = lightning_module(), _loader()",
        check="assert trainer.global_step == 3, trainer.global_step  # 3 epochs of 4 batches, accumulating 4\n"
        "model = model.net\n" + _SHARDED,
    ),
    ("README.md", "fabric"): Glue(
        setup=_CLASSIFIER,
        check=_SHARDED + "from pathlib import Path\nassert Path('ckpt/step-1/.metadata').is_file()",
    ),
    ("README.md", "accelerate"): Glue(
        setup=_CLASSIFIER + "optimizer = torch.optim.AdamW(model.parameters())",
        check=_SHARDED + "assert str(accelerator.distributed_type) == 'DistributedType.FSDP'\n"
        "from pathlib import Path\nassert (Path('ckpt') / '.metadata').is_file()",
        launch="accelerate",
        config=_ACCELERATE_BLOCK.format(precision="bf16", layer="Block"),
    ),
    ("README.md", "hf-trainer"): Glue(
        setup="from docs_snippets.glue import tiny_llama, lm_dataset\nmodel, dataset = tiny_llama(), lm_dataset()",
        check="assert trainer.state.global_step == 3\n"
        "from pathlib import Path\nassert Path('out/model.safetensors').is_file()\n" + _SHARDED,
        launch="accelerate",
        config=_ACCELERATE_BLOCK.format(precision="'no'", layer="LlamaDecoderLayer"),
    ),
    ("README.md", "trl"): Glue(
        setup="from docs_snippets.glue import tiny_llama, text_dataset, tokenizer as _tok\n"
        "tokenizer = _tok()\nmodel, text_dataset = tiny_llama(len(tokenizer)), text_dataset()",
        check="assert trainer.state.global_step == 3\n" + _SHARDED,
        launch="accelerate",
        config=_ACCELERATE_BLOCK.format(precision="'no'", layer="LlamaDecoderLayer"),
    ),
    ("README.md", "pytorch"): Glue(
        setup=_CLASSIFIER,
        check=_SHARDED + "from pathlib import Path\nassert Path('ckpt/step-000001/.metadata').is_file()",
    ),
}
