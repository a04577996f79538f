"""What the planner answers: the result types -- per-device memory (``Memory``), one layout's
plan and its verdict lines (``Plan``), the recommendation (``Recommendation``, with the preset
as planned) and the report of every layout (``Report``). Made by planner/plan.py, rendered by
planner/render.py."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from planner.communication import Communication
from planner.states import gb, gb_apart

if TYPE_CHECKING:
    from strategies.base import StrategyConfig


@dataclass
class Memory:
    """Integer bytes per device; host/nvme: what this device's share moved off the device."""

    params: int = 0
    grads: int = 0
    master: int = 0
    optimizer: int = 0
    activations: int = 0
    buffers: int = 0
    total: int = 0
    host: int = 0
    nvme: int = 0
    step: int = 0
    """On the device once the activations are gone -- the end of backward (FSDP's root unit
    reduced) and the optimizer step: states and those transients; ``total`` is the larger of
    this and forward/backward (states + activations + buffers + loss; the gradients not yet
    made when freed between steps and a step is one micro-batch)."""
    loss: int = 0
    """The loss's backward (the fp32 log-softmax and logits gradients, 8 x s x b x V bytes;
    one chunk's, 8 x chunk x V, with trainer.loss_chunk), beside every saved activation at the
    start of backward: part of the forward/backward peak."""
    host_items: dict = field(default_factory=dict)
    """Host bytes per device of what is offloaded, item by item as the engine allocates it
    (planner/host.py); ``host`` is their sum less ``process``, the process's own base."""
    growth: int = 0
    """How far the peak rises above what a finished step leaves (every state, the persistent
    buckets): activations, the loss backward and the transient buffers (gathered units,
    autocast's weight copies) less the gradients not made yet, or the step's own transients;
    the memory observer measures it as ``peak_rss_growth``."""


@dataclass
class Plan:
    strategy: str
    fits: bool
    memory: Memory
    communication: Communication
    bubble_fraction: float
    step_seconds: float
    compute_seconds: float = 0.0
    exposed_seconds: float = 0.0
    optimizer_seconds: float = 0.0
    """The optimizer step's own time (calibrated machines only: AdamW's measured ns per parameter,
    the host's where the optimizer is offloaded)."""
    floor_seconds: float = 0.0
    """The least a step takes, its launch and Python overhead (calibrated machines only): the
    step is never planned under it."""
    engine_seconds: float = 0.0
    """The engine's own work beyond its collectives and optimizer step (calibrated machines
    only: DeepSpeed ZeRO's and FSDP2's measured ns per parameter and micro-batch)."""
    flops_per_step: float = 0.0
    """Model FLOPs of one optimizer step over the world (``flops_per_step``)."""
    peak_tflops: float = 0.0
    """The per-device peak compute divides by (``peak_flops``), and where it comes from:"""
    peak_source: str = ""
    mfu: float = 0.0
    cluster: str = ""
    world_size: int = 1
    device_bytes: int = 0
    host_margin: int | None = None
    """On CPU, where the device is the host: the node's host memory left per rank once every
    rank's device peak, offloaded items and process base are counted (planner/host.py
    ``node_host_need``); None on a GPU."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    shard: int = 1
    cp: int = 1
    sp: int = 1
    ep: int = 1
    microbatches: int = 1
    activation_checkpointing: bool | str = False  # as planned: false | true | selective
    activations_full: int = 0
    activations_checkpointed: int = 0
    planned_only: bool = False
    reserve: int = 0
    """Bytes a GPU needs beyond the plan (planner.reserve_GB); 0 on CPU."""
    rung: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    hint: str | None = None
    label: str = ""
    """How the job names its preset where that is not ``strategy`` (a user's option over a built-in
    preset: ``my_fsdp (fsdp2 + reshard_after_forward=false)``, recipes.job.Job.label); "" : the name."""
    memory_fits: bool = True
    """The memory verdict alone (device, host, NVMe); ``fits`` also needs a layout that can run."""
    lossy: bool = False
    """Gradient compression that changes the numbers (fp16/bf16 casts, PowerSGD, top-k, ...)."""
    mesh_fits: bool = True
    """The layout's degrees divide this world; else its numbers are planned on an impossible
    mesh (dp 0.5) and say nothing about memory here."""
    checkpointed_total: int = 0
    """The device peak with activation checkpointing on (``strategy.activation_checkpointing=
    true``), when this plan runs without it; 0 when it already checkpoints (or has no shape)."""
    stalled: list[str] = field(default_factory=list)
    """Links of 0 GB/s this layout's collectives need (step ~ inf): never recommended. (Not a
    problem: 0 is also the cluster keys' "unknown", and the run itself is possible.)"""

    @property
    def margin(self) -> int:
        """Free bytes per device (negative: short by that much)."""
        return self.device_bytes - self.memory.total

    @property
    def spare(self) -> int:
        """Free bytes per device the verdict reports: the device's margin, and on CPU no more than
        the host memory left per rank (``host_margin``: the same RAM)."""
        return self.margin if self.host_margin is None else min(self.margin, self.host_margin)

    @property
    def runnable(self) -> bool:
        return not self.problems and not self.planned_only

    @property
    def blocking(self) -> list[str]:
        """Problems that make the layout impossible here (the mesh, the batch, the model)."""
        return [p for p in self.problems if not incomplete(p)]

    @property
    def overflows(self) -> list[str]:
        """What overflows beside the device (host memory, NVMe, DPO's reference pass)."""
        return [n for n in self.notes if n.startswith(OVERFLOWS)]

    @property
    def warnings(self) -> list[str]:
        """Notes a run says as warnings (train.py): the layout does not do what its name says."""
        return [n for n in self.notes if n.startswith(WARNINGS)]

    def say(self, log: Any, notes: list[str]) -> None:
        """What train.py logs of its plan: the summary with the preset's ``notes`` (and the
        accounting the run is planned with, where the config asked for another: ``planner.as_run``),
        then each warning (on stderr: the run is not what its preset's name says)."""
        said = [n for n in self.notes if n.startswith(ACCOUNTING_NOTE)]
        log.info("%s", "\n".join([self.summary(), *(f"note: {n}" for n in [*said, *notes])]))
        for line in self.warnings:
            log.warning("%s", line)

    @property
    def missing(self) -> list[str]:
        """Problems that only say a setting the layout needs is unset (``strategy.nvme_path``)."""
        return [p for p in self.problems if incomplete(p)]

    @property
    def tight(self) -> bool:
        return self.fits and self.margin < self.reserve

    @property
    def verdict(self) -> str:
        """cannot run | does not fit | tight | fits (an unset setting is reported apart)."""
        if self.blocking:
            return "cannot run"
        return "does not fit" if not self.fits else "tight" if self.tight else "fits"

    def summary(self) -> str:
        """One line: the preset, memory against capacity, communication and step time."""
        if self.blocking:
            return (f"plan: {self.label or self.strategy} cannot run on {self.cluster} ({self.world_size} devices): "
                    + "; ".join(self.blocking))
        if not self.fits and self.margin < 0:  # (and whatever else overflows: every shortfall)
            verdict = "; ".join([f"does NOT fit on the device, short {gb(-self.margin)}", *self.overflows])
        elif not self.fits:  # the device has room: host memory or NVMe overflows (or the layout)
            verdict = (f"fits on the device, but does NOT fit: {'; '.join(self.overflows)}"
                       if self.overflows else "does NOT fit")
        elif self.margin < self.reserve:
            verdict = (f"fits but tight: {gb(self.margin)} free, under the {gb(self.reserve)} the "
                       "CUDA context, NCCL and fragmentation typically take")
        else:
            verdict = f"fits with {gb(self.spare)} to spare"
        stalled = f" ({'; '.join(self.stalled)})" if self.stalled else ""
        need, has = gb_apart(self.memory.total, self.device_bytes)
        devices = f"{self.world_size} device{'s' if self.world_size != 1 else ''}"
        return (f"plan: {self.label or self.strategy} on {self.cluster} ({devices}): "
                f"{need} of {has} per device ({verdict}); "
                f"comm {self._comm()}; "
                f"step ~ {self.step_seconds:.3g} s{stalled}")

    def _comm(self) -> str:
        """The bytes a rank moves per step; with offload, which are collectives (what the end-of-run
        table compares) and which are host / NVMe copies (one train.log read 0.4 MiB against the
        table's 0.13)."""
        comm = self.communication
        copies = sum(x.bytes for x in comm.by_collective.values() if x.group in ("host", "nvme"))
        return f"{gb(comm.bytes_per_step)}/step" + (
            f" (collectives {gb(comm.bytes_per_step - copies)}, offload copies {gb(copies)})" if copies else "")

    def message(self) -> str:
        """The verdict line: the summary if it fits, else needs / has and the cheapest preset."""
        if self.blocking:
            return self.summary() + (f"; {self.hint}" if self.hint else "")
        if self.fits:
            missing = f"; but the config is incomplete: {'; '.join(self.missing)}" if self.missing else ""
            return self.summary() + missing
        device = ["needs {} per device, has {}".format(*gb_apart(self.memory.total, self.device_bytes))
                  ] if self.memory.total > self.device_bytes else []
        line = f"does not fit on {self.cluster}: {'; '.join(device + self.overflows)}"  # (every overflow)
        return line + (f"; {self.hint}" if self.hint else "")


