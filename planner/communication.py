"""Communication per optimizer step: ring collective volumes (Patarasuk & Yuan 2009), the
collectives each layout issues (its footprint's, plus tensor and pipeline parallelism's), over
which link, and how much of their time compute hides.
Closed forms; docs/PLANNER.md."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from planner.activations import boundary_activation_bytes
from planner.inputs import Setup
from planner.states import GB
from strategies.footprint import Sizes, StateBytes, Traffic


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


def latency_steps(op: str, n: int) -> int:
    """Sequential steps of one collective over ``n`` ranks, each paying the link's latency:
    all-reduce as NCCL's trees do it at scale, 2 ceil(log2 n) (a ring would take 2(n-1));
    all-gather / reduce-scatter as a ring, n - 1; a send or a copy, 1."""
    if n <= 1 and op != "copy":
        return 0
    if op == "all_reduce":
        return 2 * math.ceil(math.log2(n))
    if op in ("all_gather", "reduce_scatter"):
        return n - 1
    return 1


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
    calls: int = 1
    """Collectives launched per optimizer step (buckets, units, layers), each paying latency."""
    latency_seconds: float = 0.0
    """The part of ``seconds`` that is latency: calls x steps x the link's latency."""


@dataclass
class Communication:
    bytes_per_step: int = 0
    seconds_per_step: float = 0.0
    by_collective: dict[str, Collective] = field(default_factory=dict)


def communication(traffic: list[Traffic], su: Setup, sb: StateBytes, n: Sizes, pp: int, m: int,
                  ckpt: bool) -> Communication:
    """Bytes each rank sends per optimizer step, by collective, and their time: bandwidth plus
    latency (alpha-beta: calls x steps x the link's latency, ``latency_steps``). ``traffic``: the
    footprint's data-parallel collectives and offload copies; tensor- and pipeline-parallel
    traffic follows from the mesh and the model."""
    devices, shape, tp, dp = su.cluster.devices, su.shape, n.tp, n.dp
    out = Communication()

    o = su.options
    alpha = {"intra": getattr(o, "intra_latency_us", 0.0) * 1e-6,
             "inter": getattr(o, "inter_latency_us", 0.0) * 1e-6}

    def add(x: Traffic) -> None:
        if x.ranks <= 1 and x.op != "copy" or x.bytes <= 0:
            return
        per_rank = {"all_reduce": ring_all_reduce_bytes(x.bytes, x.ranks),
                    "all_gather": all_gather_bytes(x.bytes, x.ranks),
                    "reduce_scatter": reduce_scatter_bytes(x.bytes, x.ranks)}.get(x.op, x.bytes)
        per_rank *= m if x.per_micro else 1
        calls = max(1, math.ceil(x.calls)) * (m if x.per_micro else 1)
        group = x.link or ("intra" if x.stride * (x.ranks - 1) < devices else "inter")
        latency = calls * latency_steps(x.op, x.ranks) * alpha.get(group, 0.0)
        out.by_collective[x.name] = Collective(x.op, group, x.ranks, int(per_rank),
                                               transfer_seconds(per_rank, su.link_GBps(group)) + latency,
                                               x.overlap, x.per_micro, calls, latency)

    for x in traffic:
        add(x)
    if shape is not None and tp > 1:
        # Row-parallel layers all-reduce their output in forward; column-parallel ones their
        # input's gradient in backward, each separately (torch's DTensor TP does not fuse q, k,
        # v: 2 forward + 5 backward per Llama block; Megatron's fused QKV would be 2 + 2).
        # Recomputation repeats the forward ones. The embedding (row-parallel) all-reduces its
        # output, the head (column-parallel) its input gradient; the replicated logits are
        # all-gathered.
        fwd, bwd = getattr(shape, "tp_collectives", lambda: (2, 4))()
        layers = math.ceil(shape.n_layers / pp)
        x = su.trainer.micro_batch_size * shape.seq_len * shape.dim * sb.activation
        count = layers * (fwd * (2 if ckpt else 1) + bwd) + (2 if pp == 1 else 1)
        add(Traffic("tp_all_reduce", "all_reduce", tp, 1, count * x, "none", per_micro=True, calls=count))
        logits = su.trainer.micro_batch_size * shape.seq_len * shape.vocab_size * sb.activation
        add(Traffic("tp_logits_all_gather", "all_gather", tp, 1, logits, "none", per_micro=True))
    if shape is not None and pp > 1:
        # one activation forward, one gradient back per boundary and micro-batch: the first and
        # last stages send one of the two, the middle ones both
        sp = su.options.sequence_parallel and tp > 1
        x = boundary_activation_bytes(su.trainer.micro_batch_size, shape.seq_len, shape.dim, sb.activation)
        add(Traffic("pp_send_recv", "send_recv", pp, tp * dp, (2 if pp > 2 else 1) * x / (tp if sp else 1),
                    "none", per_micro=True, link="intra" if tp * dp < devices else "inter"))
    out.bytes_per_step = sum(x.bytes for x in out.by_collective.values())
    out.seconds_per_step = sum(x.seconds for x in out.by_collective.values())
    return out


def exposed_seconds(comm: Communication, compute: float, m: int, ckpt: bool) -> float:
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
