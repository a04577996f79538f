"""Train a model as the composed config says.

    python train.py                                           # the default demo
    python train.py strategy=ddp cluster.devices=2 trainer.max_steps=50
    python train.py --cfg job strategy=ddp                    # print the composed config
    python train.py -m trainer.lr=1e-3,3e-3                   # a sweep

compose (Hydra) -> validate -> plan -> backend.build -> backend.fit -> report; teardown always
runs. The backend named by ``backend=`` (backends/) is the only code that knows the engine.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import hydra
from omegaconf import DictConfig

import backends
import recipes.config  # noqa: F401  (stores the typed schemas before Hydra composes)
import strategies  # noqa: F401  (stores each strategy family's schema)
from recipes import cli
from recipes.job import Job, validate
from strategies import ConfigError

log = logging.getLogger("train")


def rank_aware_logging() -> None:
    """Rank 0 logs at INFO; other ranks only warnings and errors, prefixed with their rank.
    (Launchers start ranks > 0 with RANK or LOCAL_RANK set.)"""
    rank = int(os.environ.get("RANK") or os.environ.get("LOCAL_RANK") or 0)
    if rank == 0:
        return
    root = logging.getLogger()
    root.setLevel(logging.WARNING)
    for handler in root.handlers:
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(name)s: %(message)s"))


def plan(job: Job) -> dict:
    """Log the planner's one-line prediction; refuse a run predicted not to fit."""
    from planner import plan_dict, preflight

    result = preflight(job.cfg, job.model)
    log.info("%s", result.summary())
    if not result.fits and job.cfg.planner.enforce:
        raise ConfigError(result.message() + " (set planner.enforce=false to launch anyway)")
    return plan_dict(result)


@hydra.main(config_path="conf", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    cli.started()
    rank_aware_logging()
    try:
        job = validate(cfg, extra=[backends.check])
        predicted = plan(job)
    except ConfigError as e:
        cli.fail(e, log)
    from hydra.core.hydra_config import HydraConfig

    out = Path(HydraConfig.get().runtime.output_dir)
    backend = backends.get(job.backend)
    ok = False
    try:
        import observers

        built = backend.build(job, out, observers.build(job, out, predicted))
        outcome = backend.fit(built)
        ok = True
        del built
        r = outcome.report
        if outcome.rank == 0 and r.get("losses"):
            where = f", report {out / 'report.json'}" if job.callbacks.report else ""
            log.info("done: %d steps, final loss %.4f%s", r["steps"], r["final_loss"], where)
    finally:
        backends.teardown(ok)


if __name__ == "__main__":
    cli.run(main)
