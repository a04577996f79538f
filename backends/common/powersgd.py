"""torch's PowerSGD hook (``powerSGD_hook``, Vogels et al. 2019) with a random start that depends
on the parameters, not on DDP's buckets: what ``strategy.comm_hook=powersgd`` registers on both
backends (backends/common/ddp_comm.py's ``comm_hook``).

torch's hook keys its error feedback and its P and Q factors by bucket index, and at a bucket's
first compressed step draws every Q of the bucket from one seed (``state.rng``), in the order of
the bucket's tensors. DDP rebuilds its buckets after the first step in the order gradients became
ready, and compiled blocks (``trainer.compile=true``) hand DDP their gradients in another order
than eager ones: the same tensors got other random Qs, and the compiled run was another run
(issue #40: losses 3.9e-3, parameters 0.10 apart from the first compressed step on gpt_nano).

Everything else in torch's hook is per tensor (each matrix's P = M Q, the all-reduces sum
elementwise, the error feedback is elementwise), so only the start needed fixing: before torch's
hook first compresses a bucket, this fills the bucket's P and Q memory (torch's
``p_memory_dict``/``q_memory_dict``, laid out as its hook lays them out) with each Q drawn from
its parameter's own seed; torch's warm start then takes them (it orthogonalizes each Q, as it
does after its own draw) and runs its math unchanged. A parameter's seed is the state's seed plus
its place in DDP's first, initial buckets (built from the model's parameter order, the same on
every rank and in eager and compiled runs), which the hook records during its warm-up steps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps


class PowerSGDState(ps.PowerSGDState):
    """torch's state, plus each parameter's place in DDP's initial buckets (``keys``) and the
    seed the Qs are drawn from (``seed + key``; from ``random_seed``, the same on every rank)."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        if not self.warm_start:
            raise ValueError("per-parameter Q starts need torch's warm start (warm_start=True)")
        self.keys: dict[int, int] = {}
        self.seed = int(self.rng.randint(1_000_000_000))


def powersgd_hook(state, bucket):  # no annotations: torch checks them against dist.GradBucket
    """torch's ``powerSGD_hook`` on ``bucket``, its Qs started per parameter (module docstring)."""
    if state.iter < state.start_powerSGD_iter:
        for p in bucket.parameters():  # the first step's buckets number every parameter
            state.keys.setdefault(id(p), len(state.keys))
    elif bucket.index() not in state.q_memory_dict:
        start_factors(state, bucket)
    return ps.powerSGD_hook(state, bucket)


def start_factors(state: PowerSGDState, bucket: Any) -> None:
    """P memory (uninitialized) and Q memory (each parameter's Q from its own seed) of
    ``bucket``, in torch's layout: the compressed matrices (its ``_should_compress``) grouped by
    shape in order of first appearance, each group in bucket order, each Q ``m x rank``."""
    buf = bucket.buffer()
    groups: dict[tuple[int, int], list[tuple[Any, int]]] = {}
    for p, grad in zip(bucket.parameters(), bucket.gradients()):
        n, m = grad.shape[0], grad.numel() // max(grad.shape[0], 1)
        rank = min(n, m, state.matrix_approximation_rank)
        if ps._should_compress(n, m, rank, state.min_compression_rate)[0]:
            groups.setdefault((n, m), []).append((p, rank))
    qs, p_size = [], 0
    for (n, m), members in groups.items():
        for p, rank in members:
            if id(p) not in state.keys:
                raise RuntimeError("PowerSGD: a bucket holds a parameter its warm-up steps never "
                                   "saw, so its random start has no place to come from")
            gen = torch.Generator().manual_seed(state.seed + state.keys[id(p)])
            qs.append(torch.randn(m * rank, generator=gen, dtype=buf.dtype))
            p_size += n * rank
    index = bucket.index()
    state.p_memory_dict[index] = torch.empty(p_size, device=buf.device, dtype=buf.dtype)
    state.q_memory_dict[index] = (torch.cat(qs) if qs else buf.new_empty(0).cpu()).to(buf.device)


def powersgd(rank: int, warmup_steps: int) -> tuple[Any, PowerSGDState]:
    """The hook and its state for ``strategy.powersgd_rank`` and ``powersgd_warmup_steps``."""
    from backends.common.ddp_comm import one_bucket_at_a_time

    state = PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                          start_powerSGD_iter=warmup_steps)
    return one_bucket_at_a_time(powersgd_hook), state
