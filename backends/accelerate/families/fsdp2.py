"""FSDP2 on Accelerate: its FullyShardedDataParallelPlugin (version 2). HSDP is refused (see
``problems``)."""

from __future__ import annotations

from typing import Any

from backends.accelerate.families import Builder, builds
from backends.accelerate.families.fsdp import wrap_policy
from backends.common import torch as torch_common
from strategies.families.fsdp2 import FSDP2Config
from core.precision import of
from parallel.parallelize import checkpoint_blocks, compile_blocks, find_model, mixed_policy


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
            activation_checkpointing=self._plugin_checkpoints(),
            **wrap_policy(True, block_cls),
            cpu_ram_efficient_loading=False)}  # (no sync_module_states: FSDP2 has none, and
            # Accelerate warns on every rank that it is obsolete when it is given, even False)

    def _plugin_checkpoints(self) -> bool:
        """The plugin checkpoints every block whole; selective or every n-th block is ours."""
        p = self.preset
        return p.activation_checkpointing is True and p.ac_every == 1

    def parallelize(self, model: Any) -> Any:
        if self.run.float8 != "none":  # (the plan's first step; the plugin shards after)
            from parallel.float8 import convert

            inner, block = find_model(model)
            convert(inner, self.run.float8, fsdp=True, block=block)
        # the plugin shards (and checkpoints every block whole); other checkpointing is applied
        # here, before it shards the blocks inside the wrappers (as its own checkpointing does)
        p = self.preset
        if p.activation_checkpointing and not self._plugin_checkpoints():
            checkpoint_blocks(model, p.activation_checkpointing, every=p.ac_every)
        # the plugin shards and checkpoints (in prepare, after this): trainer.compile compiles
        # each block here, so FSDP2's gathers stay outside the graphs as on Lightning (with
        # activation checkpointing the plugin's wrapper then runs outside the compiled block)
        if self.run.compile:
            compile_blocks(model)
        return model

    def full_state_dict(self, model: Any) -> dict[str, Any]:
        return torch_common.gathered_state_dict(model)
