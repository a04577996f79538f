"""DDP: every rank holds a full replica; gradients are all-reduced in buckets during backward.

Gradient compression uses torch's own DDP communication hooks (fp16/bf16 compression, PowerSGD).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from strategies.base import Layout, Run, StrategyConfig, family
from strategies.checks import knob
from strategies.mesh import World

HOOKS = ("none", "fp16", "bf16", "powersgd")


@family("ddp")
@dataclass
class DDPConfig(StrategyConfig):
    """torch DistributedDataParallel through Lightning's DDPStrategy."""

    comm_hook: str = knob("none", choices=HOOKS)
    """Gradient compression: none | fp16 | bf16 | powersgd (torch DDP communication hooks)."""
    powersgd_rank: int = knob(1, min=1)
    """PowerSGD matrix approximation rank (higher: more accurate, more traffic)."""
    powersgd_warmup_steps: int = knob(10, min=2, fix="torch's PowerSGD with error feedback needs "
                                      ">= 2: set strategy.powersgd_warmup_steps=2 or more")
    """Optimizer steps of plain all-reduce before PowerSGD starts (torch's start_powerSGD_iter)."""
    bucket_cap_mb: int = knob(25, min=1)
    """Gradient bucket size in MiB: one all-reduce per full bucket, overlapped with backward."""
    static_graph: bool = False
    """Tell DDP the graph is the same every step (enables more overlap, checked by torch)."""
    find_unused_parameters: bool = False
    """Search the graph for parameters without gradients each step (slow; only if needed)."""
    gradient_as_bucket_view: bool = True
    """Gradients are views into DDP's communication buckets (false: DDP keeps a second copy of
    every gradient in its buckets)."""

    def problems(self, world: World, run: Run) -> list[str]:
        out = []
        if self.comm_hook == "bf16" and run.accelerator == "cpu":
            out.append("strategy.comm_hook=bf16 needs NCCL: gloo (CPU) cannot all-reduce bf16; "
                       "use strategy=ddp_fp16_compress on CPU, or cluster.accelerator=gpu")
        if world.tp * world.pp != 1:
            out.append(f"strategy={self.name} is data parallel only: tp={world.tp}, pp={world.pp}; "
                       "use a tensor/pipeline-parallel strategy")
        return out

    def layout(self, world: World) -> Layout:
        ratio = {"fp16": 0.5, "bf16": 0.5}.get(self.comm_hook, 1.0)
        return Layout(grad_bytes_ratio=ratio, grad_bucket_copy=not self.gradient_as_bucket_view,
                      grad_error_feedback=self.comm_hook == "powersgd",
                      compression_rank=self.powersgd_rank if self.comm_hook == "powersgd" else 0,
                      compression_warmup=self.powersgd_warmup_steps if self.comm_hook == "powersgd" else 0)

    def lightning(self, run: Run | None = None) -> Any:
        return _strategy_class()(self)

    def accelerate(self, world: World, run: Run, block_cls: type | None = None) -> dict[str, Any]:
        from accelerate.utils import DDPCommunicationHookType as Hook
        from accelerate.utils import DistributedDataParallelKwargs

        hook = {"none": Hook.NO, "fp16": Hook.FP16, "bf16": Hook.BF16, "powersgd": Hook.POWER_SGD}
        state = ({"matrix_approximation_rank": self.powersgd_rank,
                  "start_powerSGD_iter": self.powersgd_warmup_steps}
                 if self.comm_hook == "powersgd" else {})
        return {"kwargs_handlers": [DistributedDataParallelKwargs(
            bucket_cap_mb=self.bucket_cap_mb, static_graph=self.static_graph,
            find_unused_parameters=self.find_unused_parameters, comm_hook=hook[self.comm_hook],
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            comm_state_option=state)]}

    def _hook(self) -> tuple[Any, Any]:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        if self.comm_hook == "fp16":
            return default_hooks.fp16_compress_hook, None
        if self.comm_hook == "bf16":
            return default_hooks.bf16_compress_hook, None
        if self.comm_hook == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=self.powersgd_rank,
                start_powerSGD_iter=self.powersgd_warmup_steps,
            )
            return powerSGD_hook.powerSGD_hook, state
        return None, None


@functools.cache
def _strategy_class() -> type:
    from lightning.pytorch.strategies import DDPStrategy

    from strategies.lightning_support import PresetStrategy

    class PresetDDPStrategy(PresetStrategy, DDPStrategy):
        """Lightning's DDPStrategy with the preset's hook and buckets; the preset's activation
        checkpointing is applied to the plain model before DDP wraps it."""

        def __init__(self, preset: DDPConfig):
            hook, state = preset._hook()
            super().__init__(ddp_comm_hook=hook, ddp_comm_state=state,
                             bucket_cap_mb=preset.bucket_cap_mb, static_graph=preset.static_graph,
                             find_unused_parameters=preset.find_unused_parameters,
                             gradient_as_bucket_view=preset.gradient_as_bucket_view)
            self.preset = preset

        def _setup_model(self, model: Any) -> Any:
            return super()._setup_model(self.preset.parallelize(model))

        def _register_ddp_hooks(self) -> None:
            """Lightning registers communication hooks on CUDA only and silently drops them
            elsewhere: on CPU (gloo) the compression presets would train uncompressed. torch's
            hooks run on gloo (fp16, PowerSGD), so register them on every device."""
            if self.root_device.type == "cuda" or self._ddp_comm_hook is None:
                return super()._register_ddp_hooks()
            from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook

            _register_ddp_comm_hook(model=self.model, ddp_comm_state=self._ddp_comm_state,
                                    ddp_comm_hook=self._ddp_comm_hook,
                                    ddp_comm_wrapper=self._ddp_comm_wrapper)

        def engine_settings(self) -> dict[str, Any]:
            return {"ddp_kwargs": dict(self._ddp_kwargs),
                    "comm_hook": getattr(self._ddp_comm_hook, "__name__", None),
                    "comm_state": type(self._ddp_comm_state).__name__}

    return PresetDDPStrategy
