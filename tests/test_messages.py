"""The first things a user meets (#41's noise, #42's disk messages): a mistyped key is one error,
ours; the engines' known noise is filtered at its library; a validation split is big enough to
mean something; a full disk says so."""

from __future__ import annotations

import os
import sys

import pytest

from conftest import ROOT

# --------------------------------------------------------------------- a mistyped key: one error
@pytest.mark.subprocess
@pytest.mark.parametrize("script", ["train.py", "plan.py"])
def test_a_mistyped_key_is_one_error_and_no_advice_to_append_it(tmp_path, script):
    """Hydra's own message advised ``+trainer.max_stepz=3``, which validation then refuses; the
    user sees our line alone: the override, the key meant, the override to write; exit 2."""
    import subprocess

    proc = subprocess.run([sys.executable, str(ROOT / script), "model=gpt_nano", "trainer.max_stepz=3",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "trainer.max_stepz=3: no such key; did you mean trainer.max_steps? (trainer.max_steps=3)"], proc.stderr
    assert "+trainer" not in proc.stdout + proc.stderr and not (tmp_path / "run").exists()


@pytest.mark.unit
def test_hydra_raises_to_us_only_until_the_task_starts(monkeypatch):
    """``run`` has Hydra raise composition errors (HYDRA_FULL_ERROR) only until ``started``: the
    run's own errors are Hydra's to print as usual, and no rank inherits the variable."""
    from recipes import cli

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(cli, "_started", False)
    seen = []
    monkeypatch.setattr(sys, "argv", ["train.py"])
    monkeypatch.setattr("recipes.compose.register", lambda: None)

    def main():
        seen.append(os.environ.get("HYDRA_FULL_ERROR"))
        cli.started()
        seen.append(os.environ.get("HYDRA_FULL_ERROR"))

    cli.run(main)
    assert seen == ["1", None]
    monkeypatch.setattr(cli, "_started", False)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # the user's own: kept
    seen.clear()
    cli.run(main)
    assert seen == ["1", "1"]
