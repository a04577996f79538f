"""Tensor parallel, pipeline parallel and their compositions with FSDP2 data parallelism.

Presets: ``tp`` (Megatron column/row through DTensor ``parallelize_module``), ``fsdp_tp``
(2-D: TP inside, FSDP2 across), ``pipeline`` (``torch.distributed.pipelining`` schedules),
``pp_dp`` (pipeline x data parallel) and ``3d`` (DP x TP x PP). One family, one mesh:
``(data_parallel, pipeline_parallel, tensor_parallel)`` with the tensor dimension innermost
(neighbouring ranks), its arithmetic owned by ``strategies.mesh.World``.

Parallelism is applied from outside the recipe, in the fixed order TP -> activation
checkpointing -> FSDP2, from what the model declares: ``tp_plan`` (which linear layer is column-
or row-parallel, relative to a block) and ``pp_plan`` (the ModuleDict of blocks, and the modules
only the first or last stage runs). A pipeline stage is the model with the other stages'
modules deleted, so its parameter names -- and state-dict and checkpoint keys -- are the full
model's. Data parallelism over ``dp`` ranks is FSDP2 on the data-parallel sub-mesh (torchtitan's
layout); a replica's ``pp x tp`` ranks read the same batch.

The schedules are torch's; Lightning runs one whole schedule (forward and backward of every
micro-batch) per training step, see ``_strategy_class``.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

from strategies.base import SHARDED, Layout, Run, StrategyConfig, checkpoint_blocks, family, find_model
from strategies.checks import knob
from strategies.mesh import World

# schedule name -> (torch class, virtual stages it needs: 1 or >= 2, stage placement)
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "looped_bfs": ("ScheduleLoopedBFS", 2, "loop"),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
}
MESH_DIMS = ("data_parallel", "pipeline_parallel", "tensor_parallel")


@family("parallel")
@dataclass
class ParallelConfig(StrategyConfig):
    """DP x TP x PP on one device mesh: TP through DTensor, PP through torch.distributed.pipelining,
    DP through FSDP2. Lightning backend (Accelerate trains pipelines only through Megatron)."""

    dp: int | None = knob(None, min=1)
    """Data-parallel replicas (FSDP2 over them); None: what the world leaves, size / (tp x pp)."""
    tp: int = knob(1, min=1)
    """Tensor-parallel degree: ranks splitting each layer's heads and hidden features."""
    pp: int = knob(1, min=1)
    """Pipeline-parallel degree: ranks holding consecutive blocks of the model."""
    sequence_parallel: bool = False
    """With tp > 1: shard the norm and dropout regions along the sequence (all-gather before
    attention and the MLP, reduce-scatter after) instead of replicating them."""
    schedule: str = knob("1f1b", choices=tuple(SCHEDULES))
    """Pipeline schedule (torch's): gpipe, 1f1b, or with virtual stages interleaved_1f1b,
    looped_bfs, interleaved_zb, zbv."""
    microbatches: int = knob(4, min=1)
    """Pipeline micro-batches per training step (each of trainer.micro_batch_size samples)."""
    virtual_stages: int | None = knob(None, min=1)
    """Model stages per pipeline rank; None: 1, or 2 for the schedules that need several."""
    stages: int | None = knob(None, min=1)
    """Model stages in all (pp x virtual_stages); None: derived. Setting it derives virtual_stages."""
    split: list[int] | None = None
    """Blocks per stage (sums to model.n_layers); None: balanced by parameter count (the first
    stage also holds the embedding, the last the head)."""
    reshard_after_forward: bool = True
    """FSDP2 over data parallel: free gathered block parameters after forward."""

    # ---------------------------------------------------------------- shape
    def virtual(self) -> int:
        need = SCHEDULES[self.schedule][1]
        if self.virtual_stages is not None:
            return self.virtual_stages
        if self.stages is not None and self.pp >= 1 and self.stages % self.pp == 0:
            return self.stages // self.pp
        return need

    def n_stages(self) -> int:
        return self.pp * self.virtual()

    def chunks(self) -> int:
        """Micro-batches one training step's batch is cut into (1 without a pipeline)."""
        return self.microbatches if self.pp > 1 else 1

    def problems(self, world: World, run: Run) -> list[str]:
        out = []
        if self.dp is not None and self.dp * self.tp * self.pp != world.size:
            out.append(f"strategy.dp({self.dp}) * tp({self.tp}) * pp({self.pp}) = "
                       f"{self.dp * self.tp * self.pp} != world size {world.size} (cluster.nodes "
                       f"{world.nodes} x cluster.devices {world.devices}): set strategy.dp=null to "
                       "derive it, or change the degrees")
        if self.sequence_parallel and self.tp == 1:
            out.append("strategy.sequence_parallel=true needs strategy.tp > 1 (it shards the norm "
                       "regions over the tensor-parallel group): set strategy.tp or turn it off")
        if run.precision == "16-mixed":
            out.append("trainer.precision=16-mixed with DTensor/pipeline parallelism: no gradient "
                       "scaler for DTensor gradients; allowed: 32, bf16-mixed")
        if self.pp > 1:
            out += self._pipeline_problems()
        return out

    def _pipeline_problems(self) -> list[str]:
        out, need = [], SCHEDULES[self.schedule][1]
        if self.stages is not None and self.stages % self.pp:
            out.append(f"strategy.stages={self.stages} is not a multiple of strategy.pp={self.pp}: "
                       "each pipeline rank holds the same number of stages")
        v = self.virtual()
        if need == 1 and v != 1:
            out.append(f"strategy.schedule={self.schedule} runs one stage per rank, but "
                       f"virtual_stages={v}: use interleaved_1f1b (or looped_bfs, interleaved_zb, "
                       "zbv) for several, or set strategy.virtual_stages=1")
        if need > 1 and v < 2:
            out.append(f"strategy.schedule={self.schedule} needs >= 2 virtual stages per rank, "
                       f"got {v}: set strategy.virtual_stages=2 or use schedule=1f1b")
        if self.schedule == "zbv" and v != 2:
            out.append(f"strategy.schedule=zbv places exactly 2 stages per rank (a V): "
                       f"virtual_stages={v}; set it to 2")
        if self.schedule != "gpipe" and self.microbatches < self.pp:
            out.append(f"strategy.microbatches={self.microbatches} < strategy.pp={self.pp}: "
                       f"{self.schedule} needs at least one micro-batch per stage in flight; set "
                       f"strategy.microbatches>={self.pp} (or schedule=gpipe)")
        if self.schedule in ("interleaved_1f1b", "interleaved_zb") and self.microbatches % self.pp:
            out.append(f"strategy.microbatches={self.microbatches} must be a multiple of "
                       f"strategy.pp={self.pp} for {self.schedule}: set microbatches="
                       f"{max(self.pp, self.microbatches // self.pp * self.pp)}")
        return out

    def model_problems(self, model: Any) -> list[str]:
        """Problems of this preset with the model's shape (``recipes.config.ModelConfig``)."""
        out = []
        if self.tp > 1:
            for key in ("n_heads", "n_kv_heads", "hidden", "vocab_size"):
                value = getattr(model, key, None)
                if isinstance(value, int) and value % self.tp:
                    out.append(f"model.{key}={value} is not divisible by strategy.tp={self.tp}: "
                               f"tensor parallelism splits it over the tp ranks; choose tp "
                               f"dividing {key} (or another model)")
        if self.pp > 1:
            n, stages = model.n_layers, self.n_stages()
            if stages > n:
                out.append(f"strategy.pp={self.pp} x virtual_stages={self.virtual()} = {stages} "
                           f"stages > model.n_layers={n}: every stage needs a block; lower pp or "
                           "virtual_stages")
            if self.split is not None and (len(self.split) != stages or sum(self.split) != n
                                           or min(self.split) < 1):
                out.append(f"strategy.split={list(self.split)} must list {stages} stage sizes "
                           f">= 1 summing to model.n_layers={n}")
            if getattr(model, "tie_embeddings", False):
                out.append("model.tie_embeddings=true with strategy.pp > 1: the embedding (first "
                           "stage) and the head (last stage) would share one weight across ranks; "
                           "set model.tie_embeddings=false")
        return out

    def layout(self, world: World) -> Layout:
        # FSDP2 over the data-parallel ranks; TP and PP split what each replica holds (the
        # planner divides by tp x pp).
        return Layout(params=SHARDED, grads=SHARDED, optimizer=SHARDED,
                      reshard_after_forward=self.reshard_after_forward, backward_regather="blocks")

    def world_role(self, world: World) -> str:
        # A mesh dimension spanning every rank is the world group itself (torch reuses it).
        if self.tp == world.size:
            return "tensor"
        if self.pp == world.size:
            return "pipeline"
        return "data-shard"

    def accelerate_problems(self, world: World, run: Run) -> list[str]:
        if self.pp > 1:
            return [f"strategy={self.name} (pipeline parallel) is not supported by "
                    "backend=accelerate (Accelerate trains pipelines only through Megatron-LM): "
                    "use backend=lightning"]
        return [f"strategy={self.name} (tensor parallel) is not supported by backend=accelerate "
                "here: Accelerate builds its TP mesh only through ParallelismConfig on CUDA; "
                "use backend=lightning"]

    def lightning(self, run: Run | None = None) -> Any:
        return _strategy_class()(self)

    # ---------------------------------------------------------------- the parallelize seam
    def parallelize(self, module: Any, mesh: Any = None, *, precision: str = "32") -> Any:
        """TP -> activation checkpointing -> FSDP2 on the (stage) model inside ``module``.
        ``mesh``: the full (dp, pp, tp) DeviceMesh."""
        model, block = find_model(module)
        if self.tp > 1:
            apply_tp(model, mesh["tensor_parallel"], sequence_parallel=self.sequence_parallel)
        if self.activation_checkpointing:
            checkpoint_blocks(module)
        dp = mesh["data_parallel"]
        if dp.size() > 1:
            import torch
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            low = {"bf16-mixed": torch.bfloat16}.get(precision)
            mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
            for m in model.modules():
                if block is not None and isinstance(m, block):
                    fully_shard(m, mesh=dp, reshard_after_forward=self.reshard_after_forward,
                                mp_policy=mp)
            fully_shard(model, mesh=dp, reshard_after_forward=False, mp_policy=mp)
        return module

    def full_state_dict(self, root: Any, prefix: str = "") -> dict[str, Any]:
        """Every stage's parameters, gathered (DTensors in full) and merged on every rank."""
        import torch.distributed as dist

        from strategies.base import plain_state_dict

        mine = plain_state_dict(root.state_dict(), prefix)
        if self.pp == 1 or not dist.is_initialized():
            return mine
        out: list = [None] * dist.get_world_size()
        dist.all_gather_object(out, mine)
        return {k: v for d in out for k, v in d.items()}


