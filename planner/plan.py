"""One layout on one setup: per-device memory, communication and step time (``plan_candidate``),
and the result types. Everything is closed-form arithmetic on shapes and ``Layout`` data; no
model is built and no device is touched, so a 70B plan takes milliseconds. Formulas and their
sources: docs/PLANNER.md; the reference documents' worked numbers are tests.
"""

from __future__ import annotations

import dataclasses
import math

from dataclasses import dataclass, field

from planner.activations import activation_bytes, buffer_bytes, regime
from planner.communication import Communication, communication, exposed_seconds
from planner.inputs import Candidate, Setup
from planner.states import GB, gb, model_states, state_bytes
from strategies.base import CPU, DEVICE, NVME, SHARDED
from strategies.mesh import Batch, World


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

    @property
    def margin(self) -> int:
        """Free bytes per device (negative: short by that much)."""
        return self.device_bytes - self.memory.total

    @property
    def runnable(self) -> bool:
        return not self.problems and not self.planned_only

    def summary(self) -> str:
        """One line: the preset, memory against capacity, communication and step time."""
        if not self.fits:
            verdict = f"does NOT fit, short {gb(-self.margin)}"
        elif self.margin < self.reserve:
            verdict = (f"fits but tight: {gb(self.margin)} free, under the {gb(self.reserve)} the "
                       "CUDA context, NCCL and fragmentation typically take")
        else:
            verdict = f"fits with {gb(self.margin)} to spare"
        return (f"plan: {self.strategy} on {self.cluster} ({self.world_size} devices): "
                f"{gb(self.memory.total)} of {gb(self.device_bytes)} per device ({verdict}); "
                f"comm {gb(self.communication.bytes_per_step)}/step; "
                f"step ~ {self.step_seconds:.3g} s")

    def message(self) -> str:
        """The verdict line: the summary if it fits, else needs / has and the cheapest preset."""
        if self.fits:
            return self.summary()
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


# ----------------------------------------------------------------------------- planning
def bubble_fraction(p: int, m: int) -> float:
    """Idle fraction of a GPipe / 1F1B pipeline of ``p`` stages and ``m`` micro-batches."""
    return (p - 1) / (m + p - 1) if p > 1 else 0.0


def plan_candidate(c: Candidate, su: Setup) -> Plan:
    """Memory, communication and step time of one candidate on one setup."""
    cl, lay, shape, t, o = su.cluster, c.layout, su.shape, su.trainer, su.options
    world = World(cl.nodes, cl.devices, c.tp, c.pp)
    problems = list(c.problems) + world.problems()
    dp = max(world.dp, 1)
    if not world.problems():  # the batch arithmetic train.py refuses
        problems += Batch(t.global_batch_size, t.micro_batch_size * (c.microbatches or 1), dp).problems()
    shard = max(1, min(lay.shard_group or dp, dp))
    sb = state_bytes(o.accounting, t.precision, master_weights=c.master_weights or c.planned_only,
                     sharded_params=lay.params == SHARDED)
    if c.planned_only and o.accounting == "actual" and sb.grads < 4:
        # Megatron accumulates and reduces fp32 main gradients: 2 + 4 + 12/dp bytes per param
        sb = dataclasses.replace(sb, grads=4, reduce=4)
    mp = c.tp * c.pp
    params = su.params / mp
    trainable = (su.trainable if su.trainable is not None else su.params) / mp
    chunks = c.microbatches or 1  # a pipeline preset's micro-batches per engine step
    accumulation = max(1, t.global_batch_size // (t.micro_batch_size * chunks * dp))
    if c.pp > 1:  # planner.microbatches: a pipeline's micro-batches (others keep the batch's)
        m = o.microbatches or c.microbatches or max(accumulation, c.pp)
        per_step = m * accumulation if c.microbatches and not o.microbatches else m
    else:
        m = per_step = accumulation
    ckpt = c.activation_checkpointing if o.activation_checkpointing is None else o.activation_checkpointing
    notes = []

    mem = Memory(**model_states(params, lay, shard, sb, trainable))
    if lay.grads_partitioned_at_step:  # DeepSpeed ZeRO-1 holds only its partition at the step
        mem.grads = math.ceil(trainable * sb.grads / shard)
    if lay.optimizer_offload != DEVICE and lay.master_weights:
        # DeepSpeed steps an fp32 gradient partition on the host (4 B/param whatever the
        # precision); ZeRO-3 also keeps the reduced partition there in the gradient dtype
        mem.grads = math.ceil(trainable * (4 + (sb.grads if lay.offload_grad_buffer else 0)) / shard)
    # optimizer offload moves the fp32 gradient partition too (ZeRO-Offload, FSDP CPUOffload)
    where = {"params": lay.params_offload, "grads": lay.optimizer_offload,
             "master": lay.optimizer_offload, "optimizer": lay.optimizer_offload}
    for key, place in where.items():
        if place in (CPU, NVME):
            target = "host" if place == CPU else "nvme"
            setattr(mem, target, getattr(mem, target) + getattr(mem, key))
            setattr(mem, key, 0)

    act_full = act_ckpt = 0
    if shape is not None:
        sp = o.sequence_parallel and c.tp > 1
        kw = dict(micro=t.micro_batch_size, tp=c.tp, pp=c.pp, inflight=min(c.pp, m), sp=sp,
                  flash=o.flash_attention, elem=sb.activation,
                  regime=regime(t.precision, c.master_weights or c.planned_only))
        act_full = activation_bytes(shape, ckpt=False, **kw)
        act_ckpt = activation_bytes(shape, ckpt=True, **kw)
        mem.activations = act_ckpt if ckpt else act_full
    mem.buffers, step_buffers = buffer_bytes(c, shape, sb, params, trainable, dp, shard, mp)
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

    comm = communication(c, su, sb, params, trainable, dp, shard, per_step, ckpt)
    compute = 6 * su.params * t.global_batch_size * su.seq_len / (
        world.size * cl.peak_tflops * 1e12 * o.mfu)
    if ckpt:
        compute *= 8 / 6  # one more forward per micro-batch
    bubble = bubble_fraction(c.pp, m)
    exposed = exposed_seconds(comm, compute, m, ckpt)
    if lay.compression_rank and dp > 1:
        notes.append(f"PowerSGD rank {lay.compression_rank}: gradient traffic after its "
                     f"{lay.compression_warmup} warm-up steps (plain all-reduce until then)")
    if c.planned_only:
        notes.append("planned only: no preset runs this layout yet")
    return Plan(strategy=c.name, fits=fits, memory=mem, communication=comm,
                bubble_fraction=bubble, step_seconds=compute / (1 - bubble) + exposed,
                compute_seconds=compute, exposed_seconds=exposed, cluster=cl.name,
                world_size=world.size, device_bytes=device_bytes, tp=c.tp, pp=c.pp, dp=dp,
                shard=shard, microbatches=m, activation_checkpointing=ckpt,
                activations_full=act_full, activations_checkpointed=act_ckpt,
                planned_only=c.planned_only, rung=c.rung, problems=problems, notes=notes,
                reserve=int(o.reserve_GB * GB) if cl.accelerator == "gpu" else 0)
