"""cluster=ray: the ranks as Ray Train workers on a real Ray cluster on this machine (127.0.0.1).

CI runs one case (ddp, with Ray started by the job itself, the default ``cluster.ray.address``);
the rest (fsdp2, a killed worker, a restart from the checkpoint) run against a cluster started
with ``ray start --head`` for the module (``pytest -m slow``). Every run is bounded by a timeout
and each Ray instance is stopped by the test that started it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.cases import EXACT, case
from tests.conftest import (EQUIV, ROOT, TINY, assert_losses_close, assert_params_close, engines_loaded,
                            product_files, run_cli)

pytest.importorskip("ray.train", reason="pip install -e '.[ray]'")
pytestmark = pytest.mark.timeout(600)

# (a loopback test cluster: no token authentication)
ENV = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def _ray_run(tmp_path: Path, *overrides: str, name: str = "ray", timeout: float = 300, check: bool = True):
    return run_cli("train.py", *TINY, "backend=lightning", *overrides, "cluster=ray", out=tmp_path / name,
                   timeout=timeout, check=check, env=ENV)


def _same_as_local(local, ray_run) -> None:
    losses, params = EXACT
    assert_losses_close(local.losses, ray_run.losses, rtol=losses)
    assert_params_close(local.params(), ray_run.params(), rtol=params)


@pytest.mark.unit
def test_ray_is_imported_in_the_ray_launcher_only():
    hits = sorted(str(p.relative_to(ROOT)) for p in product_files()
                  if re.search(r"^\s*(import ray\b|from ray\b)|import_module\([\"']ray", p.read_text(), re.M))
    assert hits == ["launchers/ray.py"], hits


@pytest.mark.unit
def test_bad_ray_values_are_one_error_each():
    import launchers
    from recipes.config import compose
    from recipes.job import validate
    from strategies import ConfigError

    base = ["cluster=ray", "strategy=ddp", "cluster.devices=2", "cluster.accelerator=cpu"]
    for override, expected in [
        ("cluster.ray.address=http://x", "cluster.ray.address='http://x' is not a Ray address; allowed: null"),
        ("cluster.ray.cpus_per_worker=0", "cluster.ray.cpus_per_worker=0.0: must be > 0"),
        ("cluster.nodes=2", "cluster.nodes=2 with cluster.ray.address=null: the Ray started for the job is "
                            "this machine alone; set cluster.ray.address=<head>:6379")]:
        extra = ["trainer.global_batch_size=32"] if override == "cluster.nodes=2" else []
        with pytest.raises(ConfigError) as e:
            validate(compose([*base, override, *extra]), extra=[launchers.check])
        assert len(e.value.problems) == 1 and expected in e.value.problems[0], e.value.problems
    for good in ("auto", "10.0.0.1:6379", "ray://head:10001"):
        validate(compose([*base, f"cluster.ray.address={good}"]), extra=[launchers.check])


@pytest.mark.unit
def test_a_ray_address_port_outside_the_range_is_refused():
    from launchers import ray
    from recipes.config import compose

    for address in ("10.0.0.1:99999", "ray://head:0"):
        cluster = compose(["cluster=ray", f"cluster.ray.address={address}"]).cluster
        port = address.rsplit(":", 1)[1]
        assert (f"cluster.ray.address={address!r}: port {port} is outside 1..65535: set a port in that "
                "range, e.g. cluster.ray.address=10.0.0.1:6379") in ray.problems(cluster)
    for good in ("auto", "10.0.0.1:65535", "ray://head:10001"):
        assert not any("port" in p for p in ray.problems(compose(["cluster=ray", f"cluster.ray.address={good}"]).cluster))


def _closed_port() -> int:
    """A loopback port where nothing listens (bound, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.unit
def test_a_ray_address_where_nothing_answers_is_one_line_with_the_fix():
    """cluster.ray.address=127.0.0.1:1 (nothing listens) hung > 150 s in ray.init, repeating GCS
    timeouts about an address the user never gave (Ray's rewrite of 127.0.0.1): a bounded TCP
    connect first, and one sentence naming the key, the value and the fix."""
    from launchers import ray

    port = _closed_port()
    said = ray.unreachable(f"127.0.0.1:{port}", timeout_s=2.0)
    assert said is not None and said.startswith(f"cluster.ray.address=127.0.0.1:{port}: no Ray cluster answers "
                                                f"at 127.0.0.1:{port}"), said
    assert "`ray start --head`" in said and "cluster.ray.address=null" in said, said
    said = ray.unreachable("ray://no-such-host.invalid:10001", timeout_s=2.0)
    assert said is not None and "no-such-host.invalid" in said and "cluster.ray.address=null" in said, said
    with socket.socket() as listening:  # (something answers: Ray's own checks take it from there)
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)
        host, port = listening.getsockname()
        assert ray.unreachable(f"{host}:{port}") is None
        assert ray.unreachable(f"ray://{host}:{port}") is None
    assert ray.unreachable("auto") is None


