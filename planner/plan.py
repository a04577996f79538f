"""One layout on one setup: per-device memory, communication and step time (``plan_candidate``;
its result types: planner/results.py). Everything is closed-form arithmetic on shapes and
footprints; no model is built and no device is touched, so a 70B plan takes milliseconds.
Formulas and their sources: docs/PLANNER.md; the reference documents' worked numbers are tests.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from planner.activations import (activation_bytes, estimated_unit, loss_backward_bytes, loss_chunk,
                                 loss_chunk_problems, recomputed_share)
from planner.communication import Communication, communication, exposed_seconds
from planner.inputs import Candidate, Setup, unit_params
from planner.results import Memory, Plan, incomplete
from planner.host import host_problems, node_host_need
from planner.startup import build_problems, reference_problems
from planner.states import GB, float8_gather, state_bytes
from planner.compute import bubble_fraction, flops_per_step, mfu, peak_flops, peak_source
from strategies.base import BACKENDS
from strategies.footprint import DEVICE, SHARDED, Footprint, Sizes
from parallel.pipeline import bubble as pipeline_bubble
from parallel.pipeline import fsdp_gathers


LINKS = {"intra": "cluster.intra_node_GBps", "inter": "cluster.inter_node_GBps",
         "host": "planner.host_link_GBps", "nvme": "planner.nvme_GBps"}


def lossy(fp: object) -> bool:
    """Whether a footprint's gradient exchange is approximate (compression hooks, PowerSGD,
    top-k, int8, local SGD / DiLoCo): such a layout must win by LOSSY_WIN, never on a tie."""
    return bool(getattr(fp, "grad_ratio", 1.0) < 1 or getattr(fp, "powersgd_rank", 0)
                or getattr(fp, "topk_ratio", 0) or getattr(fp, "int8", False)
                or getattr(fp, "sync_every", 0) or getattr(fp, "diloco", False))


def documents_footprint(fp: Footprint) -> Footprint:
    """The reference documents' model of a layout (``planner.accounting=mixed16|mixed20``): each
    state replicated or sharded as the layout declares, offloaded where it is, and nothing an
    engine adds (ZeRO-1 as the paper counts it: full gradients, 4P + 12P/n; no buckets, no
    step-time copies, no loss backward) -- the ZeRO paper's and the documents' worked numbers."""
    return Footprint(params=fp.params, grads=fp.grads, optimizer=fp.optimizer,
                     params_offload=fp.params_offload, optimizer_offload=fp.optimizer_offload)


# ----------------------------------------------------------------------------- planning
@dataclass(frozen=True)
class _Layout:
    """What one candidate derives on one setup before anything is priced: its run, the bytes of
    each state, the per-device sizes, the micro-batches and the pipeline schedule."""

    c: Candidate
    su: Setup
    run: object
    sb: object
    sizes: Sizes
    per_step: int  # micro-batches each replica runs per step
    schedule: object
    virtual: int
    split: object
    m: int  # a schedule's micro-batches
    ckpt: bool | str
    tp_sp: bool
    documents: bool  # the reference documents' model: states alone
    every: int = 1  # strategy.ac_every: checkpoint blocks n, 2n, ...

    @property
    def mesh(self):
        return self.run.mesh

    @property
    def recompute(self) -> float:
        """The share of the forward run again in backward (``recomputed_share``)."""
        return recomputed_share(self.ckpt, self.every, self.su.shape.n_layers if self.su.shape else self.every)


def _state_bytes(fp: Footprint, su: Setup):
    o, t = su.options, su.trainer
    sb = fp.state_bytes(state_bytes(o.accounting, t.precision, master_weights=fp.master_weights,
                                    sharded_params=fp.params == SHARDED), o.accounting)
    if o.accounting == "actual" and t.optimizer == "sgd":
        # SGD keeps one momentum buffer, or nothing without momentum (AdamW: two moments)
        sb = dataclasses.replace(sb, optimizer=sb.optimizer / 2 if t.momentum else 0)
    return sb


def _layout(c: Candidate, su: Setup) -> _Layout:
    shape, t, o = su.shape, su.trainer, su.options
    strategy, fp = c.config, c.footprint
    run = c.run(su)
    mesh = run.mesh
    tp, pp, dp = mesh.tp, mesh.pp, mesh.dp
    sb = _state_bytes(fp, su)
    if getattr(run, "float8", "none") == "tensorwise" and fp.params == SHARDED and shape is not None:
        sb = float8_gather(sb, shape.stack_params() / max(su.params, 1))
    mp = tp * pp
    per_step = run.batch.accumulation * run.batch.chunks  # micro-batches each replica runs per step
    derived = strategy.for_batch(t.global_batch_size, t.micro_batch_size, dp)
    schedule, virtual, split = derived.pipeline_schedule()
    # a schedule's micro-batches: planner.microbatches (a what-if), the preset's, or the whole
    # step in one schedule (Megatron's way); the traffic is the step's real micro-batches
    m = (o.microbatches or derived.pipeline_microbatches() or max(per_step, pp)) if pp > 1 else per_step
    ac = strategy.activation_checkpointing
    ckpt = ac if o.activation_checkpointing is None else o.activation_checkpointing
    layers = (math.ceil(shape.n_layers / pp) if shape is not None
              else max(1.0, (su.params / (12 * 128**2)) ** (1 / 3)) / pp)
    # a sequence group (cp, Ulysses' sp) reduces gradients and splits sharded states with the
    # data-parallel ranks (core/mesh.py): dp x seq of them
    sizes = Sizes(params=su.params / mp,
                  trainable=(su.trainable if su.trainable is not None else su.params) / mp,
                  bytes=sb, dp=dp * mesh.seq, shard=mesh.dp_shard * mesh.seq, tp=tp, mp=mp,
                  unit=(unit_params(shape) if shape is not None else estimated_unit(su.params)) / mp,
                  units=layers + 1,
                  blocks=shape.stack_params() / mp if shape is not None else None,
                  model=shape, total_params=su.params, micro=t.micro_batch_size,
                  accumulation=run.batch.accumulation, resident=su.cluster.accelerator != "gpu")
    # sequence parallelism under TP: the preset's own (planned-only layouts: planner's option)
    tp_sp = tp > 1 and bool(getattr(strategy, "sequence_parallel", o.sequence_parallel))
    return _Layout(c=c, su=su, run=run, sb=sb, sizes=sizes, per_step=per_step, schedule=schedule,
                   virtual=virtual, split=split, m=m, ckpt=ckpt, tp_sp=tp_sp,
                   documents=o.accounting != "actual", every=getattr(strategy, "ac_every", 1))


def _memory(lo: _Layout) -> tuple[Memory, int, int, int]:
    """The per-device memory, the activations without and with checkpointing, and the total
    with activation checkpointing."""
    c, su, fp, sizes, ckpt = lo.c, lo.su, lo.c.footprint, lo.sizes, lo.ckpt
    shape, micro, tp = su.shape, su.trainer.micro_batch_size, lo.mesh.tp
    held = (documents_footprint(fp) if lo.documents else fp).states(sizes)
    mem = Memory(params=held.params, grads=held.grads, master=held.master, optimizer=held.optimizer,
                 host=held.host, nvme=held.nvme)
    if not lo.documents and fp.offloaded:  # the host as the engine allocates it
        mem.host_items = _host_items(lo)
        mem.host = sum(v for k, v in mem.host_items.items() if k != "process")
    act_full = act_ckpt = 0
    peak_full = peak_ckpt = 0  # activations at their peak phase, the loss backward included
    if shape is not None:
        chunk = loss_chunk(su.trainer, tp=tp, pp=lo.mesh.pp, planned_only=c.planned_only)
        kw = dict(micro=micro, tp=tp, pp=lo.mesh.pp, sp=lo.tp_sp, seq=lo.mesh.seq,
                  flash=su.options.flash_attention, elem=lo.sb.activation,
                  regime=None if c.planned_only else lo.run.regime, schedule=lo.schedule,
                  virtual=lo.virtual, microbatches=lo.m, split=lo.split, chunk=chunk,
                  vocab_tp=tp if c.planned_only else 1)  # (the runnable TP presets: whole logits)
        act_full = activation_bytes(shape, ckpt=False, **kw)
        on = dict(ckpt=ckpt or True, every=lo.every if ckpt else 1)  # as it runs, or true
        act_ckpt = activation_bytes(shape, **on, **kw)
        mem.activations = act_ckpt if ckpt else act_full
        if not lo.documents:  # (the runnable TP presets replicate the logits: the whole vocabulary)
            mem.loss = loss_backward_bytes(shape, micro=micro, tp=tp if c.planned_only else 1, chunk=chunk)
        # the loss backward lives on the rank holding the head, beside every activation it saved
        peak_full = activation_bytes(shape, ckpt=False, loss=mem.loss, **kw)
        peak_ckpt = activation_bytes(shape, loss=mem.loss, **on, **kw)
    mem.buffers, step_buffers = (0, 0) if lo.documents else fp.buffers(sizes)
    kept = 0 if lo.documents else int(fp.bucket_buffer(sizes))  # allocated once, held between steps
    states = mem.params + mem.grads + mem.master + mem.optimizer
    # freed between steps (zero_grad(set_to_none)) and made again in backward: with one
    # micro-batch per step none exist while every activation does
    released = mem.grads if not lo.documents and lo.per_step == 1 and fp.grads_released(sizes) else 0
    mem.step = states + step_buffers  # the end of backward and the optimizer step: no activations
    backward = states - released + mem.buffers  # forward/backward, beside the activations
    mem.total = max(backward + (peak_ckpt if ckpt else peak_full), mem.step)
    left = states + kept - (0 if lo.documents else fp.freed_at_step(sizes))  # what a finished step leaves
    mem.growth = mem.total - left  # every state but what the step's end frees
    checkpointed = max(backward + peak_ckpt, mem.step)  # with activation checkpointing
    return mem, act_full, act_ckpt, checkpointed


def _host_items(lo: _Layout) -> dict[str, int]:
    """planner/host.py's items for this layout: pinned only on CUDA, the optimizer's own
    temporaries by the implementation it steps with (auto: fused where DeepSpeed's host
    optimizer was built over CUDA parameters, foreach on a host's)."""
    from planner.host import host_items, moved_states

    fp, t, gpu = lo.c.footprint, lo.su.trainer, lo.su.cluster.accelerator == "gpu"
    impl = t.optimizer_impl if t.optimizer_impl != "auto" else (
        "fused" if gpu and hasattr(fp, "stage") else "foreach")
    return host_items(fp, lo.sizes, moved_states(fp, lo.sizes), gpu=gpu, optimizer=t.optimizer,
                      impl=impl, accumulation=lo.run.batch.accumulation)


@dataclass(frozen=True)
class _Seconds:
    comm: Communication
    compute: float
    optimizer: float
    engine: float
    bubble: float
    exposed: float
    floor: float = 0.0

    @property
    def step(self) -> float:
        return max(self.compute / (1 - self.bubble) + self.exposed + self.optimizer + self.engine, self.floor)


def _seconds(lo: _Layout) -> _Seconds:
    """Communication, compute, the optimizer step, the engine's own cost, the pipeline bubble
    and the communication left exposed, per step."""
    c, su, fp, sizes, mesh, m = lo.c, lo.su, lo.c.footprint, lo.sizes, lo.mesh, lo.m
    share = lo.recompute
    ckpt = share > 0  # (selective recomputes no matmul and no collective it keeps)
    tp, pp, shard, per_step = mesh.tp, mesh.pp, mesh.dp_shard, lo.per_step
    staged = None
    if pp > 1 and not c.planned_only:  # FSDP2 under torch's pipelining: per schedule run
        gathers = max(fsdp_gathers(lo.schedule, pp, lo.virtual, m, fp.reshard_after_forward), key=sum)
        staged = (*gathers, max(1, per_step // m))
    layers = su.shape.n_layers if su.shape else 1
    wrapped = (layers // max(1, lo.every)) / max(1, layers)  # (the blocks strategy.ac_every wraps)
    comm = communication(fp.traffic(sizes), su, lo.sb, sizes, pp, per_step, ckpt, cp=mesh.cp, sp=mesh.sp,
                         tp_sp=lo.tp_sp, pipeline=(lo.schedule, lo.virtual), staged=staged,
                         boundary_elem=4 if lo.run.regime in ("32", "autocast") else 2,
                         ac=(lo.ckpt, wrapped))
    compute = flops_per_step(su, share) / (mesh.size * peak_flops(su) * mfu(su))
    measured_tp = (su.machine is not None and su.machine.tp_speedup > 0 and tp == su.machine.world
                   and not c.planned_only)
    if measured_tp:  # the calibration ran this very layout: TP over every process
        compute *= tp / su.machine.tp_speedup
    optimizer = floor = 0.0
    if su.machine is not None:  # AdamW's step over the moments this device holds (offloaded: the host's)
        moments = sizes.trainable / (shard if fp.optimizer == SHARDED else 1)
        optimizer = su.machine.optimizer_seconds(moments, host=fp.optimizer_offload != DEVICE)
        floor = su.machine.floor(sizes.units - 1, per_step)  # (units: the blocks and the root)
    engine = 0.0
    offloaded = fp.optimizer_offload != DEVICE
    if su.machine is not None and fp.engine and (shard > 1 or offloaded) and not c.planned_only:
        # DeepSpeed's or FSDP2's hooks and copies, measured against DDP on the calibrated world
        # (the reference model's collectives, sharded or host step and copies taken out), over this
        # rank's parameters for each micro-batch it runs; over one rank not applied (FSDP2 at dp 1)
        # or not measured, but for an offloaded ZeRO
        engine = sizes.params * getattr(su.machine, f"engine_ns_per_param_{fp.engine}", 0.0) * 1e-9 * per_step
    try:
        bubble = pipeline_bubble(lo.schedule, pp, lo.virtual, m, recompute=ckpt)
    except (RuntimeError, ValueError, KeyError):  # a schedule that cannot run (its problems say why)
        bubble = bubble_fraction(pp, m)
    exposed = exposed_seconds(comm, compute, per_step, ckpt)
    if su.machine is not None and su.cluster.accelerator == "cpu":
        # gloo runs each collective on the cores the compute uses: on a measured CPU machine
        # nothing hides under backward or forward (measured: fsdp2/zero2/zero3 1.4x with overlap)
        exposed = comm.seconds_per_step
    if measured_tp:  # TP's own collectives are inside the measured speedup
        exposed = max(0.0, exposed - sum(x.seconds for n, x in comm.by_collective.items()
                                         if n.startswith("tp_")))
    return _Seconds(comm=comm, compute=compute, optimizer=optimizer, engine=engine, bubble=bubble,
                    exposed=exposed, floor=floor)


def _stalled(comm: Communication, su: Setup) -> list[str]:
    """A sentence for each link of 0 GB/s that a collective needs (its step never ends)."""
    dead = {}
    for name, x in comm.by_collective.items():
        if not math.isfinite(x.seconds):
            dead.setdefault(x.group, []).append(name)
    out = []
    for group, names in dead.items():
        key = LINKS.get(group, group)
        out.append(f"{key}={su.link_GBps(group) if group in LINKS else 0:g}: "
                   f"{', '.join(names)} over a 0 GB/s link never completes (step ~ inf); set "
                   f"{key} to the link's bandwidth in GB/s")
    return out


def backend_problems(c: Candidate, su: Setup) -> list[str]:
    """A preset the job's backend does not run (``Capabilities.backends``; the backend's own
    refusal says why, before launch): never recommended, nor chosen by strategy=auto."""
    runs = c.config.capabilities.backends
    if c.planned_only or su.backend in runs or su.backend not in BACKENDS:  # (another: its own problems)
        return []
    return [f"strategy={c.name} is not supported by backend={su.backend}: "
            f"{' or '.join(f'backend={b}' for b in runs)} runs it"]


def checkpointing_problems(lo: _Layout) -> list[str]:
    """The preset's activation checkpointing as planned (``planner.activation_checkpointing``
    or its own) against its family and the model, as the config validator checks a named preset
    (``StrategyConfig.checkpointing_problems``): FSDP1's engines and the expert-parallel presets
    refuse selective, so it is never ranked as runnable, recommended or chosen by strategy=auto."""
    if lo.c.planned_only:
        return []
    config = lo.c.config
    if config.activation_checkpointing != lo.ckpt:
        config = dataclasses.replace(config, activation_checkpointing=lo.ckpt)
    return config.checkpointing_problems(lo.su.shape)


def plan_candidate(c: Candidate, su: Setup) -> Plan:
    """Memory, communication and step time of one candidate on one setup."""
    cl, shape, o = su.cluster, su.shape, su.options
    lo = _layout(c, su)
    run, mesh = lo.run, lo.mesh
    asked = su.layout_problems(c.config, run) if su.layout_problems and not c.planned_only else []
    problems = [*backend_problems(c, su), *checkpointing_problems(lo), *c.config.problems(run), *asked,
                *(c.config.model_problems(shape) if shape is not None else ()),
                *run.problems(), *(mesh.model_problems(shape, c.name) if shape is not None else ()),
                *([] if c.planned_only else loss_chunk_problems(su.trainer, tp=mesh.tp, pp=mesh.pp))]
    mem, act_full, act_ckpt, checkpointed = _memory(lo)
    device_bytes = cl.device_bytes()
    notes = host_problems(mem, su) + build_problems(c, su) + reference_problems(c, mem, su)
    memory_fits = mem.total <= device_bytes and not notes
    # (on CPU the device is the host: what the node's memory leaves each rank bounds the spare)
    host_margin = None if cl.accelerator == "gpu" else (su.host_bytes - node_host_need(mem, su)[0]) // cl.devices
    t = _seconds(lo)
    notes += c.config.notes(run) + c.footprint.notes(lo.sizes)
    if mesh.seq > 1:  # the sequence degree the plan was made at (Ulysses' is chosen by the planner)
        notes.insert(0, f"{'sp' if mesh.sp > 1 else 'cp'}={mesh.seq} dp={mesh.dp}: each rank holds "
                        f"1/{mesh.seq} of the sequence")
    if c.planned_only:
        notes.append("planned only: no preset runs this layout yet")
    step = t.step
    stalled = [] if math.isfinite(step) else _stalled(t.comm, su)
    notes[:0] = stalled
    ckpt = lo.ckpt
    return Plan(strategy=c.name, fits=memory_fits and not any(not incomplete(p) for p in problems),
                memory_fits=memory_fits, lossy=lossy(c.footprint), stalled=stalled,
                checkpointed_total=checkpointed if shape is not None and not ckpt else 0,
                mesh_fits=not mesh.problems(),
                memory=mem, communication=t.comm,
                bubble_fraction=t.bubble, step_seconds=step,
                compute_seconds=t.compute, exposed_seconds=t.exposed, optimizer_seconds=t.optimizer,
                engine_seconds=t.engine, floor_seconds=t.floor,
                flops_per_step=flops_per_step(su, lo.recompute), peak_tflops=peak_flops(su) / 1e12,
                peak_source=peak_source(su), mfu=mfu(su), cluster=cl.name,
                world_size=mesh.size, device_bytes=device_bytes, host_margin=host_margin, tp=mesh.tp, pp=mesh.pp, dp=mesh.dp,
                shard=mesh.dp_shard, cp=mesh.cp, sp=mesh.sp, ep=mesh.ep, microbatches=lo.m,
                activation_checkpointing=ckpt,
                activations_full=act_full, activations_checkpointed=act_ckpt,
                planned_only=c.planned_only, rung=c.rung(mesh), problems=problems, notes=notes,
                reserve=int(o.reserve_GB * GB) if cl.accelerator == "gpu" else 0)
