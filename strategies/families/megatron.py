"""Megatron-style layouts the planner prices and no backend builds: TP inside a node and PP
across nodes, with ZeRO-1 (Megatron's distributed optimizer) over the data-parallel rest. The
runnable ``tp``/``3d`` presets shard data parallel with FSDP2 instead; these stay beside them as
the reference documents' layouts (planner/recommend.py chooses their degrees)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from strategies.base import Capabilities, StrategyConfig, family
from core.knobs import knob
from strategies.footprint import SHARDED, Footprint, Sizes, StateBytes
from core.mesh import Mesh


@family("megatron")
@dataclass
class MegatronConfig(StrategyConfig):
    """TP x PP x ZeRO-1 data parallel (planned only)."""

    CAPABILITIES = Capabilities(lora=False, degrees=("tp", "pp"), planned_only=True)

    tp: int = knob(1, min=1)
    """Tensor-parallel degree."""
    pp: int = knob(1, min=1)
    """Pipeline-parallel degree."""

    def mesh(self, nodes: int, devices: int) -> Mesh:
        return Mesh(nodes, devices, tp=self.tp, pp=self.pp)

    def footprint(self) -> MegatronFootprint:
        return MegatronFootprint()


@dataclass(frozen=True)
class MegatronFootprint(Footprint):
    """bf16 parameters and an fp32 main copy, the optimizer sharded over data parallel."""

    optimizer: str = SHARDED
    master_weights: bool = True

    def state_bytes(self, sb: StateBytes, accounting: str) -> StateBytes:
        if accounting == "actual" and sb.grads < 4:
            # Megatron accumulates and reduces fp32 main gradients: 2 + 4 + 12/dp bytes per param
            return dataclasses.replace(sb, grads=4, reduce=4)
        return sb

    def step_extra(self, n: Sizes) -> float:
        return 0.0
