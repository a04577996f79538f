"""FSDP2 on Lightning: its ModelParallelStrategy (runs on CPU unmodified) with every rank data
parallel. Lightning builds the mesh and calls the module's ``configure_model``; the strategy then
applies the preset's plan (checkpointing -> ``fully_shard`` per block -> the model) unless the
module sharded itself, and gives a meta-built model's shards their weights. The optimizer is
built after that (``configure_optimizers`` in ``setup``), over the sharded DTensor parameters."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy

from backends.common import torch as torch_common
from backends.lightning.families import builds
from backends.lightning.preset import PresetStrategy, sharded, sharded_here
from core.mesh import Axis
from strategies.families.fsdp2 import FSDP2Config
from parallel.parallelize import materialize, parallelize, plan_for


@builds(FSDP2Config)
class PresetModelParallelStrategy(PresetStrategy, ModelParallelStrategy):
    """Lightning's ModelParallelStrategy, data parallel on every rank, the preset's FSDP2."""

    def __init__(self, preset: FSDP2Config):
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=preset.distributed_checkpoint)
        self.preset = preset

    def mesh_shape(self) -> tuple[int, ...]:
        """The data-parallel mesh: (shard,) or, for HSDP, (replicate, shard)."""
        mesh = self.run().mesh
        return (mesh.dp_replicate, mesh.dp_shard) if self.preset.hybrid else (mesh.size,)

    def setup_environment(self) -> None:
        # Lightning's "auto" puts nodes on the data-parallel dimension and devices on the
        # tensor dimension; every rank is data parallel here (HSDP's 2-D mesh is derived from
        # this 1-D one in ``dp_mesh``).
        self._data_parallel_size = self.run().mesh.size
        super().setup_environment()

    def dp_mesh(self) -> Any:
        dp = self.device_mesh[Axis.DATA]
        shape = self.mesh_shape()
        if len(shape) == 1:
            return dp
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(dp.device_type, shape, mesh_dim_names=(Axis.REPLICATE, Axis.SHARD))

    # The module builds the model on the meta device; ``setup`` shards it, then each rank
    # gives only its shards storage and values (``materialize``: a pretrained model's weights
    # read, or a GPT's initial values drawn one part at a time).
    builds_on_meta = True

    def setup(self, trainer: Any) -> None:
        module, run = self.lightning_module, self.run()
        if not sharded(module):
            parallelize(module, plan_for(self.preset, run), dp_mesh=self.dp_mesh(), precision=run.precision)
        materialize(module, self.root_device)
        sharded_here(module)
        super().setup(trainer)

    def engine_settings(self) -> dict[str, Any]:
        return {"tensor_parallel_size": self._tensor_parallel_size,
                "save_distributed_checkpoint": self._save_distributed_checkpoint,
                "mesh_shape": self.mesh_shape()}

    def full_state_dict(self, prefix: str = "") -> dict[str, Any]:
        return torch_common.gathered_state_dict(self.model, prefix)
