"""Launching, for real: a multirun of multi-process strategies with its comparison report, two
torchrun "nodes" on loopback, a real one-node Slurm (slurm-wlm + munge) driven through
hydra-submitit-launcher, the SageMaker job built offline, and bad launch input refused before
anything is submitted."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import GLOO_ABORT, ROOT, TINY, assert_losses_close, assert_params_close, run_cli

pytestmark = pytest.mark.timeout(600)

# The local 2-process run the torchrun nodes and the Slurm job are compared with (trained once).
LOCAL_DDP = ("strategy=ddp", "trainer.max_steps=3", "trainer.export_params=true", "cluster.devices=2")


def _strays(mark: str) -> list[str]:
    """Processes still alive that carry ``mark`` in their environment (every process the run
    started inherits it, ranks included, however they were started)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if mark.encode() in (proc / "environ").read_bytes():
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ")[:200]
                found.append(f"{proc.name}: {cmdline!r}")
        except OSError:
            continue
    return found


def _sweep(tmp_path: Path, *overrides: str, name: str = "sweep", timeout: float = 400,
           env: dict[str, str] | None = None, check: bool = True):
    sweep, mark = tmp_path / name, uuid.uuid4().hex
    t0 = time.perf_counter()
    run = run_cli("train.py", "-m", *TINY, *overrides, f"hydra.sweep.dir={sweep}", out=tmp_path / "unused",
                  timeout=timeout, env={**(env or {}), "STRATAGEM_TEST_MARK": mark}, check=check)
    elapsed = time.perf_counter() - t0
    for _ in range(40):  # (Slurm reaps a finished job's tasks a moment after it reports it done)
        if not _strays(mark):
            break
        time.sleep(0.25)
    assert not _strays(mark), f"processes left behind: {_strays(mark)}"
    return run, sweep, elapsed


# --------------------------------------------------------------------------- multirun
@pytest.mark.multiprocess
def test_multirun_of_three_strategies_writes_a_comparison(tmp_path):
    """Three 2-process jobs one after another, each its own process group and directory; no rank
    re-runs the sweep (Lightning's launcher would re-execute the command line); the sweep
    report compares them; the jobs share one interpreter (the later ones import nothing)."""
    steps = ("trainer.max_steps=3", "cluster.devices=2")
    t0 = time.perf_counter()
    single = run_cli("train.py", *TINY, *steps, "strategy=ddp", out=tmp_path / "single")
    one = time.perf_counter() - t0
    run, sweep, elapsed = _sweep(tmp_path, *steps, "strategy=ddp,fsdp,zero2")
    print(f"single 2-process run {one:.1f}s; sweep of 3 {elapsed:.1f}s")
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert jobs == ["0", "1", "2"], jobs  # nothing else: no rank started a sweep of its own
    # each job logs to train.log, as a single run does (the preflight's compose named them "app")
    assert all((sweep / j / "train.log").is_file() for j in jobs), sorted(p.name for p in (sweep / "0").iterdir())
    reports = [json.loads((sweep / j / "report.json").read_text()) for j in jobs]
    # one interpreter (not a wall-clock bound, which a loaded CI machine broke: 11.1 s against
    # 3 x 2.9 s x 1.25): the later jobs find every library imported
    later = [r["startup"]["seconds"]["import"] for r in reports[1:]]
    assert all(t < 0.05 for t in later), later
    assert [(r["strategy"], r["world_size"]) for r in reports] == [("ddp", 2), ("fsdp", 2), ("zero2", 2)]
    assert all([m["rank"] for m in r["memory"]["ranks"]] == [0, 1] for r in reports)
    assert_losses_close(single.losses, reports[0]["losses"], rtol=1e-6)
    rows = json.loads((sweep / "sweep_report.json").read_text())["rows"]
    assert [(r["strategy"], r["status"]) for r in rows] == [("ddp", "ok"), ("fsdp", "ok"), ("zero2", "ok")]
    for r, rep in zip(rows, reports):
        assert r["final_loss"] == rep["final_loss"] and r["tokens_per_second"] > 0
        assert len(r["state_bytes_per_rank"]) == len(r["peak_memory_per_rank"]) == 2
        assert r["comm_bytes_per_step"] > 0 and r["predicted_comm_bytes_per_step"] > 0
        assert r["predicted_fits"] is True
        assert r["predicted_state_bytes"] == pytest.approx(r["state_bytes_per_rank"][0], rel=0.01)
    assert rows[1]["state_bytes_per_rank"][0] < rows[0]["state_bytes_per_rank"][0]  # fsdp shards
    md = (sweep / "sweep_report.md").read_text()
    assert all(f"`strategy={s}`" in md for s in ("ddp", "fsdp", "zero2"))
    assert (sweep / "sweep_report.png").read_bytes()[:4] == b"\x89PNG"
    # what helps choose: median step (first excluded) and the time to the first step, measured,
    # beside the predicted step; every loss curve on one plot; a closing line naming the pick
    for r, rep in zip(rows, reports):
        assert r["step_seconds"] == rep["throughput"]["step_seconds"] > 0
        own = sum(v for k, v in rep["startup"]["seconds"].items() if k not in ("import", "config", "plan"))
        assert r["first_step_seconds"] == pytest.approx(own, abs=1e-4) and own > r["step_seconds"]
        assert rep["startup"]["seconds"]["import"] > 0 or r["job"] != "0"  # (the first job's alone)
        assert r["predicted_step_seconds"] > 0 and r["losses"] == rep["losses"]
    assert (sweep / "sweep_losses.png").read_bytes()[:4] == b"\x89PNG"
    pick = json.loads((sweep / "sweep_report.json").read_text())["pick"]
    assert json.loads((sweep / "sweep_report.json").read_text())["pick_job"] == pick.split()[2]
    fastest = min(rows, key=lambda r: r["step_seconds"])  # the three reach the same loss
    assert pick.startswith(f"pick: job {fastest['job']} (`strategy={fastest['strategy']}`): the fastest"), pick
    assert "fit with margin" in pick and md.rstrip().endswith(pick) and pick in run.log


@pytest.mark.subprocess
@pytest.mark.timeout(300)
def test_one_process_jobs_of_a_sweep_each_start_clean_and_measure_their_own_peak(tmp_path):
    """One-process jobs run inside the sweep's own process, one after another. A job's peak RSS
    was the process's high-water mark, never reset (gpt_nano after gpt_small: 749 MiB, 379
    alone, in report.json, the done: line and the table); Accelerate's state singletons stayed
    set (single then zero2 failed "Accelerate built ['NO'] ... but the preset needs DEEPSPEED ...
    accelerate launch"); a DeepSpeed engine outlived its job (its hooks hold model and optimizer)
    and DeepSpeed kept its destroyed groups (the next engine failed "Group ... is not
    registered"); a group of one left RANK/WORLD_SIZE in the environment. Every job is ok, and
    gpt_nano's peak is its own: below both gpt_small jobs before it."""
    import re

    sweep = tmp_path / "sweep"
    tiny = [o for o in TINY if not o.startswith("model=")]
    run = run_cli("train.py", "-m", *tiny, "backend=accelerate", "model=gpt_small,gpt_nano",
                  "strategy=single,zero2", "trainer.max_steps=2", "trainer.global_batch_size=1",
                  "trainer.micro_batch_size=1", "model.seq_len=16", f"hydra.sweep.dir={sweep}",
                  out=tmp_path / "unused", timeout=240, check=False)
    assert run.proc.returncode == 0, run.log[-4000:]
    rows = json.loads((sweep / "sweep_report.json").read_text())["rows"]
    assert [(r["strategy"], r["status"], r["reason"]) for r in rows] == [
        ("single", "ok", None), ("zero2", "ok", None)] * 2, rows
    assert [next(o for o in r["overrides"] if o.startswith("model=")) for r in rows] == [
        "model=gpt_small"] * 2 + ["model=gpt_nano"] * 2
    peaks = [json.loads((sweep / str(j) / "report.json").read_text())["memory"]["ranks"][0]["peak_rss"]
             for j in range(4)]
    assert [r["peak_memory_per_rank"] for r in rows] == [[p] for p in peaks], rows
    small_single, small_zero2, nano_single, _ = peaks
    assert nano_single < min(small_single, small_zero2), [p >> 20 for p in peaks]
    said = [int(m) for m in re.findall(r"done: .*peak memory (\d+) MiB RSS", run.log)]
    assert said == [round(p / 2**20) for p in peaks], (said, peaks)


