"""FSDP2 on Accelerate: its FullyShardedDataParallelPlugin (version 2). HSDP is refused (see
``problems``)."""

from __future__ import annotations

from typing import Any

from backends.accelerate.families import Builder, builds
from backends.accelerate.families.fsdp import wrap_policy
from backends.common import torch as torch_common
from strategies.families.fsdp2 import FSDP2Config
from core.precision import of
from parallel.parallelize import mixed_policy


@builds(FSDP2Config)
class FSDP2(Builder):
    preset: FSDP2Config

    def problems(self) -> list[str]:
        if self.preset.hybrid:
            return [f"strategy={self.preset.name} (HSDP) is not supported by backend=accelerate: Accelerate "
                    "builds HSDP's 2-D mesh only through its ParallelismConfig, which refuses to run "
                    "without a GPU; backend=lightning runs it"]
        return []

    def kwargs(self, block_cls: type | str | int | None = None) -> dict[str, Any]:
        from accelerate.utils import FullyShardedDataParallelPlugin

        p = self.preset
        mixed = of(self.run.precision).mixed
        return {"fsdp_plugin": FullyShardedDataParallelPlugin(
            fsdp_version=2, reshard_after_forward=p.reshard_after_forward,
            mixed_precision_policy=mixed_policy(self.run.precision, p.reduce_fp32) if mixed else None,
            state_dict_type="SHARDED_STATE_DICT" if p.distributed_checkpoint else "FULL_STATE_DICT",
            activation_checkpointing=p.activation_checkpointing,
            **wrap_policy(True, block_cls),
            sync_module_states=False, cpu_ram_efficient_loading=False)}

    def parallelize(self, model: Any) -> Any:
        return model  # the plugin shards and checkpoints

    def full_state_dict(self, model: Any) -> dict[str, Any]:
        return torch_common.gathered_state_dict(model)
