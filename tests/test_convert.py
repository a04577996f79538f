"""convert.py's answers to what it cannot use: a folder of checkpoints named as one, an output it
cannot write. (Its conversions themselves: tests/test_checkpoint.py and tests/test_hf.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


def _checkpoints(run: Path, *steps: int, partial: int | None = None) -> Path:
    """A run directory holding complete checkpoints of ``steps`` (a marker, a meta.json) and an
    interrupted save of ``partial``."""
    from checkpoints import store

    for step in steps:
        temp = store.temp_for(run, step)
        temp.mkdir(parents=True)
        store.commit(temp, store.path_for(run, step), {"step": step})
    if partial is not None:
        store.temp_for(run, partial).mkdir(parents=True)
    return store.directory(run)


@pytest.mark.unit
def test_the_checkpoints_folder_named_as_a_checkpoint_names_its_newest(tmp_path):
    """convert.py <run>/checkpoints said "has no COMPLETE marker: the save did not finish"; it
    names the newest complete checkpoint in it, as for a run directory."""
    from checkpoints.store import CheckpointError, read

    folder = _checkpoints(tmp_path / "run", 2, 10, partial=12)
    with pytest.raises(CheckpointError) as e:
        read(folder)
    said = str(e.value)
    assert said.startswith(f"{folder} is a run's checkpoints folder, not one of its checkpoints: "
                           f"name one, {folder}/step10 (the newest)"), said
    assert "save did not finish" not in said


@pytest.mark.unit
def test_a_folder_without_a_complete_checkpoint_says_so(tmp_path):
    """A run whose only save was interrupted (a .tmp-step<N>): named as a run or as its
    checkpoints folder, it holds no complete checkpoint -- not "the save did not finish" of a
    folder that is no save."""
    from checkpoints.store import CheckpointError, read

    run = tmp_path / "run"
    folder = _checkpoints(run, partial=4)
    for path in (run, folder):
        with pytest.raises(CheckpointError, match=rf"^{path} holds no complete checkpoint"):
            read(path)


def _convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "convert.py"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.subprocess
def test_an_unwritable_out_is_one_line_before_any_conversion(tmp_path):
    """--out /proc/x.safetensors ended in atomic_write's FileNotFoundError traceback, exit 1, after
    the whole model was read: now one line naming --out, its value and the fix, exit 2, before
    the checkpoint is read (this one holds no model: reading it would fail otherwise)."""
    ckpt = _checkpoints(tmp_path / "run", 3) / "step3"
    (tmp_path / "here").mkdir()
    for out, says in (("/proc/x.safetensors", "--out=/proc/x.safetensors: cannot write in /proc"),
                      (str(tmp_path / "here"), f"--out={tmp_path / 'here'} is a directory, not a file")):
        proc = _convert(str(ckpt), "--to", "full", "--out", out)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert len(lines) == 1 and lines[0].startswith(says), proc.stderr[-3000:]
        assert "point --out at" in lines[0] or "name the file to write" in lines[0], lines[0]
    proc = _convert(str(ckpt), "--to", "hf", "--out", "/proc/model")
    assert proc.returncode == 2 and proc.stderr.strip().startswith("--out=/proc/model: cannot"), proc.stderr[-3000:]
