"""A user's code against ZeRO-3's partitioned parameters: the two uses DeepSpeed cannot serve,
each stopped with one error that names the use and the fix. DeepSpeed and torch are imported
only inside these functions.

Under ZeRO-3 a parameter is *partitioned*: each rank keeps its share in ``ds_tensor`` and the
parameter's own data is an empty tensor, gathered whole only while the forward (and backward)
of a module that owns it runs, or inside ``deepspeed.zero.GatheredParameters``.

1. A write while the model is built (``refuse_partitioned_writes``). Lightning runs a module's
   ``configure_model`` inside ``deepspeed.zero.Init``, which partitions each submodule's
   parameters as soon as its constructor returns; an initialisation written afterwards into an
   already-built child (``torch.nn.init.normal_(self.block[0].weight)``, nanoGPT's
   ``self.apply(self._init_weights)``, ``p.data.normal_()``, ``p.copy_(...)``) lands in the empty
   tensor and is lost: the run would silently start from the constructors' values, not the
   ones DDP starts from. A ``TorchFunctionMode``, active only while that build runs, sees every
   torch call; a call that writes (an in-place method, ``torch.nn.init.*``, ``__setitem__``,
   ``out=``, assigning ``.data``) into a partitioned parameter -- itself, or a tensor sharing its
   empty storage (``p.data``, ``p.detach()``, a view) -- raises ``PartitionedWriteError`` before
   the write. Reads pass; so do writes while the parameter is gathered (``GatheredParameters``)
   and DeepSpeed's own (the first frame outside torch is DeepSpeed's). The init functions that
   fail on an empty tensor before they write (``xavier_uniform_``'s "Fan in and fan out can not
   be computed ...") are told the same way, from the traceback. A parameter not yet reachable from
   the module is named from the stack (its name in the module whose constructor is running, else
   the call site); a write by transformers' own code (a Hugging Face model built in
   ``configure_model``) gets the fixes a user of it can apply.
2. A use outside any module's forward (``explain_use_outside_forward``): an L2 penalty on
   ``self.W`` in ``training_step`` computes on the empty tensor, and the backward fails inside
   autograd or DeepSpeed with "The size of tensor a (0) must match ..." or "returned an invalid
   gradient at index 0 - got [0] ...". Where a backend sees that exception (Lightning's
   ``on_exception``, the Accelerate hook's ``backward``) the message becomes one that says why
   and what to do. Measured (2 CPU ranks, tests/zero3_user_script.py; Accelerate: the same
   penalty after ``model(x)``): the use inside the module's forward, or on a copy taken inside
   ``deepspeed.zero.GatheredParameters([param])`` (``param.clone()``), trains as plain torch /
   DDP does; a persistence threshold above the parameter's size does not (DeepSpeed releases
   every parameter after the first step's forward, persistent or not), nor, on Accelerate, the
   use itself inside ``GatheredParameters`` without the copy (its backward reads the parameter
   after the context has emptied it again).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import Any, Callable, Iterable, Iterator


class PartitionedWriteError(RuntimeError):
    """A write into a ZeRO-3-partitioned parameter while the model is built: it would be lost."""


def fix_for_writes() -> str:
    return ("Fix: initialise it in the constructor of the module that owns it (its __init__, or a "
            "reset_parameters its __init__ calls: zero.Init partitions only after the constructor "
            "returns), or write it inside `with deepspeed.zero.GatheredParameters([param, ...], "
            "modifier_rank=0):` (the parameters are whole there, and rank 0's values are kept)")


def fix_for_transformers(pretrained: bool) -> str:
    """The fix when the write is transformers' own (its ``post_init`` / ``_init_weights``, or
    ``from_pretrained``'s loading), which a user cannot move or wrap."""
    return ("The write is transformers' own (the model's constructor initialises its weights"
            + (", and from_pretrained then loads the pretrained ones" if pretrained else "")
            + "), in code you cannot move. Fix: build the Hugging Face model in the LightningModule's "
            "__init__ instead of configure_model (it is built whole there, and DeepSpeed partitions it "
            "when training starts), or, in configure_model, keep "
            "`transformers.integrations.HfDeepSpeedConfig(self.trainer.strategy.config)` alive (an "
            "attribute: `self._hf_ds = HfDeepSpeedConfig(...)`) before `from_pretrained` -- transformers "
            "then loads the pretrained weights into the partitioned parameters itself (with from_config "
            "it initialises them its own ZeRO-3 way, which is not the initialisation a ddp preset starts "
            "from)")


