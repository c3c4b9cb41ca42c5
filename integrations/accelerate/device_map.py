"""The stock `Accelerator.prepare_model`'s refusals of a quantised model loaded with a device map,
made by `FSDP2Accelerator` before sharding, so a model the stock one refuses is refused alike.

Accelerate 1.15 refuses (`ValueError`) a bitsandbytes 8-bit or 4-bit model whose `hf_device_map`
spans several devices in a distributed run, sits on another device than the one training, or is
offloaded to CPU (without bitsandbytes' multi-backend, or on an XPU machine) or to disk. The
messages are Accelerate's, with what to do.
"""

from __future__ import annotations

from typing import Any

import accelerate.accelerator as stock
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn

__all__ = ["check_quantised_device_map"]


def check_quantised_device_map(model: nn.Module, accelerator: Accelerator) -> None:
    """Raise the stock `Accelerator.prepare_model`'s `ValueError` for a quantised model whose
    `hf_device_map` it cannot train (a no-op for any other model).

    Args:
        model: The model given to `prepare`.
        accelerator: The accelerator preparing it (its `device` and `distributed_type`).

    Raises:
        ValueError: The model is loaded in 8-bit or 4-bit on several devices (distributed), on
            another device than `device`, or with CPU (without bitsandbytes' multi-backend) or
            disk offload.
    """
    quantised = getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False)
    device_map = getattr(model, "hf_device_map", None)
    if not quantised or not device_map:
        return
    devices, device = set(device_map.values()), accelerator.device
    if len(devices) > 1 and accelerator.distributed_type != DistributedType.NO:
        raise ValueError(
            "You can't train a model that has been loaded in 8-bit or 4-bit precision on multiple devices in any "
            "distributed mode. Load it on one device (device_map={'': <this rank's device>}) to fine-tune it with "
            "FSDP2Accelerator."
        )
    if len(devices) == 1:
        _check_same_device(next(iter(devices)), device)
    # Asked of `accelerate.accelerator`, where the stock check looks them up (and tests patch them).
    cpu_refused = not stock.is_bitsandbytes_multi_backend_available() or stock.is_xpu_available()
    if ("cpu" in devices and cpu_refused) or "disk" in devices:
        raise ValueError(
            "You can't train a model that has been loaded in 8-bit or 4-bit precision with CPU or disk offload. "
            f"Its hf_device_map places modules on {sorted(map(str, devices))}: load it without offload, on the "
            "training device; to train an 8-bit or 4-bit model on CPU, install bitsandbytes with multi-backend."
        )


def _check_same_device(placed: Any, device: torch.device) -> None:
    """The stock check that a one-device quantised model sits on the training device (GPU 0 accepted)."""
    if placed == "disk":
        return  # refused as offload next (the stock check fails on it with torch's RuntimeError)
    if isinstance(placed, torch.device):
        index = placed.index
    elif isinstance(placed, str):
        index = torch.device(placed).index
    else:
        index = placed
    index = int(index) if index is not None else None
    if device.type == "cpu" and stock.is_bitsandbytes_multi_backend_available():
        return  # bitsandbytes' multi-backend runs on CPU, whatever the index
    if torch.device(device.type, index) != device and (device.index is not None or index != 0):
        raise ValueError(
            "You can't train a model that has been loaded in 8-bit or 4-bit precision on a different device than "
            f"the one you're training on ({device}). Load it on that device, e.g. device_map={{'': {device!s}}}."
        )
