"""Measured throughput: `tune` runs candidate settings on the process group and picks the fastest
that fits (`tuner`, `passes`, `measure` and its probe step's counters `probe`, `candidates`,
`result`); `measure_link` sweeps the collectives (`link`); `example_batch_from` takes the
adapters' example batch from a DataLoader (`example`); decisions are cached by model, world and
device (`cache`); `resolve` serves `FSDP2Config(sharding_strategy="auto",
objective="throughput")` and `compare_strategies(time=True)`.

Imports the base modules, `train`, `estimate` and `shard` (it shards copies of the model);
`fsdp2_strategy.choose`, above it, calls `resolve_throughput` and `measure_time_model`. `__all__` is
what other packages and the adapters use.
"""

from .candidates import default_candidates
from .example import example_batch_from
from .link import measure_link
from .resolve import measure_time_model, resolve_throughput
from .result import TuneResult
from .tuner import tune

__all__ = [
    "TuneResult",
    "default_candidates",
    "example_batch_from",
    "measure_link",
    "measure_time_model",
    "resolve_throughput",
    "tune",
]
