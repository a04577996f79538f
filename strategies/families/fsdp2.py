"""FSDP2: per-parameter sharding with ``fully_shard`` (DTensor).

Presets: ``fsdp2`` (shard over every rank) and ``hsdp2`` (2-D mesh: replicate x shard). The plan
is torchtitan's: activation checkpointing -> ``fully_shard`` per block -> ``fully_shard`` the
model, applied after the plain model is built and before the optimizer, so the optimizer holds
the sharded DTensor parameters.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from strategies.base import Capabilities, StrategyConfig, family
from core.knobs import knob
from strategies.families.fsdp import hybrid_problems, one_replica
from strategies.footprint import FSDPFootprint
from core.mesh import Mesh
from parallel.parallelize import FSDP2Plan, ParallelPlan
from core.run import Run


@family("fsdp2")
@dataclass
class FSDP2Config(StrategyConfig):
    """torch FSDP2 (``fully_shard``)."""

    CAPABILITIES = Capabilities(sharded_build=("lightning",))  # (Accelerate's plugin: whole)

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

    @property
    def capabilities(self) -> Capabilities:  # (Accelerate's HSDP mesh: ParallelismConfig, CUDA only)
        caps = self.CAPABILITIES
        return dataclasses.replace(caps, backends=("lightning",)) if self.hybrid else caps

    def mesh(self, nodes: int, devices: int) -> Mesh:
        return Mesh(nodes, devices, shard=(self.shard_group_size or devices) if self.hybrid else None)

    def problems(self, run: Run) -> list[str]:
        out = []
        if self.hybrid:
            out += hybrid_problems(self.shard_group_size, run.mesh)
        elif self.shard_group_size is not None:
            out.append(f"strategy.shard_group_size={self.shard_group_size} only applies with "
                       "strategy.hybrid=true (HSDP): remove it, or use strategy=hsdp2")
        if run.precision == "16-mixed":
            out.append("trainer.precision=16-mixed with FSDP2: there is no gradient scaler for "
                       "DTensor gradients (Lightning's ModelParallelStrategy refuses it too); "
                       "allowed: 32, bf16-mixed. Set trainer.precision=bf16-mixed")
        return out

    def notes(self, run: Run) -> list[str]:
        return one_replica(self.name, self.shard_group_size, run.mesh) if self.hybrid else []

    def footprint(self) -> FSDPFootprint:
        return FSDPFootprint(reshard_after_forward=self.reshard_after_forward,
                             reduce_fp32=self.reduce_fp32, fsdp2=True)

    def plan(self, mesh: Mesh) -> ParallelPlan:
        return ParallelPlan(activation_checkpointing=self.activation_checkpointing, ac_every=self.ac_every,
                            fsdp=FSDP2Plan(self.reshard_after_forward, self.reduce_fp32))
