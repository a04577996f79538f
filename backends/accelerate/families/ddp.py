"""ddp and its compression presets on Accelerate: DDP kwargs and Accelerate's comm-hook enum."""

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
        hook = {"none": Hook.NO, "fp16": Hook.FP16, "bf16": Hook.BF16, "powersgd": Hook.POWER_SGD}
        state = ({"matrix_approximation_rank": p.powersgd_rank,
                  "start_powerSGD_iter": p.powersgd_warmup_steps} if p.comm_hook == "powersgd" else {})
        return {"kwargs_handlers": [DistributedDataParallelKwargs(
            bucket_cap_mb=p.bucket_cap_mb, static_graph=p.static_graph,
            find_unused_parameters=p.find_unused_parameters, comm_hook=hook[p.comm_hook],
            gradient_as_bucket_view=p.gradient_as_bucket_view, comm_state_option=state)]}
