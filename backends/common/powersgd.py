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

The same per-tensor view makes a checkpoint exact (``rank_state`` / ``load_rank_state``): each
parameter's error feedback and Q are saved by name, and a resumed run's buckets -- DDP's initial
ones for the first step, then the rebuilt ones -- take them back, whatever bucket they fall in.
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
        self.layout: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
        """Bucket index -> its parameters (id, shape), as the compressed steps saw them."""
        self.held: dict[str, dict[int, torch.Tensor]] = {"error": {}, "q": {}}
        """Per parameter (id): error feedback and Q not yet in a bucket (a resume, a rebuild)."""


def powersgd_hook(state, bucket):  # no annotations: torch checks them against dist.GradBucket
    """torch's ``powerSGD_hook`` on ``bucket``, its Qs started per parameter (module docstring)."""
    if state.iter < state.start_powerSGD_iter:
        for p in bucket.parameters():  # the first step's buckets number every parameter
            state.keys.setdefault(id(p), len(state.keys))
        return ps.powerSGD_hook(state, bucket)
    index, now = bucket.index(), [(id(p), tuple(p.shape)) for p in bucket.parameters()]
    if state.layout.get(index, now) != now:  # DDP rebuilt its buckets (the step after a resume)
        _hold(state)
    if index not in state.q_memory_dict:
        start_factors(state, bucket)
    state.layout[index] = now
    return ps.powerSGD_hook(state, bucket)


def _compressed(state: PowerSGDState, shapes: list[tuple[int, tuple[int, ...]]]) -> list[tuple[int, int, int, int]]:
    """(id, n, m, rank) of the matrices torch's hook compresses in a bucket of ``shapes``, in its
    Q layout: grouped by shape in order of first appearance, each group in bucket order."""
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for pid, shape in shapes:
        numel = int(torch.Size(shape).numel())
        n = shape[0] if shape else 1
        m = numel // max(n, 1)
        rank = min(n, m, state.matrix_approximation_rank)
        if ps._should_compress(n, m, rank, state.min_compression_rate)[0]:
            groups.setdefault((n, m), []).append((pid, rank))
    return [(pid, n, m, rank) for (n, m), members in groups.items() for pid, rank in members]


def _pieces(state: PowerSGDState) -> dict[str, dict[int, torch.Tensor]]:
    """Every parameter's error feedback and Q, cut out of the buckets they are in (and those held)."""
    out = {kind: dict(held) for kind, held in state.held.items()}
    for index, shapes in state.layout.items():
        if index in state.error_dict:
            offsets = torch.tensor([0] + [int(torch.Size(s).numel()) for _, s in shapes]).cumsum(0).tolist()
            for (pid, _), a, b in zip(shapes, offsets, offsets[1:]):
                out["error"][pid] = state.error_dict[index][a:b]
        q, at = state.q_memory_dict.get(index), 0
        for pid, _, m, rank in (_compressed(state, shapes) if q is not None else []):
            out["q"][pid], at = q[at:at + m * rank], at + m * rank
    return out


def _hold(state: PowerSGDState) -> None:
    """Take every bucket's state apart into per-parameter pieces, for the new buckets to take."""
    state.held = {kind: {pid: t.clone() for pid, t in pieces.items()} for kind, pieces in _pieces(state).items()}
    for d in (state.error_dict, state.p_memory_dict, state.q_memory_dict, state.layout):
        d.clear()


def start_factors(state: PowerSGDState, bucket: Any) -> None:
    """P memory (uninitialized) and Q memory (each parameter's Q held from before, or from its
    own seed) of ``bucket``, in torch's layout (``_compressed``), each Q ``m x rank``; the bucket's
    error feedback from its parameters' held pieces, if any."""
    buf, params = bucket.buffer(), bucket.parameters()
    qs, p_size = [], 0
    for pid, n, m, rank in _compressed(state, [(id(p), tuple(p.shape)) for p in params]):
        if (held := state.held["q"].pop(pid, None)) is not None:
            qs.append(held.to(buf.dtype).cpu())
        elif pid not in state.keys:
            raise RuntimeError("PowerSGD: a bucket holds a parameter its warm-up steps never "
                               "saw, so its random start has no place to come from")
        else:
            gen = torch.Generator().manual_seed(state.seed + state.keys[pid])
            qs.append(torch.randn(m * rank, generator=gen, dtype=buf.dtype))
        p_size += n * rank
    index = bucket.index()
    state.p_memory_dict[index] = torch.empty(p_size, device=buf.device, dtype=buf.dtype)
    state.q_memory_dict[index] = (torch.cat(qs) if qs else buf.new_empty(0).cpu()).to(buf.device)
    errors = [state.held["error"].pop(id(p), None) for p in params]
    if any(e is not None for e in errors):
        state.error_dict[index] = torch.cat([torch.zeros(p.numel(), dtype=buf.dtype) if e is None else e.cpu()
                                             for p, e in zip(params, errors)]).to(buf.device, buf.dtype)


def rank_state(state: PowerSGDState, names: dict[int, str]) -> dict[str, Any]:
    """This rank's PowerSGD state by parameter name (``names``: id -> name): its step, seed and
    each parameter's key, error feedback and Q."""
    pieces = _pieces(state)
    return {"iter": state.iter, "seed": state.seed, "keys": {names[i]: k for i, k in state.keys.items()},
            **{kind: {names[i]: t.detach().cpu().clone() for i, t in got.items()} for kind, got in pieces.items()}}


def load_rank_state(state: PowerSGDState, saved: dict[str, Any], ids: dict[str, int]) -> None:
    """``rank_state``'s dict back into ``state`` (``ids``: name -> id of this run's parameters):
    held per parameter until each bucket's first compressed step takes them."""
    state.iter, state.seed = saved["iter"], saved["seed"]
    state.keys = {ids[n]: k for n, k in saved["keys"].items()}
    for d in (state.error_dict, state.p_memory_dict, state.q_memory_dict, state.layout):
        d.clear()
    state.held = {kind: {ids[n]: t for n, t in saved[kind].items()} for kind in ("error", "q")}


def powersgd(rank: int, warmup_steps: int) -> tuple[Any, PowerSGDState]:
    """The hook and its state for ``strategy.powersgd_rank`` and ``powersgd_warmup_steps``."""
    from backends.common.ddp_comm import one_bucket_at_a_time

    state = PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                          start_powerSGD_iter=warmup_steps)
    return one_bucket_at_a_time(powersgd_hook), state
