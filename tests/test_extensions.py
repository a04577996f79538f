"""Waits on a C++ extension build say what they wait for (backends/common/extensions.py).

torch builds DeepSpeed's ops at their first use under a lock file in its extensions folder, and a
process that finds the lock waits until it is gone: forever, silently, when a killed build left
it. Here a stale lock in a private ``TORCH_EXTENSIONS_DIR`` makes a ZeRO-2 run on CPU wait for
DeepSpeed's CPU collective (``deepspeed_shm_comm``, which ``deepspeed.comm`` loads on every CPU
run), and the run must name the lock, say that nobody holds it and what to do, within 60 s.
The watcher's logic is checked on torch's own ``FileBaton`` in this process.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, TINY, run_cli

# the op every DeepSpeed run on CPU loads first (deepspeed.comm's TorchBackend, DeepSpeed 0.19)
CPU_OP = "deepspeed_shm_comm"


def _stale_lock(root: Path, op: str) -> Path:
    lock = root / op / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    old = time.time() - 3 * 3600  # left behind hours ago
    os.utime(lock, (old, old))
    return lock


@pytest.mark.subprocess
def test_a_run_waiting_on_a_stale_build_lock_names_it(tmp_path):
    lock = _stale_lock(tmp_path / "extensions", CPU_OP)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "train.py"), *TINY, "strategy=zero2", "trainer.max_steps=2",
           f"hydra.run.dir={tmp_path / 'run'}"]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    said, seen = None, []
    try:
        while said is None and time.monotonic() - started < 60:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                assert proc.poll() is None, f"the run ended ({proc.returncode}):\n{''.join(seen)[-4000:]}"
                continue
            seen.append(line)
            if str(lock) in line:
                said = line
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # it would wait forever (and a stop signal waits for a step)
        proc.wait(timeout=30)
    assert said is not None, f"no line named {lock} within 60 s:\n{''.join(seen)[-4000:]}"
    assert "WARNING" in said and f"DeepSpeed's {CPU_OP} op" in said, said
    assert "h old" in said and "no process on this machine holds it" in said, said
    assert f"rm {lock}" in said, said


@pytest.fixture
def waiting(tmp_path):
    """A thread of this process in torch's FileBaton.wait on a lock nobody holds (as torch's
    extension loader waits); the lock is removed at the end, which ends the wait."""
    from torch.utils.file_baton import FileBaton

    lock = _stale_lock(tmp_path, "myop")
    thread = threading.Thread(target=FileBaton(str(lock), wait_seconds=0.02).wait, daemon=True)
    thread.start()
    yield lock
    lock.unlink(missing_ok=True)
    thread.join(timeout=10)


@pytest.mark.unit
def test_the_watcher_explains_a_wait_and_times_it(waiting, caplog, monkeypatch):
    from backends.common import extensions
    from observers import startup

    monkeypatch.setattr(startup, "_spans", [])
    watcher = extensions.Watcher(first_s=0.2, every_s=60)
    caplog.set_level(logging.INFO, logger=extensions.__name__)
    time.sleep(0.1)
    acts = extensions.activities()
    assert [(a.kind, a.folder, a.op) for a in acts] == [("wait", waiting.parent.resolve(), "myop")]
    watcher.poll()
    assert not caplog.records  # not before first_s
    time.sleep(0.3)
    watcher.poll()
    watcher.poll()  # said once per every_s
    [said] = caplog.records
    assert said.levelno == logging.WARNING
    text = said.getMessage()
    assert f"torch's build lock {waiting.resolve()}" in text and "3.0 h old" in text, text
    assert "no process on this machine holds it" in text and "holds nothing else" in text, text
    assert f"rm {waiting.resolve()}" in text, text
    waiting.unlink()
    time.sleep(0.2)
    watcher.poll()
    assert "the lock is gone after" in caplog.records[-1].getMessage()
    [(phase, a, b)] = startup._spans  # the wait is the op_build phase of the start-up
    assert phase == "op_build" and b - a >= 0.4


@pytest.mark.unit
def test_a_wait_on_another_ranks_first_build_says_it_is_one(waiting, caplog, monkeypatch):
    """Rank 0 (the rank whose INFO reaches the console) may lose the race for the lock of an op no
    run built yet; its wait then said only who held the lock, like a wait on a stuck build, and
    never the promised "first run only". With a library in the folder (a load), it does not."""
    from backends.common import extensions
    from observers import startup

    monkeypatch.setattr(startup, "_spans", [])
    monkeypatch.chdir(waiting.parent)  # (this process "works in" the folder, as the builder's ninja does)
    os.utime(waiting)  # (a fresh lock)
    caplog.set_level(logging.INFO, logger=extensions.__name__)
    watcher = extensions.Watcher(first_s=0.0, every_s=60)
    time.sleep(0.1)
    watcher.poll()
    [said] = caplog.records
    text = said.getMessage()
    assert said.levelno == logging.INFO and "DeepSpeed" not in text, text
    assert "the C++ extension myop, which another process is building for the first time (first run " \
           "only, later runs load it" in text and f"works in {waiting.parent.resolve()}" in text, text
    (waiting.parent / "myop.so").touch()  # built: the lock is a load's, or a rebuild's
    level, text = extensions.explain_wait(extensions.activities()[0], 6.0)
    assert level == logging.INFO and "for the first time" not in text, text
    assert "This run goes on when that build ends" in text, text


@pytest.mark.unit
def test_who_holds_a_lock_and_who_builds_beside_it(tmp_path, monkeypatch):
    from backends.common import extensions

    lock = _stale_lock(tmp_path, "myop")
    assert extensions.users(lock) == ([], [])
    fd = os.open(lock, os.O_RDONLY)  # as torch's builder holds it while it builds
    try:
        holders, builders = extensions.users(lock)
        assert [p.pid for p in holders] == [os.getpid()] and builders == []
        assert "python" in holders[0].command or "pytest" in holders[0].command
    finally:
        os.close(fd)
    monkeypatch.chdir(lock.parent)  # as ninja and the compiler run in the build folder
    assert [p.pid for p in extensions.users(lock)[1]] == [os.getpid()]


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_first_op_build_is_announced_and_is_its_own_startup_phase(tmp_path):
    """A ZeRO-2 run on CPU with an empty extensions folder compiles DeepSpeed's CPU collective
    (measured 104-214 s on 2 shared cores, from 24 s on a faster VM): the run says so as it begins,
    and report.json's start-up gives that time to op_build, not to the phase around it
    (rendezvous, which it was); a second run loads what the first built, in seconds, and says
    nothing."""
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    runs = [run_cli("train.py", *TINY, "strategy=zero2", "trainer.max_steps=1", out=tmp_path / name,
                    timeout=900, env=env) for name in ("cold", "warm")]
    cold, warm = (r.report["startup"]["seconds"] for r in runs)
    assert f"building DeepSpeed's {CPU_OP} op in {(tmp_path / 'extensions' / CPU_OP).resolve()}: first run " \
           "only" in runs[0].log, runs[0].log[-3000:]
    assert f"built DeepSpeed's {CPU_OP} op in" in runs[0].log
    # (the compile's own time: 104-214 s on 2 shared cores, 24 s on a faster 2-core VM)
    assert cold["op_build"] > max(10, 5 * warm["op_build"]) and cold["rendezvous"] < 10, (cold, warm)
    assert "building DeepSpeed's" not in runs[1].log and warm["op_build"] < 5, warm
