"""Expert parallelism over DeepSpeed: the family ``deepspeed_ep`` (preset ``zero2_ep``: ZeRO-2 over
the non-expert parameters; expert gradients and optimizer state partitioned over the dp / ep ranks
that hold the same experts, DeepSpeed's own expert-data-parallel groups). Trains on Lightning
(backends/lightning/families/deepspeed_ep.py: the MoE layers made DeepSpeed MoE layers, their
experts tagged as DeepSpeed tags its own, backends/common/deepspeed.py); Accelerate refuses it by name.
Its checkpoints are ``zero_ep`` (checkpoints/state.py): DeepSpeed's ``save_checkpoint`` keys a
MoE layer's experts only as its own MoE layer names them. What expert-parallel families share
lives in ``fsdp2_ep.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from core.knobs import knob
from core.mesh import Mesh
from core.run import Run
from strategies.base import ZERO_EP, Capabilities, family
from strategies.families.deepspeed import ZeroConfig
from strategies.families.fsdp2_ep import EP_SELECTIVE, ExpertSplit, moe_problems
from strategies.zero_footprint import ZeroFootprint


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
        return dataclasses.replace(super().capabilities, lora=False, degrees=("ep",), backends=("lightning",),
                                   native_config=None, checkpoint=ZERO_EP)

    def mesh(self, nodes: int, devices: int) -> Mesh:
        return Mesh(nodes, devices, ep=self.ep)

    def problems(self, run: Run) -> list[str]:
        out = super().problems(run)
        if self.stage != 2:
            out.append(f"strategy.stage={self.stage} with strategy={self.name}: DeepSpeed partitions "
                       "MoE parameters over its expert-data-parallel groups at ZeRO-2 only (ZeRO-3: "
                       "not supported; ZeRO-1: experimental); allowed: 2")
        if self.sp > 1:
            out.append(f"strategy.sp={self.sp} with strategy={self.name}: Ulysses beside expert "
                       "parallelism is not built; set strategy.sp=1")
        if self.offload_optimizer != "none" or self.offload_params != "none":
            out.append(f"strategy.offload_optimizer={self.offload_optimizer} strategy.offload_params="
                       f"{self.offload_params} with strategy={self.name}: offloading the expert groups "
                       "is not built; set both to none")
        if getattr(run, "compile", False):
            out.append(f"trainer.compile=true with strategy={self.name}: compiling blocks around the "
                       "experts' all-to-all hooks is not built; set trainer.compile=false")
        return out

    def model_problems(self, model: Any) -> list[str]:
        return super().model_problems(model) + moe_problems(self, model)

    def footprint(self) -> ZeroEPFootprint:
        base = super().footprint()
        return ZeroEPFootprint(ep=self.ep, **{f.name: getattr(base, f.name)
                                              for f in dataclasses.fields(ZeroFootprint)})


__all__ = ["ZeroEPConfig", "ZeroEPFootprint"]
