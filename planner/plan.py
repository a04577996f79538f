"""One layout on one setup: per-device memory, communication and step time (``plan_candidate``),
and the result types. Everything is closed-form arithmetic on shapes and footprints; no
model is built and no device is touched, so a 70B plan takes milliseconds. Formulas and their
sources: docs/PLANNER.md; the reference documents' worked numbers are tests.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from planner.activations import activation_bytes, estimated_unit
from planner.communication import Communication, communication, exposed_seconds
from planner.inputs import Candidate, Setup, unit_params
from planner.states import GB, gb, state_bytes
from strategies.footprint import SHARDED, Sizes


# ----------------------------------------------------------------------------- results
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
    """On the device at the optimizer step (states and the step's own transients); ``total`` is
    the larger of this and forward/backward (states + activations + buffers)."""


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
    cluster: str = ""
    world_size: int = 1
    device_bytes: int = 0
    tp: int = 1
    pp: int = 1
    dp: int = 1
    shard: int = 1
    microbatches: int = 1
    activation_checkpointing: bool = False
    activations_full: int = 0
    activations_checkpointed: int = 0
    planned_only: bool = False
    reserve: int = 0
    """Bytes a GPU needs beyond the plan (planner.reserve_GB); 0 on CPU."""
    rung: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    hint: str | None = None
    memory_fits: bool = True
    """The memory verdict alone (device, host, NVMe); ``fits`` also needs a layout that can run."""
    lossy: bool = False
    """Gradient compression that changes the numbers (fp16/bf16 casts, PowerSGD, top-k, ...)."""
    stalled: list[str] = field(default_factory=list)
    """Links of 0 GB/s this layout's collectives need (step ~ inf): never recommended. (Not a
    problem: 0 is also the cluster keys' "unknown", and the run itself is possible.)"""

    @property
    def margin(self) -> int:
        """Free bytes per device (negative: short by that much)."""
        return self.device_bytes - self.memory.total

    @property
    def runnable(self) -> bool:
        return not self.problems and not self.planned_only

    @property
    def blocking(self) -> list[str]:
        """Problems that make the layout impossible here (the mesh, the batch, the model)."""
        return [p for p in self.problems if not incomplete(p)]

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
            return (f"plan: {self.strategy} cannot run on {self.cluster} ({self.world_size} devices): "
                    + "; ".join(self.blocking))
        if not self.fits:
            verdict = f"does NOT fit, short {gb(-self.margin)}"
        elif self.margin < self.reserve:
            verdict = (f"fits but tight: {gb(self.margin)} free, under the {gb(self.reserve)} the "
                       "CUDA context, NCCL and fragmentation typically take")
        else:
            verdict = f"fits with {gb(self.margin)} to spare"
        stalled = f" ({'; '.join(self.stalled)})" if self.stalled else ""
        return (f"plan: {self.strategy} on {self.cluster} ({self.world_size} devices): "
                f"{gb(self.memory.total)} of {gb(self.device_bytes)} per device ({verdict}); "
                f"comm {gb(self.communication.bytes_per_step)}/step; "
                f"step ~ {self.step_seconds:.3g} s{stalled}")

    def message(self) -> str:
        """The verdict line: the summary if it fits, else needs / has and the cheapest preset."""
        if self.blocking:
            return self.summary() + (f"; {self.hint}" if self.hint else "")
        if self.fits:
            missing = f"; but the config is incomplete: {'; '.join(self.missing)}" if self.missing else ""
            return self.summary() + missing
        if self.memory.total > self.device_bytes:
            need = f"needs {gb(self.memory.total)} per device, has {gb(self.device_bytes)}"
        else:  # host memory or NVMe is what overflows
            need = "; ".join(n for n in self.notes if n.startswith(("host", "NVMe")))
        line = f"does not fit on {self.cluster}: {need}"
        return line + (f"; {self.hint}" if self.hint else "")


@dataclass
class Recommendation:
    strategy: str | None
    reason: str
    micro_batch_size: int | None = None
    """A larger micro batch the recommended preset still fits with (not tight), the largest;
    None: the trainer's is already the largest (or nothing fits)."""


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


LINKS = {"intra": "cluster.intra_node_GBps", "inter": "cluster.inter_node_GBps",
         "host": "planner.host_link_GBps", "nvme": "planner.nvme_GBps"}


def lossy(fp: object) -> bool:
    """Whether a footprint's gradient exchange is approximate (compression hooks, PowerSGD,
    top-k, int8, local SGD / DiLoCo): such a layout must win by LOSSY_WIN, never on a tie."""
    return bool(getattr(fp, "grad_ratio", 1.0) < 1 or getattr(fp, "powersgd_rank", 0)
                or getattr(fp, "topk_ratio", 0) or getattr(fp, "int8", False)
                or getattr(fp, "sync_every", 0) or getattr(fp, "diloco", False))


# ----------------------------------------------------------------------------- planning
def bubble_fraction(p: int, m: int) -> float:
    """Idle fraction of a GPipe / 1F1B pipeline of ``p`` stages and ``m`` micro-batches."""
    return (p - 1) / (m + p - 1) if p > 1 else 0.0


def plan_candidate(c: Candidate, su: Setup) -> Plan:
    """Memory, communication and step time of one candidate on one setup."""
    cl, shape, t, o = su.cluster, su.shape, su.trainer, su.options
    strategy, fp = c.config, c.footprint
    run = c.run(su)
    mesh = run.mesh
    problems = [*strategy.problems(run), *(strategy.model_problems(shape) if shape is not None else ()),
                *run.problems()]
    tp, pp, dp, shard = mesh.tp, mesh.pp, mesh.dp, mesh.dp_shard
    sb = fp.state_bytes(state_bytes(o.accounting, t.precision, master_weights=fp.master_weights,
                                    sharded_params=fp.params == SHARDED), o.accounting)
    mp = tp * pp
    params = su.params / mp
    trainable = (su.trainable if su.trainable is not None else su.params) / mp
    accumulation = run.batch.accumulation
    micro = strategy.for_batch(t.global_batch_size, t.micro_batch_size, dp).pipeline_microbatches()
    if pp > 1:  # planner.microbatches: a pipeline's micro-batches (others keep the batch's)
        m = o.microbatches or micro or max(accumulation, pp)
        per_step = m * accumulation if micro and not o.microbatches else m
    else:
        m = per_step = accumulation
    ac = strategy.activation_checkpointing
    ckpt = ac if o.activation_checkpointing is None else o.activation_checkpointing
    layers = (math.ceil(shape.n_layers / pp) if shape is not None
              else max(1.0, (su.params / (12 * 128**2)) ** (1 / 3)) / pp)
    sizes = Sizes(params=params, trainable=trainable, bytes=sb, dp=dp, shard=shard, tp=tp, mp=mp,
                  unit=(unit_params(shape) if shape is not None else estimated_unit(su.params)) / mp,
                  units=layers + 1,
                  blocks=shape.n_layers * shape.block_params() / mp if shape is not None else None,
                  model=shape, total_params=su.params)
    notes = []

    held = fp.states(sizes)
    mem = Memory(params=held.params, grads=held.grads, master=held.master, optimizer=held.optimizer,
                 host=held.host, nvme=held.nvme)
    act_full = act_ckpt = 0
    if shape is not None:
        sp = o.sequence_parallel and tp > 1
        kw = dict(micro=t.micro_batch_size, tp=tp, pp=pp, inflight=min(pp, m), sp=sp,
                  flash=o.flash_attention, elem=sb.activation, regime=run.regime)
        act_full = activation_bytes(shape, ckpt=False, **kw)
        act_ckpt = activation_bytes(shape, ckpt=True, **kw)
        mem.activations = act_ckpt if ckpt else act_full
    mem.buffers, step_buffers = fp.buffers(sizes)
    states = mem.params + mem.grads + mem.master + mem.optimizer
    mem.step = states + step_buffers  # the optimizer step: activations are gone
    mem.total = max(states + mem.activations + mem.buffers, mem.step)

    device_bytes = cl.device_bytes()
    fits = mem.total <= device_bytes
    if mem.host * cl.devices > su.host_bytes:
        fits = False
        notes.append(f"host memory: needs {gb(mem.host * cl.devices)} per node, "
                     f"has {gb(su.host_bytes)}")
    if mem.nvme * cl.devices > su.nvme_bytes:
        fits = False
        notes.append(f"NVMe: needs {gb(mem.nvme * cl.devices)} per node, has {gb(su.nvme_bytes)}")

    comm = communication(fp.traffic(sizes), su, sb, sizes, pp, per_step, ckpt)
    compute = 6 * su.params * t.global_batch_size * su.seq_len / (
        mesh.size * cl.peak_tflops * 1e12 * o.mfu)
    if ckpt:
        compute *= 8 / 6  # one more forward per micro-batch
    bubble = bubble_fraction(pp, m)
    exposed = exposed_seconds(comm, compute, m, ckpt)
    notes += fp.notes(sizes)
    if c.planned_only:
        notes.append("planned only: no preset runs this layout yet")
    step = compute / (1 - bubble) + exposed
    stalled: list[str] = []
    if not math.isfinite(step):
        dead = {}
        for name, x in comm.by_collective.items():
            if not math.isfinite(x.seconds):
                dead.setdefault(x.group, []).append(name)
        for group, names in dead.items():
            key = LINKS.get(group, group)
            stalled.append(f"{key}={su.link_GBps(group) if group in LINKS else 0:g}: "
                           f"{', '.join(names)} over a 0 GB/s link never completes (step ~ inf); set "
                           f"{key} to the link's bandwidth in GB/s")
        notes[:0] = stalled
    memory_fits = fits
    fits = fits and not any(not incomplete(p) for p in problems)
    return Plan(strategy=c.name, fits=fits, memory_fits=memory_fits, lossy=lossy(fp), stalled=stalled,
                memory=mem, communication=comm,
                bubble_fraction=bubble, step_seconds=step,
                compute_seconds=compute, exposed_seconds=exposed, cluster=cl.name,
                world_size=mesh.size, device_bytes=device_bytes, tp=tp, pp=pp, dp=dp,
                shard=shard, microbatches=m, activation_checkpointing=ckpt,
                activations_full=act_full, activations_checkpointed=act_ckpt,
                planned_only=c.planned_only, rung=c.rung(mesh), problems=problems, notes=notes,
                reserve=int(o.reserve_GB * GB) if cl.accelerator == "gpu" else 0)