def write_message(strategy: str, name: str, shape: tuple[int, ...], how: str, where: str,
                  transformers: str | None = None) -> str:
    """The error for a write ``how`` into partitioned parameter ``name`` while ``where`` runs;
    ``transformers``: "from_pretrained" or "init" when transformers' own code wrote it."""
    numel = 1
    for n in shape:
        numel *= n
    lost = {"from_pretrained": "the pretrained weights (a ddp preset would start from them)",
            "init": "transformers' initialisation (a ddp preset would start from it)"}.get(
        transformers or "", "this initialisation (a ddp preset would start from yours)")
    fix = fix_for_transformers(transformers == "from_pretrained") if transformers else fix_for_writes()
    return (f"{where} wrote into parameter {name} (shape {list(shape)}) with {how} after DeepSpeed "
            f"partitioned it: under strategy={strategy} (ZeRO-3) {where} runs inside "
            "deepspeed.zero.Init, which splits each module's parameters over the ranks as soon as "
            f"the module's constructor returns, so here the parameter holds 0 of its {numel} values "
            f"and the write is lost -- training would start from the constructor's values, not from "
            f"{lost}. {fix}")


def unreached_name(p: Any, frame: Any, skip: tuple[str, ...]) -> str:
    """How to name parameter ``p``, not yet reachable from the module being configured, from the
    stack at its write (``frame``): its name in the innermost module whose ``__init__`` is running
    and that holds it (and the classes of those around it), else the first call site outside the
    files under ``skip`` (torch, DeepSpeed, this file)."""
    import torch

    building = []  # the modules whose constructors run, innermost first
    site, f = None, frame
    while f is not None:
        if site is None and not f.f_code.co_filename.startswith(skip):
            site = f"{f.f_code.co_filename}:{f.f_lineno} ({f.f_code.co_name})"
        me = f.f_locals.get("self") if f.f_code.co_name == "__init__" else None
        if isinstance(me, torch.nn.Module) and all(m is not me for m in building):
            building.append(me)
        f = f.f_back
    for i, module in enumerate(building):
        try:
            local = next((n for n, q in module.named_parameters(remove_duplicate=False) if q is p), None)
        except Exception:  # (a module half-way through its constructor)
            local = None
        if local is not None:
            around = ", inside ".join(f"{type(m).__name__}'s constructor" for m in building[i + 1:])
            return (f"{local} of the {type(module).__name__} being constructed"
                    + (f" (inside {around})" if around else "")
                    + (f", written at {site}" if site else ""))
    inside = f" while {type(building[0]).__name__}'s constructor ran" if building else ""
    return f"<not yet an attribute of the module{inside}, written at {site or 'an unknown site'}>"


def transformers_write(frame: Any) -> str | None:
    """"from_pretrained" or "init" when transformers' code is on the stack at ``frame`` (the
    write is its own), else None. (transformers is not imported here: only looked up.)"""
    module = sys.modules.get("transformers")
    if module is None or not getattr(module, "__file__", None):
        return None
    home = os.path.dirname(module.__file__) + os.sep
    found = None
    while frame is not None:
        if frame.f_code.co_filename.startswith(home):
            if frame.f_code.co_name == "from_pretrained":
                return "from_pretrained"
            found = "init"
        frame = frame.f_back
    return found


# In-place names that change no values (or only autograd's view of the tensor).
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "detach_", "retain_grad"})
_AUGMENTED = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
                        "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__",
                        "__ilshift__", "__irshift__", "__imatmul__"})


