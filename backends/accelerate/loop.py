"""The training loop of one rank on ``accelerate.Accelerator``: the same recipe as the Lightning
backend (recipes/training.py), the same data order, observers and report.

Per optimizer step: ``accumulation`` micro-batches under ``accelerator.accumulate`` (DDP's
``no_sync`` and the 1/accumulation scale come from Accelerate), the global gradient norm and
clipping by the builder (``parallel.clip.clip_global_``, the Lightning presets' measure; FSDP1:
its root unit's through ``accelerator.clip_grad_norm_``), then the optimizer and the LR schedule.
DeepSpeed does the accumulation, clipping and step inside its engine: the loop calls the engine's
own ``backward``/``step`` (what Accelerate's wrapper calls) so the observers see the gradients
before the step, as on every other path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import checkpoints
from backends import Outcome
from backends.accelerate import families
from backends.accelerate.state import accelerator
from backends.common.replica import rank0_replica
from core.precision import of
from observers import startup
from observers.memory import release_freed
from parallel.float8 import precompute_after_step
from recipes import evaluation, training
from recipes.data import CountedShare, GlobalBatchSampler, build_datasets, data_facts, train_loader
from recipes.dpo import objective_for
from recipes.job import optimizer_device

if TYPE_CHECKING:
    from observers import Observers
    from recipes.job import Job

log = logging.getLogger(__name__)


@dataclass
class AccelerateEngine:
    """The ``observers.Engine`` view of a prepared Accelerate run."""

    acc: Any
    model: Any
    optimizers: list[Any]
    builder: families.Builder
    norm: Any = None
    """The last step's global gradient norm before clipping (the builder's ``clip`` or DeepSpeed's)."""

    def held_bytes(self, what: str) -> int:
        return self.builder.held_bytes(self.model, self.optimizers, what)

    def grad_norm(self) -> float | None:
        return None if self.norm is None else float(self.norm)

    def logits(self, tokens: torch.Tensor) -> Any:
        """Through the prepared model (DDP, FSDP, a DeepSpeed engine), which applies the run's
        autocast itself."""
        return self.model(tokens.to(self.acc.device))

    @property
    def rank(self) -> int:
        return self.acc.process_index

    @property
    def world_size(self) -> int:
        return self.acc.num_processes


def _prepare(acc: Any, job: Job, model: torch.nn.Module, names: tuple[list[str], frozenset[str]]
             ) -> tuple[Any, torch.optim.Optimizer, Any]:
    """(prepared model, the torch optimizer the recipe built, the prepared optimizer).
    ``names``: the plain model's parameter names and those exempt from weight decay."""
    def optimizer(m: torch.nn.Module) -> torch.optim.Optimizer:
        # (built before prepare moves the model: auto decides for where the optimizer will step)
        opt = training.build_optimizer(training.param_groups(m.named_parameters(), job.trainer, *names),
                                       job.trainer, device=optimizer_device(job.strategy, job.run))
        precompute_after_step(m, opt)  # (float8 weights gathered by FSDP2: their scales)
        return opt

    if acc.distributed_type.name == "FSDP" and not acc.is_fsdp2:
        # FSDP1: the optimizer must hold the wrapped (flat) parameters -- prepared together with
        # use_orig_params=False, it keeps the originals and the model never changes.
        model = acc.prepare(model)
        raw = optimizer(model)
        return model, raw, acc.prepare(raw)
    raw = optimizer(model)
    model, opt = acc.prepare(model, raw)
    return model, raw, opt


@dataclass
class Prepared:
    """One rank's engine, prepared: what the loop steps."""

    acc: Any
    builder: families.Builder
    model: Any
    opt: Any
    """The optimizer as Accelerate prepared it."""
    engine_opt: Any
    """The optimizer the engine steps (DeepSpeed: its ZeRO optimizer)."""
    sched: Any
    handles: Any
    """What the checkpoint code reads and restores."""

    @property
    def deepspeed(self) -> bool:
        return self.acc.distributed_type.name == "DEEPSPEED"


