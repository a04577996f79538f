"""single on Lightning: its SingleDeviceStrategy on the Trainer's device."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import SingleDeviceStrategy

from backends.lightning.families import builds
from backends.lightning.preset import PresetStrategy
from strategies.families.single import SingleConfig
from parallel.parallelize import parallelize, plan_for
from core.run import Run


@builds(SingleConfig)
class PresetSingleDeviceStrategy(PresetStrategy, SingleDeviceStrategy):
    """SingleDeviceStrategy on the Trainer's device, with the preset's plan (checkpointing)."""

    def __init__(self, preset: SingleConfig, device: str = "cpu"):
        super().__init__(device=torch.device(device))
        self.preset = preset

    @classmethod
    def of(cls, preset: SingleConfig, run: Run | None = None) -> PresetSingleDeviceStrategy:
        return cls(preset, "cuda:0" if run is not None and run.accelerator == "gpu" else "cpu").keep(run)

    def setup_environment(self) -> None:
        # Built through the registry, before the Trainer chose its accelerator: follow it.
        if not isinstance(self.accelerator, CPUAccelerator) and self.root_device.type == "cpu":
            self._root_device = torch.device("cuda", torch.cuda.current_device())
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        parallelize(self.lightning_module, plan_for(self.preset, self.run()))
        super().setup(trainer)
