"""FSDP2: per-parameter sharding with ``fully_shard`` (DTensor), through Lightning's
ModelParallelStrategy, which runs on CPU (gloo) unmodified.

Presets: ``fsdp2`` (shard over every rank) and ``hsdp2`` (2-D mesh: replicate x shard).
Lightning builds the mesh and calls the module's ``configure_model``, which builds the plain
model; the strategy then applies ``FSDP2Config.parallelize`` to it (torchtitan style: activation
checkpointing -> ``fully_shard`` per block -> ``fully_shard`` the model), unless the module
already sharded itself. The optimizer is built after that (Lightning runs
``configure_optimizers`` in ``strategy.setup``), so it holds the sharded DTensor parameters.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from strategies.base import (SHARDED, Layout, Run, StrategyConfig, checkpoint_blocks, family, find_model,
                             materialize)
from strategies.checks import knob
from strategies.fsdp import _accelerate_wrap, _hybrid_problems, gather_full_state_dict
from strategies.mesh import World


@family("fsdp2")
@dataclass
class FSDP2Config(StrategyConfig):
    """torch FSDP2 (``fully_shard``) through Lightning's ModelParallelStrategy."""

    hybrid: bool = False
    """HSDP: shard inside groups of shard_group_size ranks, replicate across groups (2-D mesh)."""
    shard_group_size: int | None = knob(None, min=1)
    """hybrid only: ranks per shard group (>= 2, divides the world); None: cluster.devices."""
    reshard_after_forward: bool = True
    """Free gathered parameters after each block's forward (false: keep them until backward,
    SHARD_GRAD_OP-like: less traffic, more memory). The root stays gathered either way."""
    reduce_fp32: bool = True
    """Under bf16-mixed/16-mixed, reduce-scatter gradients in fp32 (false: in the low dtype)."""
    distributed_checkpoint: bool = True
    """Checkpoints as a directory of per-rank DCP shards (false: one full file gathered on rank 0)."""

    def problems(self, world: World, run: Run) -> list[str]:
        out = []
        if self.hybrid:
            out += _hybrid_problems(self.shard_group_size, world)
        elif self.shard_group_size is not None:
            out.append(f"strategy.shard_group_size={self.shard_group_size} only applies with "
                       "strategy.hybrid=true (HSDP): remove it, or use strategy=hsdp2")
        if world.tp * world.pp != 1:
            out.append(f"strategy={self.name} is data parallel only: tp={world.tp}, pp={world.pp}; "
                       "use a tensor/pipeline-parallel strategy")
        if run.precision == "16-mixed":
            out.append("trainer.precision=16-mixed with FSDP2: Lightning's ModelParallelStrategy "
                       "refuses it (no gradient scaler for DTensor gradients); allowed: 32, bf16-mixed. "
                       "Set trainer.precision=bf16-mixed")
        return out

    def shard_size(self, world: World) -> int:
        return (self.shard_group_size or world.devices) if self.hybrid else world.size

    def layout(self, world: World) -> Layout:
        return Layout(params=SHARDED, grads=SHARDED, optimizer=SHARDED,
                      shard_group=self.shard_size(world) if self.hybrid else None,
                      reshard_after_forward=self.reshard_after_forward,
                      backward_regather="blocks",  # parallelize keeps the root gathered
                      reduce_fp32=self.reduce_fp32)

    def lightning(self, run: Run | None = None) -> Any:
        return _strategy_class()(self)

    def mesh_shape(self, world: World) -> tuple[int, ...]:
        """The data-parallel mesh: (shard,) or, for HSDP, (replicate, shard)."""
        if not self.hybrid:
            return (world.size,)
        shard = self.shard_size(world)
        return (world.size // shard, shard)

    # ------------------------------------------------------------------ the parallelize seam
    def parallelize(self, module: Any, mesh: Any = None, *, precision: str = "32") -> Any:
        """Apply FSDP2 to the plain model inside ``module`` (on every rank): checkpointing, then
        ``fully_shard`` on each block and on the model. ``mesh``: the data-parallel DeviceMesh,
        1-D, or 2-D (replicate, shard) for HSDP. A module that declares no model (a user's own)
        is sharded child by child."""
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        low = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
        mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if self.reduce_fp32 else low)
        model, block = find_model(module)
        if self.activation_checkpointing:
            checkpoint_blocks(module)
        if block is not None:
            for m in model.modules():
                if isinstance(m, block):
                    fully_shard(m, mesh=mesh, reshard_after_forward=self.reshard_after_forward,
                                mp_policy=mp)
        # The model (embeddings, final norm, output) is used last in forward and first in
        # backward: resharding it after forward would only re-gather it at once.
        roots = [model] if model is not module else [
            c for c in module.children() if any(True for _ in c.parameters())]
        for root in roots:
            fully_shard(root, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
        return module

    def accelerate(self, world: World, run: Run, block_cls: type | None = None) -> dict[str, Any]:
        import torch
        from accelerate.utils import FullyShardedDataParallelPlugin
        from torch.distributed.fsdp import MixedPrecisionPolicy

        low = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(run.precision)
        mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if self.reduce_fp32 else low)
        return {"fsdp_plugin": FullyShardedDataParallelPlugin(
            fsdp_version=2, reshard_after_forward=self.reshard_after_forward,
            mixed_precision_policy=mp if low is not None else None,
            state_dict_type="SHARDED_STATE_DICT" if self.distributed_checkpoint else "FULL_STATE_DICT",
            activation_checkpointing=self.activation_checkpointing,
            **_accelerate_wrap(True, block_cls),
            sync_module_states=False, cpu_ram_efficient_loading=False)}

    def accelerate_problems(self, world: World, run: Run) -> list[str]:
        if self.hybrid:
            return [f"strategy={self.name} (HSDP) is not supported by backend=accelerate: Accelerate "
                    "builds HSDP's 2-D mesh only through its ParallelismConfig, which refuses to run "
                    "without a GPU; backend=lightning runs it"]
        return []

    def full_state_dict(self, root: Any, prefix: str = "") -> dict[str, Any]:
        return gather_full_state_dict(root, prefix=prefix)


