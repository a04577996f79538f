"""FSDP2 on Accelerate: its FullyShardedDataParallelPlugin (version 2). HSDP is refused (see
``problems``)."""

from __future__ import annotations

from typing import Any

from backends.accelerate.families import Builder, builds
from backends.accelerate.families.fsdp import wrap_policy
from backends.common import torch as torch_common
from strategies.families.fsdp2 import FSDP2Config
from strategies.parallelize import low_dtype


@builds(FSDP2Config)
class FSDP2(Builder):
    preset: FSDP2Config

    def problems(self) -> list[str]:
        if self.preset.hybrid:
            return [f"strategy={self.preset.name} (HSDP) is not supported by backend=accelerate: Accelerate "
                    "builds HSDP's 2-D mesh only through its ParallelismConfig, which refuses to run "
                    "without a GPU; backend=lightning runs it"]
        return []

    def kwargs(self, block_cls: type | None = None) -> dict[str, Any]:
        import torch
        from accelerate.utils import FullyShardedDataParallelPlugin
        from torch.distributed.fsdp import MixedPrecisionPolicy

        p, low = self.preset, low_dtype(self.run.precision)
        mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if p.reduce_fp32 else low)
        return {"fsdp_plugin": FullyShardedDataParallelPlugin(
            fsdp_version=2, reshard_after_forward=p.reshard_after_forward,
            mixed_precision_policy=mp if low is not None else None,
            state_dict_type="SHARDED_STATE_DICT" if p.distributed_checkpoint else "FULL_STATE_DICT",
            activation_checkpointing=p.activation_checkpointing,
            **wrap_policy(True, block_cls),
            sync_module_states=False, cpu_ram_efficient_loading=False)}

    def parallelize(self, model: Any) -> Any:
        return model  # the plugin shards and checkpoints

    def full_state_dict(self, model: Any) -> dict[str, Any]:
        return torch_common.gathered_state_dict(model)
