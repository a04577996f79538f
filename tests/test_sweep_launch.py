"""Launch checks where the launch happens, and a sweep directory used again: a mistyped launcher
is one line (not a KeyError); a local sweep's preflight and ``--dry-run`` check this machine as
the jobs will; a new sweep does not take an earlier sweep's results for its own jobs; Ctrl-C in a
local sweep says how to resume the job and finish the sweep, and writes the report of what ran."""

from __future__ import annotations

import os
from pathlib import Path

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


# --------------------------------------------------------------------------- a sweep directory again
def _earlier_job(sweep: Path, num: int, *overrides: str, results: bool = True) -> Path:
    """Job ``num`` of an earlier sweep in ``sweep``, as Hydra and the run leave it: its overrides,
    and (``results``) a checkpoint and report.json."""
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if results:
        (job / "checkpoints" / "step2").mkdir(parents=True)
        (job / "report.json").write_text('{"final_loss": 5.0}')
    return job


EARLIER = ("model=gpt_nano", "trainer.max_steps=2")


@pytest.mark.unit
def test_a_sweep_whose_job_directories_hold_other_overrides_results_is_refused(tmp_path, capsys):
    """Hydra gives ``<sweep>/<N>`` to whatever job is N now: a new sweep there would resume (or
    call finished) the earlier job's checkpoint and report its numbers under the new overrides.
    Refused before anything starts, naming the job, both overrides and the fix; a job directory
    without results is no one's; the same sweep again (any order, trainer.max_steps raised)
    continues its jobs."""
    from launchers import sweep_dir
    from launchers.dry_run import main

    sweep = tmp_path / "s"
    _earlier_job(sweep, 0, *EARLIER, "trainer.lr=0.001")
    _earlier_job(sweep, 1, *EARLIER, "trainer.lr=0.002")
    _earlier_job(sweep, 2, *EARLIER, "trainer.lr=0.003", results=False)
    assert main(["-m", *EARLIER, "trainer.lr=0.002,0.001,0.004", f"hydra.sweep.dir={sweep}", "--dry-run"]) == 2
    out = capsys.readouterr().out
    assert (f"cannot start: hydra.sweep.dir={sweep}: job 0's directory {sweep / '0'} holds a checkpoint "
            "and report.json of an earlier sweep's job with other overrides (`trainer.lr=0.001` there, "
            "`trainer.lr=0.002` in this sweep's job 0)") in out, out
    assert f"set hydra.sweep.dir to a new directory, or remove {sweep / '0'}" in out
    assert "job 1's directory" in out and "job 2's" not in out and "would start" not in out
    same = [[*EARLIER, "trainer.lr=0.001"], [*EARLIER, "trainer.lr=0.002"], [*EARLIER, "trainer.lr=0.004"]]
    assert sweep_dir.conflicts(sweep, same) == []
    assert sweep_dir.conflicts(sweep, [[*reversed(p)] for p in same]) == []  # (the order typed)
    longer = [[o.replace("max_steps=2", "max_steps=5") for o in p] for p in same]
    assert sweep_dir.conflicts(sweep, longer) == []  # (what "already finished" says to raise)
    assert sweep_dir.conflicts(sweep, [[*p, "+preflight=false"] for p in same]) == []  # (not the job's)
    assert sweep_dir.conflicts(sweep, same, subdir="${hydra.job.override_dirname}") == []


