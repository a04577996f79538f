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
from parallel.pipeline import sends_per_microbatch


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


# FSDP's per-micro-batch collectives that a pipeline schedule repeats its own way
STAGED = ("param_all_gather_forward", "param_all_gather_backward", "grad_reduce_scatter",
          "grad_all_reduce_replicas")


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
                  ckpt: bool, *, cp: int = 1, sp: int = 1, tp_sp: bool = False,
                  pipeline: tuple[str, int] = ("1f1b", 1),
                  boundary_elem: float | None = None,
                  staged: tuple[float, float, int] | None = None,
                  ac: tuple[bool | str, float] | None = None) -> Communication:
    """Bytes each rank sends per optimizer step, by collective, and their time: bandwidth plus
    latency (alpha-beta: calls x steps x the link's latency, ``latency_steps``). ``traffic``: the
    footprint's data-parallel collectives and offload copies; tensor- and pipeline-parallel
    traffic follows from the mesh and the model. ``cp``, ``sp``: context-parallel and Ulysses
    degrees; ``tp_sp``: sequence parallelism under TP. ``m``: micro-batches per step; ``pipeline``:
    the schedule and stages per rank; ``boundary_elem``: bytes per element of what crosses a
    stage boundary (the residual stream: fp32 under autocast); ``staged``: under a pipeline,
    FSDP's block gathers per schedule run in forward and backward and the runs per step
    (parallel.pipeline.fsdp_gathers: the schedule, not each micro-batch, decides them); ``ac``:
    activation checkpointing as it runs, the mode (true, selective) and the share of the blocks it
    wraps (``strategy.ac_every``), for TP's recomputed collectives (None: ``ckpt`` on every block)."""
    devices, shape, tp, dp = su.cluster.devices, su.shape, n.tp, n.dp
    out = Communication()

    def repeats(x: Traffic) -> float:
        """How often a per-micro-batch collective runs per step."""
        if not x.per_micro:
            return 1
        if staged is None or x.name not in STAGED:
            return m
        fwd, bwd, runs = staged
        blocks = min(1.0, n.blocks / n.params) if n.blocks and n.params else 1.0
        per_run = {"param_all_gather_forward": (1 - blocks) + blocks * fwd,  # the root once a run
                   "param_all_gather_backward": bwd}.get(x.name, 1)
        return per_run * runs

    def add(x: Traffic) -> None:
        if x.ranks <= 1 and x.op != "copy" or x.bytes <= 0:
            return
        per_rank = {"all_reduce": ring_all_reduce_bytes(x.bytes, x.ranks),
                    "all_gather": all_gather_bytes(x.bytes, x.ranks),
                    "reduce_scatter": reduce_scatter_bytes(x.bytes, x.ranks),
                    "all_to_all": all_gather_bytes(x.bytes, x.ranks)}.get(x.op, x.bytes)
        per_rank *= repeats(x)
        calls = max(1, math.ceil(x.calls * repeats(x)))
        group = x.link or ("intra" if x.stride * (x.ranks - 1) < devices else "inter")
        latency = calls * latency_steps(x.op, x.ranks) * su.latency_seconds(group, x.op)
        out.by_collective[x.name] = Collective(x.op, group, x.ranks, int(per_rank),
                                               transfer_seconds(per_rank, su.link_GBps(group, x.op)) + latency,
                                               x.overlap, x.per_micro, calls, latency)

    for x in traffic:
        add(x)
    residual = boundary_elem or sb.activation  # bytes per element of the residual stream
    if shape is not None and tp > 1:
        mode, wrapped = ac if ac is not None else (ckpt, 1.0)
        for x in tp_traffic(shape, su.trainer.micro_batch_size, tp, pp, sb.activation, residual, mode,
                            tp_sp, seq=cp * sp, wrapped=wrapped):
            add(x)
    if shape is not None and pp > 1:
        add(pp_traffic(shape, su.trainer.micro_batch_size, tp, pp, dp, devices, residual, tp_sp,
                       pipeline, seq=cp * sp))
    if shape is not None and sp > 1:
        add(ulysses_traffic(shape, su.trainer.micro_batch_size, sp, sb.activation, ckpt, pp))
    if shape is not None and cp > 1:
        add(ring_traffic(shape, su.trainer.micro_batch_size, cp, sb.activation, ckpt, pp, tp))
    out.bytes_per_step = sum(x.bytes for x in out.by_collective.values())
    out.seconds_per_step = sum(x.seconds for x in out.by_collective.values())
    return out


