"""Train a model as the composed config says.

    python train.py                                           # the default demo
    python train.py strategy=ddp cluster.devices=2 trainer.max_steps=50
    python train.py --cfg job strategy=ddp                    # print the composed config
    python train.py -m trainer.lr=1e-3,3e-3                   # a sweep
    python train.py -m strategy=ddp,fsdp,zero2 cluster.devices=2   # + sweep_report.md/json/png

compose (Hydra) -> validate -> plan -> resume (which checkpoint, checked whole) -> [launch the
ranks] -> backend.build -> backend.fit -> report; each rank tears its process group down. The
backend named by ``backend=`` (backends/) is the only code that knows the engine; launchers/
starts the ranks; checkpoints/ is the one format every backend and strategy writes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

import backends
import launchers
import launchers.sweep
import recipes.config  # noqa: F401  (stores the typed schemas before Hydra composes)
import strategies  # noqa: F401  (stores each strategy family's schema)
from launchers.sweep import WillNotFit
from recipes import cli
from recipes.job import Job, validate
from strategies import ConfigError

log = logging.getLogger("train")


def plan(job: Job) -> dict:
    """Log the planner's one-line prediction; refuse a run predicted not to fit."""
    from planner import plan_dict, preflight

    result = preflight(job.cfg, job.model)
    log.info("%s", result.summary())
    predicted = plan_dict(result)
    if not result.fits and job.cfg.planner.enforce:
        raise WillNotFit(result.message() + " (set planner.enforce=false to launch anyway)", predicted)
    return predicted


def choose(cfg: DictConfig) -> tuple[DictConfig, str | None]:
    """``strategy=auto``: the planner's recommendation for this model, cluster and batch becomes
    the preset, with the reason."""
    if cfg.strategy.get("name") != "auto":
        return cfg, None
    from omegaconf import OmegaConf, open_dict

    from planner import choose as recommend
    from recipes.config import describe

    picked, reason = recommend(cfg, describe(cfg.model))
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.strategy = picked
    OmegaConf.set_readonly(cfg, False)
    log.info("strategy=auto -> %s: %s", picked.name, reason)
    return cfg, f"strategy=auto chose {picked.name}: {reason}"


def prepare(cfg: DictConfig, sweep: str | None, out: Path) -> tuple[Job, dict]:
    """Validate, plan and find the checkpoint to resume: every configuration error before any
    process starts."""
    cfg, chosen = choose(cfg)
    job = validate(cfg, extra=[backends.check, launchers.check])
    predicted = plan(job)
    if chosen:
        predicted["chosen_by"] = chosen
    return resume(dataclasses.replace(job, sweep=sweep), out), predicted


def resume(job: Job, out: Path) -> Job:
    """Which checkpoint ``trainer.resume_from`` means (``auto``: the newest complete one in the
    run directory, or none), checked whole -- every file, the model's shapes -- before any
    process starts. The ranks get its path, so they all resume from the same one. One process
    (this one, or rank 0 under torchrun) removes what interrupted saves left."""
    import checkpoints

    first = not launchers.launched() or os.environ.get("RANK", "0") == "0"
    if first and launchers.restart_problem():
        log.warning("%s", launchers.restart_problem())
    try:
        ckpt = checkpoints.resolve(job.trainer.resume_from, out, job.model, cleanup=first)
    except checkpoints.CheckpointError as e:
        raise ConfigError(f"trainer.resume_from={job.trainer.resume_from}: {e}; point "
                          "trainer.resume_from at another checkpoint, or null to start fresh") from None
    why = ckpt and checkpoints.refusal(ckpt, job)
    if why:
        raise ConfigError(f"trainer.resume_from={job.trainer.resume_from}: {why}")
    if ckpt is not None:
        log.info("resume: %s (step %d, %s on %d rank(s))", ckpt.path, ckpt.step,
                 ckpt.meta["strategy"], ckpt.meta["world_size"])
    trainer = dataclasses.replace(job.trainer, resume_from=str(ckpt.path) if ckpt else None)
    return dataclasses.replace(job, trainer=trainer)


def train(job: Job, predicted: dict, out: Path) -> None:
    """Start the ranks (or be one), train, and log where the report is."""
    if job.world.size > 1 and not launchers.launched():
        try:
            outcome = launchers.run_local_ranks(job, out, predicted)
        except launchers.RankLost as e:
            if job.sweep:  # a failed row of the sweep report; the sweep goes on
                raise
            log.error("%s", e)
            sys.exit(1)
    else:
        outcome = backends.run(job, out, predicted)
    r = outcome.report
    if outcome.rank == 0 and r.get("losses"):
        where = f", report {out / 'report.json'}" if job.callbacks.report else ""
        log.info("done: %d steps, final loss %.4f%s", r["steps"], r["final_loss"], where)
        if r.get("predicted_vs_measured"):
            from observers.compare import summary_lines

            log.info("predicted vs measured (rank 0):\n%s",
                     "\n".join(summary_lines(r["predicted_vs_measured"])))


@hydra.main(config_path="conf", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    cli.started()
    launchers.launched()  # (under srun: exports this task's rank first, for the logger)
    cli.rank_aware_logging()
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    out = Path(hydra_cfg.runtime.output_dir)
    if hydra_cfg.mode == RunMode.MULTIRUN:
        # One job of a sweep: whatever happens is a row of the sweep report, and the sweep goes on.
        sweep = str(hydra_cfg.sweep.dir)
        launchers.sweep.guard(out, lambda: train(*prepare(cfg, sweep, out), out))
        return
    try:
        job, predicted = prepare(cfg, None, out)
    except (ConfigError, WillNotFit) as e:
        cli.fail(e, log)
    train(job, predicted, out)


if __name__ == "__main__":
    cli.run(main)
