"""The first things a user meets (#41's noise, #42's disk messages): a mistyped key is one error,
ours; the engines' known noise is filtered at its library; a validation split is big enough to
mean something; a full disk says so."""

from __future__ import annotations

import logging
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
    monkeypatch.delenv(cli._RAISES, raising=False)
    monkeypatch.setattr(cli, "_started", False)
    seen = []
    monkeypatch.setattr(sys, "argv", ["train.py"])
    monkeypatch.setattr("recipes.compose.register", lambda: None)

    def main():
        seen.append(os.environ.get("HYDRA_FULL_ERROR"))
        cli.started()
        seen.append(os.environ.get("HYDRA_FULL_ERROR"))

    cli.run(main)
    assert seen == ["1", None] and cli._RAISES not in os.environ
    monkeypatch.setattr(cli, "_started", False)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # the user's own: kept
    seen.clear()
    cli.run(main)
    assert seen == ["1", "1"]


# --------------------------------------------------------------------- the engines' noise
@pytest.mark.unit
def test_peft_reading_transformers_deprecated_alias_is_filtered():
    """LoRA printed transformers' FutureWarning per rank at build, per checkpoint and at save_hf
    (peft's getattr of ``is_gradient_checkpointing``): filtered by its message and module; the
    same message from elsewhere, and any other FutureWarning, still shows."""
    import warnings

    from backends.common import quiet

    text = "`is_gradient_checkpointing` is deprecated and will be removed in v6. Use `is_activation_checkpointing` instead."
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for n in quiet.WARNINGS:  # (what quiet.install() applies, restored after the block)
            warnings.filterwarnings("ignore", message=n.message, category=n.category, module=n.module)
        warnings.warn_explicit(text, FutureWarning, "modeling_utils.py", 3312, module="transformers.modeling_utils")
        warnings.warn_explicit(text, FutureWarning, "elsewhere.py", 1, module="elsewhere")
        warnings.warn_explicit("something else is deprecated", FutureWarning, "modeling_utils.py", 1,
                               module="transformers.modeling_utils")
    assert [(str(w.message), w.filename) for w in seen] == [(text, "elsewhere.py"),
                                                            ("something else is deprecated", "modeling_utils.py")]


@pytest.mark.unit
def test_zero_to_fp32_progress_is_dropped_and_nothing_else(capsys):
    """DeepSpeed's conversion prints its progress (print and tqdm bars) on save_hf, export and a
    resume on another layout: those lines go, anything else printed or warned in the call stays."""
    from checkpoints.state import _zero_to_fp32_quietly

    with _zero_to_fp32_quietly():
        print("Processing zero checkpoint '/run/checkpoints/step3/deepspeed/state'")
        print("Parsing checkpoint created by deepspeed==0.19.8")
        sys.stderr.write("\rLoading checkpoint shards:   0%|          | 0/2 [00:00<?, ?it/s]"
                         "\rLoading checkpoint shards: 100%|##########| 2/2 [00:00<00:00, 273.32it/s]\n")
        print("Detected checkpoint of type zero stage ZeroStageEnum.gradients, world_size: 2")
        print("Reconstructed Frozen fp32 state dict with 21 params 2392704 elements")
        print("Reconstructed fp32 state dict with 16 params 7168 elements")
        print("a line DeepSpeed has not printed before")
        sys.stderr.write("UserWarning: a real warning\n")
    out, err = capsys.readouterr()
    assert out == "a line DeepSpeed has not printed before\n" and err == "UserWarning: a real warning\n"


