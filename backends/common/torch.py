"""What every backend does the same way with torch's own wrappers (DDP, FSDP1, FSDP2/DTensor)
and pipeline stages: the full parameters after training, and the bytes a rank holds."""

from __future__ import annotations

from typing import Any

from parallel.parallelize import plain_state_dict


def unwrap(root: Any) -> Any:
    """The module inside wrappers that only hold it (DDP's ``.module``)."""
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(root, DistributedDataParallel):
        root = root.module
    return root


def full_state_dict(root: Any, prefix: str = "") -> dict[str, Any]:
    """The model's full parameters, fp32 on CPU, keyed as the plain model: ``root`` is the module
    the engine wrapped, ``prefix`` where the plain model sits in it (plain modules and DDP)."""
    return plain_state_dict(unwrap(root).state_dict(), prefix)


def gathered_state_dict(root: Any, prefix: str = "") -> dict[str, Any]:
    """Full fp32 CPU tensors of a sharded module (FSDP1, FSDP2, DTensor), on every rank
    (collective), keyed as the plain model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return plain_state_dict(sd, prefix)


def stages_state_dict(root: Any, prefix: str = "") -> dict[str, Any]:
    """Every pipeline stage's parameters, gathered (DTensors in full) and merged on every rank
    (collective): each rank's module holds only its stages, under their global names."""
    import torch.distributed as dist

    mine = plain_state_dict(root.state_dict(), prefix)
    if not dist.is_initialized():
        return mine
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return {k: v for d in out for k, v in d.items()}


def held_bytes(model: Any, optimizers: list[Any], what: str) -> int:
    """Bytes of ``what`` (params | grads | optimizer) this rank holds, from live tensors (local
    shards only): ``model`` as the engine wrapped it, ``optimizers`` as the engine steps them."""
    from parallel.memory import held_bytes as live

    return live(model, optimizers, what)
