"""What both backends do with a DeepSpeed engine: choose its CPU accelerator before it is imported,
build the model under ``zero.Init``, repair its NVMe gradient reads, stop a run whose steps use
different parameters (which ZeRO trains wrong), count what it holds, gather
its parameters, show it a MoE model's split experts as its own (zero2_ep). DeepSpeed is imported
only inside these functions.

Running on CPU: DeepSpeed picks its accelerator once, when it is first imported, from
``DS_ACCELERATOR`` (or by detection: CUDA if present, else CPU). ``select_accelerator`` (the only
place that sets it) does that when the run is known (train.py), before the first
``import deepspeed``, and only for a CPU run; the CPU accelerator then uses gloo. Reached
through Lightning's registry, detection applies and ``check_accelerator`` refuses a CPU run on a
DeepSpeed that chose CUDA, naming the fix.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

from core.errors import ConfigError
from core.keys import plain_key
from core.mesh import Axis
from core.run import Run

from backends.common.torch import full_state_dict as _plain_full_state_dict


def select_accelerator(run: Run) -> None:
    """The one place DS_ACCELERATOR is set: DeepSpeed reads it once, at its first import."""
    if run.accelerator != "cpu":
        return
    if "deepspeed" in sys.modules:
        from deepspeed.accelerator import get_accelerator

        name = get_accelerator().device_name()
        if name != "cpu":
            raise RuntimeError(f"deepspeed was imported with its {name!r} accelerator before the "
                               "CPU run set DS_ACCELERATOR=cpu; do not import deepspeed earlier")
        return
    os.environ["DS_ACCELERATOR"] = "cpu"  # inherited by the ranks the launcher forks


def destroy(engine: Any) -> None:
    """A DeepSpeed engine's own end (``DeepSpeedEngine.destroy``; anything else: nothing). Its ZeRO
    optimizer's hooks on the parameters' gradient accumulators are held from torch's C++ side,
    out of the garbage collector's reach, and through them the engine, the model and the
    optimizer: without it a run's whole state outlives it in this process (a sweep's next job
    started 240 MB up, its peak RSS with it). ``backends.leave_nothing`` calls it through each
    backend's ``forget``."""
    deepspeed = sys.modules.get("deepspeed")
    if deepspeed is not None and isinstance(engine, deepspeed.DeepSpeedEngine):
        engine.destroy()


def check_accelerator() -> None:
    """A CPU run needs DeepSpeed's CPU accelerator (chosen at its first import)."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        raise ConfigError(
            f"a CPU run with DeepSpeed, but DeepSpeed was imported with its "
            f"{get_accelerator().device_name()!r} accelerator: set DS_ACCELERATOR=cpu in "
            "the environment before importing it (train.py does this itself)")


def zero_init(config: dict[str, Any], *, stage: int, offload_params: str) -> Any:
    """The context to build the model in: ZeRO-3 partitions parameters as they are created, each
    module's once its constructor returns, in the config's 16-bit dtype -- but drawn as the plain
    build draws them. ``zero.Init`` by default makes every tensor 16-bit the moment it is created
    (its dtype override of torch's constructors), so a constructor's init ran in bf16, where
    torch's uniform_ turns a draw that rounds to +bound into -bound (nn.Linear's kaiming init:
    ~0.1% of each weight sign-flipped, the model another than the seed's; a rotary table
    computed in bf16). Here only the device is overridden: the constructor draws in fp32, and
    its parameters are cast when it returns, before they are partitioned (``_cast_then_partition``)
    -- the bf16 of the seeded fp32 init, what ZeRO-1/2 start from; buffers keep the dtype they
    were made in, as the engine leaves them under ZeRO-1/2. The partitions are 16-bit as before;
    the build's transient grows: a module's own parameters are whole in fp32 until its
    constructor returns, then beside their 16-bit copy while cast (one 50M-element Linear on
    CPU: 302 MB at once, 201 MB under DeepSpeed's default, whose fp32 was never written)."""
    import deepspeed
    import deepspeed.runtime.zero as zero

    remote = offload_params if offload_params != "none" else None
    if not hasattr(zero, "DeepSpeedTensorOverride") or not hasattr(deepspeed.zero.Init, "_post_init_method"):
        import logging

        from core.internals import warn_once

        warn_once(logging.getLogger(__name__), "zero_init", (
            f"deepspeed {deepspeed.__version__} lacks zero.Init's tensor_overrides or _post_init_method "
            "(0.19.8 has both): ZeRO-3 builds the model as DeepSpeed's default does, its init drawn in "
            "the 16-bit dtype (not the fp32 init ZeRO-1/2 start from); deepspeed==0.19.8 draws it in fp32"))
        return deepspeed.zero.Init(config_dict_or_path=config, remote_device=remote, enabled=stage == 3)
    return _zero_init_class()(config_dict_or_path=config, remote_device=remote, enabled=stage == 3,
                              tensor_overrides=[zero.DeepSpeedTensorOverride.device])


@functools.cache
def _zero_init_class() -> type:
    """``deepspeed.zero.Init`` that casts a module's parameters to its dtype as it partitions
    them: ``_post_init_method`` is the hook its base class leaves to subclasses, run as each
    module's constructor returns (also after ``skip_init``'s ``to_empty``); the parent's then
    partitions what it is given."""
    import deepspeed
    from deepspeed.runtime.zero.utils import is_zero_param

    class Init(deepspeed.zero.Init):
        def _post_init_method(self, module: Any) -> None:
            _cast_then_partition(module, self.dtype, is_zero_param)
            super()._post_init_method(module)

    return Init


def _cast_then_partition(module: Any, dtype: Any, is_zero_param: Any) -> None:
    """Cast the floating parameters ``module`` holds itself (not yet partitioned: a tied one
    another module partitioned stays) to ``dtype``, as zero.Init's own override would have made
    them when they were created."""
    for p in module.parameters(recurse=False):
        if not is_zero_param(p) and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def gathered(params: list[Any]) -> Any:
    """ZeRO-3 partitions gathered whole while the context lasts; rank 0's writes are kept."""
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0)