@functools.cache
def _strategy_class() -> type:
    from lightning.pytorch.strategies import ModelParallelStrategy

    from strategies.lightning_support import PresetStrategy

    class PresetModelParallelStrategy(PresetStrategy, ModelParallelStrategy):
        """Lightning's ModelParallelStrategy (runs on CPU unmodified) with every rank data
        parallel, and the preset's FSDP2 applied after ``configure_model`` when the module did
        not shard itself."""

        def __init__(self, preset: FSDP2Config):
            super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                             save_distributed_checkpoint=preset.distributed_checkpoint)
            self.preset = preset

        def setup_environment(self) -> None:
            # Lightning's "auto" puts nodes on the data-parallel dimension and devices on the
            # tensor dimension; every rank is data parallel here (HSDP's 2-D mesh is derived
            # from this 1-D one in ``dp_mesh``).
            self._data_parallel_size = self.world().size
            super().setup_environment()

        def dp_mesh(self) -> Any:
            dp = self.device_mesh["data_parallel"]
            shape = self.preset.mesh_shape(self.world())
            if len(shape) == 1:
                return dp
            from torch.distributed.device_mesh import init_device_mesh

            return init_device_mesh(dp.device_type, shape, mesh_dim_names=("replicate", "shard"))

        # The module builds a pretrained model's parameters on the meta device; ``setup``
        # shards them, then each rank loads only its shards (``materialize``).
        builds_on_meta = True

        def setup(self, trainer: Any) -> None:
            from torch.distributed.tensor import DTensor

            module = self.lightning_module
            if not any(isinstance(p, DTensor) for p in module.parameters()):
                self.preset.parallelize(module, self.dp_mesh(), precision=self.run().precision)
            materialize(module, self.root_device)
            super().setup(trainer)

        def engine_settings(self) -> dict[str, Any]:
            return {"tensor_parallel_size": self._tensor_parallel_size,
                    "save_distributed_checkpoint": self._save_distributed_checkpoint,
                    "mesh_shape": self.preset.mesh_shape(self.world())}

    return PresetModelParallelStrategy