def prepare(job: Job) -> Prepared:
    """The Accelerator (it joins the process group), then the model and optimizer."""
    t, run = job.trainer, job.run
    builder = families.builder(job.strategy, run)
    kwargs = builder.kwargs(getattr(training.model_class(job.model), "block_cls", None))
    acc = accelerator(kwargs, on_cpu=run.accelerator == "cpu", world_size=job.mesh.size,
                      timeout=job.cluster.collective_timeout,
                      mixed_precision=of(run.precision).accelerate,
                      gradient_accumulation_steps=job.batch.accumulation)
    startup.mark("rendezvous")  # (Accelerate's state: the process group)
    log.info("accelerate: %s x %d process(es), %s", acc.distributed_type.name, acc.num_processes,
             type(kwargs.get("fsdp_plugin") or kwargs.get("deepspeed_plugin") or acc).__name__)
    with builder.model_context(kwargs):
        model = training.build_model(job.model, t.seed, gather=builder.gather_parameters)
    names = ([n for n, _ in model.named_parameters()], training.no_decay_names(model))
    model, raw_opt, opt = _prepare(acc, job, builder.parallelize(model), names)
    engine_opt = model.optimizer if acc.distributed_type.name == "DEEPSPEED" else raw_opt
    builder.repair(model, engine_opt)
    sched = training.build_scheduler(raw_opt, t)
    handles = checkpoints.Handles(model=model, optimizer=raw_opt, scheduler=sched,
                                  rank=acc.process_index, world_size=acc.num_processes,
                                  format=run.checkpoint,
                                  rank_state=getattr(builder, "rank_state", lambda *_: None)(model, raw_opt))
    startup.mark("model_build")
    return Prepared(acc, builder, model, opt, engine_opt, sched, handles)


def train(job: Job, out: Path, observers: Observers, built: Any = None) -> Outcome:
    """Run this rank; returns its outcome (every rank gets the report; rank 0 the exported
    parameters, ``trainer.export_params``). On SIGUSR1/SIGTERM/SIGINT every rank finishes its
    step, all save, and ``Interrupted`` is raised (checkpoints/interrupt.py). ``built``: the
    backend's ``Built``, which keeps the Accelerator for ``forget``."""
    p = prepare(job)
    if built is not None:
        built.accelerator = p.acc
    ckpt = checkpoints.start(job, out, rank=p.acc.process_index, world_size=p.acc.num_processes,
                             device=p.acc.device)
    start = checkpoints.load(p.handles, ckpt) if ckpt is not None else 0
    startup.mark("checkpoint_load")
    release_freed()  # (the build's and the restore's one-off buffers: observers/memory.py)
    saved: tuple[int, Path | None] = (start, ckpt.path) if ckpt is not None else (-1, None)

    def save(step: int) -> Path:
        nonlocal saved
        if saved[0] != step:
            saved = (step, checkpoints.save(p.handles, job, out, step, observers.history()))
        return saved[1]

    engine = AccelerateEngine(p.acc, p.model, [p.engine_opt], p.builder)
    if ckpt is not None:
        observers.resume(engine, ckpt.step, ckpt.path, ckpt.history())
    history = ckpt.history() if ckpt is not None else {}
    return _loop(job, out, observers, p, engine, start, save, checkpoints.interruption().install(),
                 history)


