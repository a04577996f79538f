"""Parallelism applied from outside to the plain single-device model, in the fixed order
(float8 conversion ->) TP -> context parallelism -> activation checkpointing -> compile -> FSDP2 (torchtitan's
``parallelize_*`` functions), from a family's plan (``ParallelPlan``, data) and what the model
declares: its repeated block (``block_cls``), its Megatron ``tp_plan`` and where its blocks,
embedding and head are (``tp_layout``). torch only (DTensor, ``fully_shard``, the checkpoint
wrapper): every backend calls the same functions, after building the model and before its engine
wraps it.

Also here, because every backend needs them the same way: finding the model inside a wrapper
module, giving a meta-built model's shards storage, and plain (unwrapped) state-dict keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.keys import plain_key
from core.precision import dtype, find, low_dtype, of


@dataclass(frozen=True)
class FSDP2Plan:
    """``fully_shard`` over the data-parallel mesh: each block, then the model."""

    reshard_after_forward: bool = True
    """Free gathered block parameters after forward (the model's root stays gathered: it is
    used last in forward and first in backward)."""
    reduce_fp32: bool = True
    """Under mixed precision, reduce-scatter gradients in fp32 (false: in the low dtype)."""


@dataclass(frozen=True)
class ParallelPlan:
    """What a preset applies to the plain model, in order; engines that wrap the model
    themselves (DDP, FSDP1, DeepSpeed) wrap it after."""

    tp: int = 1
    """Tensor-parallel degree (the model's tp_plan over the tensor mesh)."""
    sequence_parallel: bool = False
    cp: int = 1
    """Context-parallel degree (torch's ring attention over the cp mesh, parallel/context_parallel.py)."""
    activation_checkpointing: bool | str = False
    """false | true (each block recomputed whole) | selective (per op: matmul and attention
    outputs kept, the rest recomputed; ``parallel/checkpointing.py``)."""
    ac_every: int = 1
    """Checkpoint blocks n, 2n, ... only (1: every block)."""
    compile: bool = False
    """torch.compile each block (trainer.compile), after TP and checkpointing, before FSDP."""
    fsdp: FSDP2Plan | None = None
    """FSDP2 over the data-parallel mesh, or None."""
    float8: str = "none"
    """trainer.float8: the blocks' Linears as torchao's float8 Linear first (parallel/float8.py)."""


def plan_for(preset: Any, run: Any) -> ParallelPlan:
    """The preset's plan on this run: its ``plan(mesh)`` with the run's facts that are not the
    preset's own (``trainer.compile``, ``trainer.float8``)."""
    import dataclasses

    return dataclasses.replace(preset.plan(run.mesh), compile=bool(getattr(run, "compile", False)),
                               float8=str(getattr(run, "float8", "none")))


def mixed_policy(precision: str, reduce_fp32: bool) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for ``precision``: parameters in its low dtype (none
    under fp32, or a Lightning flag we have no name for), gradients reduced in fp32 or that
    dtype (``core.precision``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    p = find(precision) or of("32")
    return MixedPrecisionPolicy(param_dtype=dtype(p.low), reduce_dtype=dtype(p.reduce(reduce_fp32)))


def parallelize(module: Any, plan: ParallelPlan, *, tp_mesh: Any = None, dp_mesh: Any = None,
                cp_mesh: Any = None, precision: str = "32") -> Any:
    """Apply ``plan`` to the plain model inside ``module`` (on every rank), in the fixed order
    float8 conversion -> TP -> context parallelism (which wraps only the attention cores) ->
    activation checkpointing -> compile -> FSDP2."""
    model, block = find_model(module)
    if plan.float8 != "none":
        from parallel.float8 import convert

        convert(model, plan.float8, fsdp=plan.fsdp is not None, block=block)
    if plan.tp > 1:
        apply_tp(model, tp_mesh, sequence_parallel=plan.sequence_parallel)
    if plan.cp > 1:
        from parallel.context_parallel import apply_cp

        apply_cp(model, cp_mesh)
    if plan.activation_checkpointing:
        checkpoint_blocks(module, plan.activation_checkpointing, every=plan.ac_every)
    if plan.compile:
        compile_blocks(module)
    if plan.fsdp is not None:
        apply_fsdp2(module, dp_mesh, plan.fsdp, precision=precision)
    return module


def find_model(module: Any) -> tuple[Any, type | None]:
    """The model inside ``module`` that declares its repeated block (``block_cls``, as
    recipes/gpt.py does), and that class; ``(module, None)`` when nothing declares one (a user's
    own module): strategies then treat the module as one unit."""
    for m in module.modules():
        block = getattr(type(m), "block_cls", None)
        if isinstance(block, type):
            return m, block
    return module, None


# What a preset's degree needs the model to declare: (strategy key, declarations, what they say).
_NEEDS = (("tp", ("tp_plan", "tp_layout"), "which layers are column/row parallel, and where the "
           "blocks, embedding and head are"),
          ("pp", ("pp_plan",), "how to cut it into pipeline stages"),
          ("cp", ("block_cls", "attention_core"), "its repeated block and the attention core in it"),
          ("sp", ("block_cls", "attention_core"), "its repeated block and the attention core in it"),
          ("activation_checkpointing", ("block_cls",), "its repeated block, the unit to recompute"))


def undeclared(module: Any, preset: Any) -> list[str]:
    """What ``preset`` needs the model inside ``module`` to declare (class attributes, read before
    anything is built or any process talks: ``tp_plan``/``tp_layout`` for tensor parallelism,
    ``pp_plan`` for a pipeline, ``block_cls`` and ``attention_core`` for context parallelism and
    Ulysses, ``block_cls`` for activation checkpointing) and it does not: one sentence each."""
    model, _ = find_model(module)
    out = []
    for key, names, what in _NEEDS:
        value = getattr(preset, key, None)  # a degree above 1, or checkpointing on/selective
        if not (value is True or isinstance(value, str) or (type(value) is int and value > 1)):
            continue
        lacking = [n for n in names if getattr(type(model), n, None) is None]
        if lacking:
            out.append(f"strategy={preset.name} (strategy.{key}={str(value).lower()}) needs a model "
                       f"that declares {' and '.join(names)} ({what}), as recipes/gpt.py's GPT "
                       f"does; {type(model).__name__} declares no {' or '.join(lacking)}: add "
                       f"{' and '.join(lacking)} to the model class, or use a preset without "
                       f"strategy.{key} (e.g. fsdp2 or zero2)")
    return out


def checkpoint_blocks(module: Any, mode: bool | str = True, *, every: int = 1) -> None:
    """Recompute blocks of the model inside ``module`` in backward (torch's wrapper): every
    ``every``-th block (blocks n, 2n, ... in module order, as torchtitan counts), each whole
    (``mode`` true) or per op (``selective``: ``parallel/checkpointing.py``'s policy)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    from parallel.checkpointing import wrapper

    _, block = find_model(module)
    if block is None:
        raise ValueError(f"strategy.activation_checkpointing={str(mode).lower()}, but the model "
                         "declares no block_cls to checkpoint: set block_cls on the model class")
    seen = {"n": 0}

    def chosen(m: Any) -> bool:
        if not isinstance(m, block):
            return False
        seen["n"] += 1
        return seen["n"] % every == 0

    apply_activation_checkpointing(module, checkpoint_wrapper_fn=wrapper(mode), check_fn=chosen)


def compile_blocks(module: Any) -> None:
    """``torch.compile`` each block of the model inside ``module`` in place (``Module.compile``:
    names, state-dict keys and the module tree stay the plain model's), the checkpoint wrapper
    with it when blocks are checkpointed (torchtitan's order: the recomputation is compiled
    too). FSDP2 wraps the compiled blocks after, so its gathers stay outside the graph."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    model, block = find_model(module)
    if block is None:
        raise ValueError("trainer.compile=true, but the model declares no block_cls to compile: "
                         "set block_cls on the model class")
    inside = set()
    for m in model.modules():
        if isinstance(m, CheckpointWrapper) and isinstance(m._checkpoint_wrapped_module, block):
            inside.add(id(m._checkpoint_wrapped_module))
            m.compile()
    for m in model.modules():
        if isinstance(m, block) and id(m) not in inside:
            m.compile()


def apply_fsdp2(module: Any, mesh: Any, plan: FSDP2Plan, *, precision: str = "32") -> Any:
    """``fully_shard`` each block of the model inside ``module``, then the model; ``mesh``: the
    data-parallel DeviceMesh, 1-D, or 2-D (replicate, shard) for HSDP. A module that declares
    no model (a user's own) is sharded child by child, then itself where it holds parameters."""
    from torch.distributed.fsdp import fully_shard

    mp = mixed_policy(precision, plan.reduce_fp32)
    model, block = find_model(module)
    if block is not None:
        for m in _units(model, block):
            fully_shard(m, mesh=mesh, reshard_after_forward=plan.reshard_after_forward, mp_policy=mp)
    # The model (embeddings, final norm, output) is used last in forward and first in backward:
    # resharding it after forward would only re-gather it at once.
    # (a module that declares no block, a user's own: ``user_units``)
    roots = [[model]] if block is not None else user_units(module)
    for root in roots:
        fully_shard(root if len(root) > 1 else root[0], mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    return module


def user_units(module: Any) -> list[list[Any]]:
    """FSDP2's units for a module that declares no block (a user's own), each a list of modules
    for one ``fully_shard``, inner units first: each child that holds parameters (one unit over
    all would gather all at once; a child whose trainable parameters have two dtypes, or a
    ModuleList, split into its children and itself: FSDP2 asserts one dtype per unit at the
    first forward), then the module itself over the parameters it holds directly (left out,
    they were neither sharded nor reduced). Units that share a Parameter (an embedding tied to
    the output layer) become one, under the module as root unit (torch refuses a parameter in
    two units). Two dtypes left in one unit raise ``ValueError``, before anything is sharded."""
    from torch.nn import ModuleDict, ModuleList

    units: list[Any] = []

    def add(m: Any) -> None:  # a list or dict of modules is no unit: torch has no forward to hook
        if len(_dtypes(m.parameters())) > 1 or isinstance(m, (ModuleList, ModuleDict)):
            for c in m.children():
                if _holds(c):
                    add(c)
            if _holds(m, recurse=False):
                units.append(m)
        else:
            units.append(m)

    for c in module.children():
        if _holds(c):
            add(c)
    groups = _merge_tied(units + [module] if _holds(module, recurse=False) else units)
    if any(len(g) > 1 for g in groups) and not any(m is module for m in groups[-1]):
        groups.append([module])  # a unit of several modules needs one root unit above it
    names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
    units = [m for group in groups for m in group]
    for group in groups:
        mixed = _dtypes(p for _, p in _own(group, units, names))
        if len(mixed) > 1:
            where = ", ".join(".".join(filter(None, (type(module).__name__, names.get(id(m))))) for m in group)
            found = "; ".join(f"{n}: {str(p.dtype).removeprefix('torch.')}" for n, p in _own(group, units, names)
                              if p.requires_grad)
            raise ValueError(f"strategy=fsdp2 shards {where} as one unit, "
                             f"whose trainable parameters have {len(mixed)} dtypes ({found}); FSDP2 needs "
                             "one dtype per unit: give the parameters one dtype, move them into modules "
                             "of one dtype each, or call fully_shard yourself in configure_model")
    return groups


def _holds(m: Any, *, recurse: bool = True) -> bool:
    return any(True for _ in m.parameters(recurse=recurse))


def _dtypes(params: Any) -> set[Any]:
    return {p.dtype for p in params if p.requires_grad}


def _own(group: list[Any], units: list[Any], names: dict | None = None) -> list[tuple[str, Any]]:
    """The parameters ``fully_shard(group)`` manages: its modules', less those of other units
    inside them (sharded before it), with their names (``names``: each module's path)."""
    inner = {id(u) for u in units} - {id(m) for m in group}
    out, seen = [], set()
    for top in group:
        stack = [(f"{(names or {}).get(id(top))}." if (names or {}).get(id(top)) else "", top)]
        while stack:
            prefix, m = stack.pop()
            for n, p in m.named_parameters(prefix=prefix.rstrip("."), recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((n, p))
            stack += [(f"{prefix}{n}.", c) for n, c in m.named_children() if id(c) not in inner]
    return out


def _merge_tied(units: list[Any]) -> list[list[Any]]:
    """``units`` (inner ones first) grouped where they share a Parameter, each group in the
    place of its last member; a member inside another member is left to it."""
    group = list(range(len(units)))

    def top(i: int) -> int:
        while group[i] != i:
            i = group[i]
        return i

    owner: dict[int, int] = {}
    for i, u in enumerate(units):
        for _, p in _own([u], units):
            j = owner.setdefault(id(p), i)
            group[top(j)] = top(i)
    out = []
    last = {top(i): i for i in range(len(units))}
    for root, i in sorted(last.items(), key=lambda kv: kv[1]):
        members = [units[k] for k in range(len(units)) if top(k) == root]
        inside = {id(c) for m in members for c in list(m.modules())[1:]}
        out.append([m for m in members if id(m) not in inside])
    return out


def _units(model: Any, block: type) -> list[Any]:
    """FSDP2's unit for each block: the checkpoint wrapper around it where blocks are
    checkpointed (torchtitan's and Accelerate's placement), else the block. Sharded inside the
    wrapper, the block's input cast (``MixedPrecisionPolicy.cast_forward_inputs``) would run
    inside the checkpointed region, and torch 2.11 skips that cast when the block is
    recomputed (2.13 does it): the rotary table saved in bf16 came back in fp32 and backward
    failed."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    wrapped = {id(m._checkpoint_wrapped_module): m for m in model.modules() if isinstance(m, CheckpointWrapper)}
    return [wrapped.get(id(m), m) for m in model.modules() if isinstance(m, block)]


def apply_tp(model: Any, mesh: Any, *, sequence_parallel: bool = False) -> Any:
    """Megatron column/row parallelism from the model's ``tp_plan`` on each block; the embedding
    row-parallel (vocab rows split), the head column-parallel with replicated logits. With
    sequence parallelism the residual stream between blocks is sharded along the sequence."""
    import torch
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    sp = sequence_parallel
    plan: dict[str, Any] = {}
    for name, kind in type(model).tp_plan.items():
        if kind == "column":
            plan[name] = ColwiseParallel()
        elif kind == "row":
            plan[name] = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
        else:
            raise ValueError(f"{type(model).__name__}.tp_plan[{name!r}]={kind!r}: column or row")
    if sp:
        plan |= {"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
                 "attn": PrepareModuleInput(input_layouts=(Shard(1), None),
                                            desired_input_layouts=(Replicate(), None)),
                 "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}
    # Where the blocks, the embedding and the head are: the model's ``tp_layout`` (dotted paths;
    # a pipeline stage has some of them set to None).
    where = type(model).tp_layout
    blocks = model.get_submodule(where["blocks"])
    for b in (blocks.values() if isinstance(blocks, torch.nn.ModuleDict) else blocks):
        parallelize_module(b, mesh, plan)
    # Tied embeddings (model.tie_embeddings, a Hugging Face tie_word_embeddings): parallelizing
    # each module swaps in its own new parameter, which would train two; both shard the vocabulary
    # rows (the embedding row-wise, the head column-wise: Shard(0)), so one is set back in both.
    tied = (_present(model, where["embedding"]) and _present(model, where["head"])
            and model.get_submodule(where["embedding"]).weight is model.get_submodule(where["head"]).weight)
    top: dict[str, Any] = {}
    if _present(model, where["embedding"]):
        top[where["embedding"]] = RowwiseParallel(input_layouts=Replicate(),
                                                  output_layouts=Shard(1) if sp else Replicate())
    if _present(model, where["head"]):
        if sp:
            top[where["norm"]] = SequenceParallel()
        top[where["head"]] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                             output_layouts=Replicate())
    parallelize_module(model, mesh, top)
    if tied:
        model.get_submodule(where["head"]).weight = model.get_submodule(where["embedding"]).weight
    if _present(model, where["embedding"]):
        model.get_submodule(where["embedding"]).register_forward_pre_hook(_cut_weight_grad)
    return model


def _cut_weight_grad(embedding: Any, args: Any) -> None:
    """DTensor has no row-sharded rule for the embedding's backward: the gradient of a
    vocabulary-sharded embedding comes out whole (Replicate) on every rank, and without FSDP2
    (which reshards it) ``.grad`` would hold the whole table's gradient per rank through the
    optimizer step: 1.8 GB more per rank at Llama 3's vocabulary in fp32. A hook on the weight
    cuts each incoming gradient to this rank's rows (a copy, no communication) before it
    accumulates. Set at the forward, on the weight the forward uses: materializing a meta model
    and FSDP2 replace the parameter that ``apply_tp`` saw."""
    weight = embedding.weight
    if getattr(weight, "_grad_cut", False) or not hasattr(weight, "placements") or not weight.requires_grad:
        return
    mesh, placements, shape, stride = weight.device_mesh, tuple(weight.placements), weight.shape, weight.stride()

    def cut(grad: Any) -> Any:
        if tuple(grad.placements) == placements:
            return grad
        shard = grad.redistribute(mesh, placements).to_local()
        if shard.untyped_storage().nbytes() > shard.numel() * shard.element_size():
            shard = shard.clone()  # a view would keep the whole gradient alive
        return type(grad).from_local(shard, mesh, placements, shape=shape, stride=stride)

    weight.register_hook(cut)
    weight._grad_cut = True


def _present(model: Any, path: str) -> bool:
    parent, _, name = path.rpartition(".")
    return getattr(model.get_submodule(parent) if parent else model, name, None) is not None


def materialize(module: Any, device: Any) -> None:
    """After sharding a model built on the meta device: give its meta parameters real (local,
    sharded) storage on ``device``, keep every tensor that was real already (LoRA adapters,
    buffers), then let the model fill its shards (``pending_weights``: recipes/hf.py's
    ``load_pretrained``; ``pending_init``: recipes/gpt.py's ``GPT.init_shards``). A module with
    neither (a user's own) is left to the engine."""
    import torch

    tensors = lambda: [*module.named_parameters(), *module.named_buffers()]  # noqa: E731
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    ours = [m for m in module.modules()
            if getattr(m, "pending_weights", False) or getattr(m, "pending_init", None) is not None]
    if not ours or not any(t.is_meta for _, t in tensors()):
        return  # (a user's own meta-built module: the engine's materialization, e.g. Lightning's
        # to_empty + reset_parameters after sharding, as its docs promise)
    with torch.no_grad():
        keep = {n: local(t).detach().clone() for n, t in tensors() if not t.is_meta}
        module.to_empty(device=device)
        for n, t in tensors():
            if n in keep:
                local(t).copy_(keep[n])
    for m in ours:
        if getattr(m, "pending_weights", False):
            m.load_pretrained()
        else:
            m.init_shards()


def plain_state_dict(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Full fp32 CPU copies keyed as the plain model: wrapper pieces and ``prefix`` removed,
    keys outside ``prefix`` dropped."""
    out = {}
    for k, v in state.items():
        k = plain_key(k)
        if k.startswith(prefix):
            full = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[k[len(prefix):]] = _plain_tensor(full.detach()).float().cpu().clone()
    return out


def _plain_tensor(t: Any) -> Any:
    """The plain tensor inside a wrapper subclass (torchao's float8-gathered weight under
    FSDP2 holds its fp32 weight as ``_tensor``), so an export pickles no torchao class."""
    while hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        t = getattr(t, names[0])
    return t


def neighbour_group(size: int, desc: str) -> tuple[Any, int]:
    """This rank's group of ``size`` consecutive ranks (the innermost dimension, as tensor
    parallelism's) and its index in it; every rank creates every group in the same order
    (torch's rule). ``desc`` names the group in the communication profile (observers/comm.py):
    an axis (``core.mesh.Axis``), or ``mesh_<axis>`` as torch describes a mesh dimension's group."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for start in range(0, world, size):
        group = dist.new_group(list(range(start, start + size)), group_desc=str(desc))
        if start <= rank < start + size:
            mine = group
    return mine, rank % size


__all__ = ["neighbour_group", "FSDP2Plan", "ParallelPlan", "apply_fsdp2", "apply_tp", "checkpoint_blocks",
           "compile_blocks", "plan_for", "find_model", "low_dtype", "materialize", "mixed_policy",
           "parallelize", "plain_state_dict"]
