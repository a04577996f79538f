"""hydra-submitit-launcher's Slurm launcher, with two changes: a job that ends without a result is a
failed row of the sweep, not the end of the sweep; and no job is queued before every point of
its batch passed the sweep's preflight (``launchers.sweep.refuse``).

hydra-submitit-launcher 1.2 waits for each job's result in order and raises submitit's
``UncompletedJobError`` for a job that ended without one (``scancel``, the time limit, the
out-of-memory killer): the submitting process exits with a traceback while later jobs still run,
and no sweep report is written. ``SlurmSubmission`` (launchers/slurm.py) puts this class in
``hydra.launcher._target_`` before the launcher is built. While its ``launch`` waits, each job's
``results`` (submitit's ``Job.results``, the one place this module touches) records a job that
ended without a result as failed in its directory (``job.json``, the sweep report's source) and
returns an empty result, so the sweep waits for every job and then reports. (It lives under
``hydra_plugins/`` because Hydra instantiates launchers from that namespace only.)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as _SubmititSlurm
from omegaconf import OmegaConf

log = logging.getLogger(__name__)


class SlurmLauncher(_SubmititSlurm):
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from launchers.sweep import refuse

        # every point of the batch composed, validated and planned before one is queued (a no-op
        # for the points SweepReport checked already: all of a basic sweep's)
        refuse(job_overrides, self.config, started="queued")
        with _failed_jobs_as_rows(Path(str(self.config.hydra.sweep.dir))):
            return super().launch(job_overrides, initial_job_idx)


@contextlib.contextmanager
def _failed_jobs_as_rows(sweep: Path) -> Iterator[None]:
    import submitit

    original = submitit.Job.results

    def results(job: Any) -> list[Any]:
        try:
            return original(job)
        except (submitit.core.utils.UncompletedJobError, submitit.core.utils.FailedJobError) as e:
            overrides, _, num = job.submission().args[:3]  # (overrides, dir key, job num, ...)
            why = str(e).strip().splitlines()[0][:500]
            log.error("Slurm job %s (sweep job %s) ended without a result: %s", job.job_id, num, why)
            job_dir = sweep / str(num)
            hydra_dir = job_dir / ".hydra"
            if not (hydra_dir / "overrides.yaml").exists():  # it never started: still a row
                hydra_dir.mkdir(parents=True, exist_ok=True)
                OmegaConf.save(OmegaConf.create(list(overrides)), hydra_dir / "overrides.yaml")
            from launchers.sweep import FAILED, record

            record(job_dir, FAILED, f"Slurm job {job.job_id} ended without a result "
                                    f"(state {job.state}): {why}")
            return [JobReturn(status=JobStatus.COMPLETED, _return_value=None)]

    submitit.Job.results = results
    try:
        yield
    finally:
        submitit.Job.results = original
