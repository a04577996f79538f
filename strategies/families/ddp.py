"""DDP: every rank holds a full replica; gradients are all-reduced in buckets during backward.

Gradient compression uses torch's DDP communication hooks (fp16/bf16 compression, PowerSGD),
which each backend registers its way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strategies.base import StrategyConfig, family
from strategies.checks import knob
from strategies.footprint import Footprint, MiB, Sizes
from strategies.run import Run

HOOKS = ("none", "fp16", "bf16", "powersgd")


@family("ddp")
@dataclass
class DDPConfig(StrategyConfig):
    """torch DistributedDataParallel."""

    comm_hook: str = knob("none", choices=HOOKS)
    """Gradient compression: none | fp16 | bf16 | powersgd (torch DDP communication hooks)."""
    powersgd_rank: int = knob(1, min=1)
    """PowerSGD matrix approximation rank (higher: more accurate, more traffic)."""
    powersgd_warmup_steps: int = knob(10, min=2, fix="torch's PowerSGD with error feedback needs "
                                      ">= 2: set strategy.powersgd_warmup_steps=2 or more")
    """Optimizer steps of plain all-reduce before PowerSGD starts (torch's start_powerSGD_iter)."""
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
        return []

    def footprint(self) -> DDPFootprint:
        powersgd = self.comm_hook == "powersgd"
        return DDPFootprint(bucket_bytes=self.bucket_cap_mb * MiB,
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

    def grad_bytes(self, n: Sizes) -> float:
        reduce, r = self.reduce_bytes(n.bytes), self.grad_ratio
        grad = n.trainable * (max(reduce * r, min(reduce, 2)) if r < 1 else reduce)
        if self.powersgd_rank:  # after its warm-up steps; until then plain all-reduce
            grad *= powersgd_ratio(n.model, n.total_params, self.powersgd_rank)
        return grad

    def bucket_buffer(self, n: Sizes) -> float:
        bucket = n.params * n.bytes.grads if self.bucket_copy and n.dp > 1 else super().bucket_buffer(n)
        if self.powersgd_rank and n.dp > 1:
            bucket += n.params * 4  # PowerSGD's fp32 error-feedback residual
        return bucket

    def notes(self, n: Sizes) -> list[str]:
        if self.powersgd_rank and n.dp > 1:
            return [f"PowerSGD rank {self.powersgd_rank}: gradient traffic after its "
                    f"{self.powersgd_warmup} warm-up steps (plain all-reduce until then)"]
        return []


def powersgd_ratio(shape: Any, params: float, rank: int) -> float:
    """Gradient elements PowerSGD sends per step, as a fraction of the parameters (Vogels et al.
    2019; torch's powerSGD_hook): each n x m gradient matrix goes as rank-r factors P (n x r)
    and Q (m x r), unless that saves less than 2x (``min_compression_rate``); vectors (norms)
    go whole. Without a shape, square h x h matrices with h ~ 128 x layers."""
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
