"""ddp and its compression presets on Lightning: its DDPStrategy with the preset's hook and
buckets; the preset's plan (activation checkpointing) applied before DDP wraps the model; the
relaxed presets' parameter synchronization after each optimizer step (backends/common/ddp_comm.py,
the same code the Accelerate loop calls)."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from lightning.pytorch.strategies import DDPStrategy

from backends.common.ddp_comm import Synchronizer
from backends.common.ddp_comm import comm_hook as efficient_hook
from backends.common.replica import rank0_replica
from backends.lightning.families import builds
from backends.lightning.preset import PresetStrategy
from strategies.families.ddp import DDPConfig
from parallel.parallelize import parallelize, plan_for


RANK_STATE = "stratagem_rank_state"
"""Every rank's own state in a Lightning checkpoint of the presets that keep one (a list by rank)."""


def comm_hook(preset: DDPConfig) -> tuple[Any, Any]:
    """torch's DDP communication hook and its state for ``strategy.comm_hook``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if preset.comm_hook == "fp16":
        return default_hooks.fp16_compress_hook, None
    if preset.comm_hook == "bf16":
        return default_hooks.bf16_compress_hook, None
    return efficient_hook(preset)  # PowerSGD, top-k, int8, local SGD, DiLoCo


_UNUSED = "Expected to have finished reduction in the prior iteration"
"""torch DDP's error for a parameter that got no gradient in a step (Lightning rewords it)."""


def unused_parameters_advice(preset: DDPConfig) -> str:
    """What a user whose module leaves a parameter unused in a step does under ``preset``."""
    name = preset.name
    return (f"It looks like your LightningModule has parameters that were not used in producing the loss "
            f"returned by training_step. If this is intentional, set strategy={name}'s key "
            f"strategy.find_unused_parameters=true: Trainer(strategy=stratagem_strategy('{name}', "
            f"'strategy.find_unused_parameters=true')) (from backends.lightning import stratagem_strategy), "
            f"or python train.py strategy={name} strategy.find_unused_parameters=true. Not Lightning's "
            f"strategy='ddp_find_unused_parameters_true': it replaces strategy={name} with Lightning's "
            f"plain DDP (no compression hook, no local SGD).")


def resume_advice(preset: DDPConfig, held: dict[str, Any]) -> str:
    """Why ``preset`` cannot continue a checkpoint that lacks its per-rank state (``held``: what
    the checkpoint has), with a Lightning user's fixes -- their Trainer's arguments, not
    train.py's keys -- and train.py's after them."""
    name = preset.name
    holds = f"strategy={held['preset']}'s on {len(held['ranks'])} rank(s)" if held else "none"
    return (f"strategy={name} keeps state of its own on each rank ({preset.unsaved_state()}), which only its "
            f"own checkpoints on as many ranks hold, so it cannot resume this one exactly (this checkpoint "
            f"holds {holds}): fit(ckpt_path=...) a checkpoint strategy={name} wrote with the same Trainer "
            f"devices x num_nodes, fit without ckpt_path to start again, or resume it with "
            f"Trainer(strategy='stratagem_ddp') (not Lightning's 'ddp', another strategy); with train.py: "
            f"{preset.resume_problem().rpartition('; ')[2]}")


