"""The planner: per-device memory, communication and step time of a layout, before launch.

Everything here is closed-form arithmetic on shapes and ``Layout`` data; no model is built and no
device is touched, so a 70B plan takes milliseconds. Formulas and their sources are in
docs/PLANNER.md; the worked numbers of the reference documents are tests (tests/test_planner.py).

Two entry points: ``plan_all(cfg)`` plans every preset of ``conf/strategy/`` plus the planned-only
TP / PP / 3D layouts and recommends one; ``preflight(cfg)`` plans the composed run's own preset
for train.py. Both return plain dataclasses; strategies/plan_render.py turns them into a table
or JSON.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from strategies.base import CPU, DEVICE, NVME, SHARDED, Layout
from strategies.mesh import World

GB, GiB, MiB = 10**9, 2**30, 2**20
ACCOUNTINGS = ("actual", "mixed16", "mixed20")
TOLERANCE = 0.05  # steps within 5% of the fastest count as equally fast
MOVE_UP = 1.2     # a heavier rung of the ladder must be this much faster to be recommended
RUNGS = ("replicated", "sharded data parallel", "tensor parallel", "pipeline / 3D", "offload")


# ----------------------------------------------------------------------------- closed forms
@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model-state category, and of what travels on the wire."""

    params: float
    grads: float
    master: float
    optimizer: float
    """Adam's two moments."""
    gather: float
    """Bytes per parameter in a parameter all-gather (the compute dtype)."""
    reduce: float
    """Bytes per gradient element in the gradient all-reduce / reduce-scatter."""
    activation: float
    """Bytes per activation element."""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.master + self.optimizer


def state_bytes(accounting: str = "actual", precision: str = "bf16-mixed", *,
                master_weights: bool = False, sharded_params: bool = False) -> StateBytes:
    """mixed16 (ZeRO paper, 16 B/param), mixed20 (deep-dive, 20 B/param), or what is allocated."""
    if accounting == "mixed16":
        return StateBytes(2, 2, 4, 8, gather=2, reduce=2, activation=2)
    if accounting == "mixed20":  # the deep-dive's items add to 18; its stated 20 B/param and
        # 140 GB for 7B also count the bf16 gradient backward produces beside the fp32 one
        return StateBytes(2, 2 + 4, 4, 8, gather=2, reduce=4, activation=2)
    if accounting != "actual":
        raise ValueError(f"planner.accounting={accounting!r} is not one of "
                         f"{', '.join(ACCOUNTINGS)}; set planner.accounting=actual")
    p = str(precision)
    if p.startswith(("32", "64")):  # an engine with master weights copies even fp32 params
        return StateBytes(4, 4, 4 if master_weights else 0, 8, gather=4, reduce=4, activation=4)
    if p.endswith("-true"):  # everything, Adam moments included, in the 16-bit dtype
        return StateBytes(2, 2, 0, 4, gather=2, reduce=2, activation=2)
    if master_weights:
        return StateBytes(2, 2, 4, 8, gather=2, reduce=2, activation=2)
    # torch AMP: fp32 parameters and gradients; FSDP's MixedPrecision gathers/reduces in bf16
    return StateBytes(4, 4, 0, 8, gather=2, reduce=2 if sharded_params else 4, activation=2)


def ring_all_reduce_bytes(x: float, n: int) -> float:
    """Bytes each rank sends in a ring all-reduce of an ``x``-byte tensor: 2(N-1)/N x."""
    return 2 * (n - 1) / n * x if n > 1 else 0.0


def all_gather_bytes(x: float, n: int) -> float:
    """Bytes each rank sends to gather an ``x``-byte tensor (also reduce-scatter): (N-1)/N x."""
    return (n - 1) / n * x if n > 1 else 0.0


reduce_scatter_bytes = all_gather_bytes


def transfer_seconds(nbytes: float, GBps: float) -> float:
    """Bandwidth-only time: bytes / (GB/s x 1e9)."""
    if nbytes <= 0:
        return 0.0
    return nbytes / (GBps * GB) if GBps > 0 else math.inf


def boundary_activation_bytes(micro: int, seq: int, hidden: int, elem: float = 2) -> int:
    """One pipeline-stage boundary activation: micro x seq x hidden x bytes per element."""
    return int(micro * seq * hidden * elem)


