"""Errors a user meets before or during a run are one clear line each, not a traceback: a
``model=hf`` path that holds no model (exit 2, before launch, in train.py, plan.py and export.py),
an output directory that cannot be written (exit 2, before Hydra creates it), a full disk (the
line says "No space left on device", on one rank or several; exit 1).

The read-only and full filesystems are real: a tmpfs mounted in a private mount namespace
(``unshare -m``, root or CAP_SYS_ADMIN; skipped where that is not allowed), so nothing outside
the test sees the mount and it goes away with the process.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.timeout(600)]

NANO = ("model=gpt_nano", "cluster.accelerator=cpu", "trainer.warmup_steps=0")
LLAMA_SHAPE = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 8192,
               "max_position_embeddings": 64, "tie_word_embeddings": False}


def _cmd(args: list[str], *, cwd: Path = ROOT, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})


@cache
def _can_mount() -> bool:
    """Whether this process may mount a tmpfs in a private mount namespace."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        try:
            return _cmd(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {d}"], timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False


def _in_tmpfs(mount: Path, options: str, args: list[str], *, cwd: Path = ROOT, timeout: float = 240
              ) -> subprocess.CompletedProcess:
    """``args`` with a tmpfs (``options``) mounted at ``mount``, seen by that process alone."""
    if not _can_mount():
        pytest.skip("mounting a tmpfs in a private mount namespace is not allowed here (needs root)")
    mount.mkdir(parents=True, exist_ok=True)
    script = f"mount -t tmpfs -o {options} tmpfs {shlex.quote(str(mount))} && cd {shlex.quote(str(cwd))} && exec {shlex.join(args)}"
    return _cmd(["unshare", "-m", "sh", "-c", script], timeout=timeout)


def _one_clear_line(proc: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    log = proc.stdout + proc.stderr
    assert proc.returncode == code, f"exit {proc.returncode}:\n{log[-3000:]}"
    assert "Traceback" not in log and "HYDRA_FULL_ERROR" not in log, log[-3000:]
    line = next((ln for ln in log.splitlines() if all(n in ln for n in needles)), None)
    assert line is not None, f"no line with {needles}:\n{log[-3000:]}"
    return line


# --------------------------------------------------------------------- model=hf's path
def _hf_cases(tmp_path: Path) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """case -> (overrides, what its line says: key, value, fix)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "a_file").write_text("not a model\n")
    return {
        "unset": (("model=hf",), ("model=hf needs model.path, which is null", "model.path=/models/")),
        "missing": (("model=hf", f"model.path={tmp_path / 'none'}"),
                    (f"model.path={tmp_path / 'none'}: no such directory", "point model.path at a directory")),
        "empty": (("model=hf", f"model.path={tmp_path / 'empty'}"),
                  (f"model.path={tmp_path / 'empty'}: the directory holds no model (no config.json there)",
                   "point model.path at a directory")),
        "file": (("model=hf", f"model.path={tmp_path / 'a_file'}"),
                 (f"model.path={tmp_path / 'a_file'} is a file, not a model directory", "point model.path")),
    }


@pytest.mark.unit
def test_an_hf_path_without_a_model_is_a_config_error_naming_key_value_and_fix(tmp_path):
    """The planner's description of the model (what train.py asks before validation, for
    strategy=auto) raises the validation's ConfigError, not OmegaConf's resolution error; a
    directory with config.json but no safetensors weights is refused at launch depth (plan.py and
    export.py plan from config.json alone)."""
    from recipes.config import compose, describe
    from recipes.job import LAUNCH, RUN, validate
    from strategies import ConfigError

    for name, (overrides, needles) in _hf_cases(tmp_path).items():
        with pytest.raises(ConfigError) as e:
            describe(compose(list(overrides)).model)
        assert all(n in str(e.value) for n in needles), (name, str(e.value))
    shape_only = tmp_path / "shape_only"
    shape_only.mkdir()
    (shape_only / "config.json").write_text(json.dumps(LLAMA_SHAPE))
    (shape_only / "pytorch_model.bin").write_bytes(b"")
    hf = ["model=hf", f"model.path={shape_only}", "model.seq_len=32", "data.tokenizer=null", "cluster.accelerator=cpu"]
    validate(compose(hf), depth=RUN)
    with pytest.raises(ConfigError, match=r"no \*\.safetensors weights there \(only pytorch_model.bin\) and "
                                          r"model.pretrained=true loads them.*or set model.pretrained=false"):
        validate(compose(hf), depth=LAUNCH)
    validate(compose([*hf, "model.pretrained=false"]), depth=LAUNCH)


@pytest.mark.unit
def test_a_model_id_not_in_the_cache_says_how_to_download_it(tmp_path, monkeypatch):
    """The installed huggingface_hub's command is ``hf`` (``huggingface-cli`` is deprecated)."""
    from recipes.config import compose
    from recipes.job import CONFIG, validate
    from strategies import ConfigError

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ConfigError) as e:
        validate(compose(["model=hf", "model.path=org/absent"]), depth=CONFIG)
    msg = str(e.value)
    assert f"no such model id in the local Hugging Face cache ({tmp_path / 'hub'})" in msg, msg
    assert "a model id already downloaded (hf download <id>)" in msg and "huggingface-cli" not in msg, msg