def _gcs_server_here() -> bool:
    """A Ray cluster's GCS runs on this machine (another test's, or a user's)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "gcs_server":
                return True
        except OSError:
            continue
    return False


@pytest.mark.unit
def test_a_ray_address_that_answers_but_is_not_ray_is_one_line_with_the_fix(tmp_path, monkeypatch):
    """cluster.ray.address=10.0.0.1:6379 where something that is not Ray accepts TCP passed the
    connect probe, then ended after Ray's retries (52 s there; 40 s a try against a silent local
    listener, too slow to test) in a ConnectionError traceback and exit 1. Ray's ConnectionError is
    now one sentence naming the key, the value and the fix (exit 2, a ConfigError): its text here,
    and the mapping on Ray's own ConnectionError for address=auto with no cluster here (a second)."""
    from launchers import ray
    from strategies import ConfigError

    raised = ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379")  # (Ray 2.60's words)
    said = ray.not_ray("10.0.0.1:6379", raised)
    assert "\n" not in said and said.startswith("cluster.ray.address=10.0.0.1:6379: "), said
    assert "Failed to connect to Ray cluster at 10.0.0.1:6379" in said, said
    assert "`ray start --head`" in said and "cluster.ray.address=null" in said, said
    if _gcs_server_here():
        pytest.skip("a Ray cluster runs on this machine: address=auto would join it")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # (no record of a cluster started here)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError) as e:
        ray.join("auto")
    [said] = e.value.problems
    assert said.startswith("cluster.ray.address=auto: ") and "`ray start --head`" in said, said


@pytest.mark.slow  # (CI: the unit test above, the same decision)
@pytest.mark.subprocess
def test_train_py_with_a_ray_address_where_nothing_answers_exits_2_at_once(tmp_path):
    t0 = time.monotonic()
    run = _ray_run(tmp_path, "strategy=ddp", "cluster.devices=2", "trainer.max_steps=2",
                   f"cluster.ray.address=127.0.0.1:{_closed_port()}", timeout=60, check=False)
    assert run.proc.returncode == 2, run.log[-3000:]
    assert "no Ray cluster answers at 127.0.0.1:" in run.proc.stderr and "GCS" not in run.log, run.log[-3000:]
    assert time.monotonic() - t0 < 45


