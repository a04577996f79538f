"""DeepSpeed ZeRO on Lightning: its DeepSpeedStrategy minus its three refusals of non-CUDA
accelerators.

On CUDA the subclass behaves like its parent except for (4) below. On CPU it (1) skips the
CUDA-only accelerator check in ``setup_environment``, (2) skips the device-index check in
``setup_distributed`` (CPU devices have no index), (3) hands the engine ``device_rank=local rank``
instead of the CPU device's index ``None``, for training and for the inference engine of
validate/test/predict. It also passes ``scale_wrt_gas=False`` to the engine's
backward: Lightning has already divided the loss by ``accumulate_grad_batches``, and DeepSpeed
dividing it again would shrink accumulated gradients by the accumulation. On every accelerator it
(4) repairs how DeepSpeed reads gradients back from NVMe when the optimizer state is there
(backends/common/deepspeed.py), and (5) stops the run before a step in which a parameter that
had a gradient earlier has none (ZeRO would step it with a stale gradient). Under ZeRO-3 it
(6) builds the model under the Accelerate backend's ``zero.Init`` (backends/common/deepspeed.py
``zero_init``: drawn in fp32, cast to 16-bit as partitioned, the init ZeRO-1/2 start from) and
refuses a write into a partitioned parameter while ``configure_model`` runs (lost otherwise)
and (7) says what a backward that failed on a parameter used outside any module's forward means
(backends/common/partitioned.py). Lightning fills what the generated config leaves open from the
Trainer: accumulation, micro batch, clipping and the precision sections.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from typing import Any, Iterator

from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

from backends.common import deepspeed as ds
from backends.common import partitioned
from backends.lightning.families import builds, warn_cast
from backends.lightning.preset import PresetStrategy
from strategies.families.deepspeed import ZeroConfig
from parallel.parallelize import parallelize, plan_for
from core.run import Run


@builds(ZeroConfig)
class CPUCapableDeepSpeedStrategy(PresetStrategy, DeepSpeedStrategy):
    strategy_name = "stratagem_deepspeed"

    def __init__(self, preset: ZeroConfig):
        remote = preset.offload_params if preset.offload_params != "none" else None
        super().__init__(config=preset.deepspeed_json(), remote_device=remote)
        self.preset = preset

    @classmethod
    def of(cls, preset: ZeroConfig, run: Run | None = None) -> CPUCapableDeepSpeedStrategy:
        if run is not None:
            ds.select_accelerator(run)
        return cls(preset).keep(run)

    @property
    def gather_parameters(self) -> Any:
        """How the model writes whole tensors into its ZeRO-3 partitions (built under zero.Init)."""
        return ds.gathered if self.preset.stage == 3 else None

    @property
    def _on_cpu(self) -> bool:
        return isinstance(self.accelerator, CPUAccelerator)

    def engine_settings(self) -> dict[str, Any]:
        return {"config": self.config, "remote_device": self.remote_device}

    def setup_environment(self) -> None:
        self.begin()
        if not self._on_cpu:
            return DeepSpeedStrategy.setup_environment(self)
        ds.check_accelerator()
        DDPStrategy.setup_environment(self)  # (1) the parent refuses any non-CUDA accelerator

    def setup(self, trainer: Any) -> None:
        warn_cast(self)  # (Lightning's precision plugin casts the module first: convert_module)
        super().setup(trainer)

    @contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        """Lightning's (``configure_model`` inside ``deepspeed.zero.Init``), under the zero.Init
        the Accelerate backend builds in too (``zero_init``: the constructors draw in fp32, each
        module's parameters cast to 16-bit as it is partitioned; Lightning's drew in bf16),
        refusing (6) a write into a parameter zero.Init already partitioned: it would be lost
        without a word."""
        self._init_config_if_needed()  # (the parent's first step: the config's precision section)
        with ds.zero_init(self.config, stage=self.preset.stage, offload_params=self.preset.offload_params):
            if not self.zero_stage_3:
                yield
                return
            module = self.lightning_module
            with partitioned.refuse_partitioned_writes(self.preset.name, module.named_parameters):
                yield

    def on_exception(self, exception: BaseException) -> None:
        """(7) A backward that failed on a partitioned parameter used outside any module's forward
        (an L2 penalty in training_step): autograd's or DeepSpeed's shape error, said plainly."""
        super().on_exception(exception)
        if self.zero_stage_3:
            partitioned.explain_use_outside_forward(exception, self.preset.name, self.lightning_module)

    def setup_distributed(self) -> None:
        if not self._on_cpu:
            return super().setup_distributed()
        reset_seed()  # (2) as the parent, minus _validate_device_index_selection
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        self.check_model()  # (a module that built its model in configure_model)
        # activation checkpointing (torch's non-reentrant wrapper, which ZeRO-3's gather hooks
        # see through) before the engine registers its hooks
        model = parallelize(model, plan_for(self.preset, self.run()))
        model = ds.apply_ulysses(model, self.preset.sp)  # Ulysses' all-to-all around attention
        if not self._on_cpu:
            engine, ds_optimizer = super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)
        else:
            import deepspeed

            # (3) the parent passes root_device.index, None on CPU, which the engine rejects
            engine, ds_optimizer, _, _ = deepspeed.initialize(
                args=argparse.Namespace(device_rank=self.local_rank),
                config=self.config,
                model=model,
                model_parameters=[p for p in model.parameters() if p.requires_grad],
                optimizer=optimizer,
                lr_scheduler=lr_scheduler,
                dist_init_required=False,
            )
        ds.repair(ds_optimizer)  # (4)
        ds.refuse_skipped_parameters(engine, ds_optimizer)  # (5)
        return engine, ds_optimizer

    def _initialize_deepspeed_inference(self, model: Any) -> None:
        """validate/test/predict without fit: the parent's inference engine, whose device rank
        is (3) the local rank on CPU, not the CPU device's index None."""
        if not self._on_cpu:
            return super()._initialize_deepspeed_inference(model)
        import deepspeed
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        config = {"train_micro_batch_size_per_gpu": 1,  # (the parent's: DeepSpeed's timers need it)
                  **{k: self.config[k] for k in ("fp16", "bf16") if k in self.config}}
        if self.zero_stage_3:
            config.update({k: self.config[k] for k in ("zero_allow_untested_optimizer", "zero_optimization")})
        remove_module_hooks(model)
        self.model, _, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank), config=config, model=model,
            optimizer=None, lr_scheduler=None, model_parameters=[], dist_init_required=False)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # Ulysses: the sp ranks of a sequence group read the same samples
        sp = self.preset.sp
        return {"num_replicas": max(1, self.world_size // sp), "rank": self.global_rank // sp}

    @property
    def sequence_shard(self) -> tuple[int, int] | None:
        """(rank, degree) of this rank's sequence shard under Ulysses; None without it."""
        sp = self.preset.sp
        return (self.global_rank % sp, sp) if sp > 1 else None

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        kwargs.setdefault("scale_wrt_gas", False)  # Lightning already divided by accumulation
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def clip_grad_norm(self, optimizer: Any, max_norm: float) -> None:
        """DeepSpeed measures and clips in its own step (the config's gradient_clipping)."""

    def grad_norm(self) -> float | None:
        norm = self.model.get_global_grad_norm()  # the engine's, before clipping
        return None if norm is None else float(norm)

    def held_bytes(self, what: str) -> int:
        return ds.held_bytes(self.model, self.optimizers[0] if self.optimizers else None, what)

    def full_state_dict(self, prefix: str = "") -> dict[str, Any]:
        return ds.full_state_dict(self.model, self.preset.stage, prefix)
