"""Count the bytes a rank really holds, from live tensors: local shards of DTensors, FSDP1 flat
parameters, plain parameters, gradients and optimizer state. Shared storage is counted once."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` stored on this rank (a DTensor's local shard, else ``t``)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (each storage counted once, in full)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        t = local(t)
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def optimizer_tensors(optimizers: Iterable[Any]) -> Iterable[torch.Tensor]:
    for opt in optimizers:
        for state in getattr(opt, "state", {}).values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:  # step counters are scalars
                    yield v


def held_bytes(model: Any, optimizers: Iterable[Any], what: str) -> int:
    """Default count over the wrapped model's parameters and the engine's optimizers."""
    if what == "params":
        return tensor_bytes(p for p in model.parameters())
    if what == "grads":
        return tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)
    if what == "optimizer":
        return tensor_bytes(optimizer_tensors(optimizers))
    raise ValueError(f"held_bytes: what={what!r}; allowed params, grads, optimizer")


class SavedTensors:
    """Bytes autograd saves for backward while active: every distinct storage saved, except
    parameters (leaves that require grad, and views of them), copies of parameters (autocast's
    low-precision weights: weight-shaped, not activations -- the planner counts them apart) and
    the module buffers given (a RoPE table). What the memory observer reports as activations,
    and what the planner's activation model is calibrated on (recipes/calibrate.py)."""

    def __init__(self, buffers: Iterable[torch.Tensor] = ()):
        self.skip = {local(b).untyped_storage().data_ptr() for b in buffers}
        self.storages: dict[int, int] = {}
        self._hooks: Any = None

    @staticmethod
    def _is_parameter(t: torch.Tensor) -> bool:
        base = t._base if t._base is not None else t
        if base.is_leaf and base.requires_grad:
            return True
        fn = base.grad_fn  # a cast of a parameter (autocast's weight copy)
        return (type(fn).__name__ == "ToCopyBackward0"
                and any(type(n).__name__ == "AccumulateGrad" for n, _ in fn.next_functions if n))

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not self._is_parameter(t):
            try:
                storage = local(t).untyped_storage()
                key, nbytes = storage.data_ptr() or id(storage), storage.nbytes()
            except RuntimeError:  # a wrapper without real storage (a functional collective's
                key, nbytes = id(t), t.numel() * t.element_size()  # pending result): its size
            if key not in self.skip:
                self.storages[key] = nbytes
        return t

    def __enter__(self) -> SavedTensors:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())
