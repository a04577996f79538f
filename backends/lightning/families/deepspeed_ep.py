"""Expert parallelism over DeepSpeed on Lightning (strategies/families/deepspeed_ep.py): ``zero2_ep``
is the DeepSpeed builder with the experts split over the ep group first (parallel/experts.py's
``apply_ep_deepspeed``: the split fsdp_ep makes, tagged and classed as DeepSpeed's own MoE so that
its ZeRO-2 engine reduces and partitions their gradients over its expert-data-parallel groups),
the optimizer's expert parameters in groups of their own, and the final parameters gathered over
the ep group."""

from __future__ import annotations

from typing import Any

from backends.lightning.families import builds
from backends.lightning.families.deepspeed import CPUCapableDeepSpeedStrategy
from backends.common.deepspeed import apply_ep_deepspeed, moe_optimizer_groups
from parallel.experts import gather_experts
from parallel.parallelize import find_model
from strategies.families.deepspeed_ep import ZeroEPConfig


@builds(ZeroEPConfig)
class ExpertParallelDeepSpeedStrategy(CPUCapableDeepSpeedStrategy):
    """ZeRO-2 over every rank for the non-expert parameters; each MoE layer's experts split over
    ``ep`` ranks, their gradients and optimizer state partitioned over the ``dp / ep`` ranks
    holding the same ones."""

    ep_group: Any = None

    def setup(self, trainer: Any) -> None:
        if self.ep_group is None:  # (before the optimizer is built on the local experts)
            model, _ = find_model(self.lightning_module)
            self.ep_group = apply_ep_deepspeed(model, self.preset.ep)
        super().setup(trainer)

    def optimizer_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """What backends/lightning/module.py hands the optimizer: the experts in ``moe`` groups."""
        return moe_optimizer_groups(groups)

    def engine_settings(self) -> dict[str, Any]:
        return {**super().engine_settings(), "ep": self.preset.ep}

    def full_state_dict(self, prefix: str = "") -> dict[str, Any]:
        """Every expert (gathered over the ep group, collectively), keyed as the plain model."""
        state = super().full_state_dict(prefix)
        model, _ = find_model(self.model.module)
        return gather_experts(state, model, self.ep_group, prefix)
