"""DeepSpeed ZeRO on Accelerate: its DeepSpeedPlugin fed with the preset's generated DeepSpeed
config (the same the Lightning builder hands Lightning), completed with the run's batch,
clipping and precision, which Accelerate does not fill itself."""

from __future__ import annotations

import importlib.util
from typing import Any

from backends.accelerate.families import Builder, builds
from backends.common import deepspeed as ds
from strategies.families.deepspeed import ZeroConfig


def deepspeed_plugin(config: dict[str, Any]) -> Any:
    """Accelerate's DeepSpeedPlugin for ``config``, with transformers' ZeRO-3 hook (a global that
    makes its ``from_config``/``from_pretrained`` build under ``deepspeed.zero.Init``) set only
    when ``zero3_init_flag`` says so, as Accelerate documents the flag (1.15 sets it on every
    select). train.py builds and partitions the model itself (``model_context``): the hook left on
    there would also partition the builds one rank makes alone -- the checkpoint's meta shapes,
    DPO's reference model -- which then wait on collectives the other ranks never start. A user's
    script turns the flag on (backends/accelerate/user.py). ``DeepSpeedPlugin.select()`` imports
    transformers even when it is not installed: the hook needs it there."""
    from accelerate.utils import DeepSpeedPlugin as Accelerates

    class DeepSpeedPlugin(Accelerates):  # (Accelerate's name: the log line and the repr show it)
        def set_deepspeed_weakref(self) -> None:
            if self.zero3_init_flag and importlib.util.find_spec("transformers") is not None:
                super().set_deepspeed_weakref()

    DeepSpeedPlugin.__qualname__ = "DeepSpeedPlugin"  # (not deepspeed_plugin.<locals>.DeepSpeedPlugin)
    return DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=False)


@builds(ZeroConfig)
class Zero(Builder):
    preset: ZeroConfig

    def kwargs(self, block_cls: type | None = None) -> dict[str, Any]:
        ds.select_accelerator(self.run)
        return {"deepspeed_plugin": deepspeed_plugin(self.preset.deepspeed_json(self.run))}

    def model_context(self, kwargs: dict[str, Any]) -> Any:
        return ds.zero_init(kwargs["deepspeed_plugin"].deepspeed_config, stage=self.preset.stage,
                            offload_params=self.preset.offload_params)

    @property
    def gather_parameters(self) -> Any:
        return ds.gathered if self.preset.stage == 3 else None

    def parallelize(self, model: Any) -> Any:
        return ds.apply_ulysses(super().parallelize(model), self.preset.sp)

    def data_rank(self, rank: int, world: int) -> tuple[int, int]:
        sp = self.preset.sp  # Ulysses: a sequence group reads the same samples
        return rank // sp, max(1, world // sp)

    def sequence_shard(self, rank: int) -> tuple[int, int] | None:
        return (rank % self.preset.sp, self.preset.sp) if self.preset.sp > 1 else None

    def repair(self, model: Any, optimizer: Any) -> None:
        ds.repair(optimizer)
        ds.refuse_skipped_parameters(model, optimizer)  # (ZeRO steps them with stale gradients)

    def held_bytes(self, model: Any, optimizers: list[Any], what: str) -> int:
        return ds.held_bytes(model, optimizers[0] if optimizers else None, what)

    def full_state_dict(self, model: Any) -> dict[str, Any]:
        return ds.full_state_dict(model, self.preset.stage)
