"""Communication per optimizer step: ring collective volumes (Patarasuk & Yuan 2009), which
collectives each layout issues, over which link, and how much of their time compute hides.
Closed forms; docs/PLANNER.md."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from planner.activations import boundary_activation_bytes
from planner.inputs import Candidate, ModelDescription, Setup
from planner.states import GB, StateBytes
from strategies.base import CPU, DEVICE, SHARDED, Layout


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


def regathered(lay: Layout, params: float, shape: ModelDescription | None, mp: int) -> float:
    """Parameters gathered again for backward under ``reshard_after_forward`` (of this rank's
    model-parallel part ``params``): FSDP keeps its root unit gathered, DeepSpeed ZeRO-3 keeps
    up to ``live_params`` gathered; unknown shape: all."""
    if lay.backward_regather == "blocks" and shape is not None:
        return min(params, shape.n_layers * shape.block_params() / mp)
    if lay.backward_regather == "over_live":
        return max(0.0, params - lay.live_params / mp)
    return params


def powersgd_ratio(shape: ModelDescription | None, params: float, rank: int) -> float:
    """Gradient elements PowerSGD sends per step, as a fraction of the parameters (Vogels et al.
    2019; torch's powerSGD_hook): each n x m gradient matrix goes as rank-r factors P (n x r)
    and Q (m x r), unless that saves less than 2x (``min_compression_rate``); vectors (norms)
    go whole. Without a shape, square h x h matrices with h ~ 128 x layers (estimated_unit)."""
    if shape is None:
        layers = max(1.0, (params / (12 * 128**2)) ** (1 / 3))
        h = 128 * layers
        return min(1.0, 2 * rank * h / (h * h)) if h * h >= 2 * 2 * rank * h else 1.0
    d, f = shape.dim, shape.hidden
    kv = shape.n_kv_heads * (d // shape.n_heads)
    block = [(d, d), (kv, d), (kv, d), (d, d), (f, d), (f, d), (d, f)]
    tied = getattr(shape, "tie_embeddings", False)
    matrices = block * shape.n_layers + [(shape.vocab_size, d)] * (1 if tied else 2)
    total = shape.num_params()
    whole = total - sum(n * m for n, m in matrices)

    def sent(n: int, m: int) -> int:
        factors = rank * (n + m)
        return factors if n * m >= 2 * factors else n * m

    return (whole + sum(sent(n, m) for n, m in matrices)) / total


def communication(c: Candidate, su: Setup, sb: StateBytes, params: float, trainable: float,
                  dp: int, shard: int, m: int, ckpt: bool) -> Communication:
    """Bytes each rank sends per optimizer step, by collective, and their time: bandwidth plus
    latency (alpha-beta: calls x steps x the link's latency, ``latency_steps``)."""
    devices, lay, shape = su.cluster.devices, c.layout, su.shape
    out = Communication()

    o = su.options
    alpha = {"intra": getattr(o, "intra_latency_us", 0.0) * 1e-6,
             "inter": getattr(o, "inter_latency_us", 0.0) * 1e-6}

    def add(name: str, op: str, ranks: int, stride: int, full: float, overlap: str,
            per_micro: bool = False, link: str | None = None, calls: float = 1) -> None:
        if ranks <= 1 and op != "copy" or full <= 0:
            return
        per_rank = {"all_reduce": ring_all_reduce_bytes(full, ranks),
                    "all_gather": all_gather_bytes(full, ranks),
                    "reduce_scatter": reduce_scatter_bytes(full, ranks)}.get(op, full)
        per_rank *= m if per_micro else 1
        calls = max(1, math.ceil(calls)) * (m if per_micro else 1)
        group = link or ("intra" if stride * (ranks - 1) < devices else "inter")
        latency = calls * latency_steps(op, ranks) * alpha.get(group, 0.0)
        out.by_collective[name] = Collective(op, group, ranks, int(per_rank),
                                             transfer_seconds(per_rank, su.link_GBps(group)) + latency,
                                             overlap, per_micro, calls, latency)

    # launches per step: gradient buckets, and one per FSDP/ZeRO-3 unit (blocks + the root)
    layers = (math.ceil(shape.n_layers / c.pp) if shape is not None
              else max(1.0, (su.params / (12 * 128**2)) ** (1 / 3)) / c.pp)
    units = layers + 1
    bucket = (lay.reduce_bucket * min(sb.grads, 4)) if lay.reduce_bucket else c.bucket_bytes

    ratio = lay.grad_bytes_ratio
    reduce = {True: 4, False: min(sb.reduce, 2)}.get(lay.reduce_fp32, sb.reduce)
    grad = trainable * (max(reduce * ratio, min(reduce, 2)) if ratio < 1 else reduce)
    if lay.compression_rank:  # after its warm-up steps; until then plain all-reduce
        grad *= powersgd_ratio(shape, su.params, lay.compression_rank)
    stride, sharded_grads = c.tp, lay.grads == SHARDED
    if lay.params == lay.grads == lay.optimizer != SHARDED:
        add("grad_all_reduce", "all_reduce", dp, stride, grad, "backward", calls=grad / bucket)
    else:
        if lay.grad_all_reduce:  # DeepSpeed ZeRO-1/2: full buckets all-reduced, shards kept
            add("grad_all_reduce", "all_reduce", shard, stride, grad, "backward",
                per_micro=sharded_grads, calls=grad / bucket)
        else:
            add("grad_reduce_scatter", "reduce_scatter", shard, stride, grad, "backward",
                per_micro=sharded_grads,
                calls=units if lay.params == SHARDED and not lay.reduce_bucket else grad / bucket)
        if shard < dp:  # HYBRID: the shards are all-reduced across the replica groups
            add("grad_all_reduce_replicas", "all_reduce", dp // shard, stride * shard,
                grad / shard, "backward", per_micro=sharded_grads, calls=units)
        if lay.params == SHARDED:
            add("param_all_gather_forward", "all_gather", shard, stride, params * sb.gather,
                "forward", per_micro=True, calls=units)
            again = regathered(lay, params, shape, c.tp * c.pp)
            if lay.reshard_after_forward and again > 0:
                add("param_all_gather_backward", "all_gather", shard, stride,
                    again * sb.gather, "backward", per_micro=True, calls=units * again / params)
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
    if shape is not None and c.tp > 1:
        # Row-parallel layers all-reduce their output in forward; column-parallel ones their
        # input's gradient in backward, each separately (torch's DTensor TP does not fuse q, k,
        # v: 2 forward + 5 backward per Llama block; Megatron's fused QKV would be 2 + 2).
        # Recomputation repeats the forward ones. The embedding (row-parallel) all-reduces its
        # output, the head (column-parallel) its input gradient; the replicated logits are
        # all-gathered.
        fwd, bwd = getattr(shape, "tp_collectives", lambda: (2, 4))()
        layers = math.ceil(shape.n_layers / c.pp)
        x = su.trainer.micro_batch_size * shape.seq_len * shape.dim * sb.activation
        count = layers * (fwd * (2 if ckpt else 1) + bwd) + (2 if c.pp == 1 else 1)
        add("tp_all_reduce", "all_reduce", c.tp, 1, count * x, "none", per_micro=True, calls=count)
        logits = su.trainer.micro_batch_size * shape.seq_len * shape.vocab_size * sb.activation
        add("tp_logits_all_gather", "all_gather", c.tp, 1, logits, "none", per_micro=True)
    if shape is not None and c.pp > 1:
        # one activation forward, one gradient back per boundary and micro-batch: the first and
        # last stages send one of the two, the middle ones both
        sp = su.options.sequence_parallel and c.tp > 1
        x = boundary_activation_bytes(su.trainer.micro_batch_size, shape.seq_len, shape.dim, sb.activation)
        add("pp_send_recv", "send_recv", c.pp, c.tp * dp, (2 if c.pp > 2 else 1) * x / (c.tp if sp else 1),
            "none", per_micro=True, link="intra" if c.tp * dp < devices else "inter")
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
