"""The private Lightning Fabric names the shared layer uses (both Lightning packages use Fabric's
utilities), reached through `versions.find_private` and checked at import.

- `lightning.fabric.utilities.distributed._get_default_process_group_backend_for_device`: the
  backend Lightning would pick for a device (gloo on CPU, nccl on CUDA, ...).
"""

from __future__ import annotations

import lightning

from fsdp2_strategy.versions import find_private, private_api_error

_missing: list[str] = []
default_backend_for_device = find_private(
    "lightning.fabric.utilities.distributed:_get_default_process_group_backend_for_device", _missing
)


def check_private_api() -> None:
    """Raise ImportError naming every Lightning name above that a release moved."""
    if _missing:
        raise private_api_error("fsdp2_strategy's Lightning adapters", "lightning", lightning.__version__, _missing)


check_private_api()
