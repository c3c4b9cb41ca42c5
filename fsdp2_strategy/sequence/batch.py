"""A batch of whole sequences made ready to be split: the tensors a rank cannot derive from its part.

After the split a rank holds a head and a tail chunk of each sequence, so two things a causal LM
derives from whole sequences must be made before it: the labels shifted by one token (the label of a
chunk's last token is the first token of a chunk another rank holds) and the position ids (a chunk's
positions are not 0, 1, 2, ...). `ContextParallelBatch.loss` then averages over every token of the
sequences, the counts summed across the context-parallel group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..train import IGNORE_INDEX


def shift_labels(labels: torch.Tensor, seq_dim: int, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """`labels` moved one token left along `seq_dim`, the last position set to `ignore_index`: the
    target of each token, as a causal LM's loss reads it."""
    shifted = torch.full_like(labels, ignore_index)
    length = labels.size(seq_dim)
    shifted.narrow(seq_dim, 0, length - 1).copy_(labels.narrow(seq_dim, 1, length - 1))
    return shifted


def sequence_keys(batch: Mapping[str, Any], seq_dim: int) -> list[str]:
    """The keys of `batch`'s tensors that have a sequence dim `seq_dim` (what the ranks split)."""
    return [k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > seq_dim]


def prepare(batch: Mapping[str, Any], seq_dim: int, ignore_index: int) -> dict[str, Any]:
    """`batch` with "shift_labels" (from "labels", unless given) and "position_ids" (0..S-1 per row,
    unless given) added and an all-ones "attention_mask" dropped (it means no mask).

    Raises:
        ValueError: no tensor with a sequence dim, sequence lengths that differ, or an attention
            mask that masks something (padding cannot be split: pack sequences instead).
    """
    if not isinstance(batch, Mapping):
        raise ValueError(
            f"f2.context_parallel needs the batch as a dict of tensors by name (got {type(batch).__name__}), "
            "e.g. {'input_ids': ..., 'labels': ...}: it adds position_ids and shift_labels to it."
        )
    out = dict(batch)
    mask = out.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        if not bool(mask.bool().all()):
            raise ValueError(
                "f2.context_parallel: the batch's attention_mask masks tokens (padding), which a ring over "
                "sequence chunks cannot apply; pack sequences to a common length without padding (mark "
                "tokens without a target with labels=-100 instead) and drop the attention_mask."
            )
        del out["attention_mask"]  # all ones: the same attention as no mask
    tensors = {k: out[k] for k in sequence_keys(out, seq_dim)}
    if not tensors:
        raise ValueError(
            f"f2.context_parallel: the batch holds no tensor with a sequence dim {seq_dim} (keys: {sorted(out)}); "
            "pass the model's inputs, e.g. {'input_ids': ..., 'labels': ...}, or set seq_dim."
        )
    lengths = {k: v.size(seq_dim) for k, v in tensors.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"f2.context_parallel: the batch's sequence lengths (dim {seq_dim}) differ: {lengths}.")
    first = next(iter(tensors.values()))
    if "labels" in out and "shift_labels" not in out:
        out["shift_labels"] = shift_labels(out["labels"], seq_dim, ignore_index)
    if "position_ids" not in out:
        shape = first.shape[: seq_dim + 1]
        positions = torch.arange(shape[seq_dim], device=first.device)
        out["position_ids"] = positions.view(*([1] * seq_dim), -1).expand(shape).clone()
    return out


class ContextParallelBatch(dict):
    """This rank's part of every sequence of a batch (a dict of the batch's keys), inside
    `f2.context_parallel`, with the loss over all the sequences' tokens.

    Keys: the batch's own, "position_ids" and "shift_labels" (the labels moved one token left)
    added when absent. With `cp_size` ranks each holds 1/cp_size of every sequence: chunks `r` and
    `2 * cp_size - 1 - r` of `2 * cp_size` for a causal model (equal work per rank), chunk `r` of
    `cp_size` for full attention.
    """

    def __init__(
        self,
        tensors: Mapping[str, Any],
        *,
        group: dist.ProcessGroup | None,
        cp_size: int,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        super().__init__(tensors)
        self.group = group
        """The context-parallel process group (None with `cp_size` 1)."""
        self.cp_size = cp_size
        """Ranks each sequence is split across (1: none)."""
        self.ignore_index = ignore_index
        """The label of tokens without a target."""

    def token_count(self, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens with a target in the whole sequences (summed over the context-parallel group).

        Args:
            labels: Shifted labels of this rank's tokens (default: `self["shift_labels"]`).

        Returns:
            A 0-dim int64 tensor, the same on every rank of the group.
        """
        labels = self._labels(labels)
        count = (labels != self.ignore_index).sum()
        if self.group is not None:
            dist.all_reduce(count, group=self.group)
        return count

    def loss(self, logits: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Causal-LM cross-entropy over every token of the whole sequences, as this rank's share.

        The sum over this rank's tokens, times `cp_size`, over `token_count()`: FSDP averages
        gradients over the data-parallel x context-parallel ranks, so each data-parallel group's
        gradient is that of the mean over all its tokens, as one process computes it on whole
        sequences. The loss of the whole sequences is the mean of this value over the group
        (e.g. Lightning's `self.log(..., sync_dist=True)` over all ranks).

        Args:
            logits: The model's logits for this rank's tokens, (..., vocabulary).
            labels: Their shifted labels (default: `self["shift_labels"]`).

        Returns:
            A 0-dim float32 tensor to call `backward()` on.
        """
        labels = self._labels(labels)
        total = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(),
            labels.reshape(-1),
            ignore_index=self.ignore_index,
            reduction="sum",
        )
        return total * self.cp_size / self.token_count(labels).clamp(min=1)

    def _labels(self, labels: torch.Tensor | None) -> torch.Tensor:
        if labels is not None:
            return labels
        if "shift_labels" not in self:
            raise KeyError(
                "ContextParallelBatch has no 'shift_labels' (the batch had no 'labels'); pass labels= "
                "shifted one token left, or put 'labels' in the batch."
            )
        return self["shift_labels"]
