"""What a rank holds and sends under a preset: the footprint each family declares and the planner
prices (planner/ reads footprints only through this protocol, so a new family adds its own).

A ``Footprint`` answers, from ``Sizes`` (this rank's share of the model in elements, the bytes per
element the precision and accounting give, the data-parallel and shard sizes):

- ``states``: per-device bytes of parameters, gradients, fp32 master weights and optimizer
  moments, with what offload moves to host memory or NVMe;
- ``buffers``: the transients beside the states, through backward and at the optimizer step;
- ``traffic``: the data-parallel collectives and offload copies of one optimizer step, as
  ``Traffic`` (full payloads; the planner turns them into per-rank bytes and seconds, and adds
  the tensor- and pipeline-parallel traffic, which follows from the mesh and the model);
- ``notes``: what a user should know about the numbers.

The base class is plain data parallelism: each state replicated or sharded over the shard
group, optionally offloaded, gathered per unit when parameters are sharded. Families with an
engine of their own subclass it next to their config (DDP's buckets and compression, DeepSpeed
ZeRO's master weights and buffers, FSDP's root unit). Closed forms and sources: docs/PLANNER.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Where a state lives, and over how many ranks it is split.
REPLICATED, SHARDED = "replicated", "sharded"
DEVICE, CPU, NVME = "device", "cpu", "nvme"
HOST_STATES = ("params_16bit", "fp32_master", "fp32_grads", "grads_16bit", "optimizer_moments", "accumulation")
"""planner/host.py's host items that are model states (``predicted_vs_measured.state_bytes``),
``accumulation`` among them: ZeRO-2 offload's accumulated gradients, which the memory observer
counts as gradients (backends/common/deepspeed.py ``_GRAD_ATTRS``: ``accumulated_grads_in_cpu``);
the rest are an engine's staging copies, temporaries, rounding and the process."""
STEP_ONLY = ("step_temporaries",)
"""planner/host.py's host items made only in the optimizer's step, once the activations are gone
(``cpu_peak``)."""
MiB = 2**20


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


@dataclass(frozen=True)
class Sizes:
    """What the planner hands a footprint: one layout on one setup, in elements and bytes."""

    params: float
    """Parameters this rank's model-parallel part holds (the model / (tp x pp))."""
    trainable: float
    """Of those, the ones that train (LoRA: the adapters)."""
    bytes: StateBytes
    dp: int
    shard: int
    """Ranks a sharded state is split over (the mesh's dp_shard)."""
    tp: int = 1
    """Tensor-parallel degree: data-parallel peers are this many ranks apart."""
    mp: int = 1
    """tp x pp: how many ranks share one replica."""
    unit: float = 0.0
    """Elements of the largest unit gathered at once (a block or an embedding) on this rank."""
    units: float = 1.0
    """Units gathered per step: this rank's blocks and the root."""
    blocks: float | None = None
    """Parameters of this rank's blocks (what FSDP reshards); None when the shape is unknown."""
    model: Any = None
    """The model description (``planner.inputs.ModelDescription``); None: planner.params only."""
    total_params: float = 0.0
    """The whole model's parameters."""
    micro: int = 1
    """Samples per micro-batch (token all-to-all payloads of expert parallelism)."""
    accumulation: int = 1
    """Micro-batches each replica runs per optimizer step (gradient accumulation)."""
    resident: bool = False
    """Memory is a CPU host's, counted as resident pages: an allocation costs only what is
    written (``torch.empty``'s untouched tail takes no memory), where a GPU allocator reserves
    all of it."""


@dataclass(frozen=True)
class States:
    """Per-device bytes of model states; host/nvme: what this device's share moved off it."""

    params: int = 0
    grads: int = 0
    master: int = 0
    optimizer: int = 0
    host: int = 0
    nvme: int = 0