def _loop(job: Job, out: Path, observers: Observers, p: Prepared, engine: AccelerateEngine, start: int,
          save: Callable[[int], Path], interrupt: Any, history: dict[str, Any]) -> Outcome:
    t, acc, model, opt = job.trainer, p.acc, p.model, p.opt
    observers.meta["engine"] = {"distributed_type": acc.distributed_type.name,
                                "wrapped_model": type(model).__name__}
    with startup.span("data"):  # (reading, tokenizing, the cache: report.json's startup)
        data, val = build_datasets(job.data, job.model, t.seed)
        observers.meta["data"] = data_facts(data, (t.max_steps, job.batch.global_size, t.seed))
    validator = None if val is None else evaluation.Validator(
        val, micro_batch=job.batch.per_step, val_every=t.val_every, max_steps=t.max_steps)
    if validator is not None:
        validator.resume(history, start)
    dp_rank, dp_size = p.builder.data_rank(acc.process_index, acc.num_processes)
    seq = p.builder.sequence_shard(acc.process_index)
    sampler = GlobalBatchSampler(len(data), global_batch=job.batch.global_size,
                                 micro_batch=job.batch.per_step, dp_rank=dp_rank,
                                 dp_size=dp_size, seed=t.seed, steps=t.max_steps,
                                 start_step=start)
    batches = iter(train_loader(data, sampler, job.data.num_workers, seq, t.seed))
    share = CountedShare(data, global_batch=job.batch.global_size, seed=t.seed)
    objective = objective_for(job, data, out, observers.meta, resumed=start > 0)  # (a checkpoint's step is >= 1)
    observers.train_start(engine, start)
    model.train()
    for step in range(start, t.max_steps):
        observers.step_start(engine, step)
        micro = []
        p.builder.before_step(model)
        for _ in range(job.batch.accumulation):
            batch = tuple(x.to(acc.device) for x in next(batches))
            with acc.accumulate(model):
                observers.forward_start(engine, step)
                loss = training.loss(model, batch, t.loss_chunk, share(step), objective, step)
                observers.forward_end(engine, step)
                micro.append(loss.detach().float())
                if p.deepspeed:
                    _deepspeed_backward(acc, model, loss, lambda: observers.before_optimizer_step(engine, step))
                    engine.norm = model.get_global_grad_norm()  # the engine's, before its clipping
                else:
                    acc.backward(loss)
                    if acc.sync_gradients:
                        observers.before_optimizer_step(engine, step)
                        # the global norm (grad_clip 0: measured, not clipped), across shards
                        engine.norm = p.builder.clip(acc, model, t.grad_clip)
                    opt.step()  # a no-op until the accumulation boundary
                    if acc.sync_gradients:  # (torch's averagers average parameters with gradients)
                        p.builder.after_step(model)
                    opt.zero_grad()
        p.sched.step()
        observers.step_work_end(engine, step)
        loss = float(acc.reduce(torch.stack(micro).mean(), reduction="mean"))
        observers.step_end(engine, step + 1, loss)
        if validator is not None and step + 1 in validator.due:
            _validate(validator, observers, engine, p, step + 1, t.loss_chunk)
        decision = validator.decide(t, step + 1) if validator is not None else None
        if checkpoints.due(t, step + 1, decision):
            save(step + 1)
        if decision is not None and decision.stop:  # (trainer.early_stopping: every rank alike)
            break
        if step + 1 < t.max_steps and (signum := interrupt.requested(acc.device)):
            raise checkpoints.Interrupted(signum, step + 1, save(step + 1))
    if objective is not None:
        objective.publish()  # (report.json dpo; every rank: a collective)
    report = observers.train_end(engine)
    # (every rank gathers -- a collective under fsdp/zero3 and 16-bit ZeRO -- and rank 0 keeps them: backends.run
    # writes params.pt after the last collective, where no peer's timeout runs)
    params = p.builder.full_state_dict(model) if t.export_params else None
    return Outcome(rank=acc.process_index, report=report, params=params if acc.is_main_process else None)


def _validate(validator: evaluation.Validator, observers: Observers, engine: AccelerateEngine,
              p: Prepared, step: int, chunk: int = 0) -> None:
    """The held-out loss through the prepared model (DDP, FSDP, a DeepSpeed engine), which
    applies the run's autocast itself, handed to the observers; under local_sgd and diloco every
    rank validates rank 0's replica (backends/common/replica.py), as the Lightning bridge does."""
    acc, model, builder = p.acc, p.model, p.builder
    dp_rank, dp_size = builder.data_rank(acc.process_index, acc.num_processes)
    observers.validation_start(engine, step)
    with rank0_replica(getattr(builder, "synchronizer", None), model):
        model.eval()
        try:
            record = validator.run(lambda batch, i: evaluation.batch_sums(model, batch, chunk),
                                   dp_rank=dp_rank, dp_size=dp_size, device=acc.device, step=step,
                                   seq=builder.sequence_shard(acc.process_index))
        finally:
            model.train()
        observers.validation_end(engine, step, record)


def _deepspeed_backward(acc: Any, engine: Any, loss: torch.Tensor, before_step) -> None:
    """What Accelerate's DeepSpeedEngineWrapper.backward does, with the observers' hook between
    the engine's backward (which scales by the accumulation) and its step (clip, update)."""
    engine.set_gradient_accumulation_boundary(is_boundary=acc.sync_gradients)
    engine.backward(loss)
    if acc.sync_gradients:
        before_step()
        engine.step()
