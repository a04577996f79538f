"""Expert parallelism applied from outside to the plain model (torch only), from what the model
declares: ``ep_plan`` (relative to each MoE block: ``experts``, the module whose stacked
weights have the expert on dim 0, and ``moe``, the layer that routes to it), as recipes/gpt.py's
GPT does.

Each rank of an expert-parallel group of ``ep`` neighbouring ranks keeps ``n_experts / ep``
consecutive experts of every MoE layer. The layer fills one buffer of capacity slots per expert,
``(n_experts, slots, dim)``; hooks around the experts module trade it with torch's
``all_to_all_single`` (equal splits: the buffer is capacity-padded, so every
rank sends ``slots x dim`` per expert whatever the routing) -- dispatch before, combine after,
and the same two in backward -- so the module computes only its own experts, on the slots of
every rank of the group. What a token keeps or drops is decided before the dispatch, on the
sending rank, so the split changes nothing but where each expert runs.

Probed on gloo (torch 2.13, this 2-core CPU machine, 2 ranks): ``all_to_all_single`` works, with
equal and with uneven split sizes; both autograd forms -- the functional
``all_to_all_single_autograd`` and ``torch.distributed.nn.functional.all_to_all_single``
(deprecated) -- return correct gradients on their own; a size-1 FSDP2 mesh honours
``set_gradient_divide_factor``. Under the communication profile (observers/comm.py) the
functional form loses its gradient (its kernel on the Autograd key redispatches below autograd),
hence the small autograd function over the c10d collective below.

Gradients of an expert arrive summed over the tokens of the whole ep group; each engine then
averages them over the ranks that hold the same expert (``dp / ep`` replicas) and divides by
the data-parallel size ``dp``, not ``dp / ep``: the result is the mean over every rank's loss,
as for every other parameter (FSDP2: ``set_gradient_divide_factor(dp)``; DeepSpeed ZeRO divides
every bucket, expert ones included, by dp).
"""

from __future__ import annotations

from typing import Any

from core.mesh import Axis


def experts_of(model: Any) -> list[Any]:
    """The experts modules of every MoE block (``ep_plan['experts']``, relative to a block)."""
    plan = getattr(type(model), "ep_plan", None)
    if not isinstance(plan, dict):
        return []
    block = getattr(type(model), "block_cls", None)
    out = []
    for m in model.modules():
        if isinstance(block, type) and isinstance(m, block):
            try:
                out.append(m.get_submodule(plan["experts"]))
            except AttributeError:  # a dense block of a MoE model (DeepSeek's first layers)
                continue
    return out


def ep_group(ep: int) -> tuple[Any, int]:
    """This rank's expert-parallel group (``ep`` neighbouring ranks) and its index in it: its own
    process group even when it spans the world, described ``mesh_ep`` so the communication
    profile names it ``ep``."""
    from parallel.parallelize import neighbour_group

    return neighbour_group(ep, f"mesh_{Axis.EP}")


def shard_experts(experts: Any, ep: int, index: int, mesh: Any = None) -> None:
    """Keep experts ``[index x n/ep, (index + 1) x n/ep)`` of each stacked weight; ``mesh``: a
    1-D DeviceMesh of the ep group, to hold them as DTensors sharded on dim 0 (the full
    tensors are then one ``full_tensor()`` away: checkpoints, export, clipping)."""
    import torch

    for name, p in list(experts.named_parameters(recurse=False)):
        n = p.shape[0] // ep
        local = p.detach()[index * n:(index + 1) * n].clone()
        if mesh is not None:
            from torch.distributed.tensor import DTensor, Shard

            local = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        setattr(experts, name, torch.nn.Parameter(local, requires_grad=p.requires_grad))


def all_to_all(x: Any, group: Any) -> Any:
    """``torch.distributed.all_to_all_single`` (equal splits) with its backward, the same
    exchange of the gradients. (Not the functional ``all_to_all_single_autograd``: the
    communication profile's kernel on the Autograd key of ``_c10d_functional`` ops redispatches
    below autograd, and its gradient would be lost.)"""
    import torch
    import torch.distributed as dist

    class _AllToAll(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, t: Any) -> Any:
            out = torch.empty_like(t)
            dist.all_to_all_single(out, t.contiguous(), group=group)
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            out = torch.empty_like(grad)
            dist.all_to_all_single(out, grad.contiguous(), group=group)
            return out

    return _AllToAll.apply(x)