@pytest.mark.subprocess
@pytest.mark.parametrize("script", ["train.py", "plan.py", "export.py"])
def test_an_hf_path_without_a_model_exits_2_with_one_line(tmp_path, script):
    extra = ["export=accelerate", f"export.out={tmp_path / 'out.yaml'}"] if script == "export.py" else []
    models = tmp_path / "models"
    models.mkdir()
    for name, (overrides, needles) in _hf_cases(models).items():
        if name == "file":  # (the same path through the same code as "empty"; three runs suffice)
            continue
        proc = _cmd([sys.executable, script, *overrides, *extra, f"hydra.run.dir={tmp_path / 'run'}"])
        _one_clear_line(proc, 2, *needles)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("report.json"))


# --------------------------------------------------------------------- an output directory that cannot be written
@pytest.mark.unit
def test_unwritable_says_why_and_leaves_nothing_behind(tmp_path):
    from recipes.cli import unwritable

    (tmp_path / "a_file").write_text("x")
    assert unwritable("hydra.run.dir", tmp_path / "a_file" / "run") == (
        f"hydra.run.dir={tmp_path / 'a_file' / 'run'}: {tmp_path / 'a_file'} is a file, not a directory; "
        "point hydra.run.dir at a directory this user can write (hydra.run.dir=/path/to/runs/name)")
    assert unwritable("hydra.run.dir", tmp_path / "new" / "run") is None
    assert unwritable("hydra.run.dir", tmp_path) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # the probe is gone, nothing created
    if os.geteuid() != 0:  # (root writes through permission bits: the read-only mount below is root's case)
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        assert "cannot create it in " + str(locked) + ": Permission denied" in unwritable("hydra.run.dir", locked / "run")


@pytest.mark.subprocess
def test_a_run_directory_under_a_file_exits_2_with_one_line(tmp_path):
    (tmp_path / "a_file").write_text("x")
    proc = _cmd([sys.executable, "train.py", *NANO, f"hydra.run.dir={tmp_path / 'a_file' / 'run'}"])
    _one_clear_line(proc, 2, f"hydra.run.dir={tmp_path / 'a_file' / 'run'}: {tmp_path / 'a_file'} is a file")


@pytest.mark.subprocess
def test_a_read_only_run_directory_exits_2_with_one_line(tmp_path):
    """A read-only filesystem refuses root too: the explicit run directory, the default one (relative
    to a read-only working directory) and a sweep's directory."""
    ro = tmp_path / "ro"
    train = [sys.executable, str(ROOT / "train.py"), *NANO]
    proc = _in_tmpfs(ro, "ro,size=64k", [*train, f"hydra.run.dir={ro / 'run'}"])
    _one_clear_line(proc, 2, f"hydra.run.dir={ro / 'run'}: cannot create it in {ro}: Read-only file system",
                    "point hydra.run.dir at a directory")
    proc = _in_tmpfs(ro, "ro,size=64k", train, cwd=ro)
    _one_clear_line(proc, 2, "hydra.run.dir=outputs/", "Read-only file system", f"is relative to {ro}")
    proc = _in_tmpfs(ro, "ro,size=64k", [*train[:2], "-m", *NANO, "trainer.max_steps=1,2", f"hydra.sweep.dir={ro / 'sweep'}"])
    _one_clear_line(proc, 2, f"hydra.sweep.dir={ro / 'sweep'}: cannot create it in {ro}: Read-only file system")


@pytest.mark.subprocess
def test_a_run_directory_on_a_disk_already_full_exits_2_with_one_line(tmp_path):
    """The probe created an empty file, which still fits on a full tmpfs, so the run went on and
    Hydra's write of .hydra/config.yaml ended in its 26-line traceback, exit 1: the probe writes a
    byte now, and a full disk Hydra meets after it is one line too (``composition_error``)."""
    disk = tmp_path / "disk"
    fill = f"dd if=/dev/zero of={shlex.quote(str(disk / 'fill'))} bs=1k count=64 2>/dev/null; "
    train = [sys.executable, str(ROOT / "train.py"), *NANO, f"hydra.run.dir={disk / 'run'}"]
    proc = _in_tmpfs(disk, "size=64k", ["sh", "-c", fill + f"exec {shlex.join(train)}"])
    _one_clear_line(proc, 2, f"hydra.run.dir={disk / 'run'}: cannot create it in {disk}: No space left on device",
                    "free space there, or point hydra.run.dir at a disk with room")