@pytest.mark.unit
def test_a_sweep_that_lowers_max_steps_in_a_used_directory_is_refused(tmp_path):
    """trainer.max_steps was exempt from the check whichever way it changed: lowered, each job
    found its checkpoint past the new end ("already finished at step 300"), and the sweep
    reported the 300-step run as ok under trainer.max_steps=100, exit 0 (a sweep over max_steps
    with its values reordered the same). Only the same or a raised value continues a job; a
    lowered one (overridden, or a default either side: the earlier job's config.yaml, this point
    composed) is refused naming the job, both values and the fix. early_stopping.patience too
    (0, never stopping, is above any)."""
    from launchers import sweep_dir

    sweep = tmp_path / "s"
    _earlier_job(sweep, 0, "model=gpt_nano", "trainer.max_steps=300")
    lower = sweep_dir.conflicts(sweep, [["model=gpt_nano", "trainer.max_steps=100"]])
    assert len(lower) == 1, lower
    assert (f"job 0's directory {sweep / '0'} holds a checkpoint and report.json of an earlier sweep's "
            "job run to a later end (`trainer.max_steps=300` there, `trainer.max_steps=100` in this "
            "sweep's job 0)") in lower[0], lower[0]
    assert "only the same value or a raised one continues it" in lower[0]
    assert f"Set hydra.sweep.dir to a new directory, or remove {sweep / '0'}" in lower[0]
    for same_or_raised in ("300", "500"):
        assert sweep_dir.conflicts(sweep, [["model=gpt_nano", f"trainer.max_steps={same_or_raised}"]]) == []
    # a sweep over max_steps, reordered (4,6 then 6,4): job 0 raised continues, job 1 lowered is refused
    reorder = tmp_path / "r"
    _earlier_job(reorder, 0, "model=gpt_nano", "trainer.max_steps=4")
    _earlier_job(reorder, 1, "model=gpt_nano", "trainer.max_steps=6")
    found = sweep_dir.conflicts(reorder, [["model=gpt_nano", "trainer.max_steps=6"],
                                          ["model=gpt_nano", "trainer.max_steps=4"]])
    assert len(found) == 1 and "job 1's directory" in found[0], found
    # a default on either side: conf/trainer/default.yaml's 60 (composed), the earlier job's config.yaml
    default = tmp_path / "d"
    _earlier_job(default, 0, "model=gpt_nano", "trainer.max_steps=100")
    job = _earlier_job(default, 1, "model=gpt_nano")
    (job / ".hydra" / "config.yaml").write_text("trainer:\n  max_steps: 60\n")
    found = sweep_dir.conflicts(default, [["model=gpt_nano"], ["model=gpt_nano", "trainer.max_steps=10"]])
    assert [f.split("run to a later end (")[1].split("): a lower")[0] for f in found] == [
        "`trainer.max_steps=100` there, `trainer.max_steps=60` (its default) in this sweep's job 0",
        "`trainer.max_steps=60` (its default) there, `trainer.max_steps=10` in this sweep's job 1"], found
    assert sweep_dir.conflicts(default, [["model=gpt_nano", "trainer.max_steps=100"], ["model=gpt_nano"]]) == []
    patience = tmp_path / "p"
    _earlier_job(patience, 0, "model=gpt_nano", "trainer.early_stopping.patience=3")
    assert sweep_dir.conflicts(patience, [["model=gpt_nano", "trainer.early_stopping.patience=2"]])
    for more in ("3", "5", "0"):
        assert sweep_dir.conflicts(patience, [["model=gpt_nano", f"trainer.early_stopping.patience={more}"]]) == []


@pytest.mark.subprocess
def test_train_py_refuses_a_sweep_into_another_configurations_job_directories(tmp_path):
    sweep = tmp_path / "s"
    job = _earlier_job(sweep, 0, *TINY, "trainer.max_steps=2", "trainer.lr=0.001")
    run = run_cli("train.py", "-m", *TINY, "trainer.max_steps=2", "trainer.lr=0.002",
                  f"hydra.sweep.dir={sweep}", out=tmp_path / "x", check=False, timeout=120)
    assert run.proc.returncode == 2, run.log[-3000:]
    assert "holds a checkpoint and report.json of an earlier sweep's job with other" in run.log, run.log[-3000:]
    assert "nothing was started" in run.log and "Traceback" not in run.log
    assert not (job / "job.json").exists() and (job / "report.json").read_text() == '{"final_loss": 5.0}'
    # (on stderr, as a run's errors: `> sweep.log` still shows on the terminal why it stopped)
    assert "[launchers.sweep][ERROR] - the sweep directory holds an earlier sweep's jobs" in run.proc.stderr
    assert "earlier sweep" not in run.proc.stdout, run.proc.stdout[-3000:]


# --------------------------------------------------------------------------- the sweep's own lines
@pytest.mark.subprocess
def test_a_sweeps_own_refusals_and_warnings_go_to_stderr_and_its_infos_to_stdout(tmp_path):
    """The sweep driver logged through Hydra's own logging (hydra_logging, which
    conf/hydra/default.yaml did not configure): the preflight's refusal (exit 2) and the report's
    "left out" warning went to stdout, stamped [HYDRA], so `python train.py -m ... > sweep.log`
    exited 2 showing nothing. Warnings and errors go to stderr in a run's format, infos stay on
    stdout."""
    bad = run_cli("train.py", "-m", *TINY, "strategy=ddp,nosuch", "cluster.devices=2", "trainer.max_steps=2",
                  f"hydra.sweep.dir={tmp_path / 'bad'}", out=tmp_path / "x", check=False, timeout=120)
    assert bad.proc.returncode == 2, bad.log[-3000:]
    assert "[launchers.sweep][ERROR] - preflight: 1 of the sweep's 2 jobs cannot run" in bad.proc.stderr, \
        bad.log[-3000:]
    assert "strategy=nosuch: no such strategy" in bad.proc.stderr and "preflight" not in bad.proc.stdout
    sweep = tmp_path / "s"  # (an earlier sweep's job 1, which this one-job sweep leaves out)
    _earlier_job(sweep, 1, *TINY, "trainer.max_steps=2", results=False)
    run = run_cli("train.py", "-m", *TINY, "strategy=ddp", "cluster.devices=2", "trainer.max_steps=2",
                  "+preflight=false", "planner.enforce=true", "cluster.device_memory_GB=1e-6",
                  f"hydra.sweep.dir={sweep}", out=tmp_path / "y", timeout=120)  # (job 0: skipped, not run)
    assert "[launchers.sweep][WARNING] - sweep report: left out 1, which an earlier sweep" in run.proc.stderr, \
        run.log[-3000:]
    assert "left out" not in run.proc.stdout and "preflight=false" not in run.proc.stdout
    assert "sweep report: " in run.proc.stdout and "(0 ok, 1 skipped, 0 failed)" in run.proc.stdout