# -------------------------------------------------------------------- tensor parallel
def apply_tp(model: Any, mesh: Any, *, sequence_parallel: bool = False) -> Any:
    """Megatron column/row parallelism from the model's ``tp_plan`` on each block; the embedding
    row-parallel (vocab rows split), the head column-parallel with replicated logits. With
    sequence parallelism the residual stream between blocks is sharded along the sequence."""
    import torch
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    sp = sequence_parallel
    plan: dict[str, Any] = {}
    for name, kind in type(model).tp_plan.items():
        if kind == "column":
            plan[name] = ColwiseParallel()
        elif kind == "row":
            plan[name] = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
        else:
            raise ValueError(f"{type(model).__name__}.tp_plan[{name!r}]={kind!r}: column or row")
    if sp:
        plan |= {"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
                 "attn": PrepareModuleInput(input_layouts=(Shard(1), None),
                                            desired_input_layouts=(Replicate(), None)),
                 "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}
    # Where the blocks, the embedding and the head are: the model's ``tp_layout`` (dotted paths;
    # a pipeline stage has some of them set to None).
    where = type(model).tp_layout
    blocks = model.get_submodule(where["blocks"])
    for b in (blocks.values() if isinstance(blocks, torch.nn.ModuleDict) else blocks):
        parallelize_module(b, mesh, plan)
    top: dict[str, Any] = {}
    if _present(model, where["embedding"]):
        top[where["embedding"]] = RowwiseParallel(input_layouts=Replicate(),
                                                  output_layouts=Shard(1) if sp else Replicate())
    if _present(model, where["head"]):
        if sp:
            top[where["norm"]] = SequenceParallel()
        top[where["head"]] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                             output_layouts=Replicate())
    parallelize_module(model, mesh, top)
    return model


