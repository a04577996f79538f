"""What a checkpointed block keeps: the checkpoint wrapper for ``strategy.activation_checkpointing``
-- true: the whole block recomputed in backward (only its input kept); ``selective``: per op
(torchtitan's "op" option, ``torch.utils.checkpoint.create_selective_checkpoint_contexts``).

The selective policy keeps the outputs of the expensive ops -- every matmul (``mm``, ``addmm``,
``bmm``: the projections, the MLP, the experts), attention (each SDPA kernel), the collectives
whose recomputation would send again (the functional reduce-scatter, all-reduce, all-to-all) and
FP8's amax and scaled matmul -- and recomputes the rest: norms, rotary embeddings, activations,
residual adds, dtype casts, and sequence parallelism's all-gathers of the norm outputs (sent
again: the planner prices them, planner/communication.py ``tp_traffic``). torchtitan keeps every other ``mm`` (half the matmul outputs, one
matmul in two recomputed); we keep them all, so backward re-runs no matmul FLOPs at all and the
planner's term is exact per op (planner/activations.py ``selective_block_bytes``). The RNG state
is preserved (torch's default), so dropout recomputes the same masks: the run equals the
uncheckpointed one. torch only, imported where used.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

log = logging.getLogger(__name__)

SELECTIVE = "selective"

# aten / functional-collective op names kept by the selective policy (those this torch has)
_SAVE = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default",
         "aten._scaled_dot_product_flash_attention.default",
         "aten._scaled_dot_product_efficient_attention.default",
         "aten._scaled_dot_product_cudnn_attention.default",
         "aten._scaled_dot_product_flash_attention_for_cpu.default",
         "aten._flash_attention_forward.default", "aten._efficient_attention_forward.default",
         "aten._scaled_mm.default", "aten.max.default",
         "_c10d_functional.reduce_scatter_tensor.default", "_c10d_functional.all_reduce.default",
         "_c10d_functional.all_to_all_single.default")


@functools.cache
def save_list() -> frozenset:
    """The ops whose outputs a selectively checkpointed block keeps (those this torch defines)."""
    import torch

    out = set()
    for name in _SAVE:
        ns, op, overload = name.split(".")
        try:
            out.add(getattr(getattr(getattr(torch.ops, ns), op), overload))
        except (AttributeError, RuntimeError):
            continue  # not in this build (an attention kernel, a collective)
    return frozenset(out)


def _policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if func in save_list() else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> Any:
    """A fresh pair of forward / recompute contexts for one checkpointed call. While the memory
    observer counts saved tensors (``parallel.memory.SavedTensors``), the pair is wrapped so that
    the outputs the policy kept count too: they sit in the policy's cache, which no autograd
    hook sees (not under torch.compile, where the pair must stay torch's dispatch modes)."""
    import torch
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from parallel.memory import counting

    pair = create_selective_checkpoint_contexts(_policy)
    if not counting() or torch.compiler.is_compiling():
        return pair
    held: list[Any] = []
    return _Counted(pair[0], held, count=True), _Counted(pair[1], held, count=False)


class _Counted:
    """One of SAC's contexts; the forward one counts what the policy cached when it exits, the
    recompute one (kept by the checkpoint until its backward) keeps those counts alive."""

    def __init__(self, ctx: Any, held: list[Any], *, count: bool):
        self.ctx, self.held, self.count = ctx, held, count

    def __enter__(self) -> Any:
        return self.ctx.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        out = self.ctx.__exit__(*exc)
        if self.count:
            from parallel.memory import count_saved, uncounted

            kept = sac_kept(self.ctx)
            if kept is None:
                _unreadable()
                uncounted()
            else:
                self.held.extend(count_saved(kept))
        return out


_UNKNOWN = object()


def sac_kept(ctx: Any) -> list[Any] | None:
    """The tensors SAC's forward context (torch's private ``_CachingTorchDispatchMode``) cached for
    backward, read from its ``storage`` in either layout torch has had -- 2.11: ``storage[func]``,
    a list of each call's outputs; 2.13: ``storage[key][idx]``, a dict of each call's outputs or
    the ``_RECOMPUTE`` sentinel -- each output a (tuple of) ``_VersionWrapper`` (``.val``). None
    where ``storage`` is missing or laid out otherwise: the count is unknown, not 0."""
    import torch.utils.checkpoint as checkpoint

    storage = getattr(ctx, "storage", _UNKNOWN)
    if not isinstance(storage, dict):
        return None
    sentinels = [getattr(checkpoint, "_RECOMPUTE", _UNKNOWN)]
    out: list[Any] = []
    for calls in storage.values():
        if not isinstance(calls, (list, dict)):
            return None
        for output in (calls.values() if isinstance(calls, dict) else calls):
            if any(output is s for s in sentinels):
                continue
            tensors = _cached(output)
            if tensors is None:
                return None
            out += tensors
    return out


def _cached(x: Any) -> list[Any] | None:
    """The tensors in one cached output (a tensor, a wrapper holding ``.val``, or a tuple or list
    of them); None for anything else."""
    import torch

    if isinstance(x, torch.Tensor):
        return [x]
    if hasattr(x, "val"):
        return [x.val] if isinstance(x.val, torch.Tensor) else []
    if isinstance(x, (list, tuple)):
        parts = [_cached(v) for v in x]
        return None if any(p is None for p in parts) else [t for p in parts for t in p]
    return None


def _unreadable() -> None:
    from core.internals import torch_version, warn_once

    warn_once(log, "sac-storage", f"activation_checkpointing=selective: torch {torch_version()}'s selective "
              "checkpoint context (torch.utils.checkpoint._CachingTorchDispatchMode.storage) is missing or "
              "laid out unlike torch 2.11's and 2.13's, so the memory observer cannot count the outputs the "
              "policy keeps: report.json's memory activations are unknown (null) on this torch; training "
              "is unaffected")


def wrapper(mode: bool | str) -> Any:
    """The ``checkpoint_wrapper_fn`` for ``apply_activation_checkpointing``: torch's non-reentrant
    checkpoint wrapper, with the selective policy's contexts under ``selective``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if mode == SELECTIVE:
        return functools.partial(checkpoint_wrapper, context_fn=selective_context)
    if mode is True:
        return checkpoint_wrapper
    raise ValueError(f"strategy.activation_checkpointing={mode!r}: allowed false, true, selective")


__all__ = ["SELECTIVE", "save_list", "selective_context", "wrapper"]