@pytest.mark.multiprocess
def test_a_sweep_skips_what_will_not_fit_and_goes_on_after_a_failure(tmp_path):
    """Job by job (the preflight off: it would refuse the sweep): too little memory -> skipped
    with the planner's reason; a resume file that is not a checkpoint -> failed at run time with
    its error; the other job runs; every job is a row, and the sweep's exit code says a row
    failed."""
    garbage = tmp_path / "not_a_checkpoint"  # a directory, so it passes the config check
    garbage.mkdir()
    (garbage / "junk").write_text("not a checkpoint")
    run, sweep, _ = _sweep(tmp_path, "trainer.max_steps=2", "planner.enforce=true", "+preflight=false",
                           "cluster.device_memory_GB=1e-6,24", f"trainer.resume_from=null,{garbage}",
                           check=False)
    assert run.proc.returncode == 1, run.log[-3000:]
    rows = json.loads((sweep / "sweep_report.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["skipped", "skipped", "ok", "failed"], rows
    assert "does not fit" in rows[0]["reason"] or "needs" in rows[0]["reason"], rows[0]["reason"]
    assert "planner.enforce=false" in rows[0]["reason"] and rows[0]["predicted_fits"] is False
    assert rows[3]["reason"] and not (sweep / "3" / "report.json").exists()
    assert rows[2]["final_loss"] is not None
    md = (sweep / "sweep_report.md").read_text()
    assert "skipped" in md and "failed" in md
    # a shorter sweep into the same directory: its rows are its own two jobs, not the earlier 2, 3
    again, _, _ = _sweep(tmp_path, "trainer.max_steps=2", "planner.enforce=true", "+preflight=false",
                         "cluster.device_memory_GB=1e-6,2e-6")
    rows = json.loads((sweep / "sweep_report.json").read_text())["rows"]
    assert [(r["job"], r["status"]) for r in rows] == [("0", "skipped"), ("1", "skipped")], rows
    assert "sweep report: left out 2, 3, which an earlier sweep" in again.log, again.log[-2000:]
    assert "(0 ok, 2 skipped, 0 failed)" in again.log


@pytest.mark.unit
def test_a_collective_timeout_is_told_as_a_peer_that_stopped_responding():
    """A rank hung (SIGSTOP): the healthy rank 0 timed out in gloo and torch's agent recorded
    only its failure, so the message said "lost rank 0 ... exited with code 1: Timed out", blaming
    the rank that waited. It now says rank 0 timed out waiting for a peer that stopped responding."""
    from types import SimpleNamespace

    from launchers.local import _lost

    said = "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Timed out waiting 90000ms for recv operation"
    e = SimpleNamespace(failures={0: SimpleNamespace(exitcode=1, timestamp=1.0, pid=7, message=said)})
    msg = _lost(e, 2)
    assert msg.startswith("rank 0 of 2 timed out waiting for its peers in a collective: RuntimeError"), msg
    assert "another rank stopped responding" in msg and "cluster.collective_timeout" in msg and "lost rank" not in msg
    dead = SimpleNamespace(failures={1: SimpleNamespace(exitcode=-9, timestamp=1.0, pid=8, message=None)})
    assert _lost(dead, 2).startswith("lost rank 1 of 2 (pid 8) -- it was killed by SIGKILL")


@pytest.mark.unit
def test_a_rank_stuck_before_the_process_group_forms_is_named_not_the_rank_that_waited():
    """Rank 1 hung inside init_process_group: rank 0's store wait timed out ("DistStoreError: wait
    timeout after 60000ms"), which was not read as a timeout, so the line said "lost rank 0 ...
    exited with code 1", blaming the healthy rank. It is a timeout now, and the rank the launcher
    had to kill is named."""
    from types import SimpleNamespace

    from launchers.lost import _lost

    said = "DistStoreError: wait timeout after 60000ms, keys: /default_pg/0//cpu//0/1"
    e = SimpleNamespace(failures={0: SimpleNamespace(exitcode=1, timestamp=1.0, pid=7, message=said)})
    msg = _lost(e, 2, stuck={1: 8})
    assert msg.startswith("rank 0 of 2 timed out waiting for its peers as the process group formed: "
                          "DistStoreError: wait timeout"), msg
    assert "rank 1 (pid 8), killed then, stopped responding" in msg and "lost rank" not in msg, msg
    # stuck before any handler of ours: the agent's SIGTERM ended it, nobody had to kill it, and
    # the agent records only the first failure (rank 0's): the launcher names the ranks it ended
    msg = _lost(e, 2, stuck={}, ended={1: 8})
    assert "rank 1 (pid 8), ended by the launcher then, stopped responding" in msg, msg
    assert "one of ranks [1, 2] (ended by the launcher then) stopped responding" in _lost(e, 3, ended={1: 8, 2: 9})


@pytest.mark.unit
def test_a_zero_rank_aborted_on_a_collective_mismatch_is_told_its_likely_cause():
    """A parameter unused on one rank only under zero2/zero3: DeepSpeed's reductions in backward
    differ between ranks and gloo aborts the rank (SIGABRT, "Is there a distributed collective
    mismatch"), before SkippedParameterError's check at the step; the line named nothing. Under a
    ZeRO preset it now says the likely cause and the fix; other deaths get no such hint."""
    from types import SimpleNamespace

    from launchers.lost import mismatch_hint

    def failures(code, said=None):
        return SimpleNamespace(failures={1: SimpleNamespace(exitcode=code, timestamp=1.0, pid=8, message=said)})

    hint = mismatch_hint(failures(-6))
    assert "some ranks and none on others in one step" in hint and "DeepSpeed#1355" in hint, hint
    assert "0 * the skipped layer's output" in hint and "fsdp2 or a ddp preset" in hint
    said = "RuntimeError: ... Received data size doesn't match expected size. Is there a distributed collective mismatch"
    assert mismatch_hint(failures(1, said)) == hint
    assert mismatch_hint(failures(-9)) == "" and mismatch_hint(failures(1, "RuntimeError: boom")) == ""


@pytest.mark.unit
def test_ctrl_c_before_the_first_step_promises_no_checkpoint_and_hides_the_agents_traceback(
        monkeypatch, capfd, tmp_path):
    """Ctrl-C while the ranks were starting said "every rank finishes its step and saves a
    checkpoint" (none was saved: a rank still starting ends at once), then torch's agent logged
    each rank's SIGTERM exit with a ProcessExitedException traceback. The promise now waits for
    every rank to take its stop signals (launchers/lost.py Roll), and those records are dropped
    while the launcher stops the run."""
    import logging
    from types import SimpleNamespace

    from launchers.local import _Stops
    from launchers.lost import Roll

    job = SimpleNamespace(cluster=SimpleNamespace(collective_timeout=5.0), mesh=SimpleNamespace(devices=2))
    monkeypatch.setattr(signal, "setitimer", lambda *a: None)  # (no SIGALRM in the test process)
    monkeypatch.setattr(_Stops, "_send", lambda self, signum: 2)  # (two ranks, not signalled)
    said = []
    for taken in (["0"], ["0", "1"]):
        for rank in taken:
            (tmp_path / f"{rank}.stops").touch()
        stops = _Stops(tmp_path / "run", job, Roll(tmp_path))
        stops._pid = os.getpid()
        stops._signal(signal.SIGTERM, None)
        said.append(capfd.readouterr().err)
    assert said[0].startswith("SIGTERM: the ranks are still starting, before their first step: the run "
                              "stops now, without a checkpoint"), said[0]
    assert said[1].startswith("SIGTERM: every rank finishes its step and saves a checkpoint"), said[1]
    record = logging.LogRecord("torch.distributed.elastic.multiprocessing.api", logging.ERROR, "api.py", 836,
                               "failed (exitcode: %s) local_rank: %s (pid: %s) of fn: %s (start_method: %s)",
                               (-15, 0, 7, "_rank", "fork"), None)
    assert stops.quiet(record) is False
    stops.signum = 0
    assert stops.quiet(record) is True  # (a rank SIGTERMed by something else: torch's record stays)


@pytest.mark.unit
def test_a_configuration_error_found_in_the_ranks_is_its_problem_not_a_lost_rank():
    """checkpoints' "run directory not shared" is a ConfigError raised in the ranks: it was told as
    "lost rank 0 ... exited with code 1:   - hydra.run.dir=..." (exit 1, under torch's traceback).
    The ranks' ConfigError (or DataError) comes back as itself, its peers' vanishing and the
    agent's SIGTERMs aside; any other failure keeps the lost-rank sentence."""
    from types import SimpleNamespace

    from core.errors import ConfigError, DataError
    from launchers.local import _said_error

    problem = "hydra.run.dir=/x is not one directory for every node: rank 1 on b cannot read the file"
    config = f"ConfigError: invalid configuration (1 problem(s)):\n  - {problem}"

    def failures(*said):
        return SimpleNamespace(failures={r: SimpleNamespace(exitcode=code, message=m, timestamp=1.0, pid=r)
                                         for r, (code, m) in enumerate(said)})

    error = _said_error(failures((1, config), (1, "DistNetworkError: Connection reset by peer"), (-15, None)))
    assert isinstance(error, ConfigError) and error.problems == [problem], error
    error = _said_error(failures((1, "DataError: data.path=/d line 7 is not JSON"), (-15, None)))
    assert isinstance(error, DataError) and str(error) == "data.path=/d line 7 is not JSON"
    assert _said_error(failures((1, config), (1, "RuntimeError: CUDA error"))) is None
    assert _said_error(failures((-9, None), (1, "DistNetworkError: Connection reset by peer"))) is None
    # a full disk (checkpoints.save's OSError, the same on every rank): itself, as one process says it
    full = "[Errno 28] No space left on device: saving the checkpoint of step 4 into /r/.tmp-step4 failed on ranks 0, 1"
    error = _said_error(failures((1, f"Traceback ...\n    raise OSError(...)\nOSError: {full}"), (1, f"OSError: {full}")))
    assert isinstance(error, OSError) and error.errno == 28 and str(error) == full, error
    assert _said_error(failures((1, "OSError: [Errno 5] Input/output error"), (-15, None))) is None


@pytest.mark.unit
def test_a_sweep_job_run_with_callbacks_report_false_is_ok_not_failed(tmp_path):
    """``callbacks.report=false`` is a documented knob: its jobs finished (job.json "ok") but
    the sweep marked each "failed: no report.json", picked nothing and exited 1. Such a job is
    an ok row that measured nothing; a job that wrote no report otherwise still failed."""
    from launchers.sweep_report import row

    for job, reports in (("0", False), ("1", True)):
        (tmp_path / job / ".hydra").mkdir(parents=True)
        (tmp_path / job / ".hydra" / "overrides.yaml").write_text(f"- callbacks.report={str(reports).lower()}\n")
        (tmp_path / job / ".hydra" / "config.yaml").write_text(
            f"strategy: {{name: ddp}}\ncluster: {{nodes: 1, devices: 2}}\ncallbacks: {{report: {str(reports).lower()}}}\n")
        (tmp_path / job / "job.json").write_text(json.dumps({"status": "ok", "reason": None, "plan": None}))
    quiet, lost = row(tmp_path / "0", tmp_path), row(tmp_path / "1", tmp_path)
    assert quiet["status"] == "ok" and "callbacks.report=false" in quiet["reason"], quiet
    assert lost["status"] == "failed" and "no report.json" in lost["reason"], lost


@pytest.mark.unit
def test_the_sweep_report_says_which_job_is_which_and_what_each_figure_is(tmp_path):
    """A sweep over callbacks=default,none x trainer.lr: the tokens/s column held the median step
    (throughput observer on) beside the whole loop's (off), 4x apart and unmarked; the png named
    every bar "0: single" .. "3: single"; its communication legend said "max rank" for rank 0's
    bytes; and the final-loss-vs-bytes ticks of close values overprinted ("1.4x10^-1 1.5x10^-1..").
    The whole-loop rates are marked (md and png), the bars and points carry each job's differing
    overrides, the legend says rank 0, and no two tick labels overlap."""
    from launchers.sweep_report import markdown, row
    from observers.plots import sweep_figure

    rows = []
    for job, (cb, lr, mib) in enumerate([("default", "0.0001", 0.1334), ("default", "0.003", 0.14),
                                        ("none", "0.0001", 0.145), ("none", "0.003", 0.15)]):
        d = tmp_path / str(job)
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(f"- callbacks={cb}\n- trainer.lr={lr}\n- model=gpt_nano\n")
        (d / ".hydra" / "config.yaml").write_text("strategy: {name: single}\ncluster: {nodes: 1, devices: 1}\n")
        report = {"steps": 4, "final_loss": 5.6 - job / 10, "tokens_per_second": 652.0,
                  "communication": {"per_step": {"all_reduce": {"wire_bytes": mib * 2**20}}}}
        if cb == "default":
            report["throughput"] = {"tokens_per_second": 163.0, "step_seconds": 3.14}
        (d / "report.json").write_text(json.dumps(report))
        rows.append(row(d, tmp_path))
    assert [r["tokens_per_second_of"] for r in rows] == ["median step"] * 2 + ["whole loop"] * 2
    md = markdown(rows, tmp_path)
    assert "| 163 |" in md and "| 652 (whole loop) |" in md and "whole loop" in md.split("|")[0], md
    fig = sweep_figure(rows)
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert ticks == ["0: callbacks=default\ntrainer.lr=0.0001", "1: callbacks=default\ntrainer.lr=0.003",
                     "2: callbacks=none\ntrainer.lr=0.0001", "3: callbacks=none\ntrainer.lr=0.003"], ticks
    assert "hatched: the whole loop's" in fig.axes[0].get_title()
    assert [b.get_hatch() for b in fig.axes[0].patches] == [None, None, "//", "//"]
    legend = [t.get_text() for t in fig.axes[3].get_legend().get_texts()]
    assert legend == ["measured (rank 0)", "predicted"], legend
    assert [t.get_text() for t in fig.axes[4].texts] == [x.replace("\n", " ") for x in ticks]
    fig.canvas.draw()
    low, high = fig.axes[4].get_xlim()
    shown = [t for t in fig.axes[4].get_xticklabels(which="both")
             if t.get_visible() and t.get_text() and low <= t.get_position()[0] <= high]
    boxes = [t.get_window_extent() for t in shown]
    assert len(boxes) >= 2 and not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:]), \
        [t.get_text() for t in shown]
    import matplotlib.pyplot as plt

    plt.close(fig)


