"""`example_batch_from`: one micro-batch of a DataLoader for the tuner, taken without touching the
loader's state, so the training that follows sees the same data in the same order.

The adapters (Lightning's train dataloader, a DataLoader handed to Accelerate's `prepare`) use it
for `FSDP2Config(sharding_strategy="auto", objective="throughput")`: they see no batch before
sharding otherwise.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset


def example_batch_from(loader: Any) -> Any:
    """The first `loader.batch_size` samples of `loader.dataset` collated by `loader.collate_fn`:
    the same batch on every rank (same shapes, which the tuner requires), built without iterating
    the loader, so its sampler, its generator and torch's and Python's random state are left as
    they were (augmentations in `__getitem__` run under a forked random state).

    Raises ValueError naming what to do for anything else (an iterable dataset, a batch sampler
    without a batch size, not a DataLoader): tune with `f2.tune(model, batch)` and pass its
    `best_config`."""
    what = _unsupported(loader)
    if what:
        raise ValueError(
            f"objective='throughput' takes its example batch from the train DataLoader, but {what}; run "
            "f2.tune(model, batch) on every rank and pass the fields of its best_config, or use objective='memory'."
        )
    dataset = loader.dataset
    count = min(loader.batch_size, len(dataset))
    python_state = random.getstate()
    try:
        with torch.random.fork_rng(devices=[]):
            return loader.collate_fn([dataset[i] for i in range(count)])
    finally:
        random.setstate(python_state)


def _unsupported(loader: Any) -> str:
    """Why no batch can be taken from `loader` without changing it ("" when one can)."""
    if not isinstance(loader, DataLoader):
        return f"got {type(loader).__name__} instead of one torch DataLoader"
    if isinstance(loader.dataset, IterableDataset):
        return "its dataset is an IterableDataset (taking a batch would advance it)"
    if loader.batch_size is None:
        return "it has a batch sampler without a fixed batch_size"
    if not hasattr(loader.dataset, "__len__") or len(loader.dataset) == 0:
        return "its dataset has no length or is empty"
    return ""
