"""Expert parallelism over DeepSpeed: the family ``deepspeed_ep`` (preset ``zero2_ep``: ZeRO-2 over
the non-expert parameters; expert gradients and optimizer state partitioned over the dp / ep ranks
that hold the same experts, DeepSpeed's own expert-data-parallel groups). Planned only
(``capabilities.planned_only``: plan.py prices it), refused for training by name (``problems``:
its engine knows only its own MoE layer's parameters as experts). What expert-parallel families
share lives in ``fsdp2_ep.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from strategies.base import Capabilities, family
from core.knobs import knob
from strategies.families.deepspeed import ZeroConfig, ZeroFootprint
from strategies.families.fsdp2_ep import EP_SELECTIVE, ExpertSplit, moe_problems
from core.mesh import Mesh
from core.run import Run


@dataclass(frozen=True)
class ZeroEPFootprint(ExpertSplit, ZeroFootprint):
    pass


@family("deepspeed_ep")
@dataclass
class ZeroEPConfig(ZeroConfig):
    """DeepSpeed ZeRO over the non-expert parameters, the experts split over ``ep`` ranks."""

    SELECTIVE_REFUSED = EP_SELECTIVE

    ep: int = knob(2, min=1)
    """Expert-parallel degree: ranks each holding n_experts / ep experts of every MoE layer (it
    divides the data-parallel size and model.n_experts)."""

    @property
    def capabilities(self) -> Capabilities:
        return dataclasses.replace(super().capabilities, lora=False, degrees=("ep",),
                                   native_config=None, planned_only=True)

    def mesh(self, nodes: int, devices: int) -> Mesh:
        return Mesh(nodes, devices, ep=self.ep)

    def problems(self, run: Run) -> list[str]:
        out = super().problems(run)
        out.append(f"strategy={self.name} is priced by the planner but trains on no backend yet: "
                   "DeepSpeed's ZeRO-2 reduces and partitions expert gradients over its "
                   "expert-data-parallel groups only for models built from its own MoE layer "
                   "(deepspeed.moe.layer.MoE, whose checkpoint format is tied to that layer), not "
                   "for recipes/gpt.py's experts; use strategy=fsdp_ep (FSDP2 + expert parallelism)")
        if self.stage != 2:
            out.append(f"strategy.stage={self.stage} with strategy={self.name}: DeepSpeed partitions "
                       "MoE parameters over its expert-data-parallel groups at ZeRO-2 only (ZeRO-3: "
                       "not supported; ZeRO-1: experimental); allowed: 2")
        return out

    def model_problems(self, model: Any) -> list[str]:
        return super().model_problems(model) + moe_problems(self, self.ep, model)

    def footprint(self) -> ZeroEPFootprint:
        base = super().footprint()
        return ZeroEPFootprint(ep=self.ep, **{f.name: getattr(base, f.name)
                                              for f in dataclasses.fields(ZeroFootprint)})


__all__ = ["ZeroEPConfig", "ZeroEPFootprint"]