# --------------------------------------------------------------------------- torchrun, two nodes
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_command(*overrides: str, port: int) -> list[str]:
    """README's multi-node command (no hydra.run.dir: the run directory is named by the job)."""
    return [sys.executable, str(ROOT / "train.py"), *TINY, *overrides, "cluster=torchrun",
            "cluster.accelerator=cpu", "cluster.nodes=2", "cluster.devices=1",
            f"cluster.rdzv_endpoint=127.0.0.1:{port}"]


def _nodes(cmd: list[str], cwds: tuple[Path, Path], env: dict[str, str], stagger: float = 2.0,
           timeout: float = 240) -> tuple[list[subprocess.Popen], list[str]]:
    """Start the two "nodes" ``stagger`` seconds apart (as two machines would), each in its own
    working directory, and wait for both."""
    procs = []
    for i, cwd in enumerate(cwds):
        if i:
            time.sleep(stagger)
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return procs, logs


@pytest.mark.multiprocess
def test_two_torchrun_nodes_on_loopback_share_one_run_directory_and_equal_the_local_run(tmp_path, cached):
    """README's command on two "nodes" (two agents of one process each, started 2 s apart, in a
    directory they share) rendezvous at 127.0.0.1 (c10d): one run directory named by the job
    (outputs/torchrun-<endpoint>, not the clock), and the training equals the local 2-process
    run's."""
    steps = LOCAL_DDP[:-1]
    local = cached(*LOCAL_DDP)
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs, logs = _nodes(_node_command(*steps, port=port), (tmp_path, tmp_path), env)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(x[-3000:] for x in logs)
    assert not any(GLOO_ABORT in x for x in logs)
    runs = sorted((tmp_path / "outputs").iterdir())
    assert [r.name for r in runs] == [f"torchrun-127.0.0.1-{port}"], runs
    report = json.loads((runs[0] / "report.json").read_text())
    assert report["world_size"] == 2 and report["config"]["cluster"]["nodes"] == 2
    assert_losses_close(local.losses, report["losses"], rtol=1e-6)
    import torch

    assert_params_close(local.params(), torch.load(runs[0] / "params.pt"), rtol=1e-6)


@pytest.mark.multiprocess
def test_nodes_that_do_not_share_the_run_directory_are_refused_before_training(tmp_path):
    """Each "node" in a directory of its own (machines without a shared filesystem): one clear
    error naming the fix, before any step; no checkpoint split across directories."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    dirs = (tmp_path / "a", tmp_path / "b")
    for d in dirs:
        d.mkdir()
    procs, logs = _nodes(_node_command("strategy=ddp", "trainer.max_steps=3", "trainer.checkpoint_every=1",
                                       port=_free_port()), dirs, env)
    said = "\n".join(logs)
    assert [p.returncode for p in procs] == [2, 2], said[-6000:]
    assert "is not one directory for every node" in said and "shared" in said, said[-4000:]
    # one line each, as a configuration error before launch: not "lost rank" under torch's and
    # the C++ store's tracebacks
    for log in logs:
        assert "lost rank" not in log and "Traceback" not in log and "Exception raised from" not in log, log
        assert log.count("is not one directory for every node") == 1, log
    assert not list(tmp_path.rglob("checkpoints/step*")), list(tmp_path.rglob("checkpoints/*"))


@pytest.mark.multiprocess
@pytest.mark.slow  # (CI: torchrun's restart of a killed rank, tests/test_checkpoint.py, twice)
@pytest.mark.timeout(600)
def test_two_nodes_killed_and_restarted_resume_from_their_checkpoint(tmp_path, cached):
    """Both "nodes" killed after the step-2 checkpoint, then started again with the same command:
    the run resumes from it in the same directory and ends equal to the uninterrupted run."""
    straight = cached(*LOCAL_DDP[:-1], "trainer.max_steps=40", "trainer.checkpoint_every=2", "cluster.devices=2",
                      "trainer.export_params=true")
    port = _free_port()
    cmd = _node_command(*LOCAL_DDP[:-1], "trainer.max_steps=40", "trainer.checkpoint_every=2", port=port)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    run = tmp_path / "outputs" / f"torchrun-127.0.0.1-{port}"
    procs = []
    for i in (0, 1):
        time.sleep(2 * i)
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True))
    try:
        deadline = time.time() + 180
        while not (run / "checkpoints" / "step2" / "COMPLETE").exists():
            assert time.time() < deadline and all(p.poll() is None for p in procs), "no step-2 checkpoint"
            time.sleep(0.1)
    finally:
        for p in procs:
            os.killpg(p.pid, 9)
            p.wait(timeout=30)
    saved = max(int(p.name[4:]) for p in (run / "checkpoints").glob("step*"))
    assert saved < 40 and not (run / "report.json").exists()
    procs, logs = _nodes(cmd, (tmp_path, tmp_path), env)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(x[-3000:] for x in logs)
    report = json.loads((run / "report.json").read_text())
    assert report["losses"] == pytest.approx(straight.losses, rel=1e-6), (saved, report["losses"])
    assert report["resumed_from"]["step"] == saved
    import torch

    assert_params_close(straight.params(), torch.load(run / "params.pt"), rtol=1e-6)


# --------------------------------------------------------------------------- a real Slurm
SLURM = ROOT / "tests" / "slurm"


def _no_slurm() -> str | None:
    """Why a real Slurm cannot run here, or None."""
    import importlib.util
    import shutil

    if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
        return "hydra-submitit-launcher is not installed (pip install -e '.[test]')"
    if not shutil.which("slurmctld"):
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            return "Slurm is not installed and cannot be (needs root and apt-get: slurm-wlm, munge)"
    elif os.geteuid() != 0:
        return "the one-node Slurm of tests/slurm/up.sh runs its daemons as root"
    return None


def _real_slurm(tmp_path_factory, **knobs: str):
    """Start a real one-node Slurm (tests/slurm/up.sh with ``knobs``) and yield the environment
    its clients need (SLURM_CONF; PATH with an sacct stand-in, as there is no accounting
    database); stop it after. The node advertises 4 CPUs on 2 cores, so both jobs of a 2-job
    sweep of 2-task jobs run at once."""
    why = _no_slurm()
    if why:
        print(f"SKIPPED (real Slurm): {why}")
        pytest.skip(why)
    d = tmp_path_factory.mktemp("slurm")
    base = {**os.environ, "SLURM_DIR": str(d), "SLURM_CPUS": "4", "SLURM_CTLD_PORT": str(_free_port()),
            "SLURMD_PORT": str(_free_port()), **knobs}
    munge_was_up = subprocess.run("munge -n | unmunge", shell=True, capture_output=True,
                                  check=False).returncode == 0
    up = subprocess.run([str(SLURM / "up.sh")], env=base, capture_output=True, text=True, timeout=900,
                        check=False)
    if up.returncode:
        if "installing" in up.stderr and not shutil_which("slurmctld"):
            print(f"SKIPPED (real Slurm): could not install it:\n{up.stderr[-2000:]}")
            pytest.skip("slurm-wlm / munge could not be installed here")
        pytest.fail(f"tests/slurm/up.sh failed:\n{up.stderr[-3000:]}")
    env = {"SLURM_CONF": str(d / "slurm.conf"), "PATH": f"{SLURM / 'bin'}:{os.environ['PATH']}"}
    try:
        yield env
    finally:
        stop = {"MUNGE_STOP": "0" if munge_was_up else "1"}  # (leave a munged we did not start)
        subprocess.run([str(SLURM / "down.sh")], env={**base, **stop}, capture_output=True, timeout=120,
                       check=False)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A real one-node Slurm on localhost that does not count memory (CR_Core), for this module."""
    yield from _real_slurm(tmp_path_factory)


@pytest.fixture(scope="module")
def slurm_counting_memory(tmp_path_factory):
    """A second one: memory is a consumable resource (CR_Core_Memory) and a job that asks for
    none gets 300 MB per CPU (DefMemPerCPU), as on many production clusters."""
    yield from _real_slurm(tmp_path_factory, SLURM_DEF_MEM_PER_CPU="300")


def shutil_which(name: str) -> str | None:
    import shutil

    return shutil.which(name)