def written(func: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[Any, str] | None:
    """(the tensor ``func(*args, **kwargs)`` writes into, how it is named), or None for a read."""
    name = getattr(func, "__name__", "")
    if name == "__set__" and getattr(getattr(func, "__self__", None), "__name__", "") == "data":
        return (args[0] if args else None), "an assignment to .data"
    if name in _AUGMENTED or (name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES):
        target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
        module = getattr(func, "__module__", None) or ""
        how = (f"{module}.{name}" if module.startswith("torch.nn") else f"Tensor.{name}")
        return target, how
    if kwargs.get("out") is not None:
        return kwargs["out"], f"{name}(out=...)"
    return None


def _storage(t: Any) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except Exception:  # (no storage of its own: a tensor subclass, a sparse tensor)
        return None


@contextlib.contextmanager
def refuse_partitioned_writes(strategy: str, params: Callable[[], Iterable[tuple[str, Any]]],
                              where: str = "configure_model") -> Iterator[None]:
    """While the block runs, any write into a ZeRO-3-partitioned parameter raises
    ``PartitionedWriteError`` naming it (from ``params()``: (name, parameter) pairs, read only when
    there is something to name), how it was written, and the fix (module docstring, 1.)."""
    import torch
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from torch.overrides import TorchFunctionMode

    partitioned = ZeroParamStatus.NOT_AVAILABLE
    own = (os.path.dirname(torch.__file__) + os.sep, __file__)
    deepspeed_dir = os.path.dirname(os.path.dirname(os.path.dirname(
        sys.modules["deepspeed.runtime.zero.partition_parameters"].__file__))) + os.sep

    def is_partitioned(t: Any) -> bool:
        return getattr(t, "ds_status", None) is partitioned

    def by_deepspeed() -> bool:
        """The first caller outside torch and this file is DeepSpeed (its own partitioning)."""
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith(own):
            frame = frame.f_back
        return frame is not None and frame.f_code.co_filename.startswith(deepspeed_dir)

    def refuse(p: Any, how: str, frame: Any) -> PartitionedWriteError:
        name = next((n for n, q in params() if q is p), None)
        shape = tuple(getattr(p, "ds_shape", p.shape))
        return PartitionedWriteError(write_message(
            strategy, name or unreached_name(p, frame, (*own, deepspeed_dir)), shape, how, where,
            transformers_write(frame)))

    class RefuseWrites(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: dict[int, Any] = {}  # empty storage of a partitioned parameter -> it

        def target(self, t: Any) -> Any:
            """The partitioned parameter ``t`` is or shares its (empty) storage with; else None."""
            if is_partitioned(t):
                return t
            if not isinstance(t, torch.Tensor) or t.numel() != 0:
                return None
            p = self.seen.get(_storage(t))
            return p if p is not None and is_partitioned(p) and _storage(p) == _storage(t) else None

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            write = written(func, args, kwargs)
            if write is not None and (p := self.target(write[0])) is not None and not by_deepspeed():
                raise refuse(p, write[1], sys._getframe())
            for a in (*args, *kwargs.values()):
                if is_partitioned(a):  # (p.data, p.detach(), views: they share its storage)
                    self.seen[_storage(a)] = a
            return func(*args, **kwargs)

    try:
        with RefuseWrites():
            yield
    except PartitionedWriteError:
        raise
    except Exception as e:  # an init function that fails on the empty tensor before it writes
        frame = _init_frame(e.__traceback__, torch.nn.init.__file__, is_partitioned)
        if frame is None:
            raise
        raise refuse(frame.f_locals["tensor"], f"torch.nn.init.{frame.f_code.co_name}", frame) from e


def _init_frame(tb: Any, init_file: str, is_partitioned: Callable[[Any], bool]) -> Any:
    """The frame of a ``torch.nn.init`` function called on a partitioned parameter, in ``tb``."""
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename == init_file and is_partitioned(frame.f_locals.get("tensor")):
            return frame
        tb = tb.tb_next
    return None


_OUTSIDE_FORWARD = (
    re.compile(r"The size of tensor a \(0\) must match the size of tensor b \(\d+\)"),
    re.compile(r"The size of tensor a \(\d+\) must match the size of tensor b \(0\)"),
    re.compile(r"returned an invalid gradient at index \d+ - got \[0\] but expected shape compatible "
               r"with \[(?P<shape>[\d, ]+)\]"),
)


def outside_forward_message(strategy: str, original: str,
                            named: Iterable[tuple[str, tuple[int, ...]]] = ()) -> str | None:
    """The message for ``original`` (an exception's text) when it is the backward of a
    partitioned parameter used outside a module's forward; None when it is not. ``named``: the
    partitioned parameters' (name, full shape), to name the ones of the shape autograd gives."""
    found = next((m for m in (p.search(original) for p in _OUTSIDE_FORWARD) if m), None)
    if found is None or "outside the forward of a module" in original:  # (not twice)
        return None
    shape = found.groupdict().get("shape")
    shape = tuple(int(n) for n in shape.split(",")) if shape else None
    names = sorted(n for n, s in named if shape is not None and tuple(s) == shape)
    which = (f"parameter {' or '.join(names)}" if names else "a parameter")
    return (f"{which} was used outside the forward of a module that owns it (e.g. an L2 penalty on "
            "it added to the loss after the forward), which ZeRO-3 does not support: under "
            f"strategy={strategy} DeepSpeed partitions each parameter over the ranks and gathers it "
            "whole only while the forward of a module that owns it runs; elsewhere it is an empty "
            "tensor, so the backward of that use fails (raising strategy.param_persistence_threshold "
            "does not help: the first step releases those parameters after the forward too). Fix: compute that use inside a "
            "module's forward (on Lightning, the LightningModule's own forward counts), or from a "
            "copy taken while it is gathered -- `with deepspeed.zero.GatheredParameters([param]): "
            "w = param.clone()`, then use w (the gradient reaches the parameter through the copy) "
            "-- or train with a ddp preset. "
            f"(The error: {original.strip().splitlines()[0] if original.strip() else original})")


def explain_use_outside_forward(exception: BaseException, strategy: str, module: Any = None) -> bool:
    """Rewrite ``exception``'s message in place (``outside_forward_message``) when it is that
    backward's; ``module``: whose partitioned parameters to name. Whether it was rewritten."""
    named = [(n, tuple(p.ds_shape)) for n, p in (module.named_parameters() if module is not None else ())
             if hasattr(p, "ds_shape")]
    done = False
    args = []
    for a in exception.args:
        said = outside_forward_message(strategy, a, named) if isinstance(a, str) else None
        done = done or said is not None
        args.append(said if said is not None else a)
    exception.args = tuple(args)
    return done