def bubble_fraction(p: int, m: int) -> float:
    """Idle fraction of a GPipe / 1F1B pipeline of ``p`` stages and ``m`` micro-batches."""
    return (p - 1) / (m + p - 1) if p > 1 else 0.0


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False) -> float:
    """Korthikanti et al. 2022, eq. 1-3: one GPT layer's 16-bit activations (4h MLP, dropout)."""
    if sp:
        return s * b * h / t * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def layer_activation_bytes(s: int, b: int, h: int, a: int, *, ffn: int | None = None,
                           kv: int | None = None, t: int = 1, sp: bool = False,
                           dropout: bool = True, flash: bool = False, mlp_tensors: int = 2,
                           elem: float = 2) -> float:
    """Korthikanti's per-layer count, term by term, generalised to GQA (``kv`` < h), SwiGLU
    (``mlp_tensors=4``: gate, up, silu, product), no dropout, flash attention and element size.
    With the defaults it equals ``korthikanti_layer_bytes``."""
    ffn, kv = ffn or 4 * h, kv or h
    mask = 1 if dropout else 0                   # one byte per element
    # kept whole on every TP rank unless sequence parallel: 2 norm inputs, attention and MLP
    # inputs (4 elements) plus 2 dropout masks -- Korthikanti's "10"
    replicated = 4 * elem + 2 * mask
    # split over TP ranks: Q, K, V, projection input; the MLP's inner tensors -- his "24"
    split = (2 + 2 * kv / h) * elem + mlp_tensors * ffn / h * elem
    scores = 0.0 if flash else a * s / h * ((1 + mask) * elem + mask)  # softmax (+dropout) "5as/h"
    per_sbh = replicated / (t if sp else 1) + (split + scores) / t
    return s * b * h * per_sbh


def model_states(params: float, layout: Layout, shard: int, sb: StateBytes,
                 trainable: float | None = None) -> dict[str, int]:
    """Per-device bytes of parameters, gradients, fp32 master and optimizer moments, before
    offload. ``shard``: ranks a sharded state is split over (ZeRO pads shards: ceil)."""
    trainable = params if trainable is None else trainable

    def split(nbytes: float, state: str) -> int:
        return math.ceil(nbytes / shard) if state == SHARDED else math.ceil(nbytes)

    return {"params": split(params * sb.params, layout.params),
            "grads": split(trainable * sb.grads, layout.grads),
            "master": split(trainable * sb.master, layout.optimizer),
            "optimizer": split(trainable * sb.optimizer, layout.optimizer)}