@dataclass(frozen=True)
class Traffic:
    """One kind of collective of an optimizer step, before the planner prices it."""

    name: str
    op: str
    """all_reduce | all_gather | reduce_scatter | send_recv | copy."""
    ranks: int
    stride: int
    """Distance between neighbouring ranks of the group (a group spanning nodes is slower)."""
    bytes: float
    """The full payload (a ring all-reduce sends 2(N-1)/N of it per rank)."""
    overlap: str
    """forward | backward (hidden under that compute while it lasts) | none (exposed)."""
    per_micro: bool = False
    link: str | None = None
    """host | nvme for offload copies; None: intra or inter node, from the group's extent."""
    calls: float = 1.0
    """Collectives launched per step (buckets, units), each paying the link's latency."""


@dataclass(frozen=True)
class Footprint:
    """Plain data parallelism: each state replicated or sharded, optionally offloaded."""

    params: str = REPLICATED
    """replicated | sharded (ZeRO-3 / FULL_SHARD / fully_shard)."""
    grads: str = REPLICATED
    """replicated | sharded (ZeRO-2 and up)."""
    optimizer: str = REPLICATED
    """replicated | sharded (ZeRO-1 and up): fp32 master weights and moments."""
    params_offload: str = DEVICE
    """device | cpu | nvme: where the parameter shards live between uses."""
    optimizer_offload: str = DEVICE
    """device | cpu | nvme: where optimizer state (and the step, and its gradients) live."""
    reshard_after_forward: bool = True
    """With sharded parameters: free gathered units after forward (gather again for backward)."""
    bucket_bytes: int = 25 * MiB
    """Gradient bucket size: one reduction launch per bucket."""
    reduce_fp32: bool | None = None
    """Gradients are reduced in fp32 whatever the precision (True), in the low dtype (False);
    None: the precision's usual reduce dtype."""
    master_weights: bool = False
    """The engine keeps its own fp32 copy of the parameters beside 16-bit working ones."""
    pin_memory: bool | None = None
    """Offload buffers page-locked (strategy.pin_memory); None: on a GPU run."""
    swap_buffers: tuple[int, int] = (0, 0)
    """NVMe offload's pinned swap buffers: 16-bit parameter elements (count x size) and the
    number of fp32 optimizer buffers, each the largest sub-group's (planner/host.py)."""

    # ------------------------------------------------------------------ what it is
    @property
    def sharded(self) -> bool:
        return SHARDED in (self.params, self.grads, self.optimizer)

    @property
    def offloaded(self) -> bool:
        return self.params_offload != DEVICE or self.optimizer_offload != DEVICE

    def state_bytes(self, sb: StateBytes, accounting: str) -> StateBytes:
        """The bytes per element this engine really uses (the default: the precision's)."""
        return sb

    # ------------------------------------------------------------------ memory
    def states(self, n: Sizes) -> States:
        held = {**self.held(n), "host": 0, "nvme": 0}
        for key, place in self.placement().items():
            if place in (CPU, NVME):
                held["host" if place == CPU else "nvme"] += held[key]
                held[key] = 0
        return States(**held)

    def held(self, n: Sizes) -> dict[str, int]:
        """Each state's bytes per device wherever it lives (params, grads, master, optimizer)."""
        sb = n.bytes

        def split(nbytes: float, state: str) -> int:
            return math.ceil(nbytes / n.shard) if state == SHARDED else math.ceil(nbytes)

        return {"params": split(n.params * sb.params, self.params),
                "grads": self.held_grads(n, split(n.trainable * sb.grads, self.grads)),
                "master": split(n.trainable * sb.master, self.optimizer),
                "optimizer": split(n.trainable * sb.optimizer, self.optimizer)}

    def placement(self) -> dict[str, str]:
        """Where each state lives: optimizer offload moves the gradient partition and the step
        too (ZeRO-Offload, CPUOffload)."""
        return {"params": self.params_offload, "grads": self.optimizer_offload,
                "master": self.optimizer_offload, "optimizer": self.optimizer_offload}

    def held_grads(self, n: Sizes, split: int) -> int:
        """Gradient bytes held at the step (``split``: the state divided as declared)."""
        return split

    def freed_at_step(self, n: Sizes) -> float:
        """State bytes counted at the step that the engine frees when the step ends (what a
        finished step leaves lacks them; the next step's backward makes them again)."""
        return 0.0

    def grads_released(self, n: Sizes) -> bool:
        """Gradients are freed between steps (the optimizer's ``zero_grad(set_to_none=True)``) and
        made again in backward, so with one micro-batch per step none exist while every
        activation does (backward's start); False where an engine keeps them in its own buffers
        (DeepSpeed's flat partitions, DDP's buckets)."""
        return True

    def buffers(self, n: Sizes) -> tuple[int, int]:
        """Transients beside the states ``(backward, step)``: gradient buckets, gathered units
        (the current and the prefetched one, and one unit's unsharded gradient), autocast's
        16-bit weight copies; what exists once the activations are gone (the end of backward,
        the optimizer step)."""
        sb = n.bytes
        backward = step = self.bucket_buffer(n)
        backward += self.backward_extra(n)
        if self.params == SHARDED:
            gathered = self.kept_gathered(n, self.gathered(n))
            backward += gathered * sb.gather + self.block(n) * sb.reduce
        elif sb.params > sb.gather:
            backward += n.params * sb.gather  # autocast's bf16 weight copies, saved for backward
        # (the end of backward and the step come one after the other: the larger of the two)
        step += max(self.step_extra(n), self.final_extra(n))
        return int(backward), int(step)

    def bucket_buffer(self, n: Sizes) -> float:
        """Gradient buckets: one filling, one in flight -- at most the gradients there are (a
        model of 0.14 MB was booked 50 MiB of buckets)."""
        if n.dp <= 1 and self.optimizer_offload == DEVICE:
            return 0.0
        return min(2 * self.bucket_bytes, n.trainable * n.bytes.grads)

    def backward_extra(self, n: Sizes) -> float:
        """Transients made while the activations are alive."""
        return 0.0

    def final_extra(self, n: Sizes) -> float:
        """Transients made at backward's very end, once every activation is freed (a reduction
        whose only flush is the last one)."""
        return 0.0

    def gathered(self, n: Sizes) -> float:
        """Elements gathered at once through backward: the current unit and the prefetched one,
        or, not resharded after forward, every parameter."""
        return (n.unit + self.prefetched(n)) if self.reshard_after_forward else n.params

    def block(self, n: Sizes) -> float:
        """Elements of the unit whose unsharded gradient is reduced while backward runs on."""
        return n.unit

    def prefetched(self, n: Sizes) -> float:
        """Elements gathered ahead of use beside the current unit: one unit."""
        return n.unit

    def kept_gathered(self, n: Sizes, gathered: float) -> float:
        return gathered

    def step_extra(self, n: Sizes) -> float:
        return 0.0

    # ------------------------------------------------------------------ communication
    def reduce_bytes(self, sb: StateBytes) -> float:
        """Bytes per gradient element on the wire."""
        return {True: 4, False: min(sb.reduce, 2)}.get(self.reduce_fp32, sb.reduce)

    def grad_bytes(self, n: Sizes) -> float:
        """The gradient payload of one reduction of every trainable parameter."""
        return n.trainable * self.reduce_bytes(n.bytes)

    def bucket_size(self, n: Sizes) -> float:
        return self.bucket_bytes

    @property
    def engine(self) -> str:
        """The engine whose own per-parameter work the calibration measures (``zero2``,
        ``zero3``: DeepSpeed's, ``fsdp2``: torch's); "": none beyond what the footprint prices."""
        return ""

    def gathered_params(self, n: Sizes) -> float:
        """Parameters a forward gathers: all (ZeRO-3 keeps its small tensors whole)."""
        return n.params

    def regathered(self, n: Sizes) -> float:
        """Parameters gathered again for backward under ``reshard_after_forward``: all."""
        return n.params

    def traffic(self, n: Sizes) -> list[Traffic]:
        sb, grad, bucket = n.bytes, self.grad_bytes(n), self.bucket_size(n)
        stride, per_micro_grads = n.tp, self.grads == SHARDED
        out: list[Traffic] = []
        if not self.sharded:
            out.append(Traffic("grad_all_reduce", "all_reduce", n.dp, stride, grad, "backward",
                               calls=grad / bucket))
        else:
            out += self.grad_reduction(n, grad, bucket)
            if n.shard < n.dp:  # HYBRID: the shards are all-reduced across the replica groups
                out.append(Traffic("grad_all_reduce_replicas", "all_reduce", n.dp // n.shard,
                                   stride * n.shard, grad / n.shard, "backward",
                                   per_micro=per_micro_grads, calls=n.units))
            if self.params == SHARDED:
                once = self.gathered_params(n)
                out.append(Traffic("param_all_gather_forward", "all_gather", n.shard, stride,
                                   once * sb.gather, "forward", per_micro=True, calls=n.units))
                again = self.regathered(n)
                if self.reshard_after_forward and again > 0:
                    out.append(Traffic("param_all_gather_backward", "all_gather", n.shard, stride,
                                       again * sb.gather, "backward", per_micro=True,
                                       calls=n.units * again / max(once, 1.0)))
            else:  # optimizer-sharded: the updated shards (trainable parameters) are gathered
                out.append(Traffic("param_all_gather", "all_gather", n.shard, stride,
                                   n.trainable * sb.gather, "none"))
        if self.optimizer_offload != DEVICE:
            link = "host" if self.optimizer_offload == CPU else "nvme"
            moved = grad / n.shard + n.trainable * sb.gather / n.shard  # gradients down, updates up
            if link == "nvme":  # the optimizer state is read and written back every step
                moved += 2 * n.trainable * (sb.master + sb.optimizer) / n.shard
            out.append(Traffic("optimizer_offload", "copy", 1, 1, moved, "none", link=link))
        if self.params_offload != DEVICE:
            link = "host" if self.params_offload == CPU else "nvme"
            passes = 2 if self.reshard_after_forward else 1
            out.append(Traffic("param_offload_fetch", "copy", 1, 1,
                               passes * n.params * sb.params / n.shard, "none", per_micro=True,
                               link=link))
        return out

    def grad_reduction(self, n: Sizes, grad: float, bucket: float) -> list[Traffic]:
        """How sharded gradients are reduced: a reduce-scatter per unit (sharded parameters) or
        per bucket."""
        calls = n.units if self.params == SHARDED else grad / bucket
        return [Traffic("grad_reduce_scatter", "reduce_scatter", n.shard, n.tp, grad, "backward",
                        per_micro=self.grads == SHARDED, calls=calls)]

    def notes(self, n: Sizes) -> list[str]:
        return []


