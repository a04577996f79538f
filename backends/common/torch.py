"""What every backend does the same way with torch's own wrappers (DDP, FSDP1, FSDP2/DTensor)
and pipeline stages: the full parameters after training, the bytes a rank holds, and how long
every process group's collectives wait for a lost peer."""

from __future__ import annotations

import logging
from typing import Any

from parallel.parallelize import plain_state_dict


log = logging.getLogger(__name__)

GROUP_DEFAULTS = ("_get_default_timeout", "default_pg_timeout", "default_pg_nccl_timeout")
"""What ``bound_new_groups`` leans on in ``torch.distributed.distributed_c10d``."""


def bound_new_groups(seconds: float | None, c10d: Any = None) -> bool:
    """Every process group this process makes from now on without a timeout of its own waits
    ``seconds`` (``cluster.collective_timeout``) for a lost peer, as the default group does; None
    leaves torch's default. DeepSpeed's groups (``deepspeed.comm.new_group(ranks)``: ZeRO's
    data-parallel groups, MoE's), DeviceMesh's sub-groups (fsdp2/hsdp2/tp/3d on two or more
    dimensions) and Accelerate's and Lightning's pass none, and torch gives such a group its module
    default, 30 minutes (NCCL: 10), read from ``distributed_c10d.default_pg_timeout`` /
    ``default_pg_nccl_timeout`` when the group is made: those are set here, and the running
    torch asked (``_get_default_timeout``) that they took. Called before the process group forms
    (``PresetStrategy.begin``, ``backends.accelerate.state.accelerator``). Where this torch lacks
    the names, one warning and the groups keep torch's default; whether it took."""
    from datetime import timedelta

    from core.internals import lacking, lacks_message, warn_once

    if seconds is None:
        return False
    if c10d is None:
        from torch.distributed import distributed_c10d as c10d
    wanted = timedelta(seconds=seconds)
    missing = lacking(c10d, GROUP_DEFAULTS)
    if not missing:
        c10d.default_pg_timeout = wanted
        if isinstance(c10d.default_pg_nccl_timeout, timedelta):  # (None: a torch without NCCL)
            c10d.default_pg_nccl_timeout = wanted
        if c10d._get_default_timeout(c10d.Backend.GLOO) == wanted:
            return True
        missing = ["_get_default_timeout (it no longer reads default_pg_timeout)"]
    warn_once(log, "bound_new_groups", lacks_message(
        f"cluster.collective_timeout={seconds:g} on the process groups DeepSpeed, DeviceMesh and the "
        "engines make", "torch.distributed.distributed_c10d", missing,
        "those groups wait torch's default (30 min) for a lost peer instead; the default group is "
        "bounded as set"))
    return False


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