def _present(model: Any, path: str) -> bool:
    parent, _, name = path.rpartition(".")
    return getattr(model.get_submodule(parent) if parent else model, name, None) is not None


# -------------------------------------------------------------------- pipeline split
def balanced_split(costs: list[float], first: float, last: float, stages: int) -> list[int]:
    """Blocks per stage, contiguous, minimising the largest stage's parameter count; the first
    stage also carries ``first`` (embedding), the last ``last`` (norm and head)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    @functools.cache
    def best(i: int, s: int) -> tuple[float, tuple[int, ...]]:
        """Blocks i.. over stages s.. : (largest stage, sizes)."""
        if s == stages - 1:
            return prefix[n] - prefix[i] + last + (first if s == 0 else 0), (n - i,)
        out = (float("inf"), ())
        for j in range(i + 1, n - (stages - 1 - s) + 1):
            here = prefix[j] - prefix[i] + (first if s == 0 else 0)
            rest, sizes = best(j, s + 1)
            cand = (max(here, rest), (j - i, *sizes))
            out = min(out, cand)
        return out

    return list(best(0, 0)[1])


def stage_ids(schedule: str, pp_rank: int, pp: int, virtual: int) -> list[int]:
    """The stages a pipeline rank holds: r, r + P, ... (looped), or r and 2P-1-r (a V)."""
    if SCHEDULES[schedule][2] == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual)]


def build_stage(full: Any, layer_ids: list[int], first: bool, last: bool) -> Any:
    """A view of the model that runs only ``layer_ids``: it shares the kept blocks and modules
    with ``full`` (no copy) and has the others deleted (set to None), so what stays keeps its
    names. Several views of one model share their parameters."""
    import copy

    import torch

    plan = type(full).pp_plan
    stage = copy.copy(full)  # a new module object over the same children
    stage._modules, stage._parameters, stage._buffers = (
        dict(full._modules), dict(full._parameters), dict(full._buffers))
    blocks = getattr(full, plan["blocks"])
    setattr(stage, plan["blocks"], torch.nn.ModuleDict({str(i): blocks[str(i)] for i in layer_ids}))
    for name in plan["first"] if not first else ():
        setattr(stage, name, None)
    for name in plan["last"] if not last else ():
        setattr(stage, name, None)
    return stage


def split_model(full: Any, preset: ParallelConfig) -> list[list[int]]:
    """Layer indices per stage: ``strategy.split`` or balanced by parameter count."""
    plan = type(full).pp_plan
    blocks = getattr(full, plan["blocks"])
    sizes = preset.split
    if sizes is None:
        count = lambda mods: float(sum(p.numel() for m in mods if m is not None  # noqa: E731
                                       for p in m.parameters()))
        costs = [count([b]) for b in blocks.values()]
        sizes = balanced_split(costs, count([getattr(full, n) for n in plan["first"]]),
                               count([getattr(full, n) for n in plan["last"]]), preset.n_stages())
    out, i = [], 0
    for s in sizes:
        out.append(list(range(i, i + s)))
        i += s
    return out


# -------------------------------------------------------------------- Lightning
@functools.cache
def _strategy_class() -> type:
    import torch
    import torch.distributed as dist
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.pipelining import PipelineStage

    from strategies.lightning_support import PresetStrategy

    class TimedStage(PipelineStage):
        """A pipeline stage that adds up the time of its forward and backward chunks: the
        schedule's wall time minus this is the rank's idle (bubble) time."""

        compute_seconds = 0.0

        def _timed(self, name: str, *args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return getattr(super(), name)(*args, **kwargs)
            finally:
                self.compute_seconds += time.perf_counter() - t

        def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            return self._timed("forward_one_chunk", *args, **kwargs)

        def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            return self._timed("backward_one_chunk", *args, **kwargs)

        def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            return self._timed("backward_weight_one_chunk", *args, **kwargs)

    class ParallelStrategy(PresetStrategy, ModelParallelStrategy):
        """Lightning's ModelParallelStrategy on a (dp, pp, tp) mesh.

        Without a pipeline, Lightning's own loop runs: the preset's ``parallelize`` (TP, AC,
        FSDP2) is applied after ``configure_model``. With one, this rank's stages replace the
        module's model, and each ``training_step`` runs the whole schedule: forward and
        backward of every micro-batch. Lightning's closure zeroes gradients between the
        training step and ``backward`` on the first batch of an accumulation window, so the
        schedule's gradients are set aside in the step and handed back in ``backward`` (which
        runs no autograd itself). Gradient clipping uses the global norm over every stage.
        """

        def __init__(self, preset: ParallelConfig):
            super().__init__(data_parallel_size=1, tensor_parallel_size=preset.tp,
                             save_distributed_checkpoint=True)
            self.preset = preset
            self.pipeline: dict[str, Any] | None = None

        # ---------------------------------------------------------- the mesh
        def setup_environment(self) -> None:
            self.check()
            self._setup_distributed()  # Lightning's: the process group, without its 2-D mesh
            from torch.distributed.device_mesh import init_device_mesh

            w = self.world()
            self._data_parallel_size = w.dp
            self._device_mesh = init_device_mesh(
                self.root_device.type, (w.dp, self.preset.pp, self.preset.tp), mesh_dim_names=MESH_DIMS)
            self.lightning_module._device_mesh = self._device_mesh

        # ---------------------------------------------------------- the model
        def setup(self, trainer: Any) -> None:
            module, preset = self.lightning_module, self.preset
            model, _ = find_model(module)
            for needed, wanted in (("tp_plan", preset.tp > 1), ("pp_plan", preset.pp > 1)):
                if wanted and not isinstance(getattr(type(model), needed, None), dict):
                    from strategies.mesh import ConfigError

                    raise ConfigError(
                        f"strategy={preset.name} needs a model that declares {needed} (which "
                        f"layers are column/row parallel, or how to cut it into stages), as "
                        f"recipes/gpt.py's GPT does; {type(model).__name__} declares none: add "
                        f"{needed} to the model class, or use a data-parallel preset")
            if preset.pp > 1:
                self._split(module)
            else:
                preset.parallelize(module, self.device_mesh, precision=self.run().precision)
            super().setup(trainer)  # optimizers over this rank's (stage) parameters

        def _split(self, module: Any) -> None:
            from torch.distributed.pipelining import schedules

            preset, mesh = self.preset, self.device_mesh
            full = module.model
            pp_mesh = mesh["pipeline_parallel"]
            group, pp_rank = pp_mesh.get_group(), pp_mesh.get_local_rank()
            layers = split_model(full, preset)
            n = preset.n_stages()
            ids = stage_ids(preset.schedule, pp_rank, preset.pp, preset.virtual())
            stages = []
            for i in ids:
                holder = torch.nn.Module()  # (parallelize finds the model inside a module)
                holder.model = build_stage(full, layers[i], first=i == 0, last=i == n - 1)
                preset.parallelize(holder, mesh, precision=self.run().precision)
                stages.append(holder.model)
            # The module's model: one view of this rank's stages, sharing their blocks (never
            # the checkpoint wrappers), keyed as the full model: the optimizer, the state dict
            # and checkpoints see exactly this rank's parameters under their global names.
            module.model = build_stage(full, [j for i in ids for j in layers[i]],
                                       first=0 in ids, last=n - 1 in ids)
            pipe = [TimedStage(m, i, n, self.root_device, group=group) for m, i in zip(stages, ids)]
            accumulation = max(1, self.lightning_module.trainer.accumulate_grad_batches)

            def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
                if self.pipeline is not None and self.pipeline["eval"]:
                    # validation: the token-loss sum; padding targets are -100, cross entropy's
                    # ignore_index (recipes/evaluation.py's loss_sums, on the last stage)
                    return torch.nn.functional.cross_entropy(
                        logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
                # the recipe's loss on the last stage's logits, over the accumulation window
                return torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1).float(), targets.flatten()) / accumulation

            cls = getattr(schedules, SCHEDULES[preset.schedule][0])
            schedule = (cls(pipe[0], preset.microbatches, loss_fn=loss_fn) if len(pipe) == 1
                        else cls(pipe, preset.microbatches, loss_fn=loss_fn))
            last_owner = stage_ids_owner(preset, n - 1)
            self.pipeline = {"schedule": schedule, "stages": pipe, "group": group,
                             "last": n - 1 in ids, "accumulation": accumulation,
                             "last_rank": dist.get_global_rank(group, last_owner),
                             "wall": 0.0, "steps": 0, "eval": False}

        # ---------------------------------------------------------- the step
        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            if self.pipeline is None:
                return super().training_step(*args, **kwargs)
            p, module = self.pipeline, self.lightning_module
            x, y = args[0]
            batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
            params = list(module.parameters())
            # The schedule divides every gradient it finds by the micro-batch count at its end,
            # so the window's earlier gradients are set aside while it runs, and added after.
            first = batch_idx % p["accumulation"] == 0
            earlier = [None if first else q.grad for q in params]
            for q in params:
                q.grad = None
            losses: list[torch.Tensor] = []
            t = time.perf_counter()
            with self.precision_plugin.train_step_context():
                p["schedule"].step(x, target=y, losses=losses)
            p["wall"] += time.perf_counter() - t
            p["steps"] += 1
            for q, before in zip(params, earlier):
                q._stratagem_grad = q.grad if before is None else (
                    before if q.grad is None else before + q.grad)
                q.grad = None
            loss = (torch.stack(losses).mean().detach().float() * p["accumulation"] if p["last"]
                    else torch.zeros((), device=self.root_device))
            dist.broadcast(loss, src=p["last_rank"], group=p["group"])
            return loss

        def validation_step(self, *args: Any, **kwargs: Any) -> Any:
            """[sum of token losses, tokens] of one batch (recipes/evaluation.py). With a
            pipeline: the schedule's forward-only ``eval`` over the batch's micro-batches; the
            last stage's sum is broadcast to the pipeline group. Its time is kept out of the
            stages' compute time (the bubble measurement is about training)."""
            if self.pipeline is None:
                return super().validation_step(*args, **kwargs)
            p = self.pipeline
            x, y = args[0]
            losses: list[torch.Tensor] = []
            compute = [s.compute_seconds for s in p["stages"]]
            p["eval"] = True
            try:
                with self.precision_plugin.val_step_context():
                    p["schedule"].eval(x, target=y, losses=losses)
            finally:
                p["eval"] = False
                for s, c in zip(p["stages"], compute):
                    s.compute_seconds = c
            total = (torch.stack(losses).sum().detach().double() if p["last"]
                     else torch.zeros((), dtype=torch.float64, device=self.root_device))
            dist.broadcast(total, src=p["last_rank"], group=p["group"])
            return torch.stack([total, (y != -100).sum().double()])  # -100: padding (ignored)

        def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            if self.pipeline is None:
                return super().backward(closure_loss, optimizer, *args, **kwargs)
            module = self.lightning_module
            self.pre_backward(closure_loss)
            closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
            for q in module.parameters():  # the schedule's backward already ran
                q.grad, q._stratagem_grad = q._stratagem_grad, None
            closure_loss = self.precision_plugin.post_backward(closure_loss, module)
            self.post_backward(closure_loss)
            return closure_loss

        def clip_global_norm(self, optimizer: Any, clip_val: float) -> None:
            """Clip to the global norm: over DTensor gradients of every mesh, and summed over the
            pipeline stages (Lightning's clipping takes one rank's plain gradients)."""
            params = [q for g in optimizer.param_groups for q in g["params"]]
            clip_global_(params, clip_val, (self.pipeline["group"],) if self.pipeline else ())

        def pipeline_report(self) -> dict[str, Any] | None:
            """The schedule that ran and, per pipeline rank, the measured idle fraction (the
            schedule's wall time not spent in this rank's forward/backward chunks), next to
            (P-1)/(m+P-1). Collective (gathers over the pipeline group)."""
            p = self.pipeline
            if p is None:
                return None
            compute = sum(s.compute_seconds for s in p["stages"])
            idle = max(0.0, 1 - compute / p["wall"]) if p["wall"] else 0.0
            per_stage: list[Any] = [None] * self.preset.pp
            dist.all_gather_object(per_stage, round(idle, 4), group=p["group"])
            pp, m = self.preset.pp, self.preset.microbatches
            return {"schedule": self.preset.schedule, "microbatches": m,
                    "stages": self.preset.n_stages(), "virtual_stages": self.preset.virtual(),
                    "schedule_steps": p["steps"], "idle_fraction": per_stage,
                    "bubble_predicted": round((pp - 1) / (m + pp - 1), 4)}

        def engine_settings(self) -> dict[str, Any]:
            w = self.world()
            return {"mesh": dict(zip(MESH_DIMS, (w.dp, self.preset.pp, self.preset.tp)))}

    return ParallelStrategy


