"""Small models for the tests: a GPT-style transformer with the features that trip FSDP2."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab=64, dim=32, heads=4, layers=3, seq=16, tied=True, temperature=False):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight
        self.temperature = nn.Parameter(torch.tensor(1.5)) if temperature else None

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if self.temperature is not None:
            logits = logits / self.temperature
        return logits

    def score(self, x):
        """Logits of hidden states `x`: an entry point besides `forward` (FSDP gathers only in `model(...)`)."""
        return self.head(self.ln_f(x))

    def init_weights(self):
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding, nn.LayerNorm)):
                m.reset_parameters()
        with torch.no_grad():
            self.pos.normal_(0, 0.02)
            if self.temperature is not None:
                self.temperature.fill_(1.5)


def make_batch(n=8, seq=16, vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (n, seq), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


def loss_fn(model, idx, target):
    logits = model(idx)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


# ---------------------------------------------------------------------- tensor parallel
# A GPT whose attention has separate q/k/v projections and `-1` heads in `view`, as column-wise
# tensor parallelism needs; `TP_PLAN` splits it (globs relative to `TPGPT`). Also used by
# benchmarks/collectives_2d.py.
TP_PLAN = {
    "blocks.*.attn.q": "colwise",
    "blocks.*.attn.k": "colwise",
    "blocks.*.attn.v": "colwise",
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.mlp.0": "colwise",
    "blocks.*.mlp.2": "rowwise",
}


class TPAttention(nn.Module):
    """Separate q/k/v projections and `-1` heads in `view`: what column-wise TP needs."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v, self.proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class TPBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(dim), TPAttention(dim, heads), nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TPGPT(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(TPBlock(dim, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_data(vocab: int, seq: int, samples: int, seed: int) -> torch.utils.data.TensorDataset:
    """(row index, tokens, next-token targets): the row index lets a test rebuild the global batches."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (samples, seq), generator=g)
    return torch.utils.data.TensorDataset(torch.arange(samples), idx, torch.roll(idx, -1, dims=1))


def lm_loss(model: nn.Module, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def sgd_reference(
    initial: nn.Module, data: torch.utils.data.TensorDataset, steps: list[list[int]], lr: float, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """One process, SGD: step s on the rows every rank saw at step s; parameters named `prefix + name`."""
    model = copy.deepcopy(initial)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    _, idx, target = data.tensors
    for rows in steps:
        opt.zero_grad()
        lm_loss(model, idx[rows], target[rows]).backward()
        opt.step()
    return {f"{prefix}{n}": p.detach().clone() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------- the adapters' small MLP
class ResidualBlock(nn.Module):
    """`x + tanh(fc(x))`: the wrap policy's group in the Fabric and Lightning flow scripts."""

    def __init__(self, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def add_mlp_layers(module: nn.Module) -> None:
    """Give `module` the layers `inp` (8 -> 16), three `ResidualBlock`s and `out` (16 -> 1): the
    same parameter names on a plain module (`MLP`) and on a LightningModule."""
    module.inp = nn.Linear(8, 16)
    module.blocks = nn.ModuleList(ResidualBlock(16) for _ in range(3))
    module.out = nn.Linear(16, 1)


def mlp_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = module.inp(x)
    for block in module.blocks:
        x = block(x)
    return module.out(x)


class MLP(nn.Module):
    """Input layer, three `ResidualBlock`s (the wrap policy's groups), output layer."""

    def __init__(self):
        super().__init__()
        add_mlp_layers(self)

    def forward(self, x):
        return mlp_forward(self, x)


def word_tokenizer():
    """A word-level Hugging Face tokenizer over a few words, built here (no download): for TRL's
    trainers, which tokenize text themselves."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "the a cat dog sat ran on under mat log red blue big small".split()
    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "<eos>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>"
    )


def tiny_llama(vocab: int = 32, **config) -> nn.Module:
    """A Hugging Face Llama built from a config (no download): 2 layers of width 32, `config` overriding
    any `LlamaConfig` field; weights from seed 0."""
    import transformers

    fields = dict(
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
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**fields, **config}))
