"""``trainer.float8``'s refusals at validation, before any process starts: each names what is
missing (the preset, the precision, a CUDA GPU of compute capability 8.9+, torchao) and the fix.
Torch-free unless it asks this machine's GPU (``launch``)."""

from __future__ import annotations

from typing import Any

from parallel.float8 import MIN_CAPABILITY, PRESETS, capability_problem, missing

NEEDS = (f"float8 training (torchao's float8 Linear, torch._scaled_mm) runs on a CUDA GPU of compute "
         f"capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+ (H100, H200, L4, L40S)")


def problems(trainer: Any, strategy: Any, run: Any, model: Any = None, *, accelerator: str = "auto",
             launch: bool = False) -> list[str]:
    """Why ``trainer.float8`` cannot run with this preset, precision, model and machine (empty:
    it can, or it is ``none``). ``accelerator``: the cluster's as configured; ``launch``: also
    check this machine (the accelerator resolved in ``run``, torchao, the GPU's capability)."""
    recipe = str(getattr(trainer, "float8", "none"))
    if recipe == "none":
        return []
    key, fix = f"trainer.float8={recipe}", "or set trainer.float8=none"
    out = []
    if strategy.family not in PRESETS:
        out.append(f"{key} with strategy={strategy.name}: float8 training is built for strategy="
                   f"{' and '.join(PRESETS)} (FSDP2 all-gathers tensorwise weights in float8); "
                   f"use strategy=single or strategy=fsdp2, {fix}")
    if trainer.precision != "bf16-mixed":
        out.append(f"{key} with trainer.precision={trainer.precision}: float8 Linears compute "
                   "under bf16 mixed precision (fp32 master weights, bf16 elsewhere); set "
                   f"trainer.precision=bf16-mixed, {fix}")
    if model is not None and getattr(getattr(model, "lora", None), "rank", 0):
        out.append(f"{key} with model.lora.rank={model.lora.rank}: float8 of frozen base layers "
                   f"under adapters is not built; set model.lora.rank=0, {fix}")
    on_cpu = run.accelerator == "cpu" if launch else accelerator == "cpu"
    if on_cpu:
        out.append(f"{key} with cluster.accelerator={accelerator}"
                   + (" (resolved to cpu: no CUDA device)" if accelerator == "auto" else "")
                   + f": {NEEDS}; run on such a GPU, {fix}")
    if launch:
        lacking = missing()
        if lacking:
            out.append(f"{key}: {lacking}; {fix}")
        if not on_cpu and run.accelerator == "gpu":
            cap = capability_problem()
            if cap:
                out.append(f"{key}: {cap}. {NEEDS}; {fix}")
    return out


__all__ = ["NEEDS", "problems"]
