"""One process, no parallelism: the reference every other strategy is compared with."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from strategies.base import Run, StrategyConfig, family
from strategies.mesh import World


@family("single")
@dataclass
class SingleConfig(StrategyConfig):
    """Train in one process on one device (Lightning's SingleDeviceStrategy)."""

    def problems(self, world: World, run: Run) -> list[str]:
        if world.size != 1:
            return [f"strategy=single runs one process, but cluster.nodes={world.nodes} x "
                    f"cluster.devices={world.devices} = {world.size}: set cluster.devices=1 "
                    "cluster.nodes=1, or pick a multi-process strategy such as strategy=ddp"]
        return []

    def lightning(self, run: Run | None = None) -> Any:
        return _strategy_class()(self, "cuda:0" if run is not None and run.accelerator == "gpu" else "cpu")


@functools.cache
def _strategy_class() -> type:
    import torch
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from strategies.lightning_support import PresetStrategy

    class PresetSingleDeviceStrategy(PresetStrategy, SingleDeviceStrategy):
        """SingleDeviceStrategy on the Trainer's device, with the preset's checkpointing."""

        def __init__(self, preset: SingleConfig, device: str):
            super().__init__(device=torch.device(device))
            self.preset = preset

        def setup_environment(self) -> None:
            # Built through the registry, before the Trainer chose its accelerator: follow it.
            if not isinstance(self.accelerator, CPUAccelerator) and self.root_device.type == "cpu":
                self._root_device = torch.device("cuda", torch.cuda.current_device())
            super().setup_environment()

        def setup(self, trainer: Any) -> None:
            self.preset.parallelize(self.lightning_module)
            super().setup(trainer)

    return PresetSingleDeviceStrategy