def full_state_dict(engine: Any, stage: int, prefix: str = "") -> dict[str, Any]:
    """The full fp32 parameters of the module inside the DeepSpeed ``engine``, keyed as the plain
    model, on every rank (collective: every rank calls it). Under bf16/fp16 the module holds
    16-bit copies (ZeRO-1/2 whole, ZeRO-3 partitioned), so each trained parameter is its fp32
    master instead (``_with_masters``); a parameter the optimizer does not step (frozen) is the
    module's, as it trained."""
    module = engine.module
    if stage < 3:
        state = _plain_full_state_dict(module, prefix)
    else:
        import deepspeed

        # Collective: every rank gathers; modifier_rank=None means nobody writes back.
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            state = _plain_full_state_dict(module, prefix)
    return _with_masters(module, state, prefix)


def _with_masters(module: Any, state: dict[str, Any], prefix: str) -> dict[str, Any]:
    """``state`` with each 16-bit parameter's fp32 master, as DeepSpeed's own
    ``safe_get_full_fp32_param`` assembles it (ZeRO-1/2: an all-reduce over the parameter's
    data-parallel group -- an expert's: its expert-data-parallel group, so an expert comes back
    as this rank's experts, which zero2_ep then gathers; ZeRO-3: an all-gather). Collective:
    every rank walks the same parameters in the same order. fp32 parameters are their own
    masters (DeepSpeed copies the updated partitions back), so nothing is sent for them."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):  # (tied: every key)
        key = plain_key(name)
        if key.startswith(prefix):
            names.setdefault(id(p), []).append(key[len(prefix):])
    out = dict(state)
    for p in module.parameters():
        if p.dtype == torch.float32 or (hasattr(p, "ds_id") and not hasattr(p, "_z3_optimizer")):
            continue  # (the same on every rank: no optimizer, no masters)
        master = safe_get_full_fp32_param(p)
        for key in names.get(id(p), []) if master is not None else []:
            out[key] = master.detach().float().cpu().clone()
    return out


def sequence_groups(sp: int) -> Any:
    """This rank's Ulysses group: ``sp`` consecutive ranks, described ``sp`` (its name in the
    communication profile)."""
    from parallel.parallelize import neighbour_group

    return neighbour_group(sp, Axis.SP)[0]


def apply_ulysses(module: Any, sp: int) -> Any:
    """DeepSpeed Ulysses on the plain model inside ``module``: each block's attention core (the
    one the model names, ``attention_core``) inside DeepSpeed's ``DistributedAttention``, which
    all-to-alls the (batch, seq/sp, heads, head_dim) queries, keys and values of this rank's
    sequence shard into (batch, seq, heads/sp, head_dim), runs the core, and all-to-alls the
    result back; the model's rotary angles start at this rank's shard (``seq_shard``). KV heads
    that sp does not divide are replicated to the query heads before it (grouped-query attention
    maps query head i to KV head i // group, which ``repeat_interleave`` keeps). Gradients
    are then averaged over every rank by the engine (sp peers' shards are parts of one mean)."""
    if sp <= 1:
        return module
    import torch
    import torch.distributed as dist
    from deepspeed.sequence.layer import DistributedAttention

    from parallel.parallelize import find_model

    class UlyssesAttention(torch.nn.Module):
        """DistributedAttention over the (batch, seq, heads, head_dim) layout (batch dim 0)."""

        def __init__(self, core: Any, group: Any):
            super().__init__()
            self.inner = DistributedAttention(core, group, scatter_idx=2, gather_idx=1)

        def forward(self, q: Any, k: Any, v: Any) -> Any:
            if k.shape[2] % sp:  # KV heads sp does not divide: each query head's own copy
                k, v = (x.repeat_interleave(q.shape[2] // k.shape[2], dim=2) for x in (k, v))
            return self.inner(q.contiguous(), k.contiguous(), v.contiguous(), 0)

    model, block = find_model(module)
    path = getattr(type(model), "attention_core", None)
    if block is None or path is None:
        raise ValueError(f"strategy.sp={sp}: the model declares no attention_core for Ulysses to "
                         "wrap (the built-in GPT does); use a built-in model or strategy.sp=1")
    group = sequence_groups(sp)
    parent_path, _, name = path.rpartition(".")
    for m in model.modules():
        if isinstance(m, block):
            parent = m.get_submodule(parent_path) if parent_path else m
            setattr(parent, name, UlyssesAttention(getattr(parent, name), group))
    model.seq_shard = (dist.get_rank() % sp, sp)
    return module


def apply_ep_deepspeed(model: Any, ep: int) -> Any:
    """Expert parallelism that DeepSpeed's ZeRO-2 engine sees (zero2_ep): the experts split over
    groups of ``ep`` neighbouring ranks as parallel/experts.py's ``apply_ep`` does; each expert
    parameter tagged as DeepSpeed's own experts tag theirs (``allreduce=False``, ``group_name='ep_size_<ep>'``: ZeRO
    then reduces and partitions its gradient over the ``dp / ep`` ranks holding the same experts,
    dividing it by dp), and each MoE layer (``ep_plan['moe']``) made an instance of a subclass of
    its own class and ``deepspeed.moe.layer.MoE`` (our router and forward first in the MRO;
    MoE's __init__ never runs): the engine looks for that class to enable its expert groups.
    The parameters' names, hence the state dict's keys, are unchanged. The ep group."""
    from deepspeed.moe.layer import MoE

    from parallel.experts import apply_ep, mark_experts

    group = apply_ep(model, ep)
    name = f"ep_size_{ep}"
    for p in mark_experts(model):
        p.allreduce, p.group_name = False, name
    plan, block = getattr(type(model), "ep_plan", None), getattr(type(model), "block_cls", None)
    for m in model.modules() if isinstance(plan, dict) and isinstance(block, type) else ():
        if isinstance(m, block):
            try:
                layer, experts = m.get_submodule(plan["moe"]), m.get_submodule(plan["experts"])
            except AttributeError:  # a dense block of a MoE model
                continue
            local = next(experts.parameters()).shape[0]  # (stacked: the expert on dim 0)
            layer.__class__ = _deepspeed_moe_class(type(layer), MoE)
            layer.num_experts, layer.num_local_experts = local * ep, local
            layer.ep_size, layer.expert_group_name = ep, name
    return group


def _deepspeed_moe_class(cls: type, moe: type) -> type:
    """``cls`` as a ``deepspeed.moe.layer.MoE`` (one subclass per class): the engine calls its
    ``set_deepspeed_parallelism``, which creates DeepSpeed's expert and expert-data-parallel
    groups (ep neighbouring ranks; the ranks i, i + ep, ... holding the same experts)."""
    def set_deepspeed_parallelism(self: Any, use_data_before_expert_parallel_: bool = False) -> None:
        from deepspeed.utils import groups

        if self.expert_group_name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(
                self.ep_size, use_data_before_expert_parallel_=use_data_before_expert_parallel_)

    name = f"DeepSpeed{cls.__name__}"
    cached = _MOE_CLASSES.get(cls)
    if cached is None:
        cached = _MOE_CLASSES[cls] = type(name, (cls, moe), {
            "set_deepspeed_parallelism": set_deepspeed_parallelism, "forward": cls.forward,
            "__module__": __name__})
    return cached


_MOE_CLASSES: dict[type, type] = {}


def moe_optimizer_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The optimizer's groups with the experts' parameters in groups of their own marked
    ``moe`` (DeepSpeed's ``split_params_into_different_moe_groups_for_optimizer``; ZeRO-2 asks
    for them), each keeping its group's settings (weight decay)."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    named = [{**g, "name": g.get("name", f"group{i}")} for i, g in enumerate(groups)]
    return split_params_into_different_moe_groups_for_optimizer(named)


class SkippedParameterError(RuntimeError):
    """A parameter that had a gradient in an earlier step has none in this one, under ZeRO."""


def refuse_skipped_parameters(engine: Any, zero_opt: Any) -> None:
    """Stop a ZeRO run (stages 1, 2 and 3) before the optimizer step in which a trainable
    parameter that received a gradient in an earlier step of the run received none, naming it.

    DeepSpeed's ZeRO optimizers do not support iterations that see different parameters
    (deepspeedai/DeepSpeed#1355): such a parameter is stepped with stale gradient values instead
    of being left alone as torch's optimizers leave a parameter whose grad is None. Measured on
    a module whose layer runs only on odd steps, 1 and 2 ranks: losses equal to plain SGD for 3
    steps, then off by 1e-2 to 1.9 (ZeRO-1, 2 and 3, offload too) -- silently. A parameter never
    used at all is fine (exact). One tensor hook per trainable parameter records that it got
    a gradient this step (a set insert); the check at the step is one set difference. No
    DeepSpeed internals: the ZeRO optimizer's ``step`` is wrapped on this instance only."""
    params = {id(p): (n, p) for n, p in engine.module.named_parameters() if p.requires_grad}
    this_step: set[int] = set()
    earlier: set[int] = set()
    for key, (_, p) in params.items():
        p.register_hook(lambda grad, key=key: this_step.add(key))  # (returns None: grad unchanged)
    step = zero_opt.step

    def checked_step(*args: Any, **kwargs: Any) -> Any:
        skipped = [params[k][0] for k in earlier - this_step if params[k][1].requires_grad]
        if skipped:
            raise SkippedParameterError(
                f"step {engine.global_steps}: parameter(s) {', '.join(sorted(skipped))} received a "
                "gradient in an earlier step but none in this step's backward (their forward did not "
                "use them); DeepSpeed ZeRO would step them with a stale gradient (it does not "
                "support steps that use different parameters, deepspeedai/DeepSpeed#1355) and train "
                "them wrong without a word, so the run stops before this step. Fix: make every "
                "parameter take part in each forward (e.g. add 0 * the skipped layer's output), "
                "or use a strategy that skips them as torch does (fsdp2, or a ddp preset)")
        earlier.update(this_step)
        this_step.clear()
        return step(*args, **kwargs)

    zero_opt.step = checked_step


# O_DIRECT, which DeepSpeed's async I/O op uses for every swap file, needs each transfer's memory
# address aligned to the device's logical block size (512 B, or 4 KiB on some NVMe drives).
_DIRECT_IO_ALIGN = 4096


def repair(zero_opt: Any) -> None:
    """Make DeepSpeed's NVMe optimizer swapper read gradients back correctly (DeepSpeed 0.19.8, a
    bug, not a refusal; CPU and GPU), on this engine's swapper instance only.

    Root cause of "the optimizer on NVMe trains silently wrong" (measured 3e-4 relative loss
    error at step 2, 5e-4 after; independent of the optimizer): at the accumulation boundary each
    parameter's reduced gradient partition of >= 1 MiB goes to its own swap file; before the step
    ``PartitionedOptimizerSwapper._swap_in_pinned_gradients`` reads each file straight into
    ``grad.narrow(0, offset, length)`` of one flat buffer, ``offset`` being where the parameter
    sits in the rank's flat fp32 partition. Unless the parameters before it add up to a multiple
    of the block size (128 fp32 elements for 512-byte blocks), that address is not block
    aligned: the kernel refuses the O_DIRECT read (EINVAL in the completion event), DeepSpeed
    counts the event as done without looking at its result, and the optimizer steps on whatever
    the reused swap buffer held. DeepSpeed's aligned bounce buffer is skipped because the view
    lies inside a page-locked buffer.

    The repair: a misaligned chunk is read into plain memory (which DeepSpeed reads through its
    aligned bounce buffer) and copied into place; aligned chunks are read in place as before.
    Gradient writes are unaffected (packed at aligned offsets). The pipelined swapper shares the
    flaw and is refused (our typed keys never select it).
    """
    swapper = getattr(zero_opt, "optimizer_swapper", None)
    if swapper is None:  # optimizer state is not on NVMe
        return
    import torch
    from deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper import (
        PartitionedOptimizerSwapper,
    )
    from deepspeed.runtime.swap_tensor.utils import swap_in_tensors

    if type(swapper) is not PartitionedOptimizerSwapper or not hasattr(
            swapper, "_swap_in_pinned_gradients"):
        raise RuntimeError(f"DeepSpeed's NVMe optimizer swapper is {type(swapper).__name__}, whose "
                           "gradient reads from NVMe backends/common/deepspeed.py cannot repair "
                           "(misaligned O_DIRECT reads are dropped silently): use the default, "
                           "unpipelined swapper, or set strategy.offload_optimizer=cpu")

    def _swap_in_pinned_gradients(aio_handle, parameter, gradient_tensor):
        info = swapper.swap_params_info[swapper.parameter_id(parameter)]
        chunks = list(info.swapped_gradients.values())
        dests = [gradient_tensor.narrow(0, c.offset, c.length) for c in chunks]
        reads = [d if d.data_ptr() % _DIRECT_IO_ALIGN == 0 else torch.empty_like(d) for d in dests]
        swap_in_tensors(aio_handle, reads, [c.path for c in chunks])
        done = aio_handle.wait()
        if done != len(reads):
            raise RuntimeError(f"NVMe gradient swap-in completed {done} of {len(reads)} reads")
        for dest, read in zip(dests, reads):
            if read is not dest:
                dest.copy_(read)

    swapper._swap_in_pinned_gradients = _swap_in_pinned_gradients


# Where DeepSpeed 0.19's ZeRO optimizers keep gradients (stage 1/2 and stage 3). The reduction
# buckets (ipg_buffer, reduce_bucket_size elements) are communication scratch, not counted.
_GRAD_ATTRS = ("averaged_gradients", "all_grad_tensors", "grads_in_partition",
               "accumulated_grads_in_cpu", "offload_gradient_dict", "grad_partitions_flat_buffer",
               "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition")


def held_bytes(engine: Any, zero_opt: Any, what: str) -> int:
    """Count what DeepSpeed really holds on this rank.

    params: the module's parameter storage (ZeRO-3: each parameter's ``ds_tensor`` partition,
    plus the full data of parameters gathered right now or kept persistent). grads: whatever
    gradient storage exists (full ``.grad``, the engine's partitioned/averaged gradients and
    its contiguous gradient buffers). optimizer: the fp32 master partitions (on CPU when
    offloaded) and the wrapped torch optimizer's state tensors.
    """
    from parallel.memory import optimizer_tensors, tensor_bytes

    params = list(engine.module.parameters())
    if what == "params":
        tensors = [p.data for p in params if p.data.numel() > 0]
        tensors += [p.ds_tensor for p in params if getattr(p, "ds_tensor", None) is not None]
        return tensor_bytes(tensors)
    if what == "grads":
        tensors = [g for p in params for g in (p.grad, getattr(p, "grad_accum", None)) if g is not None]
        for name in _GRAD_ATTRS:
            tensors += list(_tensors_in(getattr(zero_opt, name, None)))
        # offload: the gradient partition is copied into the CPU fp32 master's .grad
        tensors += [t.grad for t in _fp32_partitions(zero_opt) if t.grad is not None]
        return tensor_bytes(tensors)
    if what == "optimizer":
        tensors = _fp32_partitions(zero_opt)
        inner = getattr(zero_opt, "optimizer", None)
        tensors += list(optimizer_tensors([inner] if inner is not None else []))
        return tensor_bytes(tensors)
    raise ValueError(f"held_bytes: what={what!r}; allowed params, grads, optimizer")


def _fp32_partitions(zero_opt: Any) -> list:
    """The fp32 master partitions the ZeRO optimizer steps (stage 1/2 and stage 3 names)."""
    out = []
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        out += list(_tensors_in(getattr(zero_opt, name, None)))
    return out


def _tensors_in(obj: Any):
    """Every tensor in a (nested) list/tuple/dict of tensors."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v)