def tp_traffic(shape, micro: int, tp: int, pp: int, elem: float, residual: float, ckpt: bool | str,
               tp_sp: bool, seq: int = 1, wrapped: float = 1.0) -> list[Traffic]:
    """Tensor parallelism's collectives per micro-batch: the blocks' all-reduces (or, with
    sequence parallelism, their all-gathers and reduce-scatters) and the logits' all-gather.
    ``elem``: bytes per element in the compute dtype; ``residual``: of the residual stream;
    ``ckpt``: the blocks' activation checkpointing (false, true, selective), over ``wrapped``
    of them (``strategy.ac_every``); ``seq``: the sequence degree (cp x sp): a rank's blocks and
    head see seq_len / seq tokens (outside attention under Ulysses, where the row outputs and the
    logits are)."""
    # Row-parallel layers reduce their output in forward (in the compute dtype: bf16 under
    # autocast); column-parallel ones their input's gradient in backward (the residual
    # stream's dtype: fp32 under autocast). torch's DTensor TP reduces q, k, v, gate and up
    # input gradients separately (2 forward + 5 backward all-reduces per Llama block;
    # Megatron's fused QKV: 2 + 2). The embedding (row-parallel) reduces its output, the
    # head (column-parallel) its input gradient; the replicated logits are all-gathered.
    # With sequence parallelism each block instead all-gathers its two norm outputs and
    # reduce-scatters its two row outputs in forward, and the reverse in backward (the gathered
    # input's gradient arrives as one reduce-scatter for q, k, v together): 4 + 4
    # half-collectives per block.
    # Recomputation (parallel/checkpointing.py: torch's non-reentrant checkpoint, which stops
    # once backward's saved tensors are back) repeats the forward's collectives but the block's
    # last row output's, which feeds only the residual add (measured: one all-reduce or
    # reduce-scatter a block, not two); the selective policy keeps every reduce's output and no
    # all-gather's, so under SP it gathers both norm outputs again and reduces nothing again.
    fwd, bwd = getattr(shape, "tp_collectives", lambda: (2, 4))()
    layers = math.ceil(shape.n_layers / pp)
    tokens = micro * shape.seq_len / seq * shape.dim
    low, res = tokens * elem, tokens * residual
    ends = 2 if pp == 1 else 1  # the embedding's and the head's (one of them past pp = 1)
    redone = layers * wrapped if ckpt else 0.0  # blocks run forward again in backward
    reduced = redone if ckpt and ckpt != "selective" else 0.0  # ... reducing their outputs again
    if tp_sp:
        g_calls, s_calls = layers * 4 + redone * 2 + ends, layers * 4 + reduced * (fwd - 1) + ends
        gathers = layers * (2 * res + 2 * low) + redone * 2 * res + ends * res
        scatters = layers * (2 * low + 2 * res) + reduced * (fwd - 1) * low + ends * res
        out = [Traffic("tp_all_gather", "all_gather", tp, 1, gathers, "none", per_micro=True, calls=g_calls),
               Traffic("tp_reduce_scatter", "reduce_scatter", tp, 1, scatters, "none", per_micro=True,
                       calls=s_calls)]
    else:
        count = layers * (fwd + bwd) + reduced * (fwd - 1) + ends
        nbytes = layers * (fwd * low + bwd * res) + reduced * (fwd - 1) * low + ends * res
        out = [Traffic("tp_all_reduce", "all_reduce", tp, 1, nbytes, "none", per_micro=True, calls=count)]
    logits = micro * shape.seq_len / seq * shape.vocab_size * elem
    return out + [Traffic("tp_logits_all_gather", "all_gather", tp, 1, logits, "none", per_micro=True)]


