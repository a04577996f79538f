"""FSDP1 on Accelerate: its FullyShardedDataParallelPlugin (version 1), which wraps and
checkpoints the blocks itself. HYBRID_SHARD is refused (see ``problems``)."""

from __future__ import annotations

import math
from typing import Any

from backends.accelerate.families import Builder, builds
from backends.common import torch as torch_common
from strategies.families.fsdp import FSDPConfig


SIZE_WRAP_PARAMS = 100_000_000
"""The size policy's unit (Accelerate's own default): a module of at least this many parameters
not yet in a unit becomes one (the root always is). For a user's model whose block class we do
not know (an exported config without ``export.wrap``)."""


def wrap_policy(auto_wrap: bool, block: type | str | int | None) -> dict[str, Any]:
    """Accelerate's FSDP plugin wrap policy (shared with FSDP2): one unit per ``block`` (a class,
    or a class name of the user's model), or by size (``block``: the minimum parameters of a
    unit), or the root alone (None)."""
    if not auto_wrap or block is None:
        return {"auto_wrap_policy": "no_wrap"}
    if isinstance(block, int):
        return {"auto_wrap_policy": "size_based_wrap", "min_num_params": block}
    return {"auto_wrap_policy": "transformer_based_wrap",
            "transformer_cls_names_to_wrap": block.split(",") if isinstance(block, str) else [block.__name__]}


@builds(FSDPConfig)
class FSDP(Builder):
    preset: FSDPConfig

    def problems(self) -> list[str]:
        if self.preset.hybrid:
            return [f"strategy={self.preset.name} (HYBRID_SHARD) is not supported by backend=accelerate: "
                    "Accelerate builds FSDP1 without a device mesh, and HYBRID_SHARD then derives its "
                    "shard group from the GPUs per node (on CPU, none: it trains silently wrong); "
                    "backend=lightning runs it"]
        return []

    def kwargs(self, block_cls: type | str | int | None = None) -> dict[str, Any]:
        from accelerate.utils import FullyShardedDataParallelPlugin

        p = self.preset
        return {"fsdp_plugin": FullyShardedDataParallelPlugin(
            fsdp_version=1, sharding_strategy=p.sharding_strategy,
            backward_prefetch=None if p.backward_prefetch == "none" else p.backward_prefetch,
            forward_prefetch=p.forward_prefetch, limit_all_gathers=p.limit_all_gathers,
            use_orig_params=p.use_orig_params, cpu_offload=p.offload_params,
            state_dict_type="SHARDED_STATE_DICT" if p.state_dict_type == "sharded" else "FULL_STATE_DICT",
            activation_checkpointing=p.activation_checkpointing,
            **wrap_policy(p.auto_wrap, block_cls),
            # the module is built identically on every rank (the seed alone decides its weights),
            # so there is nothing to broadcast -- and the broadcast wants a CUDA-like device
            sync_module_states=False, cpu_ram_efficient_loading=False)}

    def parallelize(self, model: Any) -> Any:
        return model  # the plugin wraps and checkpoints

    def clip(self, acc: Any, model: Any, max_norm: float) -> Any:
        """The root unit's own ``clip_grad_norm_`` (Accelerate calls it for FSDP1: the norm of the
        flat shards in fp32; README's equivalence notes say how far that is from single's)."""
        return acc.clip_grad_norm_(model.parameters(), max_norm or math.inf)

    def full_state_dict(self, model: Any) -> dict[str, Any]:
        return torch_common.gathered_state_dict(model)