@pytest.mark.unit
def test_accelerate_fsdp2_is_not_told_sync_module_states(caplog):
    """Accelerate warned on every rank that ``sync_module_states`` is obsolete in FSDP2 because
    the builder passed it (False); the plugin is built without it, and says nothing."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    from backends.accelerate.families.fsdp2 import FSDP2
    from recipes.compose import compose, register
    from recipes.job import CONFIG, validate

    register()
    job = validate(compose(["model=gpt_nano", "strategy=fsdp2", "cluster.devices=2", "backend=accelerate",
                            "cluster.accelerator=cpu"]), depth=CONFIG)
    with caplog.at_level(logging.WARNING):
        plugin = FSDP2(job.preset, job.run).kwargs(1000)["fsdp_plugin"]
    assert plugin.sync_module_states is None and not caplog.records, caplog.text
    with caplog.at_level(logging.WARNING):  # (what the builder provoked: the test sees it)
        FullyShardedDataParallelPlugin(fsdp_version=2, sync_module_states=False)
    assert "sync_module_states is obsolete" in caplog.text


# --------------------------------------------------------------------- a validation split that means something
@pytest.mark.unit
@pytest.mark.parametrize("n, fraction, val_samples, held", [
    (300, 0.01, 256, 16),   # #41's 3 samples: grown to the minimum
    (100, 0.01, 256, 10),   # ... but never past a tenth of the data
    (40, 0.01, 256, 4),
    (5000, 0.01, 256, 50),  # a fraction above the minimum: as asked
    (300, 0.01, 7, 7),      # nor past what is evaluated (data.val_samples)
    (20, 0.5, 256, 10),
])
def test_a_held_out_split_grows_to_the_minimum(n, fraction, val_samples, held):
    from recipes.data import held_out

    assert held_out(n, fraction, val_samples) == held


@pytest.mark.unit
def test_the_split_is_said_once_by_rank_0(caplog, monkeypatch, tmp_path):
    """The text corpus (windows of 16) with data.val_fraction=0.0002: grown, and the log says so
    once; a data.val_path of a few windows is taken as given, with a warning; other ranks say
    nothing."""
    from types import SimpleNamespace

    from recipes.config import DataConfig
    from recipes.data import CORPUS, VAL_MIN_SAMPLES, build_datasets

    shape = SimpleNamespace(seq_len=16, vocab_size=512)
    monkeypatch.delenv("RANK", raising=False)
    with caplog.at_level(logging.INFO, logger="recipes.data"):
        full = build_datasets(DataConfig(name="text"), shape, 0)[0]
        train, val = build_datasets(DataConfig(name="text", val_fraction=0.0002), shape, 0)
    assert round(len(full) * 0.0002) < VAL_MIN_SAMPLES <= len(full) // 10
    assert len(val) == VAL_MIN_SAMPLES and len(train) + len(val) == len(full)
    said = [r.getMessage() for r in caplog.records if "validation" in r.getMessage()]
    assert said == [f"validation: data.val_fraction=0.0002 of {len(full)} samples is {round(len(full) * 0.0002)}; "
                    f"held out {VAL_MIN_SAMPLES} instead (at least {VAL_MIN_SAMPLES} where a tenth of the data "
                    "allows; data.val_path sets the split exactly)"]
    small = tmp_path / "val.txt"
    small.write_text(CORPUS.read_text()[:16 * 3 + 1])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="recipes.data"):
        val = build_datasets(DataConfig(name="text", val_path=str(small)), shape, 0)[1]
        monkeypatch.setenv("RANK", "1")
        build_datasets(DataConfig(name="text", val_path=str(small)), shape, 0)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(val) == 3 and len(warned) == 1 and "validation on 3 sample(s) only (data.val_path=" in warned[0].getMessage()


# --------------------------------------------------------------------- #42: a full disk says so
@pytest.mark.unit
def test_an_atomic_write_on_a_full_disk_names_the_file_and_the_fix(tmp_path):
    """A real ENOSPC (a write to /dev/full, under the atomic writer's temp name): one OSError, its
    errno kept (train.py's ``disk_full``), the file meant and the fix; nothing left behind. Other
    errors are left as they are."""
    import errno

    from observers.files import atomic_write

    def full(tmp: str) -> None:
        with open("/dev/full", "wb") as f:
            f.write(b"x" * 4096)
            f.flush()

    with pytest.raises(OSError) as caught:
        atomic_write(tmp_path / "report.json", full)
    assert caught.value.errno == errno.ENOSPC and str(caught.value) == (
        f"[Errno 28] No space left on device: writing {tmp_path / 'report.json'}; free space there, "
        "or point hydra.run.dir at a disk with room")
    assert list(tmp_path.iterdir()) == []

    def refused(tmp: str) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", tmp)

    with pytest.raises(PermissionError):
        atomic_write(tmp_path / "report.json", refused)


@pytest.mark.subprocess
@pytest.mark.slow  # (a 30 s run; the default tier has the real ENOSPC above and test_errors' full-disk run)
@pytest.mark.timeout(300)
def test_a_report_on_a_full_disk_ends_the_run_with_one_line(tmp_path):
    """A run with no checkpoint on a 28 KiB tmpfs: the configs and the log fit, report.json does
    not; the run's last line says No space left on device, the file and the fix (it said only
    "[Errno 28] No space left on device")."""
    from tests.test_errors import NANO, _in_tmpfs, _one_clear_line

    disk = tmp_path / "disk"
    proc = _in_tmpfs(disk, "size=28k", [sys.executable, str(ROOT / "train.py"), *NANO, "trainer.max_steps=1",
                                        "trainer.save_last=false", "callbacks.plots=false",
                                        "callbacks.progress_bar=false", f"hydra.run.dir={disk / 'run'}"])
    line = _one_clear_line(proc, 1, f"[Errno 28] No space left on device: writing {disk / 'run' / 'report.json'}; "
                           "free space there, or point hydra.run.dir at a disk with room")
    assert proc.stderr.strip().splitlines()[-1] == line


@pytest.mark.unit
def test_a_sweeps_preflight_and_dry_run_say_our_line():
    """--dry-run and a sweep's preflight compose each point themselves (launchers.sweep.check_point):
    a mistyped key is our line there too, and so is a value of the wrong type."""
    from launchers.sweep import check_point

    point = check_point(["model=gpt_nano", "trainer.max_stepz=3"])
    assert point.problems == ["trainer.max_stepz=3: no such key; did you mean trainer.max_steps? (trainer.max_steps=3)"]
    assert check_point(["cluster.devices=two"]).problems == [
        "cluster.devices=two: cluster.devices takes an integer; python train.py --help lists the keys with their defaults"]


@pytest.mark.subprocess
def test_dry_run_refuses_what_the_launch_refuses(tmp_path):
    """--dry-run said "would start" where the launch then stopped: an output directory that cannot
    be created, and a Slurm submission its own check refuses (not asking for the Slurm client:
    a dry run may preview a submission from a machine without one)."""
    import subprocess

    (tmp_path / "a_file").write_text("")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    slurm = ("-m", "hydra/launcher=submitit_slurm", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    for args, said in [
            (("-m", f"hydra.sweep.dir={tmp_path / 'a_file' / 'sweep'}"), "is a file, not a directory"),
            ((*slurm, "cluster=slurm_local", "strategy=ddp", "cluster.devices=1,2"),
             "cluster.devices=1,2: one Slurm array asks one allocation shape"),
            ((*slurm, "cluster=local"), "hydra/launcher=submitit_slurm with cluster.launcher=local")]:
        proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "model=gpt_nano", *args, "--dry-run"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 2 and "cannot start: " in proc.stdout and said in proc.stdout, proc.stdout
        assert "would start" not in proc.stdout
        assert not (tmp_path / "sweep").exists()


@pytest.mark.unit
@pytest.mark.parametrize("cluster", ["k8s", "sagemaker_p5_2node"])
def test_a_cluster_that_launch_py_submits_says_so_first_and_alone(cluster, monkeypatch):
    """train.py cluster=k8s on a machine without its GPUs said "no CUDA device is visible: use
    cluster.accelerator=cpu", then "this machine has 2 core(s)", and only then "submit it with
    launch.py": this machine's checks are not the run's."""
    import launchers
    from recipes.config import compose
    from strategies import ConfigError

    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SM_HOSTS", "SM_CURRENT_HOST"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError) as e:
        launchers.refuse_elsewhere(compose([f"cluster={cluster}"]))
    assert len(e.value.problems) == 1 and f"submit it with python launch.py cluster={cluster} " in e.value.problems[0]
    launchers.refuse_elsewhere(compose(["cluster=torchrun"]))  # (ranks start here: validation says the rest)


@pytest.mark.unit
def test_the_launchers_problem_comes_with_the_others(monkeypatch):
    """A batch that does not divide and two nodes under plain train.py: one message with both (the
    launcher's came only once the batch was fixed); a world that is not sound keeps it out."""
    import launchers
    from recipes.config import compose
    from recipes.job import validate
    from strategies import ConfigError

    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(var, raising=False)
    base = ["model=gpt_nano", "strategy=ddp", "cluster.accelerator=cpu", "cluster.devices=1", "cluster.nodes=2"]
    with pytest.raises(ConfigError) as e:
        validate(compose([*base, "trainer.global_batch_size=12"]), extra=[launchers.check])
    said = e.value.problems
    assert len(said) == 2 and "trainer.global_batch_size=12" in said[0] and said[1].startswith(
        "cluster.nodes=2: plain `python train.py` starts the ranks of one machine"), said
    with pytest.raises(ConfigError) as e:
        validate(compose([*base, "cluster.devices=0"]), extra=[launchers.check])
    assert not any("plain `python train.py`" in p for p in e.value.problems), e.value.problems


@pytest.mark.unit
def test_a_multi_node_torchrun_dry_run_names_each_nodes_command_and_run_directory(capsys):
    from launchers import dry_run

    base = ["model=gpt_nano", "strategy=ddp", "cluster=torchrun", "cluster.nodes=2", "cluster.devices=1",
            "cluster.accelerator=cpu", "cluster.rdzv_endpoint=10.0.0.1:29500", "trainer.global_batch_size=16"]
    assert dry_run.main([*base, "--dry-run"]) == 0
    said = capsys.readouterr().out
    assert "run this same command on each of the 2 nodes (node ranks come from the rendezvous at " \
           "10.0.0.1:29500), into outputs/torchrun-10.0.0.1-29500 on a file system they share" in said, said
    assert dry_run.main([*base, "hydra.run.dir=/shared/run1", "--dry-run"]) == 0
    assert "into /shared/run1 on a file system" in capsys.readouterr().out


# The engines' noise in real runs (slow: a LoRA ZeRO-2 run with save_hf, an Accelerate FSDP2 run).
NOISE = ("is_gradient_checkpointing", "Processing zero checkpoint", "Detected checkpoint of type",
         "Reconstructed fp32 state dict", "Loading checkpoint shards", "sync_module_states is obsolete")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", ["lora_zero2_save_hf", "accelerate_fsdp2"])
def test_the_engines_noise_is_gone_from_real_runs(case, tmp_path):
    from tests.conftest import TINY, run_cli
    from tests.test_hf import HF, _save

    if case == "lora_zero2_save_hf":
        llama = _save(tmp_path / "llama")
        overrides = (*[o for o in TINY if not o.startswith("model=")], *HF, f"model.path={llama}",
                     "model.lora.rank=4", "model.lora.alpha=8", "cluster.devices=2", "trainer.micro_batch_size=4",
                     "strategy=zero2", "trainer.save_hf=true")
    else:
        overrides = (*TINY, "trainer.max_steps=2", "backend=accelerate", "strategy=fsdp2", "cluster.devices=2")
    run = run_cli("train.py", *overrides, out=tmp_path / "run", timeout=800)
    assert [n for n in NOISE if n in run.log] == [], run.log[-3000:]
