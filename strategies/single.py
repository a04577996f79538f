"""One process, no parallelism: the reference every other strategy is compared with."""

from __future__ import annotations

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

    def lightning(self, world: World, run: Run) -> Any:
        import torch
        from lightning.pytorch.strategies import SingleDeviceStrategy

        return SingleDeviceStrategy(torch.device("cuda", 0) if run.accelerator == "gpu" else "cpu")
