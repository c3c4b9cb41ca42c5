"""Hugging Face style weight files: tensors written in order into `model.safetensors`, or into
`model-0000i-of-0000N.safetensors` plus `model.safetensors.index.json` past a size limit."""

from __future__ import annotations

import json
from pathlib import Path

import torch

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
"""The most bytes per safetensors file by default (Hugging Face's `max_shard_size`)."""


def split_by_size(sizes: dict[str, int], max_bytes: float) -> list[list[str]]:
    """Names in order, cut into consecutive files of at most `max_bytes` (one larger tensor alone)."""
    files: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if files[-1] and used + size > max_bytes:
            files.append([])
            used = 0
        files[-1].append(name)
        used += size
    return files


class ShardWriter:
    """Writes named tensors, in order, into Hugging Face style safetensors files: `model.safetensors`,
    or `model-0000i-of-0000N.safetensors` + `model.safetensors.index.json` when the sizes announced
    up front exceed `max_bytes`. Holds at most one file's tensors."""

    def __init__(self, out: Path, sizes: dict[str, int], max_bytes: int):
        self.out = out
        self.pending: dict[str, torch.Tensor] = {}
        self.weight_map: dict[str, str] = {}
        self.files = split_by_size(sizes, max_bytes)
        self.total = sum(sizes.values())
        self.file_of = {name: i for i, names in enumerate(self.files) for name in names}
        self.index = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor; write its file once every tensor of that file arrived."""
        self.pending[name] = tensor.contiguous()
        if len(self.pending) == len(self.files[self.index]):
            self._flush()

    def _flush(self) -> None:
        from safetensors.torch import save_file  # optional ([hf])

        count = len(self.files)
        fname = "model.safetensors" if count == 1 else f"model-{self.index + 1:05d}-of-{count:05d}.safetensors"
        self.out.mkdir(parents=True, exist_ok=True)
        save_file(self.pending, str(self.out / fname), metadata={"format": "pt"})
        self.weight_map.update(dict.fromkeys(self.pending, fname))
        self.pending, self.index = {}, self.index + 1

    def close(self) -> None:
        """Write the index (several files); every announced tensor must have been added."""
        if self.pending or self.index != len(self.files):
            raise RuntimeError(f"ShardWriter closed with {len(self.pending)} tensors unwritten.")
        if len(self.files) > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": self.weight_map}
            (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
