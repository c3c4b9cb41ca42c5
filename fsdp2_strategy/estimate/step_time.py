"""Predicted step time of one FSDP2 setting: compute, communication and how much of it overlaps.

The model, per optimizer step of `k` micro-batches on one rank:

    compute       = k * (forward + backward + forward if activation checkpointing)
    optimizer     = optimizer_fixed + optimizer_full / shard_size
                                                      (each rank steps its shard only; the
                                                       per-tensor part does not shrink)
    communication = sum over all_gather, reduce_scatter, all_reduce of
                    calls * latency + bytes / bandwidth
    overhead      = per_call * calls + local_call * local calls
                                                      (FSDP's copies and hooks at every unshard
                                                       and gradient sync, collective or not)
    exposed       = communication                     ("none": gloo's synchronous CPU path)
                  | c1 + max(0, communication - c1 - compute)
                                                      ("prefetch": accelerators; c1 = one
                                                       all-gather, which nothing hides)
    step          = compute + optimizer + overhead + exposed + copies
    under CPU offload on an accelerator (on a CPU mesh offloaded state already is where it is
    used): optimizer *= host_optimizer_scale, copies = host_copy_bytes * host_copy_s_per_byte

`calls` and `bytes` (what each rank sends, ring-counted) come from `estimate_memory`
(`MemoryEstimate.collective_calls`, `.communication`), the local calls (groups sharded over one
rank: an unshard is a copy, no collective) from `MemoryEstimate.local_calls`; latency and
bandwidth per collective from a sweep on the process group (`Link`, measured by
`fsdp2_strategy.tuning.measure_link`); forward, backward and the optimizer step from one measured
step (`ComputeProfile.from_step`); `per_call` - what a collective call costs inside a step beyond
the sweep's latency (FSDP's buffer copies and hooks, ranks waiting for each other) - from a second
measured step with another number of calls (`local_call`, for a local one, where the two differ
only in those: world size 1), and from a third setting with another shard size `optimizer_fixed`
(its optimizer step) and an extra cost per byte of the collectives only it calls (its step time;
`ComputeProfile.fit`); the offload terms from a measured offloaded setting (`fit_offload`). The
overhead is not hidden behind compute on accelerators either: FSDP's copies run in the compute
stream's order and its hooks on the CPU that launches the compute (even at world size 1, where
nothing is communicated, more groups make a step slower).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..train import accumulation_mode
from .memory import MemoryEstimate

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
"""The collectives the model times (the names of `MemoryEstimate.communication`)."""

OVERLAP = {"cpu": "none"}
"""Overlap of communication with compute by device type; every other device type: "prefetch"
(FSDP's backward prefetch and asynchronous collectives on their own stream)."""


@dataclass
class CollectiveFit:
    """Time of one collective: `latency_s` per call plus the bytes each rank sends / `bytes_per_s`."""

    latency_s: float
    """Seconds per call (the fit's intercept)."""
    bytes_per_s: float
    """Bytes each rank sends per second (the inverse of the fit's slope)."""

    def seconds(self, calls: int, nbytes: float) -> float:
        """Time of `calls` calls sending `nbytes` together."""
        return calls * self.latency_s + nbytes / self.bytes_per_s


@dataclass
class Link:
    """Latency and bandwidth of each collective on one process group, as FSDP runs them there."""

    fits: dict[str, CollectiveFit]
    """Collective name ("all_gather", "reduce_scatter", "all_reduce") -> its fit."""
    world_size: int = 1
    """Ranks the sweep ran on."""

    def seconds(self, calls: dict[str, int], nbytes: dict[str, int]) -> dict[str, float]:
        """Seconds per collective for the given calls and bytes (collectives never called: 0)."""
        out = {}
        for name in COLLECTIVES:
            n, b = calls.get(name, 0), nbytes.get(name, 0)
            out[name] = self.fits[name].seconds(n, b) if (n or b) and name in self.fits else 0.0
        return out


@dataclass
class ComputeProfile:
    """One rank's compute per micro-batch and per optimizer step, communication excluded."""

    forward_s: float
    """Forward of one micro-batch (loss included)."""
    backward_s: float
    """Backward of one micro-batch."""
    optimizer_s: float
    """Optimizer step over the whole model's trainable parameters, the part that shrinks with
    the shard (a rank holding 1/N of them takes 1/N of it)."""
    per_call_s: float = 0.0
    """What each collective call costs inside a training step beyond the sweep's latency: FSDP's
    copies in and out of the communication buffers, its hooks, and ranks waiting for each other
    at every call (`fit`). Negative when the sweep's latency is more than a call costs in a step
    (ranks sharing a core), never below minus that latency."""
    optimizer_fixed_s: float = 0.0
    """The optimizer step's part that does not shrink with the shard: work per parameter tensor
    (kernel launches, DTensor dispatch), which every rank does for every tensor: AdamW on a
    fraction of a model's parameters takes more than that fraction of its time on the whole."""
    per_byte_s: dict[str, float] = field(default_factory=dict)
    """Seconds per byte sent added to a collective the first two reference settings never call
    (NO_SHARD's all-reduce when they are FULL_SHARD's), so that a third is predicted exactly:
    FSDP's copies in and out of its buffers, which the sweep does not make (`fit`)."""
    local_call_s: float = 0.0
    """What each local call (`MemoryEstimate.local_calls`: an unshard or sync of a group sharded
    over one rank, a copy and FSDP's hooks) costs, fitted where the reference settings differ in
    those calls only (world size 1); 0 otherwise. On several ranks the local calls are NO_SHARD's
    unshards, whose cost the third reference's `per_byte_s` takes in: charging them `per_call_s`
    (which includes ranks waiting for each other) made NO_SHARD's predictions worse more often
    than better."""

    host_optimizer_scale: float = 1.0
    """Under CPU offload on an accelerator the optimizer steps on the host: its time over the
    device's for the same shard, fitted to a measured offloaded setting (`fit_offload`); 1 until
    one is."""
    host_copy_s_per_byte: float = 0.0
    """Seconds per byte of `MemoryEstimate.host_copy_bytes` (the shards copied to the device at
    each unshard, the gradient shards back), fitted likewise; 0 until one is."""

    @classmethod
    def from_step(
        cls,
        forward_s: float,
        backward_s: float,
        optimizer_s: float,
        estimate: MemoryEstimate,
        link: Link,
        per_call_s: float = 0.0,
        optimizer_fixed_s: float = 0.0,
        local_call_s: float = 0.0,
    ) -> ComputeProfile:
        """The compute of a measured step (seconds per micro-batch in forward and backward, and of
        the optimizer step) of the setting `estimate` describes, its communication taken out:
        forward holds the first unshard of every group, backward the rest and the reductions;
        each collective call also costs `per_call_s`, each local call `local_call_s`;
        `optimizer_fixed_s` of the optimizer step does not shrink with the shard. Never below
        zero."""
        k = estimate.micro_batches
        calls, sent = estimate.collective_calls, estimate.communication
        gathers = calls.get("all_gather", 0)
        share = _forward_gathers(estimate) / gathers if gathers else 0.0
        ag = link.seconds({"all_gather": gathers}, {"all_gather": sent.get("all_gather", 0)})["all_gather"]
        rest = link.seconds({**calls, "all_gather": 0}, {**sent, "all_gather": 0})
        fwd_calls, bwd_calls = _call_costs(estimate, per_call_s, local_call_s)
        fwd_comm = (ag * share + fwd_calls) / k
        bwd_comm = (ag * (1 - share) + rest["reduce_scatter"] + rest["all_reduce"] + bwd_calls) / k
        recompute = 1 if estimate.activation_checkpointing else 0
        fwd = max(forward_s - fwd_comm, 0.0)
        bwd = max(backward_s - bwd_comm - recompute * fwd, 0.0)
        fixed = min(max(optimizer_fixed_s, 0.0), optimizer_s)
        shrinking = (optimizer_s - fixed) * estimate.shard_size
        return cls(fwd, bwd, shrinking, per_call_s=per_call_s, local_call_s=local_call_s, optimizer_fixed_s=fixed)

    @classmethod
    def fit(
        cls,
        phases: tuple[float, float, float],
        estimate: MemoryEstimate,
        other_step_s: float,
        other: MemoryEstimate,
        link: Link,
        device_type: str = "cpu",
        *,
        third: tuple[float, float, MemoryEstimate] | None = None,
    ) -> ComputeProfile:
        """`from_step` of a step measured by phase (forward, backward per micro-batch; optimizer),
        with `per_call_s` chosen so that a second setting with another number of collective calls
        (`other`, measured at `other_step_s` per step) is predicted exactly: 0 when the two make as
        many calls, never below minus the sweep's least latency among the collectives they call
        (a call costs no less than nothing). Where the two make as many collective calls but not
        as many local ones (world size 1), `local_call_s` is chosen so instead, never below 0.
        `third`: (optimizer seconds, step seconds, estimate) of a setting with another shard size.
        Its optimizer step splits the optimizer into the part that shrinks with the shard and the
        part that does not (`optimizer_fixed_s`); its step time gives `per_byte_s` to the
        collectives it calls and the other two do not."""
        fixed = _optimizer_fixed(phases[2], estimate.shard_size, third[0], third[2]) if third else 0.0

        local = collective_count(estimate) == collective_count(other)

        def profile(cost: float) -> ComputeProfile:
            per_call, local_call = (0.0, cost) if local else (cost, 0.0)
            return cls.from_step(
                *phases, estimate, link, per_call_s=per_call, optimizer_fixed_s=fixed, local_call_s=local_call
            )

        delta = 1e-3
        p0 = predict_step_time(other, link, profile(0.0), device_type).total_s
        slope = (predict_step_time(other, link, profile(delta), device_type).total_s - p0) / delta
        per_call = (other_step_s - p0) / slope if abs(slope) > 1e-9 else 0.0
        called = _called(link, estimate, other)
        floor = -min((link.fits[n].latency_s for n in called), default=0.0)
        fitted = profile(max(per_call, floor))
        if third:
            fitted.per_byte_s = _per_byte(fitted, link, device_type, third[1], third[2], called)
        return fitted


def fit_offload(
    compute: ComputeProfile,
    optimizer_s: float,
    step_s: float,
    estimate: MemoryEstimate,
    link: Link,
    device_type: str = "cpu",
) -> ComputeProfile:
    """`compute` with the offload terms chosen so that the offloaded setting `estimate`, measured
    at `step_s` a step of which `optimizer_s` in the optimizer step, is predicted exactly:
    `host_optimizer_scale` from its optimizer step (the host's against the device's, as
    `compute` predicts it for the same shard), then `host_copy_s_per_byte` from the rest of its
    step, never below 0. `compute` unchanged for a setting without offload, or on a CPU mesh."""
    if not _offloads_to_host(estimate, device_type):
        return compute
    base = replace(compute, host_optimizer_scale=1.0, host_copy_s_per_byte=0.0)
    on_device = predict_step_time(estimate, link, base, device_type).optimizer_s
    scaled = replace(base, host_optimizer_scale=optimizer_s / on_device if on_device > 0 else 1.0)
    missing = step_s - predict_step_time(estimate, link, scaled, device_type).total_s
    copied = estimate.host_copy_bytes
    return replace(scaled, host_copy_s_per_byte=max(missing / copied, 0.0) if copied else 0.0)


def offload_moves_state(device_type: str) -> bool:
    """Whether CPU offload moves state between host and device when training on `device_type`:
    not on a CPU mesh, where offloaded state already is where it is used."""
    return device_type != "cpu"


def _offloads_to_host(estimate: MemoryEstimate, device_type: str) -> bool:
    return estimate.cpu_offload and offload_moves_state(device_type)


def _called(link: Link, *estimates: MemoryEstimate) -> set[str]:
    """The swept collectives any of `estimates` calls."""
    return {n for e in estimates for n, c in e.collective_calls.items() if c and n in link.fits}


def _per_byte(
    compute: ComputeProfile, link: Link, device_type: str, step_s: float, third: MemoryEstimate, known: set[str]
) -> dict[str, float]:
    """Seconds per byte that make `third` (measured at `step_s`) predicted exactly, added to the
    collectives it calls beyond `known`; no collective's bytes cost less than nothing."""
    new = [n for n in _called(link, third) - known if third.communication.get(n, 0)]
    if not new:
        return {}
    nbytes = sum(third.communication[n] for n in new)
    missing = step_s - predict_step_time(third, link, compute, device_type).total_s
    floor = -min(1 / link.fits[n].bytes_per_s for n in new)
    return dict.fromkeys(new, max(missing / nbytes, floor))


def _optimizer_fixed(optimizer_s: float, shard_size: int, other_optimizer_s: float, other: MemoryEstimate) -> float:
    """The part `a` of two optimizer steps `a + b / shard` (shard sizes `shard_size` and
    `other.shard_size`) that does not shrink with the shard; 0 when the sizes are equal or the
    steps say nothing sensible (the larger shard faster)."""
    inverse = 1 / max(other.shard_size, 1) - 1 / max(shard_size, 1)
    if not inverse:
        return 0.0
    shrinking = max((other_optimizer_s - optimizer_s) / inverse, 0.0)
    return min(max(optimizer_s - shrinking / max(shard_size, 1), 0.0), optimizer_s)


def fsdp_calls(estimate: MemoryEstimate) -> int:
    """FSDP's unshards and gradient syncs per optimizer step, collective calls and local ones
    (`MemoryEstimate.local_calls`): what the per-call costs are paid for."""
    return collective_count(estimate) + sum(estimate.local_calls.values())


def collective_count(estimate: MemoryEstimate) -> int:
    """Collective calls per optimizer step (`MemoryEstimate.collective_calls`, all collectives)."""
    return sum(estimate.collective_calls.get(n, 0) for n in COLLECTIVES)


def _call_costs(estimate: MemoryEstimate, per_call_s: float, local_call_s: float) -> tuple[float, float]:
    """Seconds of FSDP's per-call overhead in one step: in its forward passes (the first unshard
    of every group), and in the rest."""
    local_unshards = estimate.local_calls.get("all_gather", 0)
    forward = _forward_gathers(estimate) * per_call_s
    forward += min(estimate.local_groups * _per_forward(estimate), local_unshards) * local_call_s
    total = collective_count(estimate) * per_call_s + sum(estimate.local_calls.values()) * local_call_s
    return forward, total - forward


def _per_forward(estimate: MemoryEstimate) -> int:
    return accumulation_mode(estimate.accumulation).gathering_forwards(estimate.micro_batches)


def _forward_gathers(estimate: MemoryEstimate) -> int:
    """All-gather calls made in forward: every gathering group once per gathering forward
    (`AccumulationMode.gathering_forwards`); the rest of `collective_calls["all_gather"]` happen in backward."""
    gathers = estimate.collective_calls.get("all_gather", 0)
    return min(estimate.gathering_groups * _per_forward(estimate), gathers)


@dataclass
class StepTimePrediction:
    """Predicted seconds of one optimizer step, by part."""

    compute_s: float
    """Forward, backward and recomputation of every micro-batch."""
    optimizer_s: float
    """This rank's optimizer step."""
    communication_s: float
    """All collectives, as if none overlapped, FSDP's per-call overhead (`fsdp_calls`) and, under
    CPU offload on an accelerator, the host-device copies (`host_copy_s`)."""
    exposed_s: float
    """The part of `communication_s` the step waits for (all of the per-call overhead and of the
    host-device copies)."""
    by_collective: dict[str, float] = field(default_factory=dict)
    """Seconds per collective."""
    host_copy_s: float = 0.0
    """Host-device copies under CPU offload (part of `communication_s` and `exposed_s`)."""

    @property
    def total_s(self) -> float:
        """The predicted step time."""
        return self.compute_s + self.optimizer_s + self.exposed_s


@dataclass
class StepTimeModel:
    """What predicts step times on one machine and process group: the link and the compute."""

    link: Link
    """Latency and bandwidth per collective."""
    compute: ComputeProfile
    """Forward, backward and optimizer seconds."""
    device_type: str = "cpu"
    """The device the job trains on: decides the overlap (`OVERLAP`)."""

    def predict(self, estimate: MemoryEstimate) -> StepTimePrediction:
        """Predicted step time of the setting `estimate_memory` described."""
        return predict_step_time(estimate, self.link, self.compute, self.device_type)


def predict_step_time(
    estimate: MemoryEstimate, link: Link, compute: ComputeProfile, device_type: str = "cpu"
) -> StepTimePrediction:
    """The module docstring's formula for one setting."""
    k = estimate.micro_batches
    recompute = compute.forward_s if estimate.activation_checkpointing else 0.0
    compute_s = k * (compute.forward_s + compute.backward_s + recompute)
    optimizer_s = compute.optimizer_fixed_s + compute.optimizer_s / max(estimate.shard_size, 1)
    copies = 0.0
    if _offloads_to_host(estimate, device_type):
        optimizer_s *= compute.host_optimizer_scale
        copies = estimate.host_copy_bytes * compute.host_copy_s_per_byte
    by = link.seconds(estimate.collective_calls, estimate.communication)
    for name, seconds in compute.per_byte_s.items():
        by[name] += seconds * estimate.communication.get(name, 0)
    comm = sum(by.values())
    overhead = sum(_call_costs(estimate, compute.per_call_s, compute.local_call_s))
    if OVERLAP.get(device_type, "prefetch") == "none":
        exposed = comm
    else:
        calls = estimate.collective_calls.get("all_gather", 0)
        first = by["all_gather"] / calls if calls else 0.0
        exposed = first + max(0.0, comm - first - compute_s)
    return StepTimePrediction(compute_s, optimizer_s, comm + overhead + copies, exposed + overhead + copies, by, copies)
