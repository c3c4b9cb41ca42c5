"""Host memory per rank of loading a QLoRA model: `from_pretrained` in 4-bit on every rank, then
`shard_model`, against meta construction + `f2.to_4bit` + `shard_model` + `f2.load_full_weights`
(each rank quantises each weight in turn and keeps its bytes).

A Llama-shaped model (16 layers of width 2048, vocabulary 4096, 0.83 B parameters, bf16
safetensors) is written once;
each path runs in its own 2-process world. Reported per rank: the peak of live tensor bytes during
loading and sharding (torch's `MemTracker`, what the memory planner counts and what a GPU would
hold), the resident memory's rise over the process after imports (`ru_maxrss`; it also counts
safetensors pages mapped from the page cache and freed blocks malloc keeps), and the 4-bit bytes
the rank holds at the end.

    python benchmarks/qlora_load.py [--out benchmarks/results/qlora_load.txt]
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from helpers.harness import run_distributed  # noqa: E402
from helpers.models import tiny_llama  # noqa: E402

import fsdp2_strategy as f2  # noqa: E402

VOCAB = 4096  # small: the 4-bit base, not the full-precision embeddings, is most of the model
SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _quantisation():
    import transformers

    return transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def _lora(model):
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))


def _measured(load) -> dict:
    """Run `load()` (which returns the sharded model) under MemTracker; the peaks in MiB."""
    import bitsandbytes  # noqa: F401  (imported before the baseline: its import is not the loading's cost)
    import peft  # noqa: F401
    import transformers  # noqa: F401
    from torch.distributed._tools.mem_tracker import MemTracker

    start, tracker = _rss_mib(), MemTracker()
    with tracker:
        model = load()
    # The CPU's: MemTracker also counts the meta device's tensors, which hold no memory.
    tensors = sum(v["Total"] for d, v in tracker.get_tracker_snapshot("peak").items() if d.type == "cpu")
    return {"tensors": tensors / 2**20, "rise": _rss_mib() - start, "local": _local_packed(model) / 2**20}


def _from_pretrained(folder: str) -> dict:
    def load():
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=_quantisation(), dtype=torch.bfloat16
        )
        return f2.shard_model(_lora(model), mixed_precision="bf16", log_plan=False)

    return _measured(load)


def _on_load(folder: str) -> dict:
    def load():
        import transformers

        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.from_pretrained(folder), dtype=torch.bfloat16
            )
        f2.to_4bit(model)
        model = f2.shard_model(_lora(model), mixed_precision="bf16", log_plan=False)
        return f2.load_full_weights(model, folder)

    return _measured(load)


def _local_packed(model) -> int:
    """Bytes of the 4-bit weights this rank holds (a sharded one: its local shard)."""
    params = dict(model.named_parameters())
    names = f2.shard.quantised_param_names(model)
    return sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for n, p in params.items() if n in names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "qlora_load.txt"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = f"{tmp}/base"
        model = tiny_llama(VOCAB, **SHAPE, num_key_value_heads=16, max_position_embeddings=2048)
        params = sum(p.numel() for p in model.parameters())
        model.to(torch.bfloat16).save_pretrained(folder)
        del model
        lines = [
            f"# {time.strftime('%Y-%m-%d')}, 2 CPU ranks, torch {torch.__version__}; Llama-shaped, 16 layers x 2048, vocab {VOCAB}, "
            f"{params / 1e9:.2f} B parameters (bf16 file {sum(f.stat().st_size for f in Path(folder).glob('*.safetensors')) / 2**20:.0f} MiB), "
            "NF4 + double quantisation, LoRA r=16 on q/v",
            "| path | rank | peak live tensors (MiB) | resident rise (MiB) | 4-bit bytes held (MiB) |",
            "|---|---|---|---|---|",
        ]
        for label, fn in (
            ("from_pretrained(4-bit) + shard_model", _from_pretrained),
            ("meta + to_4bit + shard_model + load_full_weights", _on_load),
        ):
            for rank, r in enumerate(run_distributed(fn, 2, folder, timeout=900)):
                lines.append(f"| {label} | {rank} | {r['tensors']:.0f} | {r['rise']:.0f} | {r['local']:.1f} |")
                print(lines[-1], flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