@pytest.mark.unit
def test_a_full_disk_while_hydra_writes_its_files_is_one_line(capsys):
    import errno

    from recipes.cli import composition_error

    with pytest.raises(SystemExit) as e:
        composition_error(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), [])
    err = capsys.readouterr().err
    assert e.value.code == 1 and "Traceback" not in err
    assert err.strip() == ("No space left on device while Hydra wrote the run directory's files (.hydra/, the log): "
                           "free space there, or point hydra.run.dir at a disk with room")


# --------------------------------------------------------------------- a full disk
@pytest.mark.unit
def test_a_checkpoint_write_error_is_found_under_torch_dcps_exception(tmp_path):
    """torch DCP reports a failed save as a BaseException holding each rank's exception; the
    OSError under it (a real one: a write to /dev/full) is what the run's error says."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from checkpoints import write_error

    try:
        with open("/dev/full", "wb") as f:
            f.write(b"x" * 4096)
    except OSError as e:
        full = e
    assert full.errno == errno.ENOSPC
    dcp = CheckpointException("write", {0: _wrap_exception(full), 1: _wrap_exception(full)})
    assert write_error(dcp, tmp_path) is full
    try:
        raise RuntimeError("file write failed") from full
    except RuntimeError as e:
        assert write_error(e, tmp_path) is full
    # no OSError underneath, and a filesystem with room: not a write error
    assert write_error(RuntimeError("[enforce fail at inline_container.cc] unexpected pos"), tmp_path) is None
    assert write_error(ConnectionResetError(errno.ECONNRESET, "reset by peer"), tmp_path) is None
    try:  # Ctrl-C while a write error is handled stays an interrupt
        try:
            raise full
        except OSError:
            raise KeyboardInterrupt from None
    except KeyboardInterrupt as e:
        assert e.__context__ is full and write_error(e, tmp_path) is None


FULL = ("trainer.max_steps=2", "callbacks.plots=false")


@pytest.mark.subprocess
def test_a_full_disk_ends_the_run_with_no_space_left_on_device(tmp_path):
    disk = tmp_path / "disk"
    proc = _in_tmpfs(disk, "size=256k", [sys.executable, str(ROOT / "train.py"), *NANO, *FULL,
                                         f"hydra.run.dir={disk / 'run'}"])
    line = _one_clear_line(proc, 1, "[Errno 28] No space left on device: saving the checkpoint of step 2 into "
                           f"{disk / 'run' / 'checkpoints'}", "failed on rank 0; free space there")
    assert proc.stderr.strip().splitlines()[-1] == line  # the last thing the run says (errors: stderr)


@pytest.mark.subprocess
def test_a_lower_keep_last_frees_the_full_disk_before_the_resumed_run_saves(tmp_path):
    """The full disk's advice, "keep fewer checkpoints (trainer.keep_last)", did not work: pruning
    ran only after the next save, so the resumed run failed at the same step with the same line.
    A resumed run prunes to its keep_last as it starts (never the checkpoint it resumes)."""
    disk, cmd = tmp_path / "disk", [sys.executable, str(ROOT / "train.py"), *NANO, "trainer.max_steps=4",
                                    "trainer.checkpoint_every=1", "callbacks.plots=false"]
    run = f"hydra.run.dir={disk / 'run'}"
    script = (f"{shlex.join([*cmd, 'trainer.keep_last=0', run])} 2>&1; echo EXIT=$?; "
              f"exec {shlex.join([*cmd, 'trainer.keep_last=1', run])} 2>&1")
    proc = _in_tmpfs(disk, "size=2600k", ["sh", "-c", script])  # (a checkpoint: ~1 MB)
    first, _, second = proc.stdout.partition("EXIT=1")
    assert "No space left on device: saving the checkpoint of step 3" in first, first[-3000:]
    assert proc.returncode == 0 and "resume: " in second, proc.stdout[-3000:]
    assert "removed checkpoint" in second and "step1 (trainer.keep_last=1)" in second, second[-3000:]


@pytest.mark.multiprocess
def test_a_full_disk_under_the_local_launcher_ends_in_the_same_one_line(tmp_path):
    """On 2 ranks the line came last as "lost rank 0 of 2 ... exited with code 1: OSError: ...",
    after ~130 lines of torch elastic's per-rank tracebacks; now it is the one-process run's line."""
    disk = tmp_path / "disk"
    proc = _in_tmpfs(disk, "size=256k", [sys.executable, str(ROOT / "train.py"), *NANO, *FULL, "strategy=ddp",
                                         "cluster.devices=2", f"hydra.run.dir={disk / 'run'}"])
    line = _one_clear_line(proc, 1, "[Errno 28] No space left on device: saving the checkpoint of step 2 into "
                           f"{disk / 'run' / 'checkpoints'}", "failed on ranks 0, 1; free space there")
    assert proc.stderr.strip().splitlines()[-1] == line and "lost rank" not in line, line
