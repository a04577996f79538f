"""Expert parallelism over FSDP2 on Lightning (strategies/families/fsdp2_ep.py): ``fsdp_ep`` is the
FSDP2 builder with the experts split over the ep group first (parallel/experts.py, torchtitan's
layout)."""

from __future__ import annotations

from typing import Any

from backends.lightning.families import builds
from backends.lightning.families.fsdp2 import PresetModelParallelStrategy
from backends.lightning.preset import sharded
from core.mesh import Axis
from parallel.experts import apply_ep_fsdp2
from strategies.families.fsdp2_ep import FSDP2EPConfig
from parallel.parallelize import find_model, parallelize, plan_for


@builds(FSDP2EPConfig)
class ExpertParallelFSDP2Strategy(PresetModelParallelStrategy):
    """FSDP2 over every rank for the non-expert parameters; each MoE layer's experts split over
    ``ep`` ranks and FSDP2-sharded over the ``dp / ep`` ranks holding the same ones."""

    def setup(self, trainer: Any) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        module, run = self.lightning_module, self.run()
        if not sharded(module):
            mesh, ep = run.mesh, self.preset.ep
            ep_mesh = init_device_mesh(self.root_device.type, (mesh.dp // ep, ep),
                                       mesh_dim_names=(Axis.EP_REPLICATE, Axis.EP))
            plan = plan_for(self.preset, run)
            model, _ = find_model(module)
            self.ep_group = apply_ep_fsdp2(model, ep, ep_mesh, mesh.dp, plan.fsdp, run.precision)
            parallelize(module, plan, dp_mesh=self.dp_mesh(), precision=run.precision)
        super().setup(trainer)

    def engine_settings(self) -> dict[str, Any]:
        return {**super().engine_settings(), "ep": self.preset.ep}
