"""DDP: every rank holds a full replica; gradients are all-reduced in buckets during backward.

Gradient compression uses torch's DDP communication hooks (fp16/bf16 compression, PowerSGD,
8-bit quantization) and one of ours (top-k sparsification: torch has none), which each backend
registers its way. Relaxed synchronization (``sync``: local SGD, DiLoCo) lets each rank step on
its own gradients and averages the parameters every ``sync_every`` steps (torch's post-local-SGD
hook and model averagers; DiLoCo adds an outer Nesterov step on the averaged delta).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from strategies.base import StrategyConfig, family
from core.knobs import knob
from strategies.footprint import Footprint, MiB, Sizes, Traffic
from core.run import Run

HOOKS = ("none", "fp16", "bf16", "powersgd", "topk", "int8")
SYNCS = ("every_step", "local_sgd", "diloco")


@family("ddp")
@dataclass
class DDPConfig(StrategyConfig):
    """torch DistributedDataParallel."""

    comm_hook: str = knob("none", choices=HOOKS)
    """Gradient compression: none | fp16 | bf16 | powersgd | topk | int8 (DDP communication
    hooks)."""
    powersgd_rank: int = knob(1, min=1)
    """PowerSGD matrix approximation rank (higher: more accurate, more traffic)."""
    powersgd_warmup_steps: int = knob(10, min=2, fix="torch's PowerSGD with error feedback needs "
                                      ">= 2: set strategy.powersgd_warmup_steps=2 or more")
    """Optimizer steps of plain all-reduce before PowerSGD starts (torch's start_powerSGD_iter)."""
    topk_ratio: float = knob(0.01, above=0, max=1)
    """comm_hook=topk: the fraction of each bucket's entries sent (largest magnitudes), with error
    feedback (what is not sent is kept and added to the next step's gradient)."""
    start_step: int = knob(10, min=0)
    """Optimizer steps of plain all-reduce (synchronous DDP) before comm_hook=topk|int8 or
    sync=local_sgd|diloco start."""
    sync: str = knob("every_step", choices=SYNCS)
    """every_step (DDP) | local_sgd (average parameters every sync_every steps) | diloco (an outer
    Nesterov step on the averaged parameter delta every sync_every steps)."""
    sync_every: int = knob(8, min=1)
    """sync=local_sgd|diloco: local optimizer steps between parameter synchronizations (H)."""
    outer_lr: float = knob(0.7, above=0)
    """sync=diloco: the outer optimizer's learning rate (1 with no momentum: local SGD)."""
    outer_momentum: float = knob(0.9, min=0, below=1)
    """sync=diloco: the outer optimizer's (Nesterov) momentum."""
    bucket_cap_mb: int = knob(25, min=1)
    """Gradient bucket size in MiB: one all-reduce per full bucket, overlapped with backward."""
    static_graph: bool = False
    """Tell DDP the graph is the same every step (enables more overlap, checked by torch)."""
    find_unused_parameters: bool = False
    """Search the graph for parameters without gradients each step (slow; only if needed)."""
    gradient_as_bucket_view: bool = True
    """Gradients are views into DDP's communication buckets (false: DDP keeps a second copy of
    every gradient in its buckets)."""

    def problems(self, run: Run) -> list[str]:
        if self.comm_hook == "bf16" and run.accelerator == "cpu":
            return ["strategy.comm_hook=bf16 needs NCCL: gloo (CPU) cannot all-reduce bf16; "
                    "use strategy=ddp_fp16_compress on CPU, or cluster.accelerator=gpu"]
        if self.sync != "every_step" and self.comm_hook != "none":
            return [(f"strategy.sync={self.sync} sends no gradients after strategy.start_step (each "
                     f"rank steps on its own), so strategy.comm_hook={self.comm_hook} has nothing to "
                     "compress: set strategy.comm_hook=none")]
        return []

    def unsaved_state(self) -> str | None:
        """What this preset keeps that a checkpoint of the model and optimizer does not hold."""
        return {"topk": "top-k's error-feedback residuals", "int8": "int8's error-feedback residuals",
                "powersgd": "PowerSGD's error feedback and warm-started P/Q factors"
                }.get(self.comm_hook) or {"local_sgd": "local SGD's per-rank replicas between "
                                          "synchronizations", "diloco": "DiLoCo's outer parameters "
                                          "and momentum"}.get(self.sync)

    def rank_state(self) -> dict[str, Any]:
        """The keys that make what each rank keeps (``unsaved_state``), with their values: the comm
        hook, the sync mode, and PowerSGD's rank and buckets (its factors' shapes, its error
        feedback by bucket); a checkpoint holds this preset's per-rank state only when its run had
        the same (checkpoints.refusal), whatever the presets are named. The other keys (top-k's
        ratio, start_step, sync_every, DiLoCo's outer lr and momentum) leave the state's layout as
        it is -- residuals by parameter, replicas, an outer momentum of the parameters' shape --
        and are a run's choice on resume, as the learning rate is."""
        keys = ("powersgd_rank", "bucket_cap_mb") if self.comm_hook == "powersgd" else ()
        return {k: getattr(self, k) for k in ("comm_hook", "sync", *keys)}

    def resume_problem(self, option: str | None = None) -> str | None:
        """Why a checkpoint not of this preset cannot be continued exactly (None: any can). Model
        and optimizer are rank 0's; PowerSGD's error feedback and warm-started factors, top-k's
        and int8's per-rank residuals, local SGD's diverged replicas and DiLoCo's outer
        parameters and momentum are each rank's own, which only this preset's checkpoints on as
        many ranks hold (backends/common/ddp_comm.py ``RankState``; checkpoints.refusal).
        ``option``: the strategy option chosen, where it is not the preset's name (a user's file)."""
        if (extra := self.unsaved_state()) is None:
            return None
        name = option or self.name
        return (f"strategy={name} keeps state of its own on each rank ({extra}), which only "
                "its own checkpoints on as many ranks hold, so it cannot resume this one exactly; "
                f"resume from a strategy={name} checkpoint with the same cluster.devices x "
                "cluster.nodes, start the run again without trainer.resume_from, or resume with "
                "strategy=ddp")

    def traffic_warmup(self) -> tuple[int, str]:
        """PowerSGD's warm-up, or the plain all-reduce steps before top-k, int8, local SGD or
        DiLoCo start (the plan is the traffic after them)."""
        if self.comm_hook == "powersgd":
            return self.powersgd_warmup_steps, "strategy.powersgd_warmup_steps"
        if self.comm_hook in ("topk", "int8") or self.sync != "every_step":
            return self.start_step, "strategy.start_step"
        return 0, ""

    def traffic_period(self) -> tuple[int, str]:
        """Local SGD's parameter average and DiLoCo's outer step: once every ``sync_every`` steps."""
        if self.sync != "every_step":
            return self.sync_every, "strategy.sync_every"
        return 1, ""

    def footprint(self) -> DDPFootprint:
        powersgd = self.comm_hook == "powersgd"
        return DDPFootprint(topk_ratio=self.topk_ratio if self.comm_hook == "topk" else 0.0,
                            int8=self.comm_hook == "int8",
                            sync_every=self.sync_every if self.sync != "every_step" else 0,
                            diloco=self.sync == "diloco", start_step=self.start_step,
                            bucket_bytes=self.bucket_cap_mb * MiB,
                            grad_ratio={"fp16": 0.5, "bf16": 0.5}.get(self.comm_hook, 1.0),
                            bucket_copy=not self.gradient_as_bucket_view,
                            powersgd_rank=self.powersgd_rank if powersgd else 0,
                            powersgd_warmup=self.powersgd_warmup_steps if powersgd else 0)


@dataclass(frozen=True)
class DDPFootprint(Footprint):
    """Replicated states; buckets (or, without gradient_as_bucket_view, a second copy of every
    gradient); compressed payloads; PowerSGD's fp32 error-feedback residual."""

    grad_ratio: float = 1.0
    """Communicated gradient bytes relative to the gradient dtype (fp16 hook on fp32: 0.5)."""
    bucket_copy: bool = False
    powersgd_rank: int = 0
    """The rank of the factors sent instead of each gradient matrix (0: no PowerSGD)."""
    powersgd_warmup: int = 0
    topk_ratio: float = 0.0
    """comm_hook=topk: the fraction of each bucket sent as (fp32 value, int32 index) pairs,
    all-gathered (0: not top-k)."""
    int8: bool = False
    """comm_hook=int8: each bucket all-gathered as uint8 codes + its fp32 scale and zero point."""
    sync_every: int = 0
    """sync=local_sgd|diloco: a parameter all-reduce every this many steps (0: every step DDP)."""
    diloco: bool = False
    start_step: int = 0
    broadcast_buffers: bool = True
    """DDP's broadcast_buffers (torch's default, Lightning's and Accelerate's): the module's
    buffers go from rank 0 before the first forward after a synchronized one, once per step."""

    def traffic(self, n: Sizes) -> list[Traffic]:
        """The gradient (or parameter) traffic, plus DDP's buffer broadcast: every buffer of the
        model (``ModelDescription.buffer_bytes``: the built-in GPT's rope table) from rank 0 over
        the data-parallel group, once per step, exposed before the forward (torch's
        ``_check_sync_bufs_pre_fwd``); the observer counts a broadcast's bytes on every rank, as
        the plan does."""
        buffers = getattr(n.model, "buffer_bytes", None)
        nbytes = buffers() if self.broadcast_buffers and buffers is not None and n.dp > 1 else 0
        return self.sync_traffic(n) + ([Traffic("buffer_broadcast", "broadcast", n.dp, n.tp, nbytes,
                                                "none")] if nbytes else [])

    def sync_traffic(self, n: Sizes) -> list[Traffic]:
        """After ``start_step``: top-k's all-gather of k (value, index) pairs per bucket, 8 bytes
        each (the per-rank ring volume (N-1) x k x 8); int8's all-gather of one byte per element
        plus each bucket's scale and zero point (N/8 of an fp32 all-reduce: a quarter at 2
        ranks); local SGD and DiLoCo: one fp32 all-reduce of the trainable parameters (LoRA: the
        adapters) every H steps, nothing in between."""
        if not (self.topk_ratio or self.int8 or self.sync_every) or n.dp <= 1:
            return super().traffic(n)
        buckets = max(1, math.ceil(n.trainable * 4 / self.bucket_bytes))
        if self.sync_every:
            return [Traffic("param_average_all_reduce", "all_reduce", n.dp, n.tp, n.trainable * 4 / self.sync_every,
                            "none", calls=1 / self.sync_every)]
        if self.topk_ratio:
            k = topk_count(n.trainable, self.topk_ratio, self.bucket_bytes)
            return [Traffic("grad_topk_all_gather", "all_gather", n.dp, n.tp, n.dp * k * 8, "backward",
                            calls=buckets)]
        return [Traffic("grad_int8_all_gather", "all_gather", n.dp, n.tp, n.dp * (n.trainable + 8 * buckets),
                        "backward", calls=buckets)]

    def grad_bytes(self, n: Sizes) -> float:
        reduce, r = self.reduce_bytes(n.bytes), self.grad_ratio
        grad = n.trainable * (max(reduce * r, min(reduce, 2)) if r < 1 else reduce)
        if self.powersgd_rank:  # after its warm-up steps; until then plain all-reduce
            grad *= powersgd_ratio(n.model, n.total_params, self.powersgd_rank)
        return grad

    def grads_released(self, n: Sizes) -> bool:
        # with gradient_as_bucket_view the gradients are views of DDP's buckets, which stay
        return self.bucket_copy or n.dp <= 1

    def bucket_buffer(self, n: Sizes) -> float:
        bucket = n.params * n.bytes.grads if self.bucket_copy and n.dp > 1 else super().bucket_buffer(n)
        if (self.powersgd_rank or self.topk_ratio or self.int8) and n.dp > 1:
            bucket += n.trainable * 4  # the fp32 error-feedback residual (PowerSGD, top-k, int8)
        if self.diloco and n.dp > 1:
            bucket += n.trainable * 4 * 2  # DiLoCo's outer copy and Nesterov momentum of what trains (fp32)
        return bucket

    def notes(self, n: Sizes) -> list[str]:
        if self.powersgd_rank and n.dp > 1:
            return [f"PowerSGD rank {self.powersgd_rank}: gradient traffic after its "
                    f"{self.powersgd_warmup} warm-up steps (plain all-reduce until then)"]
        if (self.topk_ratio or self.int8 or self.sync_every) and n.dp > 1:
            what = (f"top-k {self.topk_ratio:g}" if self.topk_ratio else "int8" if self.int8
                    else f"{'DiLoCo' if self.diloco else 'local SGD'} every {self.sync_every} steps")
            return [f"{what}: traffic after its {self.start_step} plain all-reduce steps"]
        return []


def topk_count(elements: float, ratio: float, bucket_bytes: float) -> float:
    """Entries top-k sends per step: ``max(1, int(ratio x bucket))`` per fp32 bucket."""
    full, last = divmod(int(elements), max(1, int(bucket_bytes // 4)))
    per = max(1, int(ratio * (bucket_bytes // 4)))
    return full * per + (max(1, int(ratio * last)) if last else 0)


def powersgd_ratio(shape: Any, params: float, rank: int) -> float:
    """Gradient elements PowerSGD sends per step, as a fraction of the parameters (Vogels et al.
    2019; torch's powerSGD_hook): each n x m gradient matrix goes as rank-r factors P (n x r)
    and Q (m x r), unless that saves less than 2x (``min_compression_rate``); vectors (norms)
    go whole. Under LoRA the adapters' A (r x in) and B (out x r), of which they are the
    fraction. Without a shape, square h x h matrices with h ~ 128 x layers."""
    if shape is None:
        layers = max(1.0, (params / (12 * 128**2)) ** (1 / 3))
        h = 128 * layers
        return min(1.0, 2 * rank * h / (h * h)) if h * h >= 2 * 2 * rank * h else 1.0
    adapters = shape.lora_matrices() if hasattr(shape, "lora_matrices") else []
    if adapters:  # LoRA: only the adapters' gradients exist, thin matrices
        matrices, total = adapters, sum(n * m for n, m in adapters)
    else:
        d, f = shape.dim, shape.hidden
        kv = shape.n_kv_heads * (d // shape.n_heads)
        block = [(d, d), (kv, d), (kv, d), (d, d), (f, d), (f, d), (d, f)]
        tied = getattr(shape, "tie_embeddings", False)
        matrices = block * shape.n_layers + [(shape.vocab_size, d)] * (1 if tied else 2)
        total = shape.num_params()
    whole = total - sum(n * m for n, m in matrices)

    def sent(n: int, m: int) -> int:
        factors = rank * (n + m)
        return factors if n * m > 2 * factors else n * m  # torch: compressed x 2 < whole

    return (whole + sum(sent(n, m) for n, m in matrices)) / total
