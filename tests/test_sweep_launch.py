"""Launch checks where the launch happens, and a sweep directory used again: a mistyped launcher
is one line (not a KeyError); a local sweep's preflight and ``--dry-run`` check this machine as
the jobs will; a new sweep does not take an earlier sweep's results for its own jobs; Ctrl-C in a
local sweep says how to resume the job and finish the sweep, and writes the report of what ran."""

from __future__ import annotations

import os

import pytest

from recipes.config import compose
from recipes.job import validate
from strategies import ConfigError
from tests.conftest import TINY, run_cli

pytestmark = pytest.mark.timeout(300)


# --------------------------------------------------------------------------- a mistyped launcher
@pytest.mark.unit
def test_a_mistyped_launcher_is_a_config_error_not_the_launchers_keyerror():
    """The cluster group reports the unknown name; the launcher's own check (train.py's ``extra``)
    must not then ask the registry for it (a KeyError traceback, exit 1)."""
    import launchers

    with pytest.raises(ConfigError) as e:
        validate(compose(["model=gpt_nano", "cluster.launcher=torchrn"]), extra=[launchers.check])
    assert "cluster.launcher='torchrn'" in str(e.value) and "torchrun" in str(e.value)


@pytest.mark.subprocess
def test_train_py_with_a_mistyped_launcher_exits_2_with_one_line(tmp_path):
    run = run_cli("train.py", *TINY, "trainer.max_steps=2", "cluster.launcher=torchrn",
                  out=tmp_path / "bad", check=False, timeout=120)
    assert run.proc.returncode == 2, run.log[-3000:]
    assert "Traceback" not in run.log and "KeyError" not in run.log, run.log[-3000:]
    assert "cluster.launcher='torchrn'" in run.log


# --------------------------------------------------------------------------- checked where it runs
def _more_than_cores() -> tuple[str, ...]:
    """A ddp point with one CPU process more than this machine's cores (valid as a run)."""
    n = len(os.sched_getaffinity(0)) + 1
    return (*TINY, "strategy=ddp", f"cluster.devices={n}", "trainer.micro_batch_size=1",
            f"trainer.global_batch_size={2 * n}", "trainer.max_steps=2")


@pytest.mark.unit
def test_a_local_sweep_checks_each_point_on_this_machine_and_a_queued_one_as_a_run():
    """A local sweep's jobs run here: its preflight refuses what each job would refuse at its start
    (more processes than cores, a Slurm cluster without the submitit launcher). Points queued to
    Slurm run elsewhere: checked as runs, not against this machine."""
    from launchers.sweep import check_point

    cores = check_point(_more_than_cores(), local=True)
    assert any("CPU processes but this machine has" in p for p in cores.problems), cores.problems
    assert not check_point(_more_than_cores()).problems
    slurm = [*TINY, "cluster=slurm_local", "strategy=ddp", "trainer.max_steps=2"]
    local = check_point(slurm, local=True)
    assert any("hydra/launcher=submitit_slurm" in p for p in local.problems), local.problems
    assert not check_point(slurm).problems


@pytest.mark.unit
def test_dry_run_of_a_local_launch_checks_this_machine(tmp_path, capsys):
    """``--dry-run`` of a cluster.launcher=local job refuses what the launch here refuses: more
    processes than cores, a named shape whose model.path holds another shape."""
    from launchers.dry_run import main
    from tests.test_named_recipes import LLAMA3_1B, ON_CPU, _config_only

    assert main([*_more_than_cores(), "--dry-run"]) == 2
    out = capsys.readouterr().out
    assert "CPU processes but this machine has" in out and "would start" not in out, out
    other = _config_only(tmp_path / "small", **(LLAMA3_1B | {"hidden_size": 1024, "num_hidden_layers": 4}))
    assert main(["experiment=llama3_1b_lora", *ON_CPU, f"model.path={other}", "model.pretrained=false",
                 "--dry-run"]) == 2
    out = capsys.readouterr().out
    assert "the checkpoint is not this shape" in out and "would start" not in out, out
