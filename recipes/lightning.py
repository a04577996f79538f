"""The Lightning backend: turn a validated ``Job`` into a Trainer, a module and data, and fit."""

from __future__ import annotations

import functools
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L

from callbacks.memory import MemoryProfile
from callbacks.progress import StepProgressBar
from callbacks.report import RunReport, atomic_torch_save
from recipes.data import build_dataset
from recipes.job import Job
from recipes.module import CausalLM, GlobalBatchData
from strategies.plan_render import plan_dict

log = logging.getLogger(__name__)

# GlobalBatchSampler resumes from trainer.global_step by construction (recipes/data.py), so
# Lightning's "dataloader is not resumable" warning does not apply to our loaders.
warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before")

PRECISION = {"32": "32-true", "bf16-mixed": "bf16-mixed", "16-mixed": "16-mixed"}


@dataclass
class Built:
    trainer: L.Trainer
    module: CausalLM
    data: GlobalBatchData
    report: RunReport | None


def _logger(cfg, out: Path):
    if cfg.logger is None:
        return False
    if cfg.logger.name == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(save_dir=str(out), name="csv")
    if cfg.logger.name == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        return WandbLogger(project=cfg.logger.project, mode=cfg.logger.mode, save_dir=str(out))
    raise ValueError(f"logger.name={cfg.logger.name!r}: allowed csv, wandb")


def build(job: Job, out: Path, predicted: Any = None) -> Built:
    """``predicted``: the planner's Plan for this run, reported next to what is measured."""
    cfg, t = job.cfg, job.cfg.trainer
    strategy = job.strategy.lightning(job.world, job.run)
    log.info("strategy: %s -> %s", job.strategy.name, type(strategy).__name__)
    module = CausalLM(job.shape, lr=t.lr, weight_decay=t.weight_decay, warmup_steps=t.warmup_steps,
                      seed=t.seed, optimizer=job.strategy.optimizer,
                      parallelize=functools.partial(job.strategy.parallelize, world=job.world, run=job.run))
    data = GlobalBatchData(build_dataset(cfg.data, job.shape, t.seed), global_batch=job.batch.global_size,
                           micro_batch=job.batch.micro_size, steps=t.max_steps, seed=t.seed,
                           num_workers=cfg.data.num_workers)
    callbacks: list[L.Callback] = [StepProgressBar()] if cfg.callbacks.progress_bar else []
    report = None
    if cfg.callbacks.report:
        report = RunReport(out / "report.json", meta=job.meta(), tokens_per_step=job.tokens_per_step)
        plan = plan_dict(predicted) if predicted is not None else None
        if plan is not None:
            report.sections["plan"] = {k: plan[k] for k in ("fits", "communication", "step_seconds")}
        if cfg.callbacks.memory:  # before the report: its on_train_end fills a report section
            callbacks.append(MemoryProfile(job.strategy, report, plan and plan["memory"]))
        callbacks.append(report)
    if t.checkpoint_every:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=out / "checkpoints", filename="step{step}",
                                         every_n_train_steps=t.checkpoint_every, save_top_k=-1,
                                         auto_insert_metric_name=False))
    trainer = L.Trainer(
        accelerator=job.run.accelerator,
        devices=job.world.devices,
        num_nodes=job.world.nodes,
        strategy=strategy,
        precision=PRECISION[job.run.precision],
        max_steps=t.max_steps,
        accumulate_grad_batches=job.batch.accumulation,
        gradient_clip_val=t.grad_clip or None,
        use_distributed_sampler=False,  # GlobalBatchSampler already splits the global batch
        logger=_logger(cfg, out),
        callbacks=callbacks,
        enable_checkpointing=bool(t.checkpoint_every),
        enable_progress_bar=cfg.callbacks.progress_bar,
        enable_model_summary=False,
        log_every_n_steps=t.log_every,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=str(out),
    )
    log.info("trainer: %d node(s) x %d %s process(es), accumulation %d",
             job.world.nodes, job.world.devices, job.run.accelerator, job.batch.accumulation)
    return Built(trainer, module, data, report)


def fit(job: Job, built: Built, out: Path) -> None:
    built.trainer.fit(built.module, datamodule=built.data, ckpt_path=job.cfg.trainer.resume_from)
    if job.cfg.trainer.export_params:
        params = job.strategy.full_state_dict(built.trainer)
        if built.trainer.global_rank == 0:
            atomic_torch_save(params, out / "params.pt")