def stage_ids_owner(preset: ParallelConfig, stage: int) -> int:
    """The pipeline rank that holds ``stage``."""
    for r in range(preset.pp):
        if stage in stage_ids(preset.schedule, r, preset.pp, preset.virtual()):
            return r
    raise ValueError(stage)


def clip_global_(params: list[Any], max_norm: float, groups: tuple[Any, ...] = ()) -> Any:
    """Clip gradients to a global norm over DTensor gradients on any meshes and plain ones,
    summing the squares over ``groups`` whose ranks hold disjoint parameters (pipeline stages)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    by_mesh: dict[Any, list[Any]] = {}
    plain = []
    for g in grads:
        if isinstance(g, DTensor):
            by_mesh.setdefault((g.device_mesh, g.placements), []).append(g)
        else:
            plain.append(g)
    sq = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)
    for group in [*by_mesh.values(), plain]:
        if group:
            n = torch.nn.utils.get_total_norm(group, 2.0)
            n = n.full_tensor() if isinstance(n, DTensor) else n
            sq = sq + n.float() ** 2
    for g in groups:
        dist.all_reduce(sq, group=g)
    coef = torch.clamp(max_norm / (sq.sqrt() + 1e-6), max=1.0)
    for g in grads:
        g.mul_(float(coef) if isinstance(g, DTensor) else coef.to(g.dtype))
    return sq.sqrt()


__all__ = ["MESH_DIMS", "SCHEDULES", "ParallelConfig", "apply_tp", "balanced_split", "build_stage",
           "clip_global_", "split_model", "stage_ids"]
