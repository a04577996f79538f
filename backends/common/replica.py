"""Which model a validation scores under the relaxed ddp presets (``local_sgd``, ``diloco``).

Between two averagings every rank trains a replica of its own, and validation runs on every
rank, sample i on data-parallel rank i mod dp: each rank scoring its own replica would add up a
loss that belongs to no model (rank 0's on the even samples, rank 1's on the odd ones), and
``trainer.keep_best`` and early stopping would judge by it. So every rank validates rank 0's
replica -- the model rank 0 resumes from, its ``rank_state/rank0.pt`` -- in place: each trainable
parameter is kept aside, rank 0's broadcast into it, and its own put back bit for bit afterwards,
so the training after a validation is the same as without one. Both backends wrap their
validation (and the observers' ``validation_end``, so ``callbacks.samples`` completes with the
same model) in ``rank0_replica``; it does nothing unless the preset's ``Synchronizer`` is active
(world > 1 and ``strategy.sync`` other than every_step). Costs one copy of the trainable
parameters on ranks other than 0 and one broadcast per parameter, per validation. A user's own
Accelerate loop gets it as ``accelerator.rank0_replica()`` (backends/accelerate/user_loop.py),
which asks ``replicas_apart`` whether an eval outside it scored replicas that differ.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def rank0_replica(sync: Any, model: Any) -> Iterator[None]:
    """Inside: every rank's ``model`` holds rank 0's trainable parameters; after (also on an
    error): each rank's own again. ``sync``: the preset's ``ddp_comm.Synchronizer``, or None."""
    if sync is None or not sync.active:
        yield
        return
    import torch
    import torch.distributed as dist

    params = [p for p in model.parameters() if p.requires_grad]
    own = [p.detach().clone() for p in params] if dist.get_rank() != 0 else None
    try:
        with torch.no_grad():
            for p in params:  # (in place: on rank 0 it sends, elsewhere it overwrites)
                dist.broadcast(p.data, src=0)
        yield
    finally:
        if own is not None:
            with torch.no_grad():
                for p, mine in zip(params, own):
                    p.copy_(mine)


def replicas_apart(sync: Any) -> bool:
    """Whether the ranks' replicas may differ now: an optimizer step past the warmup (where the
    gradients are still all-reduced) since the last averaging of the whole world, as the preset's
    averager counts (torch's periodic one: (step - warmup) % period; the hierarchical one: step %
    its largest period; DiLoCo's outer step)."""
    impl = getattr(sync, "_impl", None)
    if impl is None or not sync.active:
        return False
    if hasattr(impl, "outer"):  # (DiLoCo: counts the step before it decides)
        return impl.outer is not None and (impl.step - impl.start_step) % impl.sync_every != 0
    last = impl.step - 1  # (torch's averagers: the count the last step decided by)
    if last < impl.warmup_steps:
        return False
    if hasattr(impl, "period"):  # (PeriodicModelAverager)
        return (last - impl.warmup_steps) % impl.period != 0
    periods = getattr(impl, "_periods", None)  # (HierarchicalModelAverager's, a private name: a
    return not periods or last % max(periods) != 0  # torch without it gets "may differ", no error)
