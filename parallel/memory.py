"""Count the bytes a rank really holds, from live tensors: local shards of DTensors, FSDP1 flat
parameters, plain parameters, gradients and optimizer state. Shared storage is counted once."""

from __future__ import annotations

import threading
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


# Autograd nodes of ops that only view or cast their one input: a tensor reached from a
# parameter through these is that parameter.
_PASS_THROUGH = {"TBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0",
                 "ExpandBackward0", "AliasBackward0", "UnsafeViewBackward0", "AsStridedBackward0",
                 "ReshapeAliasBackward0", "ToCopyBackward0", "SliceBackward0", "SelectBackward0"}


class _Saved:
    """What autograd keeps instead of a counted tensor: the tensor, and a release of its count
    when autograd lets go of it (after the backward that used it)."""

    __slots__ = ("key", "owner", "tensor")

    def __init__(self, tensor: torch.Tensor, key: int, owner: SavedTensors):
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self) -> None:
        self.owner._release(self.key)


class SavedTensors:
    """Bytes autograd saves for backward while active, at their peak: every distinct storage
    saved and not yet released by the backward that uses it, except parameters (and views and
    copies of them: autocast's low-precision weights are weight-shaped, not activations -- the
    planner counts them apart) and the module buffers given (a RoPE table). Over one forward
    that is everything it saved; over a pipeline schedule, the most its micro-batches held at
    once. What the memory observer reports as activations, and what the planner's activation
    model is calibrated on (recipes/calibrate.py)."""

    def __init__(self, buffers: Iterable[torch.Tensor] = ()):
        self.skip = {local(b).untyped_storage().data_ptr() for b in buffers}
        self.storages: dict[int, int] = {}
        """Live storages (key -> bytes)."""
        self.live = self.peak = 0
        self._refs: dict[int, int] = {}
        self._lock = threading.Lock()
        self._hooks: Any = None
        self.unknown = False
        """Some saved tensors could not be counted (``uncounted``): ``bytes`` is None."""

    @staticmethod
    def _is_parameter(t: torch.Tensor) -> bool:
        """A parameter, or a view or cast of one (a transposed weight, DTensor's views of a
        sharded weight, autocast's low-precision copy): reached from an ``nn.Parameter`` through
        view and copy steps alone. A leaf that is no parameter (a pipeline stage's received
        input, the token ids) is an activation."""
        base = t._base if t._base is not None else t
        if base.is_leaf:
            return isinstance(base, torch.nn.Parameter)
        fn = base.grad_fn
        while fn is not None and type(fn).__name__ in _PASS_THROUGH:
            inputs = [n for n, _ in fn.next_functions if n is not None]
            if len(inputs) != 1:
                return False
            fn = inputs[0]
        return (type(fn).__name__ == "AccumulateGrad"
                and isinstance(getattr(fn, "variable", None), torch.nn.Parameter))

    def _pack(self, t: torch.Tensor) -> Any:
        if t.device.type == "meta" or self._is_parameter(t):  # (meta tensors hold no memory)
            return t
        try:
            storage = local(t).untyped_storage()
            key, nbytes = storage.data_ptr() or id(storage), storage.nbytes()
        except RuntimeError:  # a wrapper without real storage (a functional collective's
            key, nbytes = id(t), t.numel() * t.element_size()  # pending result): its size
        if key in self.skip:
            return t
        with self._lock:
            refs = self._refs.get(key, 0)
            self._refs[key] = refs + 1
            if refs == 0:
                self.storages[key] = nbytes
                self.live += nbytes
                self.peak = max(self.peak, self.live)
        return _Saved(t, key, self)

    def _release(self, key: int) -> None:
        with self._lock:
            refs = self._refs.get(key, 0) - 1
            if refs > 0:
                self._refs[key] = refs
            elif refs == 0:
                del self._refs[key]
                self.live -= self.storages.pop(key)

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def __enter__(self) -> SavedTensors:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    @property
    def bytes(self) -> int | None:
        """The peak of the live saved bytes while active; None where some could not be counted."""
        return None if self.unknown else self.peak


_ACTIVE: list[SavedTensors] = []


def counting() -> bool:
    """A ``SavedTensors`` is counting now."""
    return bool(_ACTIVE)


def count_saved(tensors: Iterable[torch.Tensor]) -> list[Any]:
    """Count ``tensors`` as saved for backward by the active ``SavedTensors`` (none: nothing),
    though no autograd hook saw them -- what selective checkpointing keeps in its own cache
    (parallel/checkpointing.py). Returns the handles: the count lasts while they live."""
    if not _ACTIVE:
        return []
    return [_ACTIVE[-1]._pack(t) for t in tensors if isinstance(t, torch.Tensor)]


def uncounted() -> None:
    """Some tensors saved for backward cannot be counted (selective checkpointing's cache on a
    torch whose layout we cannot read): the active ``SavedTensors`` reports None, not too few."""
    if _ACTIVE:
        _ACTIVE[-1].unknown = True
