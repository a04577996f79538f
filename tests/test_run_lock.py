"""One job per run directory (launchers/run_lock.py): a second job into a directory another job
holds exits 2 naming the holder's id, the directory and the fix; a process of the same job (its
other ranks and nodes, its requeue) goes on; the lock dies with its process, so a crashed job
leaves nothing stale; the Kubernetes default job name is new per launch."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, TINY, run_cli


@pytest.fixture
def run_lock():
    from launchers import run_lock

    yield run_lock
    for path in list(run_lock._held):
        run_lock.release(path)


def _other_job(run_lock, directory, job="slurm:77"):
    """Another job holding ``directory``: its own open file's flock (a separate open file conflicts
    like another process's) and its owner file. Closing the file is that job's death."""
    directory.mkdir(parents=True, exist_ok=True)
    f = open(directory / run_lock.LOCK, "a+")  # noqa: SIM115
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    run_lock._write_owner(directory, run_lock.Owner(job, "node7", 4242, "2026-01-01T00:00:00"))
    return f


@pytest.mark.unit
def test_the_job_id_comes_from_the_launcher_else_from_the_process(run_lock):
    job_id = run_lock.job_id
    assert job_id({"STRATAGEM_JOB_ID": "k8s:default/run1", "SLURM_JOB_ID": "9"}) == "k8s:default/run1"
    assert job_id({"SLURM_JOB_ID": "123"}) == "slurm:123"  # a requeue keeps it
    assert job_id({"SLURM_JOB_ID": "123", "SLURM_STEP_ID": "0"}) == "slurm:123.0"
    assert job_id({"SM_CURRENT_HOST": "algo-1", "SM_HOSTS": '["algo-1"]',
                   "TRAINING_JOB_NAME": "tj"}) == "sagemaker:tj"
    assert job_id({"TORCHELASTIC_RUN_ID": "abc"}) == "torchrun:abc"  # the same across its restarts
    assert job_id({"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "10.0.0.1",
                   "MASTER_PORT": "29500"}) == "torchrun:10.0.0.1:29500"
    assert job_id({}, rendezvous="10.0.0.1:29500") == "torchrun:10.0.0.1:29500"  # cluster=torchrun nodes
    mine = job_id({})
    assert mine.startswith("process:") and f":{os.getpid()}:" in mine


@pytest.mark.unit
def test_another_job_is_refused_with_its_id_the_directory_and_the_fix(run_lock, tmp_path):
    held = _other_job(run_lock, tmp_path / "run")
    with pytest.raises(run_lock.RunDirectoryBusy) as e:
        run_lock.hold(tmp_path / "run", job="process:me")
    text = str(e.value)
    for part in (str((tmp_path / "run").resolve()), "job slurm:77", "host node7", "pid 4242",
                 "hydra.run.dir=<new directory>", "wait until that job ends"):
        assert part in text, text
    assert run_lock.owner(tmp_path / "run").job == "slurm:77"  # the refused job wrote nothing
    held.close()


@pytest.mark.unit
def test_the_same_job_goes_on_and_a_dead_holder_leaves_no_lock(run_lock, tmp_path):
    d = tmp_path / "run"
    held = _other_job(run_lock, d)
    assert run_lock.hold(d, job="slurm:77") is False  # another rank / node / attempt of the job
    held.close()  # the holder died (a crash, a kill -9, a node gone)
    assert run_lock.hold(d, job="process:me") is True
    assert run_lock.owner(d).job == "process:me" and run_lock.owner(d).pid == os.getpid()
    assert run_lock.hold(d, job="process:me") is True  # held already by this process
    with pytest.raises(BlockingIOError):  # now another job is the one locked out
        _other_job(run_lock, d)
    run_lock.release(d)
    other = _other_job(run_lock, d)  # released: free for the next
    other.close()


@pytest.mark.unit
def test_a_file_system_without_flock_warns_and_goes_on(run_lock, tmp_path, monkeypatch, capsys):
    def no_flock(*a):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)  # (Lustre mounted noflock)
    assert run_lock.hold(tmp_path / "run", job="process:me") is False
    assert "cannot lock run directory" in capsys.readouterr().err


@pytest.mark.unit
def test_the_k8s_default_job_name_is_new_per_launch_and_an_explicit_one_is_kept():
    from launchers import k8s
    from recipes.config import compose
    from recipes.job import RUN, validate

    base = ["cluster=k8s", "cluster.k8s.volume_claim=runs", "strategy=ddp"]
    m = k8s.manifest(validate(compose(base), depth=RUN).cluster, base, "gpu")
    name = m["metadata"]["name"]
    assert re.fullmatch(r"stratagem-\d{8}-\d{6}-[0-9a-f]{4}", name) and k8s.DNS1035.match(name)
    pod = m["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert pod["command"][-1] == f"hydra.run.dir=/mnt/stratagem/{name}"
    assert {"name": "STRATAGEM_JOB_ID", "value": f"k8s:default/{name}"} in pod["env"]
    manifest, said = k8s.dry_run(m)
    assert name in manifest and any(name in line for line in said)
    k8s._new_name.cache_clear()  # the next launch
    again = k8s.manifest(validate(compose(base), depth=RUN).cluster, base, "gpu")["metadata"]["name"]
    assert again != name
    mine = [*base, "cluster.k8s.job_name=run1"]
    kept = k8s.manifest(validate(compose(mine), depth=RUN).cluster, mine, "gpu")
    assert kept["metadata"]["name"] == "run1"


@pytest.mark.subprocess
def test_two_train_py_runs_into_one_directory_the_second_exits_2_naming_the_first(tmp_path):
    """The first run is frozen (SIGSTOP) once it holds the directory; a second train.py there exits
    2 naming it; the first is then killed (a crash: nothing released by hand) and the same command
    trains in that directory to the end."""
    out = tmp_path / "run"
    overrides = (*TINY, "trainer.max_steps=3")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("STRATAGEM_JOB_ID", None)
    first = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.run.dir={out}"],
                             cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (out / ".owner.json").is_file():
            assert first.poll() is None, "the first run ended before it held its directory"
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGSTOP)
        owner = json.loads((out / ".owner.json").read_text())
        assert owner["pid"] == first.pid, owner
        second = run_cli("train.py", *overrides, out=out, check=False, timeout=120)
        assert second.proc.returncode == 2, second.log[-3000:]
        assert f"run directory {out.resolve()} is in use by job {owner['job']}" in second.log
        assert f":{first.pid}:" in owner["job"] and "hydra.run.dir=" in second.log
        assert json.loads((out / ".owner.json").read_text()) == owner  # the second wrote nothing
    finally:
        first.kill()
        first.wait(timeout=30)
    again = run_cli("train.py", *overrides, out=out, timeout=240)
    assert len(json.loads((out / "report.json").read_text())["losses"]) == 3, again.log[-3000:]
    assert json.loads((out / ".owner.json").read_text())["pid"] != first.pid


@pytest.mark.unit
def test_an_outside_torchrun_that_restarts_without_the_store_switch_is_refused(monkeypatch):
    """torchrun --max-restarts without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 hangs on a restart
    (pytorch#135712); a worker cannot set its agent's environment, so it is one error before any
    collective (cluster=torchrun and the k8s pods set it themselves)."""
    import launchers
    from recipes.config import compose
    from recipes.job import CONFIG, validate

    job = validate(compose(list(TINY)), depth=CONFIG)
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "TORCHELASTIC_MAX_RESTARTS": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    found = launchers.check(job)
    assert any("torchrun --max-restarts=2" in p and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun" in p
               for p in found), found
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    assert not any("max-restarts" in p for p in launchers.check(job))


@pytest.mark.unit
def test_the_hydra_callback_refuses_a_held_sweep_directory_with_exit_2(run_lock, tmp_path, capsys):
    """A multirun holds its sweep directory (train.py -m ...: the process that drives the sweep);
    a second sweep into it exits 2 before its first job, naming hydra.sweep.dir."""
    from omegaconf import OmegaConf

    held = _other_job(run_lock, tmp_path / "sweep")
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "sweep")}},
                               "cluster": {"launcher": "local"}})
    with pytest.raises(SystemExit) as e:
        run_lock.RunLock().on_multirun_start(config)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "job slurm:77" in err and "hydra.sweep.dir=<new directory>" in err, err
    held.close()
    run_lock.RunLock().on_multirun_start(config)  # free: this sweep holds it, until its end
    assert run_lock.owner(tmp_path / "sweep").pid == os.getpid()
    run_lock.RunLock().on_multirun_end(config)
    _other_job(run_lock, tmp_path / "sweep").close()


@pytest.mark.subprocess
def test_a_full_disk_leaves_neither_a_temporary_owner_file_nor_the_last_holders(tmp_path):
    """On a full disk the owner file could not be written: its ``.owner.json.<pid>.tmp`` stayed,
    and so did the last (ended) job's record, which a refused job would then quote."""
    import ast
    import shlex

    from tests.test_errors import _in_tmpfs

    disk = tmp_path / "disk"
    probe = ("import json, os, sys; from launchers import run_lock; d = sys.argv[1]; "
             "print(run_lock.hold(d)); print(sorted(os.listdir(d)))")
    script = (f"cd {shlex.quote(str(disk))} && echo '{{\"job\": \"ended\"}}' > {run_lock_owner()} && "
              f"dd if=/dev/zero of=fill bs=1k count=64 2>/dev/null; cd {shlex.quote(str(ROOT))} && "
              f"exec {shlex.join([sys.executable, '-c', probe, str(disk)])}")
    proc = _in_tmpfs(disk, "size=64k", ["sh", "-c", script])
    assert proc.returncode == 0, proc.stderr[-2000:]
    held, listing = proc.stdout.strip().splitlines()[-2:]
    assert held == "True" and "No space left on device" in proc.stderr, proc.stderr
    assert not [n for n in ast.literal_eval(listing) if n.startswith(run_lock_owner())], listing


def run_lock_owner() -> str:
    from launchers.run_lock import OWNER

    return OWNER