@pytest.mark.unit
def test_a_skipped_jobs_row_shows_the_plan_its_job_recorded(tmp_path):
    """A job the planner skipped has no report.json, but its job.json holds the plan: its row said
    "predicted: fits = no" and left the predicted step s, state MiB and comm MiB/step at "-".
    They come from the recorded plan, as an ok job's come from its report."""
    import json

    import planner
    from launchers.sweep_report import markdown, row
    from observers.compare import predicted_state_bytes, predicted_wire_bytes

    overrides = [*TINY, "strategy=ddp", "cluster.devices=2", "planner.enforce=true", "cluster.device_memory_GB=1e-6"]
    with pytest.raises(planner.WillNotFit) as e:
        planner.check(validate(compose(overrides)))
    job = _earlier_job(tmp_path, 0, *overrides, results=False)
    (job / ".hydra" / "config.yaml").write_text("strategy: {name: ddp}\ncluster: {nodes: 1, devices: 2}\n")
    (job / "job.json").write_text(json.dumps({"status": "skipped", "reason": str(e.value), "plan": e.value.plan},
                                             default=str))
    r = row(job, tmp_path)
    plan = e.value.plan
    assert r["status"] == "skipped" and r["predicted_fits"] is False, r
    assert r["predicted_step_seconds"] == plan["step_seconds"] > 0
    assert r["predicted_state_bytes"] == predicted_state_bytes(plan["memory"]) > 0
    assert r["predicted_comm_bytes_per_step"] == predicted_wire_bytes(plan["communication"]) > 0
    cells = [c.strip() for c in markdown([r], tmp_path).splitlines()[-7].split("|")[1:-1]]
    assert cells[2] == "skipped" and cells[10] == "no" and "-" not in cells[11:], cells


# --------------------------------------------------------------------------- Ctrl-C in a sweep
def _ctrl_c_sweep(tmp_path: Path) -> tuple[str, Path, list[str], dict[str, str]]:
    """A local sweep of two one-process jobs, Ctrl-C'd (SIGINT to its process group, as a terminal
    sends it) once job 0 finished step 2: (its output, the sweep directory, the command it printed
    to finish the sweep, the environment). Asserts what it said."""
    import json
    import shlex
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT

    sweep, note, log = tmp_path / "s", tmp_path / "note", tmp_path / "log"
    cmd = [sys.executable, str(ROOT / "tests" / "faults.py"), "--pause-at", "2", "--rank", "0", "--seconds", "60",
           "--note", str(note), "--", "-m", *TINY, "trainer.max_steps=3", "trainer.lr=0.001,0.002",
           f"hydra.sweep.dir={sweep}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 240
        while not (note.exists() and "pause0" in note.read_text()):
            assert job.poll() is None and time.time() < deadline, log.read_text()[-4000:]
            time.sleep(0.1)
        os.killpg(job.pid, signal.SIGINT)
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(timeout=30)
    text = log.read_text()
    assert job.returncode == 130, text[-4000:]
    assert "stopped by SIGINT" in text and "to resume: " in text and f"hydra.run.dir={sweep / '0'}" in text, \
        text[-4000:]
    assert f"the report of the jobs that ran: {sweep / 'sweep_report.md'}" in text, text[-4000:]
    rows = json.loads((sweep / "sweep_report.json").read_text())["rows"]
    assert [(r["job"], r["status"]) for r in rows] == [("0", "failed")] and "stopped by SIGINT" in rows[0]["reason"]
    finish = [ln for ln in text.splitlines() if "to finish it" in ln]
    assert len(finish) == 1, text[-4000:]
    again = shlex.split(finish[0].split("the jobs after it start): ", 1)[1])
    assert "-m" in again and f"hydra.sweep.dir={sweep}" in again and "trainer.lr=0.001,0.002" in again, again
    return text, sweep, again, env


@pytest.mark.subprocess
@pytest.mark.timeout(600)
def test_ctrl_c_in_a_local_sweep_says_how_to_resume_and_finish_it_and_writes_its_report(tmp_path):
    """Ctrl-C while job 0 of two runs: it saves after its step and the sweep exits 130 saying so
    -- the checkpoint, the command that resumes that job, the report of what ran and the command
    that finishes the sweep (it exited without a word, and wrote no report)."""
    _ctrl_c_sweep(tmp_path)


@pytest.mark.subprocess
@pytest.mark.slow  # (CI: the Ctrl-C and what it prints, above; this runs the printed command too)
@pytest.mark.timeout(900)
def test_the_command_a_stopped_sweep_prints_resumes_its_job_and_runs_the_rest(tmp_path):
    import json
    import subprocess

    from tests.conftest import ROOT

    _, sweep, again, env = _ctrl_c_sweep(tmp_path)
    done = subprocess.run(again, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert f"resume: {sweep / '0' / 'checkpoints' / 'step2'} (step 2" in out, out[-4000:]
    rows = json.loads((sweep / "sweep_report.json").read_text())["rows"]
    assert [(r["job"], r["status"], r["steps"]) for r in rows] == [("0", "ok", 3), ("1", "ok", 3)], rows
