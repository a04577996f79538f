"""The Lightning backend's run: a validated ``Job`` -> a Trainer, the recipe's module and data,
the observers behind one callback; Lightning runs the loop of this rank.

The ranks are started before this (launchers/, or torchrun): Lightning finds torchrun's
environment and never uses its own launcher, which would re-run the command line per rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from backends.lightning.torchmetrics_imports import import_lightning

L = import_lightning()  # before any other `import lightning` of ours: see torchmetrics_imports

import checkpoints
from backends import Outcome
from backends.lightning import families
from backends.lightning.bridge import ObserverBridge
from backends.lightning.checkpointing import Checkpointing
from backends.lightning.module import MODEL_PREFIX, CausalLM, GlobalBatchData
from backends.lightning.preset import set_timeout
from core.precision import of
from observers import startup
from recipes.data import CountedShare, build_datasets, data_facts
from recipes.dpo import objective_for
from recipes.evaluation import Validator

if TYPE_CHECKING:
    from observers import Observers
    from recipes.job import Job

log = logging.getLogger(__name__)


@dataclass
class Built:
    job: Job
    out: Path
    trainer: L.Trainer
    module: CausalLM
    data: GlobalBatchData
    bridge: ObserverBridge


def trainer_for(job: Job, out: Path, callbacks: list[L.Callback]) -> L.Trainer:
    """The Trainer of the job (no process is started until ``fit``)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    t = job.trainer
    strategy = families.build(job.strategy, job.run)
    set_timeout(strategy, job.cluster.collective_timeout)
    # Under Slurm, resume has one owner: our checkpoints (the Checkpointing callback stops every
    # rank after a step on SIGUSR1/SIGTERM and saves). Lightning's auto-requeue would save its own
    # hpc checkpoint from a signal handler (a barrier that can deadlock, Lightning#21406) and
    # restore it over ours on the next attempt.
    plugins = [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []
    return L.Trainer(
        plugins=plugins,
        accelerator=job.run.accelerator,
        devices=job.mesh.devices,
        num_nodes=job.mesh.nodes,
        strategy=strategy,
        precision=of(job.run.precision).lightning,
        max_steps=t.max_steps,
        accumulate_grad_batches=job.batch.accumulation,
        gradient_clip_val=t.grad_clip or None,
        use_distributed_sampler=False,  # GlobalBatchSampler already splits the global batch
        logger=False,  # loggers are observers, the same on every backend
        callbacks=callbacks,
        enable_checkpointing=False,  # checkpoints are ours (backends/lightning/checkpointing.py)
        enable_progress_bar=False,  # the progress bar is an observer, the same on every backend
        enable_model_summary=False,
        log_every_n_steps=t.log_every,
        limit_val_batches=0,  # validation is the bridge's (fixed samples, every strategy's forward)
        num_sanity_val_steps=0,
        default_root_dir=str(out),
    )


def build(job: Job, out: Path, observers: Observers) -> Built:
    t = job.trainer
    with startup.span("data"):  # (reading, tokenizing, the cache: report.json's startup)
        train, val = build_datasets(job.data, job.model, t.seed)
        observers.meta["data"] = data_facts(train, (t.max_steps, job.batch.global_size, t.seed))
    validator = None if val is None else Validator(val, micro_batch=job.batch.per_step,
                                                   val_every=t.val_every, max_steps=t.max_steps)
    bridge = ObserverBridge(observers, validator)
    # (in this order: the bridge validates a step before Checkpointing acts on the validation)
    trainer = trainer_for(job, out, [bridge, Checkpointing(job, out, observers, validator)])
    log.info("strategy: %s -> %s", job.label, type(trainer.strategy).__name__)
    module = CausalLM(job.model, t)
    module.share = CountedShare(train, global_batch=job.batch.global_size, seed=t.seed)
    module.objective = objective_for(job, train, out, observers.meta,
                                     resumed=checkpoints.resuming(job, out))
    data = GlobalBatchData(train, global_batch=job.batch.global_size,
                           micro_batch=job.batch.per_step, steps=t.max_steps, seed=t.seed,
                           num_workers=job.data.num_workers)
    log.info("trainer: %d node(s) x %d %s process(es), accumulation %d",
             job.mesh.nodes, job.mesh.devices, job.run.accelerator, job.batch.accumulation)
    return Built(job, out, trainer, module, data, bridge)


def fit(built: Built) -> Outcome:
    checkpoints.interruption().install()  # before Lightning's: its teardown restores ours
    job, trainer = built.job, built.trainer
    # (Lightning's note that its validation loop is skipped is filtered in backends/common/quiet.py:
    # the module's validation_step is reached through strategy.validation_step by the bridge.)
    trainer.fit(built.module, datamodule=built.data)
    built.bridge.untrained(trainer, built.module)  # (restored at max_steps: the loop was skipped)
    # (every rank gathers -- a collective under fsdp/zero3 and 16-bit ZeRO -- and rank 0 keeps them: backends.run
    # writes params.pt after the last collective, where no peer's timeout runs)
    params = trainer.strategy.full_state_dict(prefix=MODEL_PREFIX) if job.trainer.export_params else None
    return Outcome(rank=trainer.global_rank, report=built.bridge.report,
                   params=params if trainer.global_rank == 0 else None)
