"""ddp and its compression presets on Accelerate: DDP kwargs and Accelerate's comm-hook enum;
top-k, int8, local SGD and DiLoCo (not in that enum) registered on the prepared model, and the
relaxed presets' parameter synchronization around each optimizer step
(backends/common/ddp_comm.py, the same code the Lightning strategy calls)."""

from __future__ import annotations

from typing import Any

from backends.accelerate.families import Builder, builds
from strategies.families.ddp import DDPConfig


@builds(DDPConfig)
class DDP(Builder):
    preset: DDPConfig

    def kwargs(self, block_cls: type | None = None) -> dict[str, Any]:
        from accelerate.utils import DDPCommunicationHookType as Hook
        from accelerate.utils import DistributedDataParallelKwargs

        p = self.preset
        hook = {"none": Hook.NO, "fp16": Hook.FP16, "bf16": Hook.BF16, "powersgd": Hook.NO,
                "topk": Hook.NO, "int8": Hook.NO}  # ours (backends/common/ddp_comm.py): in repair
        return {"kwargs_handlers": [DistributedDataParallelKwargs(
            bucket_cap_mb=p.bucket_cap_mb, static_graph=p.static_graph,
            find_unused_parameters=p.find_unused_parameters, comm_hook=hook[p.comm_hook],
            gradient_as_bucket_view=p.gradient_as_bucket_view)]}

    def repair(self, model: Any, optimizer: Any) -> None:
        from backends.common.ddp_comm import Synchronizer, comm_hook  # (torch: not at export.py's import)

        hook, state = comm_hook(self.preset)
        if hook is not None and hasattr(model, "register_comm_hook"):  # DDP-wrapped (world > 1)
            model.register_comm_hook(state, hook)
        self.sync = Synchronizer(self.preset, nodes=self.run.mesh.nodes, devices=self.run.mesh.devices)
        self.comm_state = state

    def rank_state(self, model: Any, optimizer: Any) -> Any:
        """What each rank keeps beyond the checkpoint's model and optimizer (backends/common/
        ddp_comm.py ``RankState``); None for presets that keep none."""
        if self.preset.unsaved_state() is None:
            return None
        from backends.common.ddp_comm import RankState

        return RankState(model, optimizer, getattr(self, "comm_state", None), getattr(self, "sync", None))

    @property
    def synchronizer(self) -> Any:
        """The relaxed presets' parameter synchronization (validation asks it whether replicas
        differ: backends/common/replica.py); None before ``repair``."""
        return getattr(self, "sync", None)

    def before_step(self, model: Any) -> None:
        getattr(self, "sync", None) and self.sync.before_step(model)

    def after_step(self, model: Any) -> None:
        getattr(self, "sync", None) and self.sync.after_step(model)
