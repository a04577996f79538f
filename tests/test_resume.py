"""The command a stopped run prints to resume it (launchers/resume.py); the command line as typed
and what it pins: tests/test_checkpoint.py."""

from __future__ import annotations

import shlex
import sys

import pytest


@pytest.mark.unit
def test_the_printed_run_directory_resumes_from_any_directory(monkeypatch, tmp_path):
    """An absolute hydra.run.dir came back relative to the working directory (``int2`` for
    /tmp/audit_ckpt/int2): pasted from another directory, the command started a fresh run there.
    The run directory is printed absolute, whether it was given absolute or relative."""
    from launchers import resume

    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_JOB_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "runs" / "exp1"
    for typed in (str(out), "runs/exp1"):
        monkeypatch.setattr(sys, "argv", ["/opt/stratagem/train.py", "strategy=ddp", f"hydra.run.dir={typed}"])
        for given in (out, "runs/exp1"):
            cmd = shlex.split(resume.command(given))
            assert cmd[1:] == ["/opt/stratagem/train.py", "strategy=ddp", f"hydra.run.dir={out}"], cmd
    monkeypatch.chdir("/")  # (where the command is pasted changes nothing: the path names one directory)
    assert shlex.split(resume.command(out))[-1] == f"hydra.run.dir={out}"