def _submission(sweep: Path) -> str:
    scripts = sorted(sweep.glob(".submitit/*/*_submission.sh"))
    assert scripts, f"no submission script under {sweep / '.submitit'}"
    return scripts[0].read_text()


@pytest.mark.multiprocess
def test_slurm_sweep_is_an_array_of_two_task_jobs(slurm, tmp_path, cached):
    """hydra/launcher=submitit_slurm with cluster=slurm_local: a 2-job sweep is one array; each
    job is a Slurm job with one task per device, srun starts the ranks, Slurm's environment
    numbers them (Lightning's SLURMEnvironment; for Accelerate, torch's variables exported from
    it); both engines train what the local 2-process run trains."""
    local = cached(*LOCAL_DDP)
    _, sweep, elapsed = _sweep(tmp_path, "hydra/launcher=submitit_slurm", "cluster=slurm_local",
                                 "trainer.max_steps=3", "strategy=ddp", "backend=lightning,accelerate", env=slurm)
    print(f"slurm sweep of 2 two-task jobs: {elapsed:.1f}s")
    script = _submission(sweep)
    for flag in ("--array=0-1", "--ntasks-per-node=2", "--nodes=1", "--cpus-per-task=1", "--time=10",
                 "--signal=USR1@60", "--requeue"):
        assert flag in script, f"{flag} not in the submission:\n{script}"
    rows = json.loads((sweep / "sweep_report.json").read_text())["rows"]
    assert [(r["strategy"], r["status"], r["world_size"]) for r in rows] == [("ddp", "ok", 2)] * 2
    reports = [json.loads((sweep / j / "report.json").read_text()) for j in ("0", "1")]
    assert [r["backend"] for r in reports] == ["lightning", "accelerate"]
    assert all([m["rank"] for m in r["memory"]["ranks"]] == [0, 1] for r in reports)
    assert_losses_close(local.losses, reports[0]["losses"], rtol=1e-6)
    assert_losses_close(local.losses, reports[1]["losses"], rtol=1e-5)
    for r in reports:  # start-up by phase under srun too (from each task's own process start)
        s = r["startup"]
        assert s["seconds"]["rendezvous"] > 0 and s["seconds"]["model_build"] > 0 and s["seconds"]["first_step"] > 0
        assert sum(s["seconds"].values()) == pytest.approx(s["total"], abs=1e-3) and s["first_step_at"]
    for j in ("0", "1"):  # two srun tasks per job, each a rank
        tasks = sorted(sweep.glob(f".submitit/*_{j}/*_{j}_*_log.out"))
        assert len(tasks) == 2, tasks


REQUEUE = ("strategy=ddp", "trainer.max_steps=300", "trainer.checkpoint_every=50", "trainer.export_params=true")


def _job_log(job_dir: Path) -> str:
    """The job's log (Hydra names it after the task: <name>.log in the job directory)."""
    return "".join(p.read_text() for p in sorted(job_dir.glob("*.log")))


def _slurm_state(env: dict[str, str], sweep: Path) -> str:
    squeue = subprocess.run(["squeue", "-t", "all"], env=env, capture_output=True, text=True, check=False)
    ctld = Path(env["SLURM_CONF"]).parent / "log" / "slurmctld.log"
    return (f"\nsqueue:\n{squeue.stdout}\njob log:\n{_job_log(sweep / '0')[-3000:]}"
            f"\nslurmctld.log:\n{ctld.read_text()[-2000:] if ctld.exists() else ''}")


def _requeued_sweep(slurm: dict[str, str], sweep: Path, *overrides: str, requeues: int = 1,
                    rng: Any = None, during: str | None = None, after_start: float | None = None
                    ) -> tuple[str, int]:
    """Submit a one-job sweep; ``requeues`` times, once a checkpoint of the current attempt
    exists (a random moment later when ``rng`` is given; or, with ``during``, as soon as the job
    log shows that text; or ``after_start`` seconds after the job's batch script began its log),
    signal the job with SIGUSR1 as Slurm does before the time limit; wait for the end. Returns
    the output and the exit code."""
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", *TINY, "hydra/launcher=submitit_slurm",
           "cluster=slurm_local", *overrides, f"hydra.sweep.dir={sweep}"]
    env = {**os.environ, **slurm, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ckpts = sweep / "0" / "checkpoints"
    try:
        for i in range(requeues):
            before = {p.name for p in ckpts.glob("step*")} if ckpts.exists() else set()
            def ready() -> bool:
                if after_start is not None:  # the batch script started (its log exists)
                    return bool(list((sweep / ".submitit").glob("*/*_log.out")))
                if during:  # the attempt's start-up reached that line
                    return (sweep / "0").exists() and during in _job_log(sweep / "0")
                return ckpts.exists() and bool({p.name for p in ckpts.glob("step*")} - before)

            deadline = time.time() + 240
            while not ready():
                assert proc.poll() is None and time.time() < deadline, _slurm_state(env, sweep)
                time.sleep(0.05 if during else 0.2)
            if rng is not None:
                time.sleep(rng.uniform(0, 1.5))
            if after_start is not None:
                time.sleep(after_start)
            job = next((sweep / ".submitit").glob("*/")).name  # the job this sweep submitted
            subprocess.run(["scancel", "--signal=USR1", job], env=env, check=True, timeout=30)
            deadline = time.time() + 120  # the attempt ends (its report would say otherwise)
            while _job_log(sweep / "0").count("requeued Slurm job") < i + 1:
                assert time.time() < deadline, "no requeue" + _slurm_state(env, sweep)
                time.sleep(0.2)
        try:
            out = proc.communicate(timeout=420)[0]
        except subprocess.TimeoutExpired:
            pytest.fail(f"the requeued job did not finish{_slurm_state(env, sweep)}")
    finally:
        proc.kill()
    return out, proc.returncode


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend, preset", [
    ("lightning", "ddp"), pytest.param("accelerate", "ddp", marks=pytest.mark.slow),
    pytest.param("lightning", "ddp_powersgd", marks=pytest.mark.slow)])
