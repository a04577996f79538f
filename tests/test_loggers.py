"""The loggers' records (observers/loggers.py), read back with each library's own files: W&B's
history steps are the run's optimizer steps (no step after the last), a resumed W&B run's
first new step lands after the earlier attempt's last; a run stopped early logs its last
step; each logger records the job's config (and W&B names the run by its overrides); a
logger that cannot write is one line naming it, the path, the cause and the fix; wandb-only
keys under another logger are refused before launch."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, TINY, run_cli
from tests.wandb_records import history

# A 2-rank run's report as close() gets it: both tables W&B is given at the end.
PROFILES = {"memory": {"ranks": [{"rank": r, "params": 100, "grads": 100, "optimizer": 200, "activations": 50,
                                  "peak_rss": 1000} for r in (0, 1)]},
            "communication": {"by_group": {"data-replicate": {"all_reduce": {"count": 1.0, "bytes": 400.0,
                                                                            "wire_bytes": 400.0}}}}}


def _wandb_attempt(out: Path, steps: range, resumed: int | None) -> None:
    """One attempt of a run through the W&B logger itself (offline): its steps, then close()."""
    from observers.loggers import WandbLog

    log = WandbLog(1000, out, project="stratagem-test", mode="offline", config={"trainer": {"max_steps": steps[-1]}},
                   group=None)
    log.resumed = resumed
    log.open()
    for step in steps:
        log.write(step, {"loss": 10.0 / step})
    log.close({"steps": steps[-1], **PROFILES})


@pytest.mark.subprocess  # (wandb.init starts W&B's service process)
def test_wandb_history_is_the_optimizer_steps_and_an_extended_resume_keeps_its_first_step(tmp_path, monkeypatch):
    """close() logged each profile table in its own call without a step: the second committed the
    last step's row and opened step max_steps + 1, a step that never happened (4 steps: history
    steps 1-5). W&B resumes a run at its last step + 1 and ignores a lower step ("Tried to log to
    step 5 that is less than the current step 6"), so the extended run's first step was lost on
    sync. The tables join the last optimizer step."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    out.mkdir()
    _wandb_attempt(out, range(1, 5), resumed=None)
    time.sleep(1.1)  # (W&B names a run's directory by the second it started: the resume's is another)
    _wandb_attempt(out, range(5, 9), resumed=4)  # trainer.max_steps 4 -> 8, resumed from step 4
    first, second = sorted((out / "wandb").glob("offline-run-*"))
    assert first.name.split("-")[-1] == second.name.split("-")[-1]  # the same W&B run, resumed
    rows = history(first)
    assert [r["_step"] for r in rows] == [1, 2, 3, 4], rows
    assert {k.split("/")[0] for k in rows[-1]} >= {"memory", "communication", "train"}, rows[-1]
    resumed = [r["_step"] for r in history(second)]
    assert resumed == [5, 6, 7, 8] and resumed[0] > rows[-1]["_step"], resumed


@pytest.mark.subprocess
def test_a_run_stopped_early_logs_its_last_step_and_the_csv_its_config(tmp_path):
    """Early stopping at step 6 with trainer.log_every=4: metrics.csv had the train row of step 4
    only, and the final loss the run reports (step 6) reached no logger, though the docstring
    promises every log_every-th step and the last. The last step trained is logged at train end.
    Beside metrics.csv: config.yaml, the job's resolved config (what W&B gets as its run config)."""
    import csv

    import yaml

    out = tmp_path / "es"
    run = run_cli("train.py", *TINY, "logger=csv", "trainer.max_steps=12", "trainer.log_every=4",
                  "data.val_fraction=0.1", "trainer.val_every=3", "trainer.early_stopping.patience=1",
                  "trainer.early_stopping.min_delta=10", out=out)
    r = run.report
    assert r["steps"] == 6, r["steps"]  # (stopped early: no improvement of 10 at step 6)
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    train = [(int(x["step"]), float(x["loss"])) for x in rows if x["loss"]]
    assert [s for s, _ in train] == [4, 6], rows
    assert train[-1][1] == pytest.approx(r["final_loss"], rel=1e-6)
    assert [int(x["step"]) for x in rows if x["val_loss"]] == [3, 6], rows
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config == r["config"], "config.yaml is not the report's config"
    assert config["trainer"]["log_every"] == 4 and config["logger"]["name"] == "csv"


@pytest.mark.unit
def test_tensorboard_records_the_jobs_config(tmp_path):
    """TensorBoard had the scalars only: lr, strategy and batch size of a run were nowhere in it.
    The config is a text (tag ``config``) at the run's first step; a resumed run adds its own at
    the step it resumed from (the purge keeps it), so an extended run shows what changed."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from observers.loggers import TensorBoardLog

    for resumed, max_steps in ((None, 2), (2, 4)):
        log = TensorBoardLog(1000, tmp_path, {"strategy": {"name": "ddp"}, "trainer": {"max_steps": max_steps}})
        log.resumed = resumed
        log.open()
        for step in range(1 + (resumed or 0), max_steps + 1):
            log.write(step, {"loss": 1.0 / step})
        log.close({})
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("config/text_summary")}
    assert sorted(texts) == [0, 2], texts
    assert "    strategy:\n      name: ddp\n" in texts[0] and "max_steps: 2\n" in texts[0], texts[0]
    assert "max_steps: 4\n" in texts[2], texts[2]


@pytest.mark.unit
def test_the_communication_table_says_its_values_are_per_step():
    """Its columns were count, bytes, wire_bytes, holding report.json's per-step averages
    (count 2.2 for a broadcast): they say so."""
    from observers.loggers import profile_tables

    columns, rows = profile_tables(PROFILES)["communication"]
    assert columns == ["group", "kind", "count_per_step", "bytes_per_step", "wire_bytes_per_step"]
    assert rows == [["data-replicate", "all_reduce", 1.0, 400.0, 400.0]]


# --------------------------------------------------------------------- a logger that cannot write
def _blocked(tmp_path: Path, logger: str) -> tuple[Path, Path]:
    """(the run directory, what stands in the logger's way): metrics.csv a directory, a file where
    tensorboard/ or wandb/ should be."""
    out = tmp_path / "run"
    out.mkdir()
    blocking = out / {"csv": "metrics.csv", "tensorboard": "tensorboard", "wandb": "wandb"}[logger]
    if logger == "csv":
        blocking.mkdir()
    else:
        blocking.write_text("not a directory\n")
    return out, blocking


def _open(logger: str, out: Path) -> None:
    """The logger's start on rank 0 (``Ended``: the engine as a rank, all it reads there)."""
    from observers.base import Ended
    from observers.loggers import CSVLog, TensorBoardLog, WandbLog

    made = {"csv": lambda: CSVLog(1000, out, {}), "tensorboard": lambda: TensorBoardLog(1000, out, {}),
            "wandb": lambda: WandbLog(1000, out, project="stratagem-test", mode="offline", config={}, group=None)}
    made[logger]().on_train_start(Ended(0), 0)


@pytest.mark.parametrize("logger", [pytest.param("csv", marks=pytest.mark.unit),
                                    pytest.param("tensorboard", marks=pytest.mark.unit),
                                    pytest.param("wandb", marks=pytest.mark.subprocess)])  # (W&B's service)
def test_a_path_in_the_loggers_way_is_one_config_error(tmp_path, monkeypatch, logger):
    """A directory where metrics.csv goes, a file where tensorboard/ or wandb/ goes: the raw
    IsADirectoryError / FileExistsError / NotADirectoryError of the library (a 60-70 line
    traceback through train.py) is one ConfigError naming the logger, the path and the fix."""
    from core.errors import ConfigError

    if logger != "csv":
        pytest.importorskip(logger)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    out, blocking = _blocked(tmp_path, logger)
    with pytest.raises(ConfigError) as e:
        _open(logger, out)
    (problem,) = e.value.problems
    kind = "a directory, not a file" if logger == "csv" else "a file, not a directory"
    assert problem.startswith(f"logger={logger} cannot write {blocking}"), problem
    assert f"{blocking} is {kind}; remove or rename it, or point hydra.run.dir at another directory" in problem


def _tensorboard_on(tmp_path: Path, options: str, fill: bool) -> subprocess.CompletedProcess:
    """A 1-rank run whose tensorboard/ is a directory of its own tmpfs (``options``; ``fill``: full
    before the run starts), the rest of the run directory on a disk with room."""
    from tests.test_errors import _in_tmpfs

    mount, out = tmp_path / "mnt", tmp_path / "run"
    out.mkdir()
    (out / "tensorboard").symlink_to(mount / "tb")
    then = [f"mkdir {mount / 'tb'}"]
    if fill:
        then.append(f"dd if=/dev/zero of={mount / 'fill'} bs=1k count=64 2>/dev/null")
    if "ro" in options.split(","):
        options, then = options.replace("ro,", ""), [*then, f"mount -o remount,ro {mount}"]
    train = [sys.executable, str(ROOT / "train.py"), *TINY, "logger=tensorboard", "trainer.max_steps=2",
             f"hydra.run.dir={out}"]
    return _in_tmpfs(mount, options, ["sh", "-c", " && ".join([*then, f"exec {shlex.join(train)}"])])


@pytest.mark.subprocess
def test_a_read_only_tensorboard_directory_is_one_line_exit_2(tmp_path):
    """Its event file is created by TensorBoard's writer thread: 159 lines, two tracebacks (the
    thread's, then Hydra's), exit 1, no summary line."""
    from tests.test_errors import _one_clear_line

    proc = _tensorboard_on(tmp_path, "ro,size=64k", fill=False)
    events = tmp_path / "run" / "tensorboard" / "events.out.tfevents."
    _one_clear_line(proc, 2, f"logger=tensorboard cannot write {events}", "Read-only file system; point "
                    "hydra.run.dir at a directory this user can write, or logger=null")
    assert "Exception in thread" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.subprocess
def test_a_full_disk_under_tensorboard_names_its_event_file(tmp_path):
    """A full disk ended in "[Errno 28] No space left on device" after the writer thread's
    traceback: the line names the logger and the event file, exit 1 as every full disk."""
    from tests.test_errors import _one_clear_line

    proc = _tensorboard_on(tmp_path, "size=64k", fill=True)
    events = tmp_path / "run" / "tensorboard" / "events.out.tfevents."
    line = _one_clear_line(proc, 1, f"[Errno 28] No space left on device: logger=tensorboard writing {events}",
                           "free space there, or point hydra.run.dir at a disk with room")
    assert "Exception in thread" not in proc.stderr and proc.stderr.strip().splitlines()[-1] == line


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_directory_where_metrics_csv_goes_is_one_line_on_two_ranks(tmp_path):
    """2 ranks: rank 0's error was torch's record of its traceback (59 lines at 1 rank, 185 at 2
    with the agent's) ending in 'lost rank 0 of 2 ... IsADirectoryError'; the ranks' ConfigError
    is the launcher's one line, exit 2."""
    from tests.test_errors import _one_clear_line

    out, blocking = _blocked(tmp_path, "csv")
    run = run_cli("train.py", *TINY, "logger=csv", "strategy=ddp", "cluster.devices=2", "trainer.max_steps=2",
                  out=out, check=False)
    _one_clear_line(run.proc, 2, f"logger=csv cannot write {blocking}: {blocking} is a directory, not a file")
    assert "lost rank" not in run.log, run.log[-3000:]
