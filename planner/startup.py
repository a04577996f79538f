"""What a run needs before its first step, beside the steady state the plan sizes: every
process's build of the whole model on the host (``build_problems``) and objective=dpo's
reference pass on the device (``reference_problems``). Each returns the sentences that make a
layout not fit (planner/results.py ``OVERFLOWS``). docs/PLANNER.md, "The build"."""

from __future__ import annotations

from typing import Any

from planner.activations import loss_backward_bytes
from planner.host import PROCESS_BYTES
from planner.states import gb


def build_problems(c: Any, su: Any) -> list[str]:
    """Host memory the node lacks while each of its processes builds the whole fp32 model
    before the preset shards it (presets without ``Capabilities.sharded_build`` on this backend;
    each process's own base too). Planned-only layouts: their engine's build (Megatron's is
    sharded)."""
    cl = su.cluster
    if c.planned_only or not su.params or su.backend in c.config.capabilities.sharded_build:
        return []
    whole = 4 * su.params
    need = (whole + PROCESS_BYTES["gpu" if cl.accelerator == "gpu" else "cpu"]) * cl.devices
    if need <= su.host_bytes:
        return []
    return [f"host memory: each of the node's {cl.devices} processes builds the whole fp32 model "
            f"({gb(whole)}) before strategy={c.name} {'shards' if c.config.footprint().sharded else 'wraps'} it, "
            f"{gb(need)} per node, has "
            f"{su.host_has()}; fsdp2 and the tp/pp presets build their shards alone "
            "(backend=lightning), zero3 under zero.Init"]


def reference_problems(c: Any, mem: Any, su: Any) -> list[str]:
    """objective=dpo: the device each rank needs before training for the reference pass (the
    whole fp32 model, and the fp32 logits with their log-softmax of one micro-batch's rows;
    Accelerate runs it beside the prepared model). Not for planned-only layouts (not ours)."""
    if not su.reference or su.shape is None or c.planned_only:
        return []
    whole = 4 * su.params
    need = whole + loss_backward_bytes(su.shape, micro=su.trainer.micro_batch_size) + (
        mem.params if su.backend == "accelerate" else 0)
    if need <= su.cluster.device_bytes():
        return []
    return [f"objective=dpo's reference pass: each rank runs the pairs through the whole fp32 "
            f"model ({gb(whole)}) before training: needs {gb(need)} per device, has "
            f"{gb(su.cluster.device_bytes())}"]
