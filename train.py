"""Train a model as the composed config says.

    python train.py                                           # the default demo
    python train.py strategy=ddp cluster.devices=2 trainer.max_steps=50
    python train.py --cfg job strategy=ddp                    # print the composed config
    python train.py -m trainer.lr=1e-3,3e-3                   # a sweep

compose (Hydra) -> validate -> plan -> build -> fit -> report; teardown always runs.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import recipes.config  # noqa: F401  (stores the typed schemas before Hydra composes)
import strategies  # noqa: F401  (stores each strategy family's schema)
from recipes.job import Job, validate
from strategies import ConfigError

log = logging.getLogger("train")


def rank_aware_logging() -> None:
    """Rank 0 logs at INFO; other ranks only warnings and errors, prefixed with their rank.
    (Lightning's launcher starts ranks > 0 as children of this script with LOCAL_RANK set.)"""
    rank = int(os.environ.get("RANK") or os.environ.get("LOCAL_RANK") or 0)
    if rank == 0:
        return
    root = logging.getLogger()
    root.setLevel(logging.WARNING)
    for handler in root.handlers:
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(name)s: %(message)s"))


def plan(job: Job):
    """Log the planner's one-line prediction; refuse a run predicted not to fit."""
    from strategies.planner import preflight

    result = preflight(job.cfg)
    log.info("%s", result.summary())
    if not result.fits and job.cfg.planner.enforce:
        raise ConfigError(result.message() + " (set planner.enforce=false to launch anyway)")
    return result


def teardown(ok: bool) -> None:
    """Leave no process group behind: gloo aborts at exit without an explicit barrier+destroy."""
    import torch.distributed as dist

    gc.collect()
    if dist.is_available() and dist.is_initialized():
        if ok:
            dist.barrier()
        dist.destroy_process_group()


@hydra.main(config_path="conf", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    rank_aware_logging()
    try:
        job = validate(cfg)
        predicted = plan(job)
    except ConfigError as e:
        log.error("%s", e)
        sys.exit(2)
    out = Path(HydraConfig.get().runtime.output_dir)
    from recipes import lightning as backend

    ok = False
    try:
        built = backend.build(job, out, predicted)
        backend.fit(job, built, out)
        ok = True
        if built.trainer.global_rank == 0 and built.report is not None:
            log.info("done: %d steps, final loss %.4f, report %s", len(built.report.losses),
                     built.report.losses[-1], built.report.path)
        del built
    finally:
        teardown(ok)


if __name__ == "__main__":
    main()