def exchange(experts: Any, group: Any, ep: int) -> None:
    """Trade the slot buffer around ``experts``: dispatch (each rank's slots for expert e go to
    the rank holding e) before its forward, combine (back to the rank the slots came from)
    after; autograd runs the reverse all-to-all of each in backward."""
    def dispatch(_module: Any, args: tuple) -> tuple:
        slots = args[0]  # (n_experts, s, d), expert-major: chunk r belongs to rank r
        e, s, d = slots.shape
        got = all_to_all(slots, group)
        # (ep sources, e/ep local experts, s, d) -> (local experts, ep x s, d)
        return (got.view(ep, e // ep, s, d).transpose(0, 1).reshape(e // ep, ep * s, d),)

    def combine(_module: Any, _args: tuple, out: Any) -> Any:
        local, n, d = out.shape
        back = out.view(local, ep, n // ep, d).transpose(0, 1).reshape(local * ep, n // ep, d)
        return all_to_all(back, group)

    experts.register_forward_pre_hook(dispatch)
    experts.register_forward_hook(combine)


def apply_ep(model: Any, ep: int, mesh: Any = None) -> Any:
    """Expert parallelism over groups of ``ep`` ranks on every MoE block of ``model`` (the plain
    model, before any engine wraps it); the group, for reading back (``gather_experts``)."""
    group, index = ep_group(ep)
    for experts in experts_of(model):
        shard_experts(experts, ep, index, mesh)
        exchange(experts, group, ep)
    return group


def apply_ep_fsdp2(model: Any, ep: int, mesh: Any, dp: int, plan: Any, precision: str = "32") -> Any:
    """torchtitan's layout: the experts of each MoE block as DTensors sharded over the ``ep``
    dimension of ``mesh`` (2-D: ``ep_replicate`` x ``ep``), then ``fully_shard`` over the
    ``ep_replicate`` ranks that hold the same experts (before the blocks are sharded, so the
    block's ``fully_shard`` leaves them alone), dividing their gradients by ``dp``; the ep
    group."""
    from torch.distributed.fsdp import fully_shard

    from parallel.parallelize import mixed_policy

    group = apply_ep(model, ep, mesh[Axis.EP])
    mp = mixed_policy(precision, plan.reduce_fp32)
    for experts in experts_of(model):
        fully_shard(experts, mesh=mesh[Axis.EP_REPLICATE], reshard_after_forward=plan.reshard_after_forward,
                    mp_policy=mp)
        experts.set_gradient_divide_factor(float(dp))
        if mesh[Axis.EP_REPLICATE].size() > 1:
            # a plain sum and a separate division: gloo has no PREMUL_SUM reduce-scatter. (Not
            # on one replica: torch 2.13 then skips the division altogether -- SGD tests see it.)
            experts.set_force_sum_reduction_for_comms(True)
    mark_experts(model)
    return group


def mark_experts(model: Any) -> list[Any]:
    """The routed experts' parameters (what ep splits), each tagged ``expert=True``."""
    out = []
    for experts in experts_of(model):
        for p in experts.parameters(recurse=False):
            p.expert = True
            out.append(p)
    return out


def gather_experts(state: dict[str, Any], model: Any, group: Any, prefix: str = "") -> dict[str, Any]:
    """``state`` (plain keys) with each local expert weight replaced by all of them, gathered
    over the ep ``group`` (collective: every rank of the group calls it)."""
    import torch
    import torch.distributed as dist

    names = {f"{prefix}{n}" for n, p in model.named_parameters() if getattr(p, "expert", False)}
    out = dict(state)
    for key in sorted(state):
        if any(key.endswith(n.removeprefix(prefix)) for n in names):
            local = state[key].contiguous()
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, local, group=group)
            out[key] = torch.cat(parts, 0)
    return out


__all__ = ["apply_ep", "apply_ep_fsdp2", "ep_group", "exchange", "experts_of", "gather_experts", "mark_experts",
           "shard_experts"]
