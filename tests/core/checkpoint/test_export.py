"""export_full / CLI: a sharded DCP checkpoint becomes Hugging Face safetensors or a torch file."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.harness import launch, run_agreeing


def _cli(*args, cwd, check=True):
    """`fsdp2-strategy ARGS...` in its own process (`python -m fsdp2_strategy.cli`); with `check`, a
    non-zero exit fails the test with the command and the ends of its output."""
    return launch("python", "-m", "fsdp2_strategy.cli", *args, cwd=cwd, timeout=120, check=check)


def _save_world(root: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from transformers import GPT2Config, GPT2LMHeadModel

    import fsdp2_strategy as f2

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    model = f2.shard_model(GPT2LMHeadModel(config), log_plan=False)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.arange(8).view(1, 8), labels=torch.arange(8).view(1, 8)).loss.backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/step-000003")
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in msd.items()}
    return full


def test_consolidate_to_hf_safetensors_and_torch(tmp_path):
    from safetensors.torch import load_file
    from transformers import GPT2Config, GPT2LMHeadModel

    import fsdp2_strategy as f2

    root = tmp_path / "ckpt"
    full = run_agreeing(_save_world, 2, str(root))
    (root / "step-000004").mkdir()  # a crashed save: no .metadata

    info = f2.inspect_checkpoint(root)
    assert info.world_size == 2 and info.steps == {3: True, 4: False}
    assert info.tensors["model.lm_head.weight"] == ((96, 32), "float32")
    assert "4 (partial)" in str(info)

    out = f2.export_full(root, tmp_path / "hf")
    exported = load_file(str(out / "model.safetensors"))
    assert set(exported) == set(full)
    assert all(torch.equal(exported[k], full[k]) for k in full)

    # Hugging Face reads it back: same logits as the weights that were trained.
    config = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    config.save_pretrained(out)
    reloaded = GPT2LMHeadModel.from_pretrained(out).eval()
    reference = GPT2LMHeadModel(config).eval()
    reference.load_state_dict(full)
    ids = torch.arange(10).view(1, 10)
    assert torch.allclose(reloaded(ids).logits, reference(ids).logits, atol=1e-6)

    # Over the size limit: several files plus an index; bf16 conversion.
    sharded = f2.export_full(root, tmp_path / "split", max_shard_size=40_000, dtype="bf16")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    merged = {}
    for f in files:
        merged.update(load_file(str(sharded / f)))
    assert all(torch.equal(merged[k], full[k].to(torch.bfloat16)) for k in full)

    # CLI: torch format and inspect; a missing checkpoint is a clear error.
    _cli("consolidate", root, tmp_path / "pt", "--format", "torch", cwd=tmp_path)
    state = torch.load(tmp_path / "pt" / "model.pt")
    assert all(torch.equal(state[k], full[k]) for k in full)
    shown = _cli("inspect", root, cwd=tmp_path)
    assert "saved by 2 rank(s)" in shown.stdout and "model.transformer.h.0.attn.c_attn.weight" in shown.stdout
    missing = _cli("inspect", tmp_path / "nothing", cwd=tmp_path, check=False)
    assert missing.returncode == 2 and "No committed checkpoint" in missing.stderr
    with pytest.raises(ValueError, match="format='onnx'"):
        f2.export_full(root, tmp_path / "x", format="onnx")


def test_consolidate_and_inspect_refuse_a_damaged_checkpoint(tmp_path):
    """A byte flipped in a committed shard: export refuses (naming the file and an earlier step),
    inspect reports it, the CLI exits non-zero; the intact earlier step still exports."""
    import fsdp2_strategy as f2

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    ckpt = f2.Checkpointer(tmp_path / "root")
    ckpt.save(1, model=model)
    ckpt.save(2, model=model)
    assert "checksums: every file matches" in str(f2.inspect_checkpoint(tmp_path / "root"))
    shard = ckpt.step_path(2) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    with pytest.raises(ValueError, match=r"__0_0.distcp: corrupted .*\n.*earlier step"):
        f2.export_full(tmp_path / "root", tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()
    info = f2.inspect_checkpoint(tmp_path / "root")
    assert info.problems and "DAMAGED: __0_0.distcp: corrupted" in str(info)
    consolidate = _cli("consolidate", tmp_path / "root", tmp_path / "out", cwd=tmp_path, check=False)
    assert consolidate.returncode == 2 and "damaged" in consolidate.stderr
    inspect = _cli("inspect", tmp_path / "root", cwd=tmp_path, check=False)
    assert inspect.returncode == 1 and "DAMAGED" in inspect.stdout
    f2.export_full(tmp_path / "root", tmp_path / "out", step=1)
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(tmp_path / "out" / "model.safetensors"))["weight"], model.weight)
