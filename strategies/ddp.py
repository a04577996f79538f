"""DDP: every rank holds a full replica; gradients are all-reduced in buckets during backward.

Gradient compression uses torch's own DDP communication hooks (fp16/bf16 compression, PowerSGD).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strategies.base import Layout, Run, StrategyConfig, family
from strategies.mesh import World

HOOKS = ("none", "fp16", "bf16", "powersgd")


@family("ddp")
@dataclass
class DDPConfig(StrategyConfig):
    """torch DistributedDataParallel through Lightning's DDPStrategy."""

    comm_hook: str = "none"
    """Gradient compression: none | fp16 | bf16 | powersgd (torch DDP communication hooks)."""
    powersgd_rank: int = 1
    """PowerSGD matrix approximation rank (higher: more accurate, more traffic)."""
    powersgd_warmup_steps: int = 10
    """Optimizer steps of plain all-reduce before PowerSGD starts (torch's start_powerSGD_iter)."""
    bucket_cap_mb: int = 25
    """Gradient bucket size in MiB: one all-reduce per full bucket, overlapped with backward."""
    static_graph: bool = False
    """Tell DDP the graph is the same every step (enables more overlap, checked by torch)."""
    find_unused_parameters: bool = False
    """Search the graph for parameters without gradients each step (slow; only if needed)."""

    def problems(self, world: World, run: Run) -> list[str]:
        out = []
        if self.comm_hook not in HOOKS:
            out.append(f"strategy.comm_hook={self.comm_hook!r} is not one of {', '.join(HOOKS)}")
        if self.comm_hook == "bf16" and run.accelerator == "cpu":
            out.append("strategy.comm_hook=bf16 needs NCCL: gloo (CPU) cannot all-reduce bf16; "
                       "use strategy=ddp_fp16_compress on CPU, or cluster.accelerator=gpu")
        if self.comm_hook == "powersgd" and self.powersgd_warmup_steps < 2:
            out.append(f"strategy.powersgd_warmup_steps={self.powersgd_warmup_steps}: torch's "
                       "PowerSGD with error feedback needs >= 2; set it to 2 or more")
        if self.powersgd_rank < 1:
            out.append(f"strategy.powersgd_rank={self.powersgd_rank}: must be >= 1")
        if self.bucket_cap_mb < 1:
            out.append(f"strategy.bucket_cap_mb={self.bucket_cap_mb}: must be >= 1")
        return out

    def layout(self, world: World) -> Layout:
        ratio = {"fp16": 0.5, "bf16": 0.5}.get(self.comm_hook, 1.0)
        return Layout(grad_bytes_ratio=ratio)

    def lightning(self, world: World, run: Run) -> Any:
        from lightning.pytorch.strategies import DDPStrategy

        hook, state = self._hook()
        return DDPStrategy(
            ddp_comm_hook=hook,
            ddp_comm_state=state,
            bucket_cap_mb=self.bucket_cap_mb,
            static_graph=self.static_graph,
            find_unused_parameters=self.find_unused_parameters,
        )

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