@builds(DDPConfig)
class PresetDDPStrategy(PresetStrategy, DDPStrategy):
    """Lightning's DDPStrategy with the preset's hook and buckets."""

    def __init__(self, preset: DDPConfig):
        hook, state = comm_hook(preset)
        super().__init__(ddp_comm_hook=hook, ddp_comm_state=state,
                         bucket_cap_mb=preset.bucket_cap_mb, static_graph=preset.static_graph,
                         find_unused_parameters=preset.find_unused_parameters,
                         gradient_as_bucket_view=preset.gradient_as_bucket_view)
        self.preset = preset
        self._sync = Synchronizer(preset)
        self._scoring = ExitStack()

    def _enable_model_averaging(self) -> None:
        """Lightning would average with its own PeriodicModelAverager for the post-local-SGD hook;
        local SGD, its hierarchical form and DiLoCo run ours instead (``optimizer_step``), the
        same objects the Accelerate loop steps."""
        self._model_averager = None
        self._sync = Synchronizer(self.preset, nodes=self.num_nodes, devices=self.num_processes)

    @property
    def synchronizer(self) -> Synchronizer:
        """The relaxed presets' parameter synchronization (validation asks it whether replicas
        differ: backends/common/replica.py)."""
        return self._sync

    def on_validation_start(self) -> None:
        """A user's own validation (Lightning's loop; train.py validates in its bridge): under
        local SGD / DiLoCo every rank scores rank 0's replica, not each its own on its share of
        the samples (backends/common/replica.py); each rank's own is back at the end, or before
        a checkpoint saved meanwhile (a ModelCheckpoint at validation end), so the checkpoint
        keeps every rank's own replica."""
        super().on_validation_start()
        self._scoring.enter_context(rank0_replica(self._sync, self.model))

    def on_validation_end(self) -> None:
        self._scoring.close()
        super().on_validation_end()

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        self._sync.before_step(self.model)
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._sync.after_step(self.model)
        return out

    def _setup_model(self, model: Any) -> Any:
        return super()._setup_model(parallelize(model, plan_for(self.preset, self.run())))

    def on_exception(self, exception: BaseException) -> None:
        """DDP's error for a parameter unused in a step: Lightning's advice (``strategy=
        'ddp_find_unused_parameters_true'``) would replace the preset with its plain DDP -- no
        compression, no local SGD -- so the message names the preset's own key instead."""
        super().on_exception(exception)
        exception.args = tuple(unused_parameters_advice(self.preset) if isinstance(a, str) and
                               (_UNUSED in a or "ddp_find_unused_parameters_true" in a) else a
                               for a in exception.args)

    def _register_ddp_hooks(self) -> None:
        """Lightning registers communication hooks on CUDA only and silently drops them
        elsewhere: on CPU (gloo) the compression presets would train uncompressed. torch's
        hooks run on gloo (fp16, PowerSGD), so register them on every device."""
        if self.root_device.type == "cuda" or self._ddp_comm_hook is None:
            return super()._register_ddp_hooks()
        from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook

        _register_ddp_comm_hook(model=self.model, ddp_comm_state=self._ddp_comm_state,
                                ddp_comm_hook=self._ddp_comm_hook,
                                ddp_comm_wrapper=self._ddp_comm_wrapper)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Lightning's own checkpoint (a user's ModelCheckpoint, ``trainer.save_checkpoint``)
        with every rank's own state gathered into it (``RANK_STATE``), so ``ckpt_path`` resumes
        these presets exactly as train.py's checkpoints do. Every rank calls this (Lightning's
        contract); rank 0 writes."""
        self._scoring.close()  # (each rank's own replica, also when saved inside a validation)
        if (own := self.rank_state("")) is not None:
            import torch.distributed as dist

            every: list[Any] = [None] * self.world_size
            dist.all_gather_object(every, own.state_dict())
            checkpoint = {**checkpoint, RANK_STATE: {"preset": self.preset.name, "ranks": every}}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """After the optimizer, this rank's own state from a checkpoint of this preset on as many
        ranks (``save_checkpoint``); any other is refused, as train.py refuses it."""
        super().load_optimizer_state_dict(checkpoint)
        if (own := self.rank_state("")) is None:
            return
        held = checkpoint.get(RANK_STATE) or {}
        if (held.get("preset"), len(held.get("ranks") or ())) != (self.preset.name, self.world_size):
            from core.errors import ConfigError

            raise ConfigError(resume_advice(self.preset, held))
        own.load_state_dict(held["ranks"][self.global_rank])

    def rank_state(self, prefix: str) -> Any:
        """What each rank keeps beyond the checkpoint's model and optimizer (residuals, factors,
        replicas: backends/common/ddp_comm.py ``RankState``); None for presets that keep none."""
        if self.preset.unsaved_state() is None:
            return None
        from backends.common.ddp_comm import RankState

        return RankState(self.model, self.optimizers[0], self._ddp_comm_state, self._sync, prefix=prefix)

    def engine_settings(self) -> dict[str, Any]:
        return {"ddp_kwargs": dict(self._ddp_kwargs),
                "comm_hook": getattr(self._ddp_comm_hook, "__name__", None),
                "comm_state": type(self._ddp_comm_state).__name__}