def pp_traffic(shape, micro: int, tp: int, pp: int, dp: int, devices: int, residual: float,
               tp_sp: bool, pipeline: tuple[str, int], seq: int = 1) -> Traffic:
    """The pipeline's stage-boundary sends per micro-batch on the busiest rank (``seq``: the
    sequence degree, cp x sp: a boundary carries this rank's seq_len / seq tokens)."""
    # every stage boundary between two ranks carries each micro-batch's activation forward
    # and its gradient back: the busiest rank's sends (parallel.pipeline counts them for
    # the schedule's stage placement: 2v - 1 or 2v per rank looped, fewer in a V)
    schedule, virtual = pipeline
    sends = max(sends_per_microbatch(schedule, pp, virtual))
    x = boundary_activation_bytes(micro, shape.seq_len / seq, shape.dim, residual)
    return Traffic("pp_send_recv", "send_recv", pp, tp * dp, sends * x / (tp if tp_sp else 1),
                   "none", per_micro=True, link="intra" if tp * dp < devices else "inter", calls=sends)


def ulysses_traffic(shape, micro: int, sp: int, elem: float, ckpt: bool, pp: int = 1) -> Traffic:
    """DeepSpeed Ulysses per micro-batch: each layer all-to-alls its sequence shard's queries,
    keys and values into head shards and the attention output back -- 4 x s x b x h / sp
    elements with full heads (keys and values at the KV width under GQA) -- in forward, the same
    again in backward, and once more in forward when blocks are recomputed. A rank sends
    (sp - 1) / sp of each payload (``all_to_all``). KV heads sp does not divide are replicated
    to the query heads first (as DeepSpeed does): keys and values then travel at full width."""
    kv_heads = shape.n_kv_heads if shape.n_kv_heads % sp == 0 else shape.n_heads
    kv = kv_heads * (shape.dim // shape.n_heads)
    layers = math.ceil(shape.n_layers / pp)
    per_layer = (2 * shape.dim + 2 * kv) * micro * shape.seq_len / sp * elem
    passes = 3 if ckpt else 2
    return Traffic("sp_all_to_all", "all_to_all", sp, 1, per_layer * layers * passes, "none",
                   per_micro=True, calls=4 * layers * passes)


def ring_traffic(shape, micro: int, cp: int, elem: float, ckpt: bool, pp: int = 1,
                 tp: int = 1) -> Traffic:
    """torch's context parallelism per micro-batch (ring attention): each layer passes its
    sequence shard's keys and values to the other cp - 1 ranks in forward (torch 2.13 all-gathers
    them once, ``_AllGatherRotater``: the same bytes a rank sends as cp - 1 ring passes), again
    in backward, where the key and value gradients, accumulated in fp32 (torch's
    ``convert_to_f32``), travel the ring back to their owners (cp all-to-all passes);
    recomputation repeats the forward's. Under tensor parallelism a rank holds 1/tp of the heads.
    Measured on gloo: exactly these bytes."""
    kv = shape.n_kv_heads * (shape.dim // shape.n_heads) / tp
    layers = math.ceil(shape.n_layers / pp)
    chunk = 2 * kv * micro * shape.seq_len / cp  # this rank's K and V, elements
    gathers = 3 if ckpt else 2
    per_layer = chunk * ((cp - 1) * gathers * elem + cp * 4)
    return Traffic("cp_kv_send_recv", "send_recv", cp, 1, per_layer * layers, "none",
                   per_micro=True, calls=layers * (gathers + cp))


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
