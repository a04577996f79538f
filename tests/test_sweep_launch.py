"""Launch checks where the launch happens, and a sweep directory used again: a mistyped launcher
is one line (not a KeyError); a local sweep's preflight and ``--dry-run`` check this machine as
the jobs will; a new sweep does not take an earlier sweep's results for its own jobs; Ctrl-C in a
local sweep says how to resume the job and finish the sweep, and writes the report of what ran."""

from __future__ import annotations

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