def test_slurm_requeue_resumes_from_our_checkpoint_and_equals_the_straight_run(slurm, tmp_path, cached, backend,
                                                                               preset):
    """SIGUSR1 (what Slurm sends cluster.slurm.requeue_signal_s before the time limit) after a
    checkpoint: every rank finishes its step, all save together, rank 0 requeues; the next
    attempt resumes from that checkpoint (one owner: no Lightning hpc checkpoint) and the run
    ends equal to the straight one, on either backend -- and for a preset that keeps state of
    its own on each rank (PowerSGD: its factors and error feedback, rank_state/), which a
    requeue used to stop at."""
    over = (*REQUEUE, f"strategy={preset}", f"backend={backend}")
    straight = cached(*over, "cluster.devices=2")
    sweep = tmp_path / "requeue"
    out, code = _requeued_sweep(slurm, sweep, *over)
    assert code == 0, out[-3000:]
    log = _job_log(sweep / "0")
    stopped = int(log.split("stopped by SIGUSR1 after step ")[1].split(";")[0])
    assert f"at step {stopped}: model and optimizer" in log, log[-3000:]
    assert not list((sweep / "0").glob("hpc_ckpt_*")) and "Restoring states" not in log
    report = json.loads((sweep / "0" / "report.json").read_text())
    assert report["resumed_from"]["step"] == stopped  # and the report covers the whole run
    assert_losses_close(straight.losses, report["losses"], rtol=1e-6)
    import torch

    assert_params_close(straight.params(), torch.load(sweep / "0" / "params.pt"), rtol=1e-6)
    rows = json.loads((sweep / "sweep_report.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["ok"]


@pytest.mark.slow  # (CI: the signal held through start-up, tests/test_checkpoint.py, one process)
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_a_requeue_signal_while_the_job_starts_requeues_and_ends_equal(slurm, tmp_path, cached):
    """SIGUSR1 while the ranks are still building the engine (before the run takes its signals):
    no rank dies of it -- train.py holds it from its first line, the task function again under
    submitit -- the attempt stops after step 1, saves, requeues, and the run ends equal."""
    straight = cached(*REQUEUE, "cluster.devices=2", "backend=lightning")
    sweep = tmp_path / "requeue_start"
    out, code = _requeued_sweep(slurm, sweep, *REQUEUE, "backend=lightning", during="strategy: ddp")
    assert code == 0, out[-3000:]
    log = _job_log(sweep / "0")
    assert "stopped by SIGUSR1 after step 1" in log, log[-3000:]
    report = json.loads((sweep / "0" / "report.json").read_text())
    assert report["resumed_from"]["step"] == 1
    assert_losses_close(straight.losses, report["losses"], rtol=1e-6)


@pytest.mark.subprocess
def test_a_slurm_job_s_python_holds_sigusr1_from_its_first_moment(tmp_path):
    """launchers/site on PYTHONPATH (our sbatch script's setup line): a SIGUSR1 that arrives before
    the process imported anything of ours is held, and the run's flag takes it over at ``hold``;
    without it, SIGUSR1's default action ends the process. A sitecustomize it shadows still runs."""
    from launchers.slurm import SITE, request
    from recipes.config import compose

    other = tmp_path / "theirs"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['THEIRS'] = 'ran'\n")
    code = ("import os, signal\nos.kill(os.getpid(), signal.SIGUSR1)\n"
            "from checkpoints.interrupt import current, hold\nhold()\n"
            "print(current().signum, os.environ.get('THEIRS'), 'STRATAGEM_HELD_SIGNAL' in os.environ)")
    env = {**os.environ, "PYTHONPATH": f"{SITE}:{other}:{ROOT}"}
    held = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert held.returncode == 0 and held.stdout.split() == [str(int(signal.SIGUSR1)), "ran", "False"], held
    bare = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=60, check=False)
    assert bare.returncode == -signal.SIGUSR1
    setup = request(compose(["cluster=slurm_local"]))["setup"]
    assert setup == [f"export PYTHONPATH={SITE}:$PYTHONPATH"]


MOMENTS = {"at 0.5 s": {"after_start": 0.5}, "mid-start-up": {"during": "strategy: ddp"}, "mid-training": {}}


@pytest.mark.slow  # (CI: the signal at 0.5 s and mid-build, tests/test_checkpoint.py, one process)
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("attempt", [1, 2, 3])
@pytest.mark.parametrize("moment", list(MOMENTS))
def test_sigusr1_at_three_moments_always_requeues_and_ends_equal(slurm, tmp_path, cached, moment, attempt):
    """SIGUSR1 at 0.5 s (the job's processes importing Python and submitit, before they unpickle
    the job: held by launchers/site/sitecustomize.py), while the engine builds, and after a
    checkpoint -- three times each: the job always requeues, and the run ends equal."""
    straight = cached(*REQUEUE, "cluster.devices=2", "backend=lightning")
    sweep = tmp_path / "requeue"
    out, code = _requeued_sweep(slurm, sweep, *REQUEUE, "backend=lightning", **MOMENTS[moment])
    assert code == 0, out[-3000:]
    log = _job_log(sweep / "0")
    assert "stopped by SIGUSR1 after step" in log, log[-3000:]
    report = json.loads((sweep / "0" / "report.json").read_text())
    assert report["resumed_from"]["step"] >= 1
    assert_losses_close(straight.losses, report["losses"], rtol=1e-6)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(1800)
def test_twenty_requeues_at_random_moments_none_hangs_all_equal(slurm, tmp_path, cached):
    """Twenty SIGUSR1 requeues of one job, each a random moment after a checkpoint of its attempt:
    none hangs (the deadlock of a handler that saves with a barrier), and the run ends equal to
    the straight one."""
    import random

    steps = ("strategy=ddp", "trainer.max_steps=4000", "trainer.checkpoint_every=25", "trainer.export_params=true")
    straight = cached(*steps, "cluster.devices=2")
    sweep = tmp_path / "requeues"
    out, code = _requeued_sweep(slurm, sweep, *steps, requeues=20, rng=random.Random(20))
    assert code == 0, out[-3000:]
    report = json.loads((sweep / "0" / "report.json").read_text())
    assert_losses_close(straight.losses, report["losses"], rtol=1e-6)  # one record across 20 attempts
    import torch

    assert_params_close(straight.params(), torch.load(sweep / "0" / "params.pt"), rtol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.slow  # (CI: a failed job in a local sweep is a failed row and the sweep goes on)
@pytest.mark.timeout(600)
def test_a_cancelled_slurm_job_is_a_failed_row_and_the_sweep_exits_nonzero(slurm, tmp_path):
    """Two jobs; the second is cancelled (scancel) while it runs: the first finishes, the sweep
    waits for both, writes its report with the second row failed, and exits non-zero."""
    sweep = tmp_path / "cancelled"
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", *TINY, "hydra/launcher=submitit_slurm",
           "cluster=slurm_local", "strategy=ddp", "trainer.max_steps=3,100000", f"hydra.sweep.dir={sweep}"]
    env = {**os.environ, **slurm, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 240
        while not list((sweep / "1").glob("*.log")):
            assert proc.poll() is None and time.time() < deadline, _slurm_state(env, sweep)
            time.sleep(0.2)
        time.sleep(3)
        array = next((sweep / ".submitit").glob("*/")).name.split("_")[0]
        subprocess.run(["scancel", f"{array}_1"], env=env, check=True, timeout=30)
        out = proc.communicate(timeout=300)[0]
    finally:
        proc.kill()
    assert proc.returncode not in (0, None), out[-3000:]
    assert "Traceback" not in out.split("sweep report")[-1], out[-3000:]
    rows = json.loads((sweep / "sweep_report.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["ok", "failed"], rows
    assert "ended without a result" in rows[1]["reason"], rows[1]


@pytest.mark.subprocess
def test_a_slurm_without_accounting_is_refused_before_submission(slurm, tmp_path):
    """submitit polls sacct for every job state; a Slurm without an accounting database (and no
    stand-in on PATH) would leave the sweep waiting forever: refused at once, with the fix."""
    path = os.environ["PATH"]  # without tests/slurm/bin: the real sacct, which has no database here
    run = run_cli("train.py", "-m", *TINY, "hydra/launcher=submitit_slurm", "cluster=slurm_local",
                  "strategy=ddp", f"hydra.sweep.dir={tmp_path / 'sweep'}", out=tmp_path / "bad",
                  check=False, env={**slurm, "PATH": path}, timeout=120)
    assert run.proc.returncode == 2, run.log[-3000:]
    assert "sacct cannot answer job states here" in run.log and "accounting" in run.log
    assert not list((tmp_path / "sweep").glob(".submitit/*")), "something was submitted"


@pytest.mark.subprocess
def test_every_point_of_a_sweep_is_checked_before_any_job_starts(tmp_path):
    """A sweep with an invalid point (global batch 15 on 2 ranks) starts nothing: one message
    naming that point and its problem, exit 2."""
    sweep = tmp_path / "sweep"
    run = run_cli("train.py", "-m", *TINY, "strategy=ddp", "cluster.devices=2",
                  "trainer.global_batch_size=16,15", f"hydra.sweep.dir={sweep}", out=tmp_path / "x",
                  check=False, timeout=120)
    assert run.proc.returncode == 2, run.log[-3000:]
    assert "preflight: 1 of the sweep's 2 jobs cannot run; nothing was started" in run.log
    assert "trainer.global_batch_size=15 is not divisible" in run.log
    assert not list(sweep.glob("*/report.json")) and "Initializing distributed" not in run.log


@pytest.mark.subprocess
def test_a_slurm_that_counts_memory_is_planned_with_the_memory_its_job_gets(slurm_counting_memory, tmp_path):
    """Where Slurm counts memory, a job that asks for none gets the partition's default, not the
    node: the planner plans with what Slurm grants -- before submission from scontrol, inside the
    job from the job's own allocation -- and names the fix; cluster.slurm.mem_gb=0 asks for the
    whole node (sbatch --mem=0), which the plan and the submission then agree on."""
    env = slurm_counting_memory
    offload = ("cluster=slurm_local", "strategy=zero2_offload", "model=gpt_small", "planner.enforce=true")
    sweep = tmp_path / "sweep"
    run = run_cli("train.py", "-m", *TINY, "hydra/launcher=submitit_slurm", *offload,
                  f"hydra.sweep.dir={sweep}", out=tmp_path / "bad", check=False, env=env, timeout=120)
    assert run.proc.returncode == 2, run.log[-3000:]
    assert "has 0.6 GB (the cluster's DefMemPerCPU 300 MB x 2 CPUs: Slurm's default for a job " \
           "without cluster.slurm.mem_gb" in run.log, run.log[-3000:]
    assert not list(sweep.glob(".submitit/*")), "something was submitted"

    plan = run_cli("plan.py", *offload, "cluster.slurm.mem_gb=0", "planner.format=json", out=tmp_path / "p",
                   env=env, timeout=120)
    whole = json.loads(plan.proc.stdout)["plans"][0]
    assert whole["fits"], whole
    from launchers.slurm import request
    from recipes.compose import compose

    assert request(compose([*offload, "cluster.slurm.mem_gb=0"]))["mem_gb"] == 0  # (submitit writes --mem=0GB: all of each node's memory)

    # inside a job that asked for none (sbatch, then srun, as submitit does): its own allocation
    probe = ("from recipes.cluster_config import ClusterConfig, SlurmConfig; "
             "print(ClusterConfig(name='s', launcher='slurm', host_memory_GB=2000, devices=1, "
             "slurm=SlurmConfig()).host_limit())")
    out = tmp_path / "job.out"
    done = subprocess.run(["sbatch", "-W", "-n1", "-o", str(out), "--wrap",
                           f"srun {sys.executable} -c {shlex.quote(probe)}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})
    assert done.returncode == 0 and out.exists(), done.stderr[-2000:]
    import ast

    gb, source = ast.literal_eval(out.read_text().strip().splitlines()[-1])
    assert gb == pytest.approx(300 * 2**20 / 1e9), out.read_text()
    assert source.startswith("this job's allocation, SLURM_MEM_PER_CPU 300 MB x 1 CPUs: Slurm's default"), source


@pytest.mark.subprocess
def test_a_slurm_memory_request_larger_than_the_nodes_is_refused_before_submission(slurm, tmp_path):
    """cluster.slurm.mem_gb above the partition's nodes (sinfo): one line with the largest that
    fits, nothing submitted."""
    sweep = tmp_path / "sweep"
    run = run_cli("train.py", "-m", *TINY, "hydra/launcher=submitit_slurm", "cluster=slurm_local",
                  "strategy=ddp", "cluster.slurm.mem_gb=100000", f"hydra.sweep.dir={sweep}",
                  out=tmp_path / "bad", check=False, env=slurm, timeout=120)
    assert run.proc.returncode == 2, run.log[-3000:]
    assert "cluster.slurm.mem_gb=100000 but the smallest node of partition debug has" in run.log, run.log[-3000:]
    assert not list(sweep.glob(".submitit/*")), "something was submitted"


# --------------------------------------------------------------------------- SageMaker
_NO_SDK = """
import atexit, runpy, sys
atexit.register(lambda: sys.stderr.write('LOADED=' + ','.join(sorted({m.split('.')[0] for m in sys.modules}
                                           & {'sagemaker', 'boto3', 'torch', 'lightning'})) + '\\n'))
sys.argv = %r
runpy.run_path(sys.argv[0], run_name='__main__')
"""


@pytest.mark.subprocess
def test_sagemaker_dry_run_prints_the_job_and_each_hosts_command():
    argv = ["launch.py", "cluster=sagemaker_p5_2node", "strategy=fsdp", "model=llama_1b",
            "trainer.max_steps=100", "cluster.sagemaker.output_path=s3://b/out",
            "cluster.sagemaker.checkpoint_s3_uri=s3://b/ckpt", "--dry-run"]
    proc = subprocess.run([sys.executable, "-c", _NO_SDK % argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = next(x for x in proc.stderr.splitlines() if x.startswith("LOADED=")).removeprefix("LOADED=")
    assert loaded == "", f"--dry-run imported {loaded}"  # no SDK, no cloud, no engine
    args = json.loads(proc.stdout)  # (the job's arguments alone; what is said of them on stderr)
    text = proc.stderr
    assert args["compute"] == {"instance_type": "ml.p5.48xlarge", "instance_count": 2, "volume_size_in_gb": 100}
    assert args["source_code"]["source_dir"] == str(ROOT)
    command = ("pip install -q -e . && STRATAGEM_RUN_DIR_PER_HOST=1 python train.py cluster=sagemaker_p5_2node strategy=fsdp "
               "model=llama_1b trainer.max_steps=100 cluster.sagemaker.output_path=s3://b/out "
               "cluster.sagemaker.checkpoint_s3_uri=s3://b/ckpt hydra.run.dir=/opt/ml/checkpoints/run")
    assert args["source_code"]["command"] == command
    assert args["checkpoint_config"] == {"s3_uri": "s3://b/ckpt", "local_path": "/opt/ml/checkpoints"}
    assert args["output_data_config"] == {"s3_output_path": "s3://b/out"}
    assert args["training_image"]["framework"] == "pytorch"
    for i in (0, 1):
        assert f"algo-{i + 1} (SM_CURRENT_HOST_RANK={i}): {command}" in text
    assert "a restarted job gets their union back on every host" in text



@pytest.mark.subprocess
def test_sagemaker_job_without_a_checkpoint_destination_or_with_an_undeclared_channel_is_refused(tmp_path):
    """Its checkpoints and report would vanish with the job, or its data would not be there."""
    base = ["launch.py", "cluster=sagemaker_p5_2node", "strategy=fsdp", "model=llama_1b", "data=jsonl",
            "data.path=/opt/ml/input/data/train/c.jsonl", "data.tokenizer=/opt/ml/input/data/tok/t.json",
            "--dry-run"]
    run = run_cli(*base, out=tmp_path, check=False)
    _refused(run, "cluster.sagemaker.checkpoint_s3_uri=null and cluster.sagemaker.output_path=null",
             "data.path=/opt/ml/input/data/train/c.jsonl is in channel 'train'",
             "+cluster.sagemaker.inputs.train=s3://<bucket>/<prefix>", "+cluster.sagemaker.inputs.tok=")
    run = run_cli(*base, "cluster.sagemaker.output_path=s3://b/out", "+cluster.sagemaker.inputs.train=s3://b/d",
                  "+cluster.sagemaker.inputs.tok=s3://b/t", out=tmp_path)
    text = run.proc.stdout
    args = json.loads(text[text.index("{"):text.index("\n}\n") + 2])
    assert args["checkpoint_config"] == {"s3_uri": "s3://b/out/checkpoints", "local_path": "/opt/ml/checkpoints"}
    assert args["input_data_config"] == [{"channel_name": "tok", "data_source": "s3://b/t"},
                                         {"channel_name": "train", "data_source": "s3://b/d"}]


@pytest.mark.unit
def test_sagemaker_s3_destinations_that_are_not_s3_uris_are_refused():
    """output_path=my-bucket/x was accepted (checkpoints to "my-bucket/x/checkpoints")."""
    from launchers import sagemaker
    from recipes.config import compose

    def problems(*over: str) -> list[str]:
        cfg = compose(["cluster=sagemaker_p5_2node", *over])
        return sagemaker.submission_problems(cfg.cluster, cfg.data)

    assert problems("cluster.sagemaker.output_path=my-bucket/x") == [
        "cluster.sagemaker.output_path=my-bucket/x is not an S3 URI: set "
        "cluster.sagemaker.output_path=s3://<bucket>/<prefix>"]
    assert problems("cluster.sagemaker.output_path=s3://b/x", "cluster.sagemaker.checkpoint_s3_uri=/tmp/c") == [
        "cluster.sagemaker.checkpoint_s3_uri=/tmp/c is not an S3 URI: set "
        "cluster.sagemaker.checkpoint_s3_uri=s3://<bucket>/<prefix>"]
    assert problems("cluster.sagemaker.output_path=s3://b/x") == []


@pytest.mark.unit
def test_the_sagemaker_image_has_at_least_the_torch_pyproject_requires():
    """Each host runs `pip install -e .`: an image older than pyproject.toml's torch minimum would
    have its torch replaced. The default is that minimum; an older version is refused."""
    import re

    from launchers import sagemaker
    from recipes.config import compose

    minimum = re.search(r'"torch>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert sagemaker.torch_minimum() == minimum
    base = ["cluster=sagemaker_p5_2node", "cluster.sagemaker.output_path=s3://b/x"]
    default = compose(base).cluster
    assert default.sagemaker.framework_version == f"{minimum}.0"
    assert sagemaker.submission_problems(default, None) == []
    old = compose([*base, "cluster.sagemaker.framework_version=2.8.0"])
    assert sagemaker.submission_problems(old.cluster, old.data) == [
        f"cluster.sagemaker.framework_version=2.8.0: the PyTorch image's torch is older than pyproject.toml's "
        f"torch>={minimum}, which each host's `pip install -e .` would install over it; set "
        f"cluster.sagemaker.framework_version=<a version >= {minimum}> (e.g. {minimum}.0), or "
        f"cluster.sagemaker.image_uri=<an image with torch>={minimum}>"]
    own = compose([*base, "cluster.sagemaker.framework_version=2.8.0", "cluster.sagemaker.image_uri=r/img:1"])
    assert sagemaker.submission_problems(own.cluster, own.data) == []  # (framework_version unused)


@pytest.mark.unit
def test_sagemaker_cluster_numbers_follow_the_instance_type():
    from recipes.config import compose

    p5 = compose(["cluster=sagemaker_p5_2node"]).cluster
    g5 = compose(["cluster=sagemaker_p5_2node", "cluster.sagemaker.instance_type=ml.g5.48xlarge"]).cluster
    assert (p5.devices, p5.device_memory_GB, p5.peak_tflops) == (8, 80.0, 989.0)
    assert (g5.devices, g5.device_memory_GB, g5.peak_tflops) == (8, 24.0, 70.0)
    mine = compose(["cluster=sagemaker_p5_2node", "cluster.device_memory_GB=40"]).cluster
    assert mine.device_memory_GB == 40 and mine.peak_tflops == 989.0  # a value set explicitly wins
    with pytest.raises(Exception, match="cluster.sagemaker.instance_type='ml.x' is not a known instance type"):
        _ = compose(["cluster=sagemaker_p5_2node", "cluster.sagemaker.instance_type=ml.x"]).cluster.devices

@pytest.mark.unit
def test_the_sagemaker_sdk_accepts_the_job(monkeypatch):
    """The dry run's arguments build the SDK's own ModelTrainer (offline: no call to AWS)."""
    pytest.importorskip("sagemaker", reason="the SageMaker SDK extra is not installed ('.[sagemaker]')")
    from launchers import sagemaker
    from recipes.config import compose

    for k, v in {"AWS_ACCESS_KEY_ID": "AKIAOFFLINE", "AWS_SECRET_ACCESS_KEY": "offline",
                 "AWS_DEFAULT_REGION": "us-west-2", "SAGEMAKER_VALIDATE_ROLE": "false"}.items():
        monkeypatch.setenv(k, v)
    cluster = compose(["cluster=sagemaker_p5_2node", "cluster.sagemaker.region=us-west-2",
                       "cluster.sagemaker.role=arn:aws:iam::123456789012:role/Training"]).cluster
    trainer = sagemaker.build(sagemaker.job_arguments(cluster, ["strategy=fsdp"], str(ROOT)))
    assert trainer.compute.instance_count == 2 and "pytorch-training:2.11.0" in trainer.training_image
    assert trainer.source_code.command.endswith("hydra.run.dir=/opt/ml/checkpoints/run")


@pytest.mark.subprocess
def test_launch_py_refuses_before_submission(tmp_path):
    """Not a SageMaker cluster; and submitting without the SDK names the extra."""
    run = run_cli("launch.py", "cluster=slurm_8x8_h100", "strategy=fsdp", "model=llama_1b", out=tmp_path,
                  check=False)
    assert run.proc.returncode == 2 and "launch.py submits cluster.launcher=sagemaker" in run.log
    import importlib.util

    if importlib.util.find_spec("sagemaker") is None:
        run = run_cli("launch.py", "cluster=sagemaker_p5_2node", "strategy=fsdp", "model=llama_1b", out=tmp_path,
                      check=False)
        assert run.proc.returncode == 2 and "pip install -e '.[sagemaker]'" in run.log, run.log


def _sagemaker_env(monkeypatch, rank: int, hosts: int = 2) -> None:
    """What SageMaker's training container exports (as its SDK's environment script does)."""
    names = [f"algo-{i + 1}" for i in range(hosts)]
    for k, v in {"SM_HOSTS": json.dumps(names), "SM_CURRENT_HOST": names[rank], "SM_HOST_COUNT": str(hosts),
                 "SM_CURRENT_HOST_RANK": str(rank), "SM_MASTER_ADDR": "algo-1", "SM_MASTER_PORT": "7777",
                 "SM_NUM_GPUS": "8", "TRAINING_JOB_NAME": "stratagem-1"}.items():
        monkeypatch.setenv(k, v)


@pytest.mark.unit
def test_in_a_sagemaker_container_the_run_takes_its_nodes_from_sagemaker(monkeypatch):
    import launchers
    from launchers.local import Rendezvous, rendezvous
    from recipes.config import compose
    from recipes.job import RUN, validate

    cfg = compose(["cluster=sagemaker_p5_2node", "strategy=fsdp", "model=llama_1b"])
    job = validate(cfg, depth=RUN)
    assert any("python launch.py cluster=sagemaker_p5_2node" in p for p in launchers.check(job))
    _sagemaker_env(monkeypatch, rank=1)
    assert launchers.check(job) == []
    assert rendezvous(job) == Rendezvous(2, "algo-1:7777", "sagemaker-stratagem-1", 0)
    three = validate(compose(["cluster=sagemaker_p5_2node", "strategy=fsdp", "model=llama_1b",
                              "cluster.nodes=3", "trainer.global_batch_size=48"]), depth=RUN)
    assert any("cluster.nodes=3 but this SageMaker job has 2 instance(s)" in p for p in launchers.check(three))


SIM = ("strategy=ddp", "trainer.max_steps=4", "trainer.checkpoint_every=2", "trainer.keep_last=0",
       "trainer.global_batch_size=8", "trainer.micro_batch_size=4", "trainer.export_params=true")


def _host_env(i: int, port: int) -> dict[str, str]:
    """Host ``i`` of a two-instance SageMaker job, as its container's environment says, with the
    declaration every host's command carries (launchers/sagemaker.py host_command)."""
    names = ["algo-1", "algo-2"]
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "SM_HOSTS": json.dumps(names),
            "SM_CURRENT_HOST": names[i], "SM_HOST_COUNT": "2", "SM_CURRENT_HOST_RANK": str(i),
            "SM_MASTER_ADDR": "127.0.0.1", "SM_MASTER_PORT": str(port), "SM_NUM_GPUS": "0",
            "TRAINING_JOB_NAME": "sim-1", "STRATAGEM_RUN_DIR_PER_HOST": "1"}


def _two_hosts(disks: list[Path]) -> list[subprocess.CompletedProcess]:
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(ROOT / "train.py"), *TINY, *SIM, "cluster=sagemaker_p5_2node",
                               "cluster.accelerator=cpu", "cluster.devices=1", f"hydra.run.dir={disk / 'run'}"],
                              cwd=ROOT, env=_host_env(i, port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for i, disk in enumerate(disks)]
    try:
        return [subprocess.CompletedProcess(p.args, p.wait(timeout=240), p.communicate()[0]) for p in procs]
    finally:
        for p in procs:
            p.kill()


@pytest.mark.multiprocess
def test_two_sagemaker_hosts_with_their_own_disks_train_and_resume_from_the_synced_union(tmp_path, cached):
    """Two "instances", each with its own /opt/ml/checkpoints (a directory of its own): every
    host commits its ranks' part of each checkpoint under the one manifest. SageMaker's restart is
    simulated as its S3 sync does it -- every host gets the union of what the hosts uploaded --
    with the newest checkpoint's part of host 2 never uploaded: the restarted job resumes from the
    newest checkpoint that is whole (step 2) and ends equal to a straight 2-process run."""
    import shutil

    import torch

    straight = cached(*SIM, "cluster.devices=2")
    disks = [tmp_path / "algo-1", tmp_path / "algo-2"]
    first = _two_hosts(disks)
    assert [p.returncode for p in first] == [0, 0], "\n".join(p.stdout[-3000:] for p in first)
    for step in (2, 4):  # each host's own part of each checkpoint, under the same manifest
        parts = [disk / "run" / "checkpoints" / f"step{step}" for disk in disks]
        assert (parts[0] / "rng" / "rank0.pt").is_file() and not (parts[0] / "rng" / "rank1.pt").exists()
        assert (parts[1] / "rng" / "rank1.pt").is_file() and not (parts[1] / "meta.json").exists()
        assert (parts[0] / "COMPLETE").read_text() == (parts[1] / "COMPLETE").read_text()
    assert_losses_close(straight.losses, json.loads((disks[0] / "run" / "report.json").read_text())["losses"],
                        rtol=1e-6)
    s3 = tmp_path / "s3"  # what reached S3: everything but host 2's part of step 4
    shutil.copytree(disks[0] / "run", s3)
    for f in (disks[1] / "run" / "checkpoints").rglob("*"):
        if f.is_file() and "step4" not in f.parts:
            (s3 / f.relative_to(disks[1] / "run")).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, s3 / f.relative_to(disks[1] / "run"))
    (s3 / "report.json").unlink()
    (s3 / "params.pt").unlink()
    for disk in disks:  # the restarted job: fresh instances, the union downloaded to each
        shutil.rmtree(disk)
        shutil.copytree(s3, disk / "run")
    again = _two_hosts(disks)
    assert [p.returncode for p in again] == [0, 0], "\n".join(p.stdout[-3000:] for p in again)
    assert "not resuming from a checkpoint a host's files never reached" in again[0].stdout
    report = json.loads((disks[0] / "run" / "report.json").read_text())
    assert report["resumed_from"]["step"] == 2
    assert_losses_close(straight.losses, report["losses"], rtol=1e-6)
    assert_params_close(straight.params(), torch.load(disks[0] / "run" / "params.pt"), rtol=1e-6)


# --------------------------------------------------------------------------- bad input
def _refused(run, *needles: str) -> None:
    assert run.proc.returncode == 2, run.log[-3000:]
    for needle in needles:
        assert needle in run.log, f"{needle!r} not in:\n{run.log[-3000:]}"
    assert "Initializing distributed" not in run.log and "Submitit" not in run.log


@pytest.mark.subprocess
def test_a_multi_node_torchrun_without_a_rendezvous_is_refused(tmp_path):
    run = run_cli("train.py", *TINY, "strategy=ddp", "cluster=torchrun", "cluster.nodes=2", out=tmp_path / "bad",
                  check=False)
    _refused(run, "cluster.rdzv_endpoint=null", "cluster.nodes=2", "cluster.rdzv_endpoint=<node 0's address>:29500")


@pytest.mark.unit
@pytest.mark.parametrize("endpoint", ["127.0.0.1:99999", "127.0.0.1:0", "[::1]:65536"])
def test_a_rendezvous_port_outside_the_range_is_refused(endpoint):
    """--dry-run said "would start"; the run then crashed in torch's socket code (a traceback)."""
    import launchers
    from recipes.config import compose
    from recipes.job import validate
    from strategies import ConfigError

    base = [*TINY, "strategy=ddp", "cluster=torchrun", "cluster.nodes=1", "cluster.devices=2",
            "cluster.accelerator=cpu"]
    with pytest.raises(ConfigError) as e:
        validate(compose([*base, f"cluster.rdzv_endpoint='{endpoint}'"]), extra=[launchers.check])
    port = endpoint.rsplit(":", 1)[1]
    assert e.value.problems == [f"cluster.rdzv_endpoint={endpoint!r}: port {port} is outside 1..65535: set a "
                                "port in that range, e.g. cluster.rdzv_endpoint=10.0.0.1:29500"]
    validate(compose([*base, "cluster.rdzv_endpoint=127.0.0.1:65535"]), extra=[launchers.check])


@pytest.mark.unit
def test_two_torchrun_jobs_on_one_endpoint_have_their_own_rendezvous_ids():
    """The rendezvous id was ``stratagem-<endpoint>``: a second job on the same endpoint joined the
    first one's rendezvous, waited until it ended, then died with RendezvousConnectionError. The
    id is the job's run directory as given (the same on every node of it, as the command is)."""
    from launchers.torchrun import run_id

    assert run_id("outputs/torchrun-127.0.0.1-29600") == run_id("outputs/torchrun-127.0.0.1-29600")
    assert run_id("/runs/A") != run_id("/runs/B")
    assert run_id("/runs/A").startswith("stratagem-")


@pytest.mark.unit
def test_a_rendezvous_port_in_use_on_its_host_by_another_job_or_program_is_refused():
    """Where this machine serves the rendezvous: a port held by a program that is not a torch store
    hung in torch's connection timeouts; one held by another job's store was joined. Both are one
    line naming the key, the value and the fix (a free port); this job's own store (another node
    of it on this machine) and another machine's endpoint are let through."""
    import datetime
    import socket

    from torch.distributed import TCPStore

    from launchers.torchrun import port_problem, run_id

    me = run_id("/runs/A")
    assert port_problem(f"127.0.0.1:{_free_port()}", me) is None  # (free)
    assert port_problem("192.0.2.1:29500", me) is None  # (another machine serves it)
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen(1)
        endpoint = f"127.0.0.1:{other.getsockname()[1]}"
        said = port_problem(endpoint, me, wait_s=1.0)
    assert said is not None and said.startswith(f"cluster.rdzv_endpoint={endpoint}: port "), said
    assert "in use on this machine" in said and "cluster.rdzv_endpoint=127.0.0.1:" in said, said
    store = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=5))
    store.set(f"torch.rendezvous.{run_id('/runs/B')}", "another job's state")
    endpoint = f"127.0.0.1:{store.port}"
    assert "in use on this machine" in (port_problem(endpoint, me, wait_s=1.0) or "")
    store.set(f"torch.rendezvous.{me}", "this job's state")
    assert port_problem(endpoint, me, wait_s=1.0) is None


@pytest.mark.slow  # (CI: the unit test above, the same decision)
@pytest.mark.subprocess
def test_a_torchrun_job_whose_port_another_program_holds_exits_2_at_once(tmp_path):
    import socket

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen(5)
        port = other.getsockname()[1]
        run = run_cli("train.py", *TINY, "strategy=ddp", "cluster=torchrun", "cluster.nodes=1",
                      "cluster.devices=2", f"cluster.rdzv_endpoint=127.0.0.1:{port}", "trainer.max_steps=2",
                      out=tmp_path / "r", timeout=60, check=False)
    _refused(run, f"cluster.rdzv_endpoint=127.0.0.1:{port}: port {port} is in use on this machine")


@pytest.mark.unit
def test_every_cluster_preset_that_can_span_nodes_has_an_inter_node_bandwidth(monkeypatch):
    """cluster=ray inherited local's inter_node_GBps: 0: README's 2-node Ray example planned
    "step ~ inf s ... never completes" and said ok. A preset can span nodes when its launcher
    starts several (any but local) or its nodes follow an outside torchrun's (here 2 x 8)."""
    from recipes.config import compose

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}.items():
        monkeypatch.setenv(key, value)
    spanning = {}
    for path in sorted((ROOT / "conf" / "cluster").glob("*.yaml")):
        c = compose([f"cluster={path.stem}"]).cluster
        if c.launcher != "local" or c.nodes > 1:
            spanning[path.stem] = c.inter_node_GBps
    assert {"local", "torchrun", "ray", "k8s", "sagemaker_p5_2node", "slurm_local"} <= set(spanning), spanning
    assert all(bandwidth > 0 for bandwidth in spanning.values()), spanning


@pytest.mark.subprocess
def test_an_unknown_slurm_key_is_refused_before_submission(tmp_path):
    run = run_cli("train.py", "-m", *TINY, "hydra/launcher=submitit_slurm", "cluster=slurm_local",
                  "cluster.slurm.partiton=debug", f"hydra.sweep.dir={tmp_path / 'sweep'}", out=tmp_path / "bad",
                  check=False)
    _refused(run, "partiton")
    assert not (tmp_path / "sweep").exists()


@pytest.mark.multiprocess
@pytest.mark.parametrize("override, needles", [
    ("cluster.slurm.partition=gpu", ("cluster.slurm.partition='gpu' is not a partition", "debug")),
    ("cluster.devices=8 trainer.micro_batch_size=2", ("cluster.devices=8 ranks", "have 4 CPUs", "cluster.devices<=4")),
    ("cluster.devices=1,2", ("cluster.devices=1,2: one Slurm array asks one allocation shape",)),
], ids=["unknown-partition", "devices-per-node", "swept-shape"])
def test_what_this_slurm_cannot_run_is_refused_before_submission(slurm, tmp_path, override, needles):
    run = run_cli("train.py", "-m", *TINY, "strategy=ddp", "hydra/launcher=submitit_slurm", "cluster=slurm_local",
                  *override.split(), f"hydra.sweep.dir={tmp_path / 'sweep'}", out=tmp_path / "bad", check=False, env=slurm,
                  timeout=60)
    _refused(run, *needles)
    assert not (tmp_path / "sweep" / ".submitit").exists()


# --------------------------------------------------------------------------- sweep preflight
@pytest.mark.subprocess
def test_a_sweep_with_an_invalid_point_and_one_that_will_not_fit_starts_nothing(tmp_path):
    """Six points, each composed, validated and planned before any job starts: a model without
    layers (invalid) and one too large for the memory given (will not fit, planner.enforce=true)
    are both in the one report, the four others marked ok; exit 2, no job directory, no rank."""
    sweep = tmp_path / "sweep"
    run = run_cli("train.py", "-m", *TINY, "strategy=ddp", "cluster.devices=2", "planner.enforce=true",
                  "cluster.device_memory_GB=0.2", "model.n_layers=1,2,3,4,0,400",
                  f"hydra.sweep.dir={sweep}", out=tmp_path / "x", check=False, timeout=120)
    assert run.proc.returncode == 2, run.log[-3000:]
    assert "preflight: 2 of the sweep's 6 jobs cannot run; nothing was started" in run.log, run.log[-3000:]
    assert "invalid       model.n_layers=0" in run.log and "model.n_layers=0: must be >= 1" in run.log
    assert "will not fit  model.n_layers=400" in run.log and "planner.enforce=false" in run.log
    assert run.log.count(" ok ") >= 4 and "Traceback" not in run.log
    assert not list(sweep.glob("*/.hydra")) and "Initializing distributed" not in run.log


@pytest.mark.subprocess
def test_preflight_false_skips_the_check_and_each_job_fails_on_its_own(tmp_path):
    """``+preflight=false`` (the issue's spelling): the points are checked only as each job
    starts -- here both fail their validation, each a failed row."""
    sweep = tmp_path / "sweep"
    run = run_cli("train.py", "-m", *TINY, "strategy=ddp", "cluster.devices=2", "+preflight=false",
                  "trainer.global_batch_size=15,13", f"hydra.sweep.dir={sweep}", out=tmp_path / "x",
                  check=False, timeout=120)
    assert run.proc.returncode == 1, run.log[-3000:]
    assert "preflight: " not in run.log and "preflight=false" in run.log
    rows = json.loads((sweep / "sweep_report.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["failed", "failed"], rows


# --------------------------------------------------------------------------- outside launchers
def _outside(cmd: list[str], out: Path, *overrides: str, timeout: float = 300
             ) -> tuple[subprocess.CompletedProcess, float]:
    """Run an outside launcher's command line (torchrun, accelerate launch) on a tiny train.py run;
    returns the process and the time it was started (seconds since the epoch)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    t0 = time.time()
    proc = subprocess.run([*cmd, str(ROOT / "train.py"), *TINY, "strategy=ddp", "trainer.max_steps=2",
                           *overrides, f"hydra.run.dir={out}"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    return proc, t0


def _assert_startup(report: dict, started: float, within: float = 0.05) -> None:
    """Every phase reported, and together they are the time from the launch to the end of the
    first step measured from outside (the test's clock at the launch; the run's at that end)."""
    s = report["startup"]
    assert set(s["seconds"]) == {"import", "config", "plan", "rendezvous", "op_build", "data", "model_build",
                                 "checkpoint_load", "compile", "first_step"}, s
    assert all(v >= 0 for v in s["seconds"].values()) and s["seconds"]["import"] > 0
    assert s["seconds"]["data"] > 0  # (the data's build, its own phase on both backends)
    assert s["seconds"]["rendezvous"] > 0 and s["seconds"]["model_build"] > 0 and s["seconds"]["first_step"] > 0
    measured = s["first_step_at"] - started
    assert sum(s["seconds"].values()) == pytest.approx(s["total"], abs=1e-3)
    assert s["total"] == pytest.approx(measured, rel=within), (s, measured)


@pytest.mark.multiprocess
@pytest.mark.slow  # (CI: two torchrun nodes on loopback take their world from torchrun's environment)
def test_under_torchrun_the_world_comes_from_its_environment(tmp_path):
    """``torchrun --nproc-per-node 2 train.py strategy=ddp`` (no cluster.devices): a 2-rank job
    (it was Lightning's ValueError); its start-up by phase adds up to the time to the first step.
    cluster.devices=1 against torchrun's 2 is one error before any collective, from rank 0."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    proc, t0 = _outside([*torchrun, "--rdzv-endpoint", f"127.0.0.1:{_free_port()}"], tmp_path / "ok")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    report = json.loads((tmp_path / "ok" / "report.json").read_text())
    assert report["world_size"] == 2 and [m["rank"] for m in report["memory"]["ranks"]] == [0, 1]
    _assert_startup(report, t0)
    proc, _ = _outside([*torchrun, "--rdzv-endpoint", f"127.0.0.1:{_free_port()}"], tmp_path / "bad",
                       "cluster.devices=1", timeout=120)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "ValueError" not in log, log[-4000:]
    said = "torchrun started WORLD_SIZE=2 processes, LOCAL_WORLD_SIZE=2 per node, but cluster.nodes=1 x cluster.devices=1"
    assert log.count(said) == 1, log[-4000:]
    assert "Initializing distributed" not in log and not (tmp_path / "bad" / "report.json").exists()


@pytest.mark.multiprocess
@pytest.mark.slow  # (CI: test_under_an_outside_torchrun_the_run_directory_is_named_by_the_job, unit)
def test_an_outside_torchrun_of_two_nodes_started_apart_writes_one_run_directory(tmp_path):
    """README's ``torchrun --nnodes 2 ... train.py ...`` without hydra.run.dir, its two nodes started
    1.5 s apart: each rank named the run directory by its own clock (outputs/<date>/<time>), so
    the nodes got two and failed ("not one directory for every node"). One directory, named by
    torchrun's run id, the same on both."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "job1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [*torchrun, str(ROOT / "train.py"), *TINY, "strategy=ddp", "trainer.max_steps=2"]
    procs, logs = _nodes(cmd, (tmp_path, tmp_path), env, stagger=1.5, timeout=200)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(x[-3000:] for x in logs)
    runs = [p.relative_to(tmp_path / "outputs") for p in (tmp_path / "outputs").rglob("report.json")]
    assert [str(r.parent) for r in runs] == ["torchrun-job1"], runs


@pytest.mark.unit
def test_under_an_outside_torchrun_the_run_directory_is_named_by_the_job(monkeypatch):
    """Each rank of an outside torchrun composes its own config: a name from its own clock differs
    between nodes started apart (and between ranks at a second boundary). Several nodes: named
    by torchrun's run id, else by the rendezvous all meet at; one node: by the moment its
    launcher (the ranks' parent) started, which every rank of it reads alike."""
    import datetime

    from launchers.run_lock import _started
    from recipes.compose import run_name

    for k in ("SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert run_name(2, "local") == "torchrun-job1"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert run_name(2, "local") == "torchrun-10.0.0.1-29500"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # one node: its launcher's start, not now
    launcher = datetime.datetime.fromisoformat(_started(os.getppid()))
    assert run_name(1, "local") == launcher.strftime("%Y-%m-%d/%H-%M-%S")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "0f3c")  # (torchrun --standalone: a new id per launch)
    assert run_name(1, "local") == launcher.strftime("%Y-%m-%d/%H-%M-%S")
    assert run_name(2, "torchrun", "10.0.0.1:29400") == "torchrun-10.0.0.1-29400"  # (cluster=torchrun's own)


@pytest.mark.subprocess
def test_accelerate_launch_cpu_without_a_world_is_one_clear_error():
    """``accelerate launch --num_processes 2 --cpu train.py strategy=ddp``: Accelerate's CPU
    launcher starts this one process without a world size (several only through mpirun); the
    run says so and how to get two ranks, before any process group (it was "the preset needs NO
    on 1" from inside the Accelerate backend)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2",
                           "--cpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend",
                           "no", str(ROOT / "train.py"), *TINY, "strategy=ddp", "backend=accelerate",
                           "hydra.run.dir=/tmp/never"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180, stdin=subprocess.DEVNULL)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    assert log.count("`accelerate launch` was asked for more than one process but started this one") == 1, log[-3000:]
    assert "cluster.devices=<N>" in log and "--multi_gpu --num_processes <N>" in log
    assert "the preset needs" not in log and "Initializing distributed" not in log


@pytest.mark.multiprocess
@pytest.mark.slow
def test_accelerate_launch_multi_process_sets_the_world_for_the_accelerate_backend(tmp_path):
    """``accelerate launch --multi_gpu --num_processes 2`` (torchrun underneath, on CPU here) and no
    cluster.devices: the Accelerate backend trains 2 ranks, its start-up by phase adding up."""
    proc, t0 = _outside([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                         "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                         "--dynamo_backend", "no", "--main_process_port", str(_free_port())],
                        tmp_path / "run", "backend=accelerate")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["world_size"] == 2 and report["engine"]["distributed_type"] == "MULTI_CPU"
    _assert_startup(report, t0)


# --------------------------------------------------------------------------- start-up by phase
@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["lightning", pytest.param("accelerate", marks=pytest.mark.slow)])
def test_startup_phases_add_up_to_the_time_to_the_first_step(tmp_path, backend):
    """A real 2-rank run started by our launcher: report.json's ``startup`` names every phase, and
    they sum to the time from the command's start to the end of the first step (measured from
    outside) within 5%; the summary line shows the start-up, which took longer than training."""
    out = tmp_path / "run"
    t0 = time.time()
    run = run_cli("train.py", *TINY, "strategy=ddp", "cluster.devices=2", "trainer.max_steps=2",
                  f"backend={backend}", out=out, fresh=True)  # (its imports are measured)
    _assert_startup(run.report, t0)
    start, wall = run.report["startup"], run.report["wall_seconds"]
    assert start["total"] > wall  # a 2-step run is mostly its start
    assert f"start-up {start['total']:.1f} s (" in run.log and f"> training {wall:.1f} s" in run.log
