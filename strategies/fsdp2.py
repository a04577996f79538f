"""FSDP2: per-parameter sharding with ``fully_shard`` (DTensor), through Lightning's
ModelParallelStrategy, which runs on CPU (gloo) unmodified.

Presets: ``fsdp2`` (shard over every rank) and ``hsdp2`` (2-D mesh: replicate x shard).
Lightning builds the mesh and calls ``CausalLM.configure_model``, which builds the plain GPT and
hands it to ``FSDP2Config.parallelize`` (this family's seam, torchtitan style: activation
checkpointing -> ``fully_shard`` per block -> ``fully_shard`` the root). The optimizer is built
after that (Lightning runs ``configure_optimizers`` in ``strategy.setup``, after
``configure_model``), so it holds the sharded DTensor parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strategies.base import SHARDED, Layout, Run, StrategyConfig, checkpoint_blocks, family
from strategies.fsdp import _hybrid_problems, gather_full_state_dict
from strategies.mesh import World


@family("fsdp2")
@dataclass
class FSDP2Config(StrategyConfig):
    """torch FSDP2 (``fully_shard``) through Lightning's ModelParallelStrategy."""

    hybrid: bool = False
    """HSDP: shard inside groups of shard_group_size ranks, replicate across groups (2-D mesh)."""
    shard_group_size: int | None = None
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
                      reshard_after_forward=self.reshard_after_forward)

    def lightning(self, world: World, run: Run) -> Any:
        from lightning.pytorch.strategies import ModelParallelStrategy

        # Every rank is data parallel (HSDP's 2-D mesh is derived in parallelize), so the
        # strategy's data-parallel dimension, and the sampler's, is the whole world.
        return ModelParallelStrategy(data_parallel_size=world.size, tensor_parallel_size=1,
                                     save_distributed_checkpoint=self.distributed_checkpoint)

    # ------------------------------------------------------------------ the parallelize seam
    def parallelize(self, model: Any, device_mesh: Any, *, world: World | None = None,
                    run: Run | None = None) -> Any:
        """Apply FSDP2 to the plain model (called on every rank inside ``configure_model``).
        Without ``world`` (outside train.py) the shard group is ``shard_group_size`` or the mesh."""
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = self._mesh(device_mesh, world)
        precision = run.precision if run is not None else "32"
        low = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
        mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if self.reduce_fp32 else low)
        if self.activation_checkpointing:
            checkpoint_blocks(model)
        for block in model.layers:
            fully_shard(block, mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=mp)
        # The root (embeddings, final norm, output) is used last in forward and first in backward:
        # resharding it after forward would only re-gather it at once.
        fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
        return model

    def _mesh(self, device_mesh: Any, world: World | None) -> Any:
        dp = device_mesh["data_parallel"]
        if not self.hybrid:
            return dp
        from torch.distributed.device_mesh import init_device_mesh

        shard = self.shard_size(world) if world is not None else self.shard_group_size or dp.size()
        return init_device_mesh(dp.device_type, (dp.size() // shard, shard),
                                mesh_dim_names=("replicate", "shard"))

    def full_state_dict(self, trainer: Any) -> dict[str, Any]:
        # ModelParallelStrategy's model is the LightningModule; its ``model`` is the GPT.
        return gather_full_state_dict(trainer.strategy.model, prefix="model.")

