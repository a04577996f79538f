"""Train a model as the composed config says.

    python train.py                                           # the default demo
    python train.py strategy=ddp cluster.devices=2 trainer.max_steps=50
    python train.py -m strategy=ddp,fsdp,zero2 cluster.devices=2   # + sweep_report.md/json/png
    python train.py ... --dry-run                             # check and show what would start

compose (Hydra) -> validate -> plan -> resume -> [launch the ranks] -> build -> fit -> report."""

from __future__ import annotations

from checkpoints.interrupt import hold  # first: a requeue signal in start-up waits for step 1
hold()
import dataclasses  # noqa: E402
import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import backends
import checkpoints
import launchers.dry_run  # (and launchers itself)
import launchers.sweep
from observers import report, startup
from recipes import cli
from recipes.job import Job, validate
from core.errors import ConfigError, DataError
from core.conf import CONF_DIR

log = logging.getLogger("train")


def prepare(cfg: DictConfig, sweep: str | None, out: Path) -> tuple[Job, dict]:
    """Validate (auto: the planner chooses), plan, find the checkpoint: every error before launch."""
    import planner

    launchers.refuse_elsewhere(cfg)  # (launch.py submits it: this machine's checks are not the run's)
    job = startup.timed("config", validate, cfg, extra=[backends.check, launchers.check], auto=planner.choose,
                        origin=cli.origin())  # (what Hydra recorded: the options chosen, your own directories)
    if job.auto:
        log.info("%s", job.chosen_by)
    result = startup.timed("plan", planner.check, job)  # (report.json's startup)
    result.say(log, [*job.implied, *job.strategy.notes(job.run)])  # (summary, notes; warnings: stderr)
    predicted = planner.plan_dict(result) | ({"chosen_by": job.chosen_by} if job.auto else {})
    first = not launchers.launched() or os.environ.get("RANK", "0") == "0"
    job = dataclasses.replace(job, sweep=sweep, name=HydraConfig.get().job.override_dirname or None)
    return checkpoints.for_launch(job, out, cleanup=first), predicted


def train(job: Job, predicted: dict, out: Path) -> None:
    """Start the ranks (or be one), train, and log where the report is."""
    try:
        outcome = launchers.run(job, out, predicted)
    except (launchers.RankLost, launchers.Stopped, OSError) as e:  # (OSError: a full disk's one line)
        if job.sweep or (isinstance(e, OSError) and not checkpoints.disk_full(e)):  # a sweep: a failed row
            raise
        log.error("%s", e)
        sys.exit(getattr(e, "code", 1))
    r = outcome.report
    if outcome.rank == 0 and r.get("losses"):
        for message in report.closing(r, out / "report.json" if job.callbacks.report else None):
            log.info("%s", message)
    if outcome.rank == 0 and job.trainer.save_hf:
        from checkpoints.convert import final_hf, hf_step

        step = hf_step(job.trainer, r)
        log.info("Hugging Face model: %s (step %d)", final_hf(out, step), step)


@hydra.main(config_path=str(CONF_DIR), config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    hold()  # (again: a submitit job unpickles main in a process of its own)
    cli.started()
    launchers.launched()  # (under srun: exports this task's rank first, for the logger)
    cli.rank_aware_logging()
    from hydra.types import RunMode

    from planner import WillNotFit
    hydra_cfg = HydraConfig.get()
    out = Path(hydra_cfg.runtime.output_dir)
    if hydra_cfg.mode == RunMode.MULTIRUN:
        # One job of a sweep: whatever happens is a row of the sweep report, and the sweep goes on.
        launchers.sweep.guard(out, lambda: train(*prepare(cfg, str(hydra_cfg.sweep.dir), out), out))
        return
    try:
        train(*prepare(cfg, None, out), out)
    except (ConfigError, WillNotFit, DataError) as e:  # (DataError: a bad record the run read)
        cli.fail(e, log)
    except checkpoints.Finished as e:  # a re-run (or a requeue) of a run that is done
        log.info("%s", e)


if __name__ == "__main__":
    launchers.dry_run.exit_if_asked()  # --dry-run: check and print what would start, start nothing
    cli.run(main, __doc__, ready=lambda: startup.mark("import"))
