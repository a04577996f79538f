"""TP, context parallelism and pipelines on Accelerate: refused, with the reason (no builder runs
them here)."""

from __future__ import annotations

from backends.accelerate.families import Builder, builds
from strategies.families.parallel import ParallelConfig


@builds(ParallelConfig)
class Parallel(Builder):
    preset: ParallelConfig

    def problems(self) -> list[str]:
        if self.preset.pp > 1:
            return [f"strategy={self.preset.name} (pipeline parallel) is not supported by "
                    "backend=accelerate (Accelerate trains pipelines only through Megatron-LM): "
                    "use backend=lightning"]
        if self.preset.cp > 1 and self.preset.tp == 1:
            return [f"strategy={self.preset.name} (context parallel, strategy.cp={self.preset.cp}) is "
                    "not supported by backend=accelerate here: Accelerate builds its cp mesh only "
                    "through ParallelismConfig, which refuses to run without a GPU; use "
                    "backend=lightning"]
        return [f"strategy={self.preset.name} (tensor parallel) is not supported by backend=accelerate "
                "here: Accelerate builds its TP mesh only through ParallelismConfig on CUDA; "
                "use backend=lightning"]
