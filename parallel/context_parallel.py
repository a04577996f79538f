"""torch's context parallelism on the plain model (``strategy.cp``): each block's attention core
(the model's ``attention_core``) inside torch's ``_ContextParallel`` module wrapper, which
hands scaled_dot_product_attention sequence-sharded DTensors so that torch's ring attention
runs it (``_templated_ring_attention``: keys and values travel around the cp ranks, causal
chunks load-balanced head-tail); the model's rotary angles follow the same positions
(``seq_shard``, recipes.data.shard_index), and the data path hands each rank those tokens.
torchtitan applies it the same way (module wrapper, torch's head-tail balancer).

The one workaround for torch here, CPU (``_cpu_ring``): torch 2.13's ring attention is
registered for the CUDA kernels only (flash, memory-efficient, cuDNN). On CPU,
scaled_dot_product_attention dispatches ``aten._scaled_dot_product_flash_attention_for_cpu``,
which has neither a DTensor sharding rule nor a ring handler (probed: NotImplementedError). We
register both for that kernel and its backward: the sequence-sharded rule, and a handler that
calls torch's own ring functions with the CPU kernel -- nothing of the ring is ours. CUDA runs
torch's registrations unchanged.
"""

from __future__ import annotations

from typing import Any

SEQ_DIM = 2  # (batch, heads, seq, head_dim) inside scaled_dot_product_attention


def apply_cp(model: Any, mesh: Any) -> Any:
    """Context parallelism over ``mesh`` (1-D, the cp ranks) on ``model``, which declares
    ``attention_core`` (a module per block taking (batch, seq, heads, head_dim) q, k, v)."""
    from torch.distributed.tensor.experimental._context_parallel import (
        _ContextParallel,
        _enable_context_parallel_dispatcher,
    )
    from torch.distributed.tensor.parallel import parallelize_module

    from parallel.parallelize import find_model

    model, block = find_model(model)
    path = getattr(type(model), "attention_core", None)
    if block is None or path is None:
        raise ValueError(f"strategy.cp={mesh.size()}: the model declares no attention_core for "
                         "context parallelism to wrap (the built-in GPT does); use a built-in "
                         "model or strategy.cp=1")
    style = _ContextParallel(seq_dim=1, attention_type=_ContextParallel.AttentionType.SDPA)
    for m in model.modules():
        if isinstance(m, block):
            parallelize_module(m.get_submodule(path), mesh, style)
    _enable_context_parallel_dispatcher()
    if mesh.device_type == "cpu":
        _cpu_ring()
    model.seq_shard = (mesh.get_local_rank(), mesh.size(), True)
    return model


def _cpu_ring() -> None:
    """Register torch's ring attention for the CPU flash kernel (see the module's docstring)."""
    import torch
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, register_op_strategy
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    aten = torch.ops.aten
    fwd = aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    dispatcher = DTensor._op_dispatcher
    if fwd in dispatcher._custom_op_handlers:
        return

    def forward_rule(schema: Any) -> Any:  # (out, logsumexp) <- (q, k, v), all on the sequence
        return expand_to_full_mesh_op_strategy(schema.get_mesh_from_args(), schema,
                                               [[Shard(SEQ_DIM)] * 5], input_index=2)

    def backward_rule(schema: Any) -> Any:  # (dq, dk, dv) <- (dout, q, k, v, out, logsumexp)
        return expand_to_full_mesh_op_strategy(schema.get_mesh_from_args(validate=False), schema,
                                               [[Shard(SEQ_DIM)] * 9], input_index=3)

    def forward(mesh: Any, q: Any, k: Any, v: Any, dropout_p: float = 0.0, is_causal: bool = False,
                *, attn_mask: Any = None, scale: float | None = None) -> Any:
        return ring._templated_ring_attention(mesh.get_group(), SEQ_DIM, fwd, q, k, v,
                                              is_causal=is_causal, dropout_p=dropout_p, scale=scale)

    def backward(mesh: Any, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dropout_p: float,
                 is_causal: bool, *, attn_mask: Any = None, scale: float | None = None) -> Any:
        return ring._templated_ring_attention_backward(
            mesh.get_group(), SEQ_DIM, bwd, grad_out=dout, grad_out_name="grad_out", query=q, key=k,
            value=v, out=out, logsumexp=lse, is_causal=is_causal, dropout_p=dropout_p, scale=scale)

    def handler(op: Any, args: tuple, kwargs: dict) -> Any:  # as torch's ring._sdpa_handler
        info = dispatcher.unwrap_to_op_info(op, args, kwargs)
        dispatcher.sharding_propagator.propagate(info)
        local = (forward if op is fwd else backward)(info.compute_mesh, *info.local_args,
                                                     **info.local_kwargs)
        return dispatcher.wrap(local, info.output_sharding.output_spec)

    register_op_strategy(fwd, schema_info=RuntimeSchemaInfo(3))(forward_rule)
    register_op_strategy(bwd, schema_info=RuntimeSchemaInfo(6))(backward_rule)
    dispatcher._custom_op_handlers[fwd] = handler
    dispatcher._custom_op_handlers[bwd] = handler


def flattened(mesh: Any, name: str) -> Any:
    """``mesh``'s dimensions as one, named ``name`` (FSDP2's data x context mesh: cp ranks hold
    different tokens of the same samples): torch's private ``DeviceMesh._flatten``, asked for first."""
    from core.internals import PROVEN, require

    return require(mesh, ["_flatten"], feature="context parallelism (strategy.cp > 1: FSDP2 over the "
                   "data x context mesh flattened into one)", where="torch.distributed.device_mesh.DeviceMesh",
                   fix=f"set strategy.cp=1, or use torch {PROVEN} (the versions CI runs)")._flatten(name)


__all__ = ["apply_cp", "flattened"]