@pytest.mark.subprocess
def test_answers_about_a_ray_job_import_no_engine_and_no_ray(tmp_path):
    argv = ("train.py", "--cfg", "job", "cluster=ray", "cluster.devices=2", "strategy=ddp")
    proc, loaded = engines_loaded(*argv, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert loaded == [], f"{' '.join(argv)} imported {loaded}"


@pytest.mark.multiprocess
def test_ddp_on_ray_equals_the_local_run(cached, tmp_path):
    """The default: Ray started for the job on this machine and stopped after it."""
    local = cached(*EQUIV, *case("ddp"))
    started = time.monotonic()
    run = _ray_run(tmp_path, *EQUIV, *case("ddp"))
    print(f"ray ddp run: {time.monotonic() - started:.1f} s")
    assert "ray: 2 worker(s) on a Ray instance started here" in run.log
    assert (tmp_path / "ray" / "checkpoints" / "step6").is_dir()  # where a local run puts them
    assert run.report["world_size"] == 2
    _same_as_local(local, run)


# --------------------------------------------------------------------- a cluster of the module
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def head():
    """``ray start --head --block`` on 127.0.0.1 (its own temp dir); stopped by terminating that
    process, which stops the cluster it started. Yields the address."""
    port, tmp = _free_port(), tempfile.mkdtemp(prefix="ray", dir="/tmp")
    ray_cli = Path(sys.executable).with_name("ray")
    proc = subprocess.Popen([str(ray_cli), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
                             f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                             f"--temp-dir={tmp}", "--disable-usage-stats"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, **ENV}, start_new_session=True)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        assert proc.poll() is None, "ray start --head failed"
        time.sleep(0.5)
    time.sleep(2)
    try:
        yield address
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("preset,backend", [("fsdp2", "lightning"), ("ddp", "accelerate")])
def test_a_ray_cluster_trains_equal_to_the_local_run(cached, head, tmp_path, preset, backend):
    local = cached(*EQUIV, *case(preset), f"backend={backend}")
    run = _ray_run(tmp_path, *EQUIV, *case(preset), f"backend={backend}", f"cluster.ray.address={head}")
    assert f"ray: 2 worker(s) on {head}" in run.log
    _same_as_local(local, run)


LONG = ("strategy=ddp", "cluster.devices=2", "trainer.micro_batch_size=4", "trainer.max_steps=300",
        "trainer.global_batch_size=8", "trainer.lr=1e-3", "trainer.checkpoint_every=10",
        "trainer.export_params=true", "cluster.collective_timeout=60")


def _kill_rank_during(tmp_path: Path, head: str, rank: int, *overrides: str):
    """Run train.py on the cluster; when the step-10 checkpoint is complete, SIGKILL the Ray
    worker process of ``rank`` (its pid read from Ray's own start-up lines). Returns (the
    process, its output, the seconds from the kill to its end, the killed pid)."""
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "train.py"), *TINY, "backend=lightning", "cluster=ray",
           f"cluster.ray.address={head}", *LONG, *overrides, f"hydra.run.dir={out}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **ENV},
                            stdin=subprocess.DEVNULL)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    killed, kill_time, deadline = None, None, time.monotonic() + 240
    try:
        while proc.poll() is None and time.monotonic() < deadline and killed is None:
            pids = [m.group(1) for ln in list(lines)
                    for m in [re.search(rf"\(ip=[^,]*, pid=(\d+)\) world_rank={rank},", ln)] if m]
            if pids and (out / "checkpoints" / "step10" / "COMPLETE").exists():
                killed, kill_time = int(pids[-1]), time.monotonic()
                os.kill(killed, signal.SIGKILL)
            time.sleep(0.1)
        assert killed is not None, "never reached the step-10 checkpoint:\n" + "".join(lines)[-4000:]
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    reader.join(timeout=10)
    return proc, "".join(lines), time.monotonic() - kill_time, killed


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_killed_ray_worker_ends_the_job_naming_its_rank(head, tmp_path):
    proc, log, seconds, pid = _kill_rank_during(tmp_path, head, 1)
    assert proc.returncode != 0, log[-4000:]
    assert "lost rank 1 of 2" in log, log[-4000:]
    assert seconds < 60, f"took {seconds:.0f} s to end after the kill (collective_timeout 60)"
    assert "lost rank 1 of 2 -- its Ray worker process" in log and " died " in log, log[-4000:]
    print(f"killed worker pid {pid}: the job ended {seconds:.1f} s later:",
          next(ln for ln in log.splitlines() if "lost rank 1 of 2" in ln))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_ray_restart_resumes_with_the_straight_runs_losses(head, tmp_path):
    straight = run_cli("train.py", *TINY, "backend=lightning", *LONG, out=tmp_path / "straight")
    proc, log, _, _ = _kill_rank_during(tmp_path, head, 1, "cluster.max_restarts=1")
    assert proc.returncode == 0, log[-5000:]
    import json

    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report.get("resumed_from"), "the run was meant to resume from a checkpoint"
    assert_losses_close(straight.losses, report["losses"], rtol=1e-5)
