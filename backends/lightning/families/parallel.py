"""TP, PP and their compositions on Lightning: its ModelParallelStrategy on a (dp, pp, tp) mesh.

Without a pipeline, Lightning's own loop runs after the preset's plan (TP, checkpointing, FSDP2
over the data-parallel sub-mesh) is applied to the model ``configure_model`` built. With one,
this rank's stages replace the module's model and each ``training_step`` runs the whole schedule
(backends/lightning/pipeline.py). Gradient clipping uses the global norm over every mesh and
stage (``clip_grad_norm``, reached through the module's ``configure_gradient_clipping``).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy

from backends.common import torch as torch_common
from backends.lightning.families import builds
from backends.lightning.pipeline import Pipeline
from backends.lightning.preset import PresetStrategy, sharded, sharded_here
from core.mesh import Axis
from strategies.families.parallel import ParallelConfig
from parallel.context_parallel import flattened
from parallel.clip import clip_global_
from parallel.parallelize import materialize, parallelize, plan_for


@builds(ParallelConfig)
class ParallelStrategy(PresetStrategy, ModelParallelStrategy):
    """Lightning's ModelParallelStrategy on a (dp, pp, tp) mesh, with torch's pipeline schedules."""

    def __init__(self, preset: ParallelConfig):
        super().__init__(data_parallel_size=1, tensor_parallel_size=preset.tp,
                         save_distributed_checkpoint=True)
        self.preset = preset
        self.pipeline: Pipeline | None = None

    # ---------------------------------------------------------- the mesh
    def setup_environment(self) -> None:
        self.begin()
        self._setup_distributed()  # Lightning's: the process group, without its 2-D mesh
        from torch.distributed.device_mesh import init_device_mesh

        mesh = self.run().mesh
        self._data_parallel_size = mesh.dp
        dims = self.preset.mesh_dims(mesh)
        self._device_mesh = init_device_mesh(self.root_device.type, tuple(dims.values()),
                                             mesh_dim_names=tuple(dims))
        self.lightning_module._device_mesh = self._device_mesh

    # ---------------------------------------------------------- the model
    # The module builds the model on the meta device; ``setup`` shards it (a pipeline: cuts its
    # stages first), then each rank gives only what it holds storage and values (``materialize``).
    builds_on_meta = True

    def setup(self, trainer: Any) -> None:
        self.check_model()  # (a module that built its model in configure_model)
        module, preset, run = self.lightning_module, self.preset, self.run()
        plan, mesh = plan_for(preset, run), self.device_mesh
        if preset.pp > 1:
            self.pipeline = Pipeline(module, preset, plan, mesh, device=self.root_device,
                                     precision=run.precision,
                                     accumulation=trainer.accumulate_grad_batches,
                                     dp_mesh=self._data_mesh(), cp_mesh=self._cp_mesh())
        elif not sharded(module):  # (a later trainer call: fit, then test)
            parallelize(module, plan, tp_mesh=mesh[Axis.TENSOR], dp_mesh=self._data_mesh(),
                        cp_mesh=self._cp_mesh(), precision=run.precision)
        materialize(module, self.root_device)
        sharded_here(module)
        super().setup(trainer)  # optimizers over this rank's (stage) parameters

    def _data_mesh(self) -> Any:
        """FSDP2's mesh: the data-parallel ranks, with the cp ranks folded in (torchtitan's
        dp_shard x cp: cp ranks hold different tokens of the same samples)."""
        mesh = self.device_mesh
        if self.preset.cp == 1:
            return mesh[Axis.DATA]
        return flattened(mesh[Axis.DATA, Axis.CONTEXT], Axis.DP_CP)

    def _cp_mesh(self) -> Any:
        """The context-parallel ranks' mesh, or None without context parallelism."""
        return self.device_mesh[Axis.CONTEXT] if self.preset.cp > 1 else None

    @property
    def sequence_shard(self) -> tuple[int, int, bool] | None:
        """(rank, degree, balanced) of this rank's sequence shard under context parallelism
        (torch's head-tail load balancing); None without it."""
        cp = self._cp_mesh()
        return None if cp is None else (cp.get_local_rank(), self.preset.cp, True)

    # ---------------------------------------------------------- the step
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            return super().training_step(*args, **kwargs)
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        return self.pipeline.train_step(self.lightning_module, args[0], batch_idx,
                                        self.precision_plugin.train_step_context())

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """[sum of token losses, tokens] of one batch (recipes/evaluation.py)."""
        if self.pipeline is None:
            return super().validation_step(*args, **kwargs)
        return self.pipeline.eval_step(args[0], self.precision_plugin.val_step_context())

    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        Pipeline.restore_grads(module)  # the schedule's backward already ran
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def clip_grad_norm(self, optimizer: Any, max_norm: float) -> None:
        """The global norm over DTensor gradients of every mesh, summed over the pipeline stages
        (Lightning's clipping takes one rank's plain gradients); clipped when ``max_norm`` > 0."""
        params = [q for g in optimizer.param_groups for q in g["params"]]
        self._grad_norm = clip_global_(params, max_norm, (self.pipeline.group,) if self.pipeline else ())

    def pipeline_report(self) -> dict[str, Any] | None:
        return None if self.pipeline is None else self.pipeline.report()

    def engine_settings(self) -> dict[str, Any]:
        return {"mesh": self.preset.mesh_dims(self.run().mesh)}

    def full_state_dict(self, prefix: str = "") -> dict[str, Any]:
        if self.preset.pp > 1:
            return torch_common.stages_state_dict(self.model, prefix)
        return torch_common.full_state_dict(self.model, prefix)