@dataclass(frozen=True)
class FSDPFootprint(Footprint):
    """torch FSDP (FSDP1 flat units, FSDP2 per-parameter): every state sharded, each block its own
    unit. The root unit holds what no block does (embeddings, final norm, head): gathered whole
    at forward's start and, not resharded after forward, held through backward, so only the
    blocks are gathered again; its gradients are reduced last, once the activations are gone
    (unsharded gradients and the flat copy reduce-scattered, beside its gathered parameters).
    Gradients are reduce-scattered per unit: no DDP buckets."""

    params: str = SHARDED
    grads: str = SHARDED
    optimizer: str = SHARDED
    fsdp2: bool = False
    """FSDP2 (``fully_shard``), whose own per-parameter work the calibration measures; FSDP1's
    is not measured."""

    @property
    def engine(self) -> str:
        return "fsdp2" if self.fsdp2 else ""

    def root(self, n: Sizes) -> float:
        """Parameters of the root unit on this rank: what no block holds; 0 without a shape."""
        return 0.0 if n.blocks is None else max(0.0, n.params - n.blocks)

    def block(self, n: Sizes) -> float:
        return n.unit if n.blocks is None else n.blocks / max(1.0, n.units - 1)

    def gathered(self, n: Sizes) -> float:
        if n.blocks is None or not self.reshard_after_forward:
            return super().gathered(n)
        return self.root(n) + 2 * self.block(n)  # the root, the current block, the next one

    def prefetched(self, n: Sizes) -> float:
        return self.block(n)

    def bucket_buffer(self, n: Sizes) -> float:
        return 0.0

    def step_extra(self, n: Sizes) -> float:
        # the root's reduce-scatter closes backward: its gathered parameters, its unsharded
        # gradients (compute dtype) and the flat copy reduced (reduce dtype), its sharded
        # gradient not yet made (what the states count for it)
        root, sb = self.root(n), n.bytes
        if not root or self.params_offload != DEVICE:
            return 0.0
        return max(0.0, root * (sb.gather + sb.gather + self.reduce_bytes(sb)) - root * sb.grads / n.shard)

    def regathered(self, n: Sizes) -> float:
        return n.params if n.blocks is None else min(n.params, n.blocks)


