"""What the two adapters' spawn launchers add to Lightning's: a clean end for each worker."""

from __future__ import annotations

from typing import Any

from fsdp2_strategy.distributed import shutdown


class ShutdownAfterWorker:
    """Mixin for Lightning's and Fabric's `_MultiProcessingLauncher`: workers end through
    `fsdp2_strategy.shutdown()`.

    A spawned worker otherwise leaves through interpreter finalisation with the gloo process
    group alive (Lightning never destroys it), which aborted "terminate called without an active
    exception" in 1 of 6 runs after a DCP save (tests/integrations/lightning/scripts/spawn.py). The user cannot
    add the call: the worker runs only Lightning's function, so the launcher does.
    """

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)  # type: ignore[misc]  # rank 0 has queued its results
        # A worker that raised never gets here: torch.multiprocessing reports its traceback.
        shutdown()
