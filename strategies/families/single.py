"""One process, no parallelism: the reference every other strategy is compared with."""

from __future__ import annotations

from dataclasses import dataclass

from strategies.base import StrategyConfig, family
from core.run import Run


@family("single")
@dataclass
class SingleConfig(StrategyConfig):
    """Train in one process on one device."""

    def problems(self, run: Run) -> list[str]:
        m = run.mesh
        if m.size != 1:
            return [f"strategy=single runs one process, but cluster.nodes={m.nodes} x "
                    f"cluster.devices={m.devices} = {m.size}: set cluster.devices=1 "
                    "cluster.nodes=1, or pick a multi-process strategy such as strategy=ddp"]
        return []