def moe_features(shape: Any) -> dict[str, float]:
    """A mixture-of-experts block's features per token (recipes/calibrate.py's MOE_FEATURES, the
    planner's activations; ``shape``: a ``recipes.config.ModelConfig``): every top-k assignment
    counted (none dropped: an upper bound)."""
    t, e = shape.seq_len, shape.n_experts
    slots = e * math.ceil(shape.capacity_factor * t * shape.top_k / e) / t
    return {"experts": e, "k": shape.top_k, "k_dim": shape.top_k * shape.dim,
            "slots_dim": slots * shape.dim, "slots_ffn": slots * shape.expert_hidden,
            "shared_ffn": shape.n_shared_experts * shape.expert_hidden, "experts/seq": e / t}


__all__ = ["CPU", "DEVICE", "FSDPFootprint", "Footprint", "HOST_STATES", "MiB", "NVME", "REPLICATED", "SHARDED",
           "STEP_ONLY", "Sizes", "StateBytes", "States", "Traffic", "cpu_peak", "moe_features"]


def cpu_peak(total: int, step: int, host: int, items: dict) -> int:
    """On CPU, where the device is the host: a rank's peak above its process base, the busier of
    its two phases -- forward/backward (``memory.total``, the activations live) beside every host
    item but those the optimizer's step alone makes (``STEP_ONLY``), and the end of backward and
    the step (``memory.step``, the activations gone) beside every host item. Equal to
    ``total + host`` where nothing is step-only. The one place: the node's host check
    (planner/host.py ``node_host_need``) and the run's ``peak`` row (observers/compare.py) read it."""
    only = sum(items.get(k, 0) for k in STEP_ONLY)
    return max(total + host - only, step + host)