OVERFLOWS = ("host", "NVMe", "objective=dpo")
"""How the notes that make a layout not fit beside the device's steady state begin."""
WARNINGS = ("ZeRO-3 shards",)
"""How the notes a run warns of begin (strategies/zero_footprint.py: ZeRO-3 sharding (almost) nothing)."""
ACCOUNTING_NOTE = "planner.accounting="
"""How the note of a run planned with another accounting than its config's begins (said with the plan)."""


@dataclass
class Recommendation:
    strategy: str | None
    reason: str
    micro_batch_size: int | None = None
    """A larger micro batch the recommended preset still fits with (not tight), the largest;
    None: the trainer's is already the largest (or nothing fits)."""
    activation_checkpointing: bool = False
    """The recommended preset fits only with ``strategy.activation_checkpointing=true`` (nothing
    runnable fits without it): the ``run it`` line sets it, ``strategy=auto`` turns it on."""
    with_checkpointing: str | None = None
    """A preset activation checkpointing would make the better answer (it fits with margin where
    the recommendation is tight, or is MOVE_UP times faster), named in the reason."""
    tight: bool = False
    """It fits with less free than planner.reserve_GB (as recommended: with checkpointing when
    it fits only so); strategy=auto refuses it."""
    config: StrategyConfig | None = field(default=None, repr=False)
    """The recommended preset as planned (its degrees, checkpointing when it fits only so)."""


@dataclass
class Report:
    model: str
    cluster: str
    world_size: int
    accounting: str
    plans: list[Plan]
    recommendation: Recommendation
    assumptions: list[str] = field(default_factory=list)
    batch: str = ""
    """The batch and precision the plans assume (the trainer group's, or the cluster's defaults)."""


def incomplete(problem: str) -> bool:
    """A problem that only names an unset setting (``strategy.nvme_path=None but ...``): the
    layout is possible here once it is set, and its memory verdict stands."""
    return re.match(r"^[\w.]+=None\b", problem) is not None