# ----------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a transformer (from the model config, no torch needed here)."""

    params: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    vocab: int
    seq_len: int
    dropout: float = 0.0
    embed_params: int = 0

    @classmethod
    def of(cls, model: Any) -> ModelShape:
        from recipes.gpt import GPTShape  # the single source of the parameter count

        s = GPTShape.of(model)
        return cls(params=s.num_params(), dim=s.dim, n_layers=s.n_layers, n_heads=s.n_heads,
                   n_kv_heads=s.n_kv_heads, ffn=s.hidden, vocab=s.vocab_size, seq_len=s.seq_len,
                   dropout=s.dropout, embed_params=s.vocab_size * s.dim)

    @property
    def block_params(self) -> int:
        outside = self.embed_params * 2 + self.dim  # untied in/out embeddings, final norm
        return max((self.params - outside) // self.n_layers, 0)

    @property
    def unit_params(self) -> int:
        """The largest FSDP/ZeRO-3 unit: a transformer block or an embedding matrix."""
        return max(self.block_params, self.embed_params)


@dataclass(frozen=True)
class Hardware:
    name: str
    nodes: int
    devices: int
    device_bytes: int
    """Capacity per process (a CPU cluster's memory is shared by its processes)."""
    host_bytes: int
    nvme_bytes: int
    peak_tflops: float
    intra_GBps: float
    inter_GBps: float

    @classmethod
    def of(cls, c: Any) -> Hardware:
        shared = str(c.accelerator) != "gpu"
        dev = c.device_memory_GB * GB / (c.devices if shared else 1)
        return cls(str(c.name), int(c.nodes), int(c.devices), int(dev), int(c.host_memory_GB * GB),
                   int(c.nvme_GB * GB), float(c.peak_tflops), float(c.intra_node_GBps),
                   float(c.inter_node_GBps))


@dataclass(frozen=True)
class Setup:
    """Everything but the layout: model, hardware, batch, precision and planner options."""

    hardware: Hardware
    params: int
    shape: ModelShape | None = None
    trainable: int | None = None
    global_batch: int = 1
    micro_batch: int = 1
    seq_len: int = 1
    precision: str = "bf16-mixed"
    accounting: str = "actual"
    mfu: float = 0.4
    microbatches: int | None = None
    checkpointing: bool | None = None
    sequence_parallel: bool = True
    flash_attention: bool = True
    host_link_GBps: float = 25.0
    nvme_GBps: float = 3.0

    @classmethod
    def of(cls, cfg: Any) -> Setup:
        p, t = cfg.planner, cfg.trainer
        shape = None if p.params is not None else ModelShape.of(cfg.model)
        params = int(p.params) if p.params is not None else shape.params
        return cls(Hardware.of(cfg.cluster), params, shape,
                   None if p.trainable is None else int(p.trainable), int(t.global_batch_size),
                   int(t.micro_batch_size), int(cfg.model.seq_len), str(t.precision),
                   str(p.accounting), float(p.mfu), p.microbatches, p.activation_checkpointing,
                   bool(p.sequence_parallel), bool(p.flash_attention), float(p.host_link_GBps),
                   float(p.nvme_GBps))


@dataclass(frozen=True)
class Candidate:
    """A layout to plan: a preset of conf/strategy/, or a planned-only TP / PP / 3D layout."""

    name: str
    layout: Layout = Layout()
    tp: int = 1
    pp: int = 1
    planned_only: bool = False
    activation_checkpointing: bool = False
    master_weights: bool = False
    bucket_bytes: int = 25 * MiB
    problems: tuple[str, ...] = ()
    description: str = ""

    @property
    def rung(self) -> int:
        """The deep-dive's ladder: replicate, shard, TP inside a node, PP across, offload."""
        lay = self.layout
        if lay.params_offload != DEVICE or lay.optimizer_offload != DEVICE:
            return 4
        if self.pp > 1:
            return 3
        if self.tp > 1:
            return 2
        return int(SHARDED in (lay.params, lay.grads, lay.optimizer))


def candidate(preset: Any, world: World, run: Any = None) -> Candidate:
    """A preset's typed config (``strategies.load(name)``) as a planner candidate."""
    problems = tuple(preset.problems(world, run)) if run is not None else ()
    return Candidate(name=preset.name, layout=preset.layout(world),
                     activation_checkpointing=bool(preset.activation_checkpointing),
                     master_weights=preset.layout(world).master_weights,
                     bucket_bytes=int(getattr(preset, "bucket_cap_mb", 25)) * MiB,
                     problems=problems, description=f"{preset.family} preset")


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


@dataclass
class Collective:
    op: str
    """all_reduce | all_gather | reduce_scatter | send_recv | copy."""
    group: str
    """intra | inter (node), host (PCIe) or nvme."""
    ranks: int
    bytes: int
    """Sent per rank per optimizer step."""
    seconds: float
    overlap: str
    """forward | backward (hidden under that compute while it lasts) | none (exposed)."""
    per_micro: bool = False


@dataclass
class Communication:
    bytes_per_step: int = 0
    seconds_per_step: float = 0.0
    by_collective: dict[str, Collective] = field(default_factory=dict)


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
        verdict = (f"fits, {gb(self.margin)} free" if self.fits
                   else f"does NOT fit, short {gb(-self.margin)}")
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


@dataclass
class Report:
    model: str
    cluster: str
    world_size: int
    accounting: str
    plans: list[Plan]
    recommendation: Recommendation
    assumptions: list[str] = field(default_factory=list)


def gb(nbytes: float) -> str:
    """Human units, always GB = 1e9 bytes (GiB is shown separately where it helps)."""
    return f"{nbytes / GB:,.1f} GB" if abs(nbytes) >= GB / 10 else f"{nbytes / MiB:,.1f} MiB"


# ----------------------------------------------------------------------------- planning
def plan_candidate(c: Candidate, su: Setup) -> Plan:
    """Memory, communication and step time of one candidate on one setup."""
    hw, lay, shape = su.hardware, c.layout, su.shape
    world = World(hw.nodes, hw.devices, c.tp, c.pp)
    problems = list(c.problems) + world.problems()
    dp = max(world.dp, 1)
    shard = max(1, min(lay.shard_group or dp, dp))
    sb = state_bytes(su.accounting, su.precision, master_weights=c.master_weights or c.planned_only,
                     sharded_params=lay.params == SHARDED)
    mp = c.tp * c.pp
    params = su.params / mp
    trainable = (su.trainable if su.trainable is not None else su.params) / mp
    accumulation = max(1, su.global_batch // (su.micro_batch * dp))
    m = su.microbatches or (max(accumulation, c.pp) if c.pp > 1 else accumulation)
    ckpt = c.activation_checkpointing if su.checkpointing is None else su.checkpointing
    notes = []

    mem = Memory(**model_states(params, lay, shard, sb, trainable))
    # optimizer offload moves the fp32 gradient partition too (ZeRO-Offload, FSDP CPUOffload)
    where = {"params": lay.params_offload, "grads": lay.optimizer_offload,
             "master": lay.optimizer_offload, "optimizer": lay.optimizer_offload}
    for key, place in where.items():
        if place in (CPU, NVME):
            moved = getattr(mem, key)
            setattr(mem, "host" if place == CPU else "nvme", getattr(mem, "host" if place == CPU
                                                                     else "nvme") + moved)
            setattr(mem, key, 0)

    act_full = act_ckpt = 0
    if shape is not None:
        sp = su.sequence_parallel and c.tp > 1
        kw = dict(micro=su.micro_batch, tp=c.tp, pp=c.pp, inflight=min(c.pp, m), sp=sp,
                  flash=su.flash_attention, elem=sb.activation)
        act_full = activation_bytes(shape, ckpt=False, **kw)
        act_ckpt = activation_bytes(shape, ckpt=True, **kw)
        mem.activations = act_ckpt if ckpt else act_full
        mem.buffers = _buffers(c, shape, sb, params, dp, mp)
    mem.total = (mem.params + mem.grads + mem.master + mem.optimizer + mem.activations
                 + mem.buffers)

    fits = mem.total <= hw.device_bytes
    if mem.host * hw.devices > hw.host_bytes:
        fits = False
        notes.append(f"host memory: needs {gb(mem.host * hw.devices)} per node, "
                     f"has {gb(hw.host_bytes)}")
    if mem.nvme * hw.devices > hw.nvme_bytes:
        fits = False
        notes.append(f"NVMe: needs {gb(mem.nvme * hw.devices)} per node, has {gb(hw.nvme_bytes)}")

    comm = _communication(c, su, sb, params, trainable, dp, shard, m, ckpt)
    compute = 6 * su.params * su.global_batch * su.seq_len / (
        world.size * hw.peak_tflops * 1e12 * su.mfu) if hw.peak_tflops > 0 else 0.0
    if ckpt:
        compute *= 8 / 6  # one more forward per micro-batch
    bubble = bubble_fraction(c.pp, m)
    exposed = _exposed(comm, compute, m, ckpt)
    step = compute / (1 - bubble) + exposed
    if c.planned_only:
        notes.append("planned only: no preset runs this layout yet")
    return Plan(c.name, fits, mem, comm, bubble, step, compute, exposed,
                hw.name, world.size, hw.device_bytes, c.tp, c.pp, dp, shard, m, ckpt, act_full,
                act_ckpt, c.planned_only, c.rung, problems, notes)


def activation_bytes(shape: ModelShape, *, micro: int, tp: int = 1, pp: int = 1,
                     inflight: int = 1, sp: bool = False, ckpt: bool = False,
                     flash: bool = True, elem: float = 2) -> int:
    """Activations of the busiest device for one micro-batch (``inflight`` under 1F1B)."""
    s, b, h = shape.seq_len, micro, shape.dim
    layer = layer_activation_bytes(s, b, h, shape.n_heads, ffn=shape.ffn,
                                   kv=shape.n_kv_heads * (h // shape.n_heads), t=tp, sp=sp,
                                   dropout=shape.dropout > 0, flash=flash, mlp_tensors=4, elem=elem)
    block_input = s * b * h * elem / (tp if sp else 1)  # all a checkpointed block keeps
    layers = math.ceil(shape.n_layers / pp)
    kept = (block_input if ckpt else layer) * layers
    recompute = layer if ckpt else 0.0                   # one block re-run in backward
    head = 4 * s * b * shape.vocab / tp + s * b * h * elem / (tp if sp else 1)  # fp32 logits, norm
    first, last = kept * inflight + recompute, kept + recompute + head
    return int(max(first, last))


def _buffers(c: Candidate, shape: ModelShape, sb: StateBytes, params: float, dp: int,
             mp: int) -> int:
    lay, out = c.layout, 0.0
    if dp > 1 or lay.optimizer_offload != DEVICE:
        out += 2 * c.bucket_bytes  # one bucket filling, one in flight
    if lay.params == SHARDED:
        unit = shape.unit_params / mp
        gathered = 2 * unit if lay.reshard_after_forward else params  # current + prefetched
        out += gathered * sb.gather + unit * sb.reduce  # + one unit's unsharded gradient
    elif sb.params > sb.gather:
        out += params * sb.gather  # autocast's bf16 weight copies, saved for backward
    return int(out)


def _communication(c: Candidate, su: Setup, sb: StateBytes, params: float, trainable: float,
                   dp: int, shard: int, m: int, ckpt: bool) -> Communication:
    hw, lay, shape = su.hardware, c.layout, su.shape
    out = Communication()

    def add(name: str, op: str, ranks: int, stride: int, full: float, overlap: str,
            per_micro: bool = False, link: str | None = None) -> None:
        if ranks <= 1 and op != "copy" or full <= 0:
            return
        per_rank = {"all_reduce": ring_all_reduce_bytes(full, ranks),
                    "all_gather": all_gather_bytes(full, ranks),
                    "reduce_scatter": reduce_scatter_bytes(full, ranks)}.get(op, full)
        per_rank *= m if per_micro else 1
        group = link or ("intra" if stride * (ranks - 1) < hw.devices else "inter")
        bw = {"intra": hw.intra_GBps, "inter": hw.inter_GBps, "host": su.host_link_GBps,
              "nvme": su.nvme_GBps}[group]
        out.by_collective[name] = Collective(op, group, ranks, int(per_rank),
                                             transfer_seconds(per_rank, bw), overlap, per_micro)

    ratio = lay.grad_bytes_ratio
    grad = trainable * (max(sb.reduce * ratio, min(sb.reduce, 2)) if ratio < 1 else sb.reduce)
    stride, sharded_grads = c.tp, lay.grads == SHARDED
    if lay.params == lay.grads == lay.optimizer != SHARDED:
        add("grad_all_reduce", "all_reduce", dp, stride, grad, "backward")
    else:
        add("grad_reduce_scatter", "reduce_scatter", shard, stride, grad, "backward",
            per_micro=sharded_grads)
        if shard < dp:  # HYBRID: the shards are all-reduced across the replica groups
            add("grad_all_reduce_replicas", "all_reduce", dp // shard, stride * shard,
                grad / shard, "backward", per_micro=sharded_grads)
        if lay.params == SHARDED:
            add("param_all_gather_forward", "all_gather", shard, stride, params * sb.gather,
                "forward", per_micro=True)
            if lay.reshard_after_forward:
                add("param_all_gather_backward", "all_gather", shard, stride,
                    params * sb.gather, "backward", per_micro=True)
        else:  # ZeRO-1/2: updated parameter shards are gathered after the optimizer step
            add("param_all_gather", "all_gather", shard, stride, params * sb.gather, "none")
    if lay.optimizer_offload != DEVICE:
        link = "host" if lay.optimizer_offload == CPU else "nvme"
        traffic = grad / shard + params * sb.gather / shard  # gradients down, parameters up
        if link == "nvme":  # the optimizer state is read and written back every step
            traffic += 2 * trainable * (sb.master + sb.optimizer) / shard
        add("optimizer_offload", "copy", 1, 1, traffic, "none", link=link)
    if lay.params_offload != DEVICE:
        link = "host" if lay.params_offload == CPU else "nvme"
        passes = 2 if lay.reshard_after_forward else 1
        add("param_offload_fetch", "copy", 1, 1, passes * params * sb.params / shard, "none",
            per_micro=True, link=link)
    if shape is not None and c.tp > 1:  # Megatron: 2 all-reduces forward, 2 backward per block
        per_layer = (4 + (2 if ckpt else 0)) * su.micro_batch * shape.seq_len * shape.dim
        add("tp_all_reduce", "all_reduce", c.tp, 1, per_layer * sb.activation
            * math.ceil(shape.n_layers / c.pp), "none", per_micro=True)
    if shape is not None and c.pp > 1:  # one activation forward, one gradient back per boundary
        sp = su.sequence_parallel and c.tp > 1
        x = boundary_activation_bytes(su.micro_batch, shape.seq_len, shape.dim, sb.activation)
        add("pp_send_recv", "send_recv", c.pp, c.tp * dp, 2 * x / (c.tp if sp else 1), "none",
            per_micro=True, link="intra" if c.tp * dp < hw.devices else "inter")
    out.bytes_per_step = sum(x.bytes for x in out.by_collective.values())
    out.seconds_per_step = sum(x.seconds for x in out.by_collective.values())
    return out


def _exposed(comm: Communication, compute: float, m: int, ckpt: bool) -> float:
    """Communication time not hidden under compute. Forward-phase collectives overlap each
    micro-batch's forward, backward-phase ones its backward; per-step backward collectives
    (DDP, ZeRO-1) overlap only the last micro-batch's backward; the rest is exposed."""
    fwd = compute * (1 / 4 if ckpt else 1 / 3) / m
    bwd = compute / m - fwd
    per = {(o, pm): 0.0 for o in ("forward", "backward", "none") for pm in (True, False)}
    for x in comm.by_collective.values():
        per[x.overlap, x.per_micro] += x.seconds / (m if x.per_micro else 1)
    f_m, b_m, b_step = per["forward", True], per["backward", True], per["backward", False]
    exposed = m * max(0.0, f_m - fwd) + (m - 1) * max(0.0, b_m - bwd)
    exposed += max(0.0, b_m + b_step - bwd) + m * per["none", True] + per["none", False]
    return exposed + per["forward", False]


# ----------------------------------------------------------------------------- candidates
def planned_candidates(su: Setup, tp: int = 1, pp: int = 1) -> list[Candidate]:
    """TP inside a node and PP across nodes, with ZeRO-1 (Megatron's distributed optimizer)
    over the data-parallel rest. Degrees: ``planner.tp``/``planner.pp``, or derived."""
    hw, shape, out = su.hardware, su.shape, []
    zero1 = Layout(optimizer=SHARDED)
    heads = math.gcd(shape.n_heads, shape.n_kv_heads) if shape else hw.devices
    t = tp if tp > 1 else max((d for d in range(1, hw.devices + 1)
                               if hw.devices % d == 0 and heads % d == 0), default=1)
    if t > 1:
        out.append(Candidate("tp", zero1, tp=t, planned_only=True,
                             description=f"TP={t} inside a node x ZeRO-1 data parallel"))
    if pp > 1 or hw.nodes > 1:
        for name, t_ in (("pp", 1), ("3d", t)):
            if name == "3d" and t_ <= 1:
                continue
            p = pp if pp > 1 else _fitting_pp(su, t_, zero1)
            out.append(Candidate(name, zero1, tp=t_, pp=p, planned_only=True,
                                 description=f"TP={t_} x PP={p} x ZeRO-1 data parallel"))
    return out


def _fitting_pp(su: Setup, tp: int, layout: Layout) -> int:
    """The smallest pipeline degree (dividing the nodes, at least 2) whose plan fits."""
    options = [p for p in range(2, su.hardware.nodes + 1) if su.hardware.nodes % p == 0]
    for p in options:
        if plan_candidate(Candidate("pp", layout, tp=tp, pp=p, planned_only=True), su).fits:
            return p
    return options[-1] if options else 2


# ----------------------------------------------------------------------------- ranking
def recommend(plans: list[Plan]) -> Recommendation:
    """Walk the ladder: the lowest rung with a fitting layout, unless a heavier rung (short of
    offload) is MOVE_UP times faster. Within a rung: the fastest, and among layouts within
    TOLERANCE of it, the one leaving the most memory free, then the one moving fewest bytes."""
    ok = [p for p in plans if p.fits and not p.problems]
    if not ok:
        need = min(plans, key=lambda p: p.memory.total, default=None)
        why = f"; the smallest need is {need.strategy}'s {gb(need.memory.total)}" if need else ""
        return Recommendation(None, f"nothing fits{why}")
    best, why = None, ""
    for rung in range(4):
        top = best_of([p for p in ok if p.rung == rung])
        if top is None:
            continue
        if best is None:
            best, why = top, _why_first(top, plans)
        elif top.step_seconds * MOVE_UP < best.step_seconds:
            why = (f"{top.strategy} ({RUNGS[rung]}) is {best.step_seconds / top.step_seconds:.2f}x "
                   f"faster than {best.strategy} (step ~ {top.step_seconds:.3g} s vs "
                   f"{best.step_seconds:.3g} s)")
            best = top
    if best is None:
        best = best_of([p for p in ok if p.rung == 4])
        moved = best.memory.host + best.memory.nvme
        why = (f"nothing fits in device memory without offload; {best.strategy} moves "
               f"{gb(moved)} per device to host/NVMe (step ~ {best.step_seconds:.3g} s)")
    if best.planned_only:
        why += "; planned only: needs a TP/PP implementation"
    return Recommendation(best.strategy, why)


def best_of(plans: list[Plan]) -> Plan | None:
    if not plans:
        return None
    fastest = min(p.step_seconds for p in plans)
    near = [p for p in plans if p.step_seconds <= fastest * (1 + TOLERANCE)]
    return min(near, key=lambda p: (p.memory.total, p.communication.bytes_per_step, p.strategy))


def _why_first(top: Plan, plans: list[Plan]) -> str:
    if top.rung == 0:
        return (f"the replicated state fits ({gb(top.memory.total)} of {gb(top.device_bytes)} "
                f"per device): no sharding needed; {top.strategy} is the fastest "
                f"(step ~ {top.step_seconds:.3g} s)")
    rep = [p for p in plans if p.rung == 0 and not p.problems]
    lead = (f"replicated needs {gb(min(p.memory.total for p in rep))} per device, has "
            f"{gb(top.device_bytes)}, so the state must be sharded" if rep
            else "no replicated layout runs here")
    return (f"{lead}; {top.strategy} is the fastest {RUNGS[top.rung]} layout that fits "
            f"(step ~ {top.step_seconds:.3g} s, {gb(top.memory.total)} per device, "
            f"{gb(top.communication.bytes_per_step)} moved per step)")


def rank(plans: list[Plan], rec: Recommendation) -> list[Plan]:
    """Recommended first, then fitting layouts by step time, then the rest by memory."""
    return sorted(plans, key=lambda p: (p.strategy != rec.strategy, not (p.fits and not p.problems),
                                        p.step_seconds if p.fits else p.memory.total, p.strategy))


# ----------------------------------------------------------------------------- entry points
def _run(cfg: Any) -> Any:
    from strategies.base import Run

    gpu = str(cfg.cluster.accelerator) == "gpu"
    return Run(accelerator="gpu" if gpu else "cpu", precision=str(cfg.trainer.precision),
               micro_batch_size=int(cfg.trainer.micro_batch_size))


def plan_all(cfg: Any, *, chosen: bool = False) -> Report:
    """Plan every preset (the composed ``cfg.strategy`` with its overrides in place of its own
    file) and the planned-only layouts; ``chosen``: only the composed preset."""
    from strategies.base import as_config
    from strategies.presets import load, names

    su = Setup.of(cfg)
    world, run = World(su.hardware.nodes, su.hardware.devices), _run(cfg)
    own = as_config(cfg.strategy)
    presets = [own] if chosen else [own if n == own.name else load(n) for n in names()]
    cands = [candidate(p, world, run) for p in presets]
    if not chosen:
        cands += planned_candidates(su, int(cfg.planner.tp), int(cfg.planner.pp))
    plans = [plan_candidate(c, su) for c in cands]
    rec = recommend(plans) if not chosen else Recommendation(plans[0].strategy, "chosen")
    for p in plans:
        if not p.fits:
            p.hint = _hint(plans if not chosen else _others(su, world, run, p))
    model = f"{su.params:,} parameters" if su.shape is None else str(cfg.model.name)
    return Report(model, su.hardware.name, world.size, su.accounting, rank(plans, rec), rec,
                  assumptions(su))


def _others(su: Setup, world: World, run: Any, skip: Plan) -> list[Plan]:
    from strategies.presets import load, names

    return [plan_candidate(candidate(load(n), world, run), su) for n in names()
            if n != skip.strategy]


def _hint(plans: list[Plan]) -> str:
    rec = recommend([p for p in plans if p.runnable])
    if rec.strategy:
        return f"cheapest preset that fits: {rec.strategy} (strategy={rec.strategy})"
    planned = recommend([p for p in plans if p.planned_only])
    if planned.strategy:
        return f"no preset fits; the planned-only layout {planned.strategy} would"
    return "no preset fits: use more devices, a smaller micro batch or activation checkpointing"


def preflight(cfg: Any) -> Plan:
    """The plan of the composed run's own preset, for train.py (``.fits``, ``.summary()``,
    ``.message()``); the cheapest fitting preset is searched only when it does not fit."""
    return plan_all(cfg, chosen=True).plans[0]


def assumptions(su: Setup) -> list[str]:
    acc = {"mixed16": "mixed16: 2 bf16 param + 2 bf16 grad + 4 fp32 master + 8 Adam = 16 B/param",
           "mixed20": "mixed20: 2 bf16 param + 2 bf16 + 4 fp32 grad + 4 fp32 master + 8 Adam = 20 B/param",
           "actual": f"actual: what precision={su.precision} allocates (AdamW; torch AMP keeps "
                     "fp32 params, DeepSpeed bf16 params + fp32 master)"}[su.accounting]
    out = [f"GB = 1e9 bytes, GiB = 2^30; memory is per device; accounting {acc}",
           f"compute = 6 x params x tokens / (devices x peak x MFU {su.mfu:g}); activation "
           "checkpointing adds one forward (8 x params x tokens)",
           "bandwidth-only collective times (ring: 2(N-1)/N x bytes per rank for all-reduce, "
           "(N-1)/N for all-gather / reduce-scatter); groups spanning nodes run at "
           "inter_node_GBps; no latency terms",
           "overlap: gradient all-reduce / reduce-scatter hide under backward, ZeRO-3/FSDP "
           "gathers under forward/backward (prefetch); ZeRO-1/2 post-step all-gather, TP "
           "all-reduces, pipeline sends and offload copies are exposed"]
    if su.shape is None:
        out.append("planner.params: model states only (no activations, buffers, TP/PP traffic)")
    else:
        attn = ("flash attention (no s x s scores)" if su.flash_attention
                else "materialised attention scores")
        out.append(f"activations: Korthikanti et al. 2022 per layer, SwiGLU/GQA terms, {attn}, "
                   f"micro batch {su.micro_batch} x seq {su.seq_len}; fp32 logits for the loss")
    out.append("planned-only TP / PP / 3D layouts use ZeRO-1 over data parallel; bubble "
               "(P-1)/(m+P-1), 1F1B keeps min(P, m) micro-batches in flight on stage 0")
    return out


__all__ = ["ACCOUNTINGS", "Candidate", "Collective", "Communication", "Hardware", "Memory",
           "ModelShape", "Plan", "Recommendation", "Report", "Setup", "StateBytes",
           "activation_bytes", "all_gather_bytes", "boundary_activation_bytes", "bubble_fraction",
           "candidate", "korthikanti_layer_bytes", "layer_activation_bytes", "model_states",
           "plan_all", "plan_candidate", "planned_candidates", "preflight", "recommend",
           "reduce_scatter_bytes", "ring_all_reduce_bytes", "state_bytes", "transfer_seconds"]