def reduction_copies(fp: Any, n: Sizes) -> float:
    """DeepSpeed ZeRO-2/3 (``fp``: its footprint): the flat copies a bucket's reduction makes
    beside the bucket at backward's end (measured, DeepSpeed 0.19.8, RSS high-water marks around
    each call on CPU). ZeRO-2, with dp > 1: stage_1_and_2.py ``allreduce_bucket``'s
    ``self.flatten(bucket)`` (the bucket's slices, one run per destination rank, concatenated: a
    copy once the bucket spans two ranks' partitions; on one rank a view). ZeRO-3, on any number
    of ranks: coalesced_collectives.py ``reduce_scatter_coalesced``'s ``torch.cat`` of the
    bucket's gradients, and on a host (gloo) torch's ``reduce_scatter_tensor`` one more copy of
    its input (NCCL makes none). Each is one bucket's gradients: ``reduce_bucket_size`` elements
    at most, and at most what is reduced. docs/PLANNER.md, "Host memory of offload". Where all
    that is reduced fits one bucket, its only flush is backward's last (``final_flush``): the
    copies come after every activation is freed (ZeroConfig.final_extra), else beside them."""
    if not fp.reduce_bucket or (fp.stage < 3 and n.dp <= 1):
        return 0.0
    reduced = n.trainable if fp.stage < 3 else n.params
    copies = 1 + (fp.stage >= 3 and n.resident)
    return copies * min(fp._reduce_bucket(n), reduced) * n.bytes.grads


def final_flush(fp: Any, n: Sizes) -> bool:
    """DeepSpeed ZeRO-2/3: whether everything a backward reduces fits one reduce bucket, so that
    the bucket is flushed once, at backward's end (stage_1_and_2.py / stage3.py's epilogue),
    when no activation is alive any more."""
    reduced = n.trainable if fp.stage < 3 else n.params
    return bool(fp.reduce_bucket) and reduced <= fp._reduce_bucket(n)
