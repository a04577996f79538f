"""The pipeline runner under Lightning: this rank's stages, torch's schedule, and one whole schedule
(forward and backward of every micro-batch) per Lightning training step.

Lightning's closure zeroes gradients between the training step and ``backward`` on the first
batch of an accumulation window, and torch's schedule divides every gradient it finds by the
micro-batch count at its end: so the window's earlier gradients are set aside before the schedule
runs, added after, and handed back in ``backward`` (which runs no autograd). The loss is the
recipe's (recipes/training.py), on the last stage, broadcast over the pipeline group. Idle time
per stage is measured by a ``PipelineStage`` that times its forward/backward chunks.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, schedules

from recipes import evaluation, training
from recipes.data import IGNORE
from core.mesh import Axis
from strategies.families.parallel import ParallelConfig
from parallel.parallelize import ParallelPlan, materialize, parallelize
from parallel.pipeline import SCHEDULES, bubble, build_stage, split_model, stage_ids, stage_owner


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

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        # torch's first schedule infers shapes by running the stage once on real tensors and
        # keeps part of that graph: not the model's activations, so hidden from the memory
        # observer's saved-tensor count (an inner pair of hooks that count nothing)
        with torch.autograd.graph.saved_tensors_hooks(_same, _same):
            return super()._prepare_forward_infra(*args, **kwargs)


def _same(t: Any) -> Any:
    return t


class Pipeline:
    """This rank's stages of the model inside ``module`` and torch's schedule over them.

    Building it replaces ``module.model`` by one view of this rank's stages, sharing their
    blocks (never the checkpoint wrappers), keyed as the full model: the optimizer, the state
    dict and checkpoints see exactly this rank's parameters under their global names."""

    def __init__(self, module: Any, preset: ParallelConfig, plan: ParallelPlan, mesh: Any, *,
                 device: Any, precision: str, accumulation: int, dp_mesh: Any, cp_mesh: Any = None):
        full = module.model
        pp_mesh = mesh[Axis.PIPELINE]
        self.group, pp_rank = pp_mesh.get_group(), pp_mesh.get_local_rank()
        self.preset, self.device, self.accumulation = preset, device, max(1, accumulation)
        n = preset.n_stages()
        layers = split_model(full, n, preset.split)
        ids = stage_ids(preset.schedule, pp_rank, preset.pp, preset.virtual())
        stages = []
        for i in ids:
            holder = torch.nn.Module()  # (parallelize finds the model inside a module)
            holder.model = build_stage(full, layers[i], first=i == 0, last=i == n - 1)
            parallelize(holder, plan, tp_mesh=mesh[Axis.TENSOR],
                        dp_mesh=dp_mesh, cp_mesh=cp_mesh, precision=precision)
            stages.append(holder.model)
        module.model = build_stage(full, [j for i in ids for j in layers[i]],
                                   first=0 in ids, last=n - 1 in ids)
        materialize(module, device)  # (a meta build: only this rank's stages get storage)
        self.stages = [TimedStage(m, i, n, device, group=self.group) for m, i in zip(stages, ids)]
        cls = getattr(schedules, SCHEDULES[preset.schedule][0])
        self.schedule = (cls(self.stages[0], preset.microbatches, loss_fn=self._loss)
                         if len(self.stages) == 1 else cls(self.stages, preset.microbatches, loss_fn=self._loss))
        # Only the rank holding the first stage hands the schedule its inputs (torch 2.11 refuses
        # them on the others: shape inference there receives from the previous stage).
        self.first, self.last = 0 in ids, n - 1 in ids
        owner = stage_owner(preset.schedule, n - 1, preset.pp, preset.virtual())
        self.last_rank = dist.get_global_rank(self.group, owner)
        self.wall, self.steps, self.evaluating = 0.0, 0, False
        self.share = 1.0  # this step's token-true loss weight (recipes/data.py CountedShare)

    def _inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x,) if self.first else ()

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.evaluating:  # the token-loss sum (padding targets are ignored)
            return evaluation.loss_sums(logits, targets)[0]
        # the recipe's loss on the last stage's logits, over the accumulation window
        return training.token_loss(logits, targets, self.share) / self.accumulation

    def train_step(self, module: Any, batch: Any, batch_idx: int, context: Any) -> torch.Tensor:
        """Forward and backward of every micro-batch; gradients set aside for ``backward``."""
        x, y = batch
        self.share = module.step_share()
        params = list(module.parameters())
        # The schedule divides every gradient it finds by the micro-batch count at its end, so
        # the window's earlier gradients are set aside while it runs, and added after.
        first = batch_idx % self.accumulation == 0
        earlier = [None if first else q.grad for q in params]
        for q in params:
            q.grad = None
        losses: list[torch.Tensor] = []
        t = time.perf_counter()
        with context:
            self.schedule.step(*self._inputs(x), target=y, losses=losses)
        self.wall += time.perf_counter() - t
        self.steps += 1
        for q, before in zip(params, earlier):
            q._stratagem_grad = q.grad if before is None else (before if q.grad is None else before + q.grad)
            q.grad = None
        loss = (torch.stack(losses).mean().detach().float() * self.accumulation if self.last
                else torch.zeros((), device=self.device))
        dist.broadcast(loss, src=self.last_rank, group=self.group)
        return loss

    @staticmethod
    def restore_grads(module: Any) -> None:
        """Hand the schedule's gradients back (Lightning's ``backward`` runs no autograd here)."""
        for q in module.parameters():
            q.grad, q._stratagem_grad = q._stratagem_grad, None

    def eval_step(self, batch: Any, context: Any) -> torch.Tensor:
        """[sum of token losses, tokens] of one batch through the schedule's forward-only
        ``eval``; its time is kept out of the stages' compute time (the bubble is about training)."""
        x, y = batch
        losses: list[torch.Tensor] = []
        compute = [s.compute_seconds for s in self.stages]
        self.evaluating = True
        try:
            with context:
                self.schedule.eval(*self._inputs(x), target=y, losses=losses)
        finally:
            self.evaluating = False
            for s, c in zip(self.stages, compute):
                s.compute_seconds = c
        total = (torch.stack(losses).sum().detach().double() if self.last
                 else torch.zeros((), dtype=torch.float64, device=self.device))
        dist.broadcast(total, src=self.last_rank, group=self.group)
        return torch.stack([total, (y != IGNORE).sum().double()])

    def report(self) -> dict[str, Any]:
        """The schedule that ran and, per pipeline rank, the measured idle fraction (the
        schedule's wall time not spent in this rank's chunks), next to the schedule's own
        bubble (``parallel.pipeline.bubble``: its chunk order simulated with a backward twice
        the forward) and their ratio. Collective (gathers over the pipeline group)."""
        p = self.preset
        compute = sum(s.compute_seconds for s in self.stages)
        idle = max(0.0, 1 - compute / self.wall) if self.wall else 0.0
        per_stage: list[Any] = [None] * p.pp
        dist.all_gather_object(per_stage, round(idle, 4), group=self.group)
        predicted = bubble(p.schedule, p.pp, p.virtual(), p.microbatches,
                           recompute=p.activation_checkpointing is True)
        mean = sum(per_stage) / len(per_stage)
        return {"schedule": p.schedule, "microbatches": p.microbatches, "stages": p.n_stages(),
                "virtual_stages": p.virtual(), "schedule_steps": self.steps, "idle_fraction": per_stage,
                "bubble_predicted": round(predicted, 4), "idle_mean": round(mean, 4),
                "idle_vs_predicted": round(mean / predicted, 3) if predicted else None}
