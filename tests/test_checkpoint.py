"""Checkpoints, resume and faults (checkpoints/, both backends), on CPU with gloo.

- exact resume: 6 steps straight vs a copy of its step-3 checkpoint resumed with the default
  ``trainer.resume_from=auto`` to 6 -- the same per-step losses and bitwise-equal parameters, for
  single, ddp, fsdp, fsdp2, zero2, zero3 on both backends (Lightning single and ddp through the
  fault tests); sharded presets save one shard per rank;
- cross-preset and cross-world-size resume (zero3 on 2 -> fsdp on 1 and ddp on 2; fsdp2 on 2 ->
  single, and from Lightning to Accelerate): the loaded parameters equal the saved ones exactly
  (convert.py's full state dict), and training continues;
- faults: SIGKILL of one of 2 ranks ends the job within ``cluster.collective_timeout``, naming
  the lost rank, no process left; rank 0's own writes at the end (plots, params.pt) held past
  the timeout do not end a finished run; SIGKILL during a (slowed) save resumes from the previous
  checkpoint; torchrun with max_restarts=1 and a rank killed once equals the uninterrupted run;
- untrusted files: truncated or garbage files and a different model shape -> a clear error
  naming the file or the key, before any process starts.

Cost: the straight runs are the session cache's (the accelerate tests share their keys); each
resumed run switches the measuring observers off (``callbacks=none``).
"""

from __future__ import annotations

import csv
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from tests.cases import CASES
from tests.conftest import EQUIV, GLOO_ABORT, ROOT, TINY, assert_losses_close, assert_params_close, run_cli

pytestmark = pytest.mark.timeout(600)

# Each preset's overrides, as the equivalence tests run them (so the straight runs are shared).
PRESETS = {name: CASES[name].overrides for name in ("single", "ddp", "fsdp", "fsdp2", "zero2", "zero3")}
CKPT3 = "trainer.checkpoint_every=3"
QUIET = "callbacks=none"  # the report only: no memory, communication or plots to measure


def _straight(cached, preset: str, backend: str = "lightning"):
    return cached(*EQUIV, *PRESETS[preset], CKPT3, f"backend={backend}")


def _same_params(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"not bitwise equal: {differ}"


def _convert(step_dir: Path, out: Path) -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "convert.py"), str(step_dir), "--to", "full",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    from safetensors.torch import load_file

    return load_file(out)


# --------------------------------------------------------------------------- exact resume
# (Lightning single and ddp resume exactly in the fault tests below: a kill mid-save, and torchrun's
# restart, each against the uninterrupted run, bitwise.)
EXACT = [(p, "lightning") for p in ("fsdp", "fsdp2", "zero2", "zero3")] + [
    (p, "accelerate") for p in PRESETS]
# CI: DeepSpeed's payload (DCP's: resharded below, from the same straight run, and per pipeline
# stage in tests/test_parallel.py; Accelerate's resume in the signal case below); the rest, ZeRO-2
# on Accelerate among them, in the slow tier.
EXACT_CI = {("zero3", "lightning")}
EXACT = [c if c in EXACT_CI else pytest.param(*c, marks=pytest.mark.slow) for c in EXACT]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("preset", "backend"), EXACT)
def test_resume_is_exact(cached, train, tmp_path, preset, backend):
    straight = _straight(cached, preset, backend)
    step3 = straight.out / "checkpoints" / "step3"
    assert (step3 / "COMPLETE").is_file(), sorted(p.name for p in step3.parent.iterdir())
    world = 1 if preset == "single" else 2
    if preset.startswith("zero"):  # DeepSpeed's own layout: one optimizer shard per rank
        assert len(list((step3 / "deepspeed").rglob("*optim_states.pt"))) == world
    else:  # torch DCP: every rank writes its own file
        assert len(list((step3 / "dcp").glob("*.distcp"))) == world
    # "3 steps, kill": a run directory holding only the step-3 checkpoint; resume_from=auto
    shutil.copytree(step3, tmp_path / "resumed" / "checkpoints" / "step3")
    resumed = train(*EQUIV, *PRESETS[preset], CKPT3, f"backend={backend}", QUIET, name="resumed")
    assert "resumed from" in resumed.log and "at step 3: model and optimizer" in resumed.log
    assert resumed.losses == straight.losses  # the same floats, not merely close; the whole run
    assert resumed.report["resumed_from"] == {"step": 3, "path": str(resumed.out / "checkpoints" / "step3")}
    _same_params(straight.params(), resumed.params())
    assert (resumed.out / "checkpoints" / "step6" / "COMPLETE").is_file()


# --------------------------------------------------------------------------- across presets
@pytest.mark.multiprocess
def test_zero3_on_2_resumes_as_fsdp_on_1_and_ddp_on_2(cached, train, tmp_path):
    zero3 = _straight(cached, "zero3")
    step3 = zero3.out / "checkpoints" / "step3"
    saved = _convert(step3, tmp_path / "zero3.safetensors")  # DeepSpeed's zero_to_fp32
    # the file loads into the plain model, without any of our checkpoint code
    from recipes.config import compose, describe
    from recipes.gpt import GPT

    GPT(describe(compose(TINY).model)).load_state_dict(saved, strict=True)
    # fsdp on 1 process, resumed at step 3 with max_steps=3: trains nothing, exports what it loaded
    fsdp = train(*EQUIV, "strategy=fsdp", "cluster.devices=1", "trainer.micro_batch_size=8",
                 "trainer.max_steps=3", f"trainer.resume_from={step3}", QUIET, name="fsdp1")
    assert "model only, from a deepspeed checkpoint of zero3 on 2 rank(s)" in fsdp.log
    _same_params(saved, fsdp.params())
    # ddp on 2 continues to step 6: the first step after the resume sees the same weights and data
    ddp = train(*EQUIV, "strategy=ddp", "cluster.devices=2", "trainer.micro_batch_size=4",
                f"trainer.resume_from={step3}", QUIET, name="ddp2")
    assert "optimizer state does not carry over" in ddp.log
    assert ddp.losses[:3] == zero3.losses[:3]  # the record of the run it continues
    assert_losses_close(zero3.losses[3:4], ddp.losses[3:4], rtol=1e-6)
    assert len(ddp.losses) == 6 and ddp.losses[-1] < ddp.losses[3]
    # zero2 on the same 2 ranks: ZeRO-3's files are not ZeRO-2's layout (DeepSpeed's loader
    # asserted, after launch); it takes the model, as from any other preset
    zero2 = train(*EQUIV, *PRESETS["zero2"], "trainer.max_steps=4", f"trainer.resume_from={step3}", QUIET,
                  name="zero2")
    assert "model only, from a deepspeed checkpoint of zero3 on 2 rank(s)" in zero2.log, zero2.log[-2000:]
    assert_losses_close(zero3.losses[3:4], zero2.losses[3:4], rtol=1e-6)


@pytest.mark.multiprocess
def test_zero3_resumed_at_another_precision_takes_the_model_with_a_fresh_optimizer(cached, train, capsys):
    """zero3's fp32 checkpoint resumed under trainer.precision=bf16-mixed passed --dry-run ("ok"),
    then every rank died with FileNotFoundError: .../bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt
    (DeepSpeed keeps its optimizer state per precision). It loads the model with a fresh
    optimizer, as from another preset: --dry-run and the launch say so, naming trainer.precision,
    and the first step computes on the loaded weights."""
    from launchers import dry_run

    zero3 = _straight(cached, "zero3")
    step3 = zero3.out / "checkpoints" / "step3"
    over = [*TINY, *EQUIV, *PRESETS["zero3"], "trainer.max_steps=4", "trainer.precision=bf16-mixed",
            f"trainer.resume_from={step3}", QUIET]
    capsys.readouterr()
    assert dry_run.main([*over, "--dry-run"]) == 0
    said = capsys.readouterr().out
    assert f"resume: {step3} (step 3, zero3 on 2 rank(s)); the model only: the checkpoint's run had " \
           "trainer.precision=32" in said, said
    bf16 = train(*over[len(TINY):], name="bf16")
    assert "the model only: the checkpoint's run had trainer.precision=32" in bf16.log, bf16.log[-3000:]
    assert "model only, from a deepspeed checkpoint of zero3 on 2 rank(s)" in bf16.log
    assert bf16.losses[:3] == zero3.losses[:3]
    assert_losses_close(zero3.losses[3:4], bf16.losses[3:4], rtol=1e-2)  # (in bf16)


@pytest.mark.subprocess
def test_a_rewind_sets_the_abandoned_timeline_aside(train, tmp_path):
    """Resuming from an older checkpoint of the same run directory (rewinding past a spike):
    its newer checkpoints stayed, and a later resume_from=auto (a requeue, the command Ctrl-C
    prints) went back to the abandoned step 6, or said "already finished". They move aside,
    kept, and auto continues the rewound timeline. (A resume at another global batch, which
    continues elsewhere in the data stream, says so.)"""
    every = ("trainer.checkpoint_every=2", QUIET)
    first = train(*every, "trainer.max_steps=6", name="run")
    ckpts = first.out / "checkpoints"
    rewound = train(*every, "trainer.max_steps=4", f"trainer.resume_from={ckpts / 'step2'}", "trainer.lr=1e-4",
                    name="run")
    assert "that timeline moved to" in rewound.log and "step4, step6" in rewound.log, rewound.log[-2000:]
    aside = [p for p in ckpts.iterdir() if p.name.startswith("superseded-")]
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == ["step4", "step6"]
    assert sorted(p.name for p in ckpts.glob("step*")) == ["step2", "step4"]
    again = train(*every, "trainer.max_steps=6", "trainer.lr=1e-4", "trainer.global_batch_size=32", name="run")
    assert again.report["resumed_from"]["step"] == 4 and again.report["steps"] == 6, again.log[-2000:]
    assert again.losses[:4] == rewound.losses[:4]  # the rewound timeline's record, continued
    # another global batch: the data position is step x batch, so it continues elsewhere; said
    assert ("trainer.global_batch_size=32, the checkpoint's run 16: the data continues at sample 128 of "
            "the stream, where that run had consumed 64 (samples 64-127 are skipped)") in again.log, again.log[-3000:]


@pytest.mark.subprocess
def test_an_earlier_runs_checkpoints_never_outrank_this_runs(train):
    """A run directory holding an earlier run's higher steps: a resume from another directory's
    checkpoint, or trainer.resume_from=null, pruned (keep_last) each checkpoint it had just saved,
    since the stale steps ranked newest -- its log named directories already gone, and a later
    auto resumed the other run's. Every step<N> that is not this run's timeline moves aside, kept."""
    every = ("trainer.checkpoint_every=1", QUIET)
    first = train(*every, "trainer.max_steps=4", name="run")
    ckpts = first.out / "checkpoints"
    src = train(*every, "trainer.max_steps=1", name="src")
    foreign = train(*every, "trainer.max_steps=2", "trainer.keep_last=1",
                    f"trainer.resume_from={src.out / 'checkpoints' / 'step1'}", name="run")
    assert sorted(p.name for p in ckpts.glob("step*")) == ["step2"], foreign.log[-2000:]
    assert "step1, step2, step3, step4 (an earlier run's) moved to" in foreign.log, foreign.log[-2000:]
    fresh = train(*every, "trainer.max_steps=1", "trainer.keep_last=1", "trainer.resume_from=null", name="run")
    assert sorted(p.name for p in ckpts.glob("step*")) == ["step1"], fresh.log[-2000:]
    assert "removed checkpoint" not in fresh.log and len(fresh.losses) == 1, fresh.log[-2000:]
    ours = fresh.losses  # (read now: the next run writes the same directory)
    aside = sorted(p for p in ckpts.iterdir() if p.name.startswith("superseded-"))
    assert [sorted(q.name for q in p.iterdir()) for p in aside] == [
        ["step1", "step2", "step3", "step4"], ["step2"]], aside
    again = train(*every, "trainer.max_steps=2", "trainer.keep_last=1", name="run")  # auto: this run's step 1
    assert again.report["resumed_from"]["step"] == 1 and again.losses[:1] == ours, again.log[-2000:]


@pytest.mark.subprocess
def test_a_resume_trains_at_this_runs_learning_rate_and_schedule(train, tmp_path):
    """Rewind and lower the lr, or raise max_steps of a cosine run: the resumed steps ran the
    old run's lr (the scheduler's restored base rate; report.json said the new one), and a
    cosine run extended from 4 to 8 steps took its 5th step at the old schedule's end, 0.0.
    The checkpoint's step count continues on this run's settings, and the log says what changed."""
    cosine = ("trainer.scheduler=cosine", "trainer.checkpoint_every=2", "trainer.optimizer=sgd", QUIET)
    first = train(*cosine, "trainer.max_steps=4", "trainer.lr=3e-3", name="first")
    shutil.copytree(first.out / "checkpoints" / "step2", tmp_path / "again" / "checkpoints" / "step2")
    again = train(*cosine, "trainer.max_steps=8", "trainer.lr=1e-3", name="again")
    straight = train(*cosine, "trainer.max_steps=8", "trainer.lr=1e-3", name="straight")
    assert again.report["lrs"][2:] == pytest.approx(straight.report["lrs"][2:], rel=1e-12)
    assert again.report["lrs"][2] > 0 and again.report["lrs"][:2] == first.report["lrs"][:2]
    assert "this run's trainer settings govern" in again.log and "lr 0.003 -> 0.001" in again.log, again.log[-2000:]


@pytest.mark.multiprocess
def test_fsdp2_on_2_resumes_as_zero3_on_2_and_as_zero2_on_1_on_accelerate(cached, train, tmp_path):
    """A ZeRO run takes another preset's (or world's, or backend's) model, its optimizer fresh,
    as a torch preset takes a ZeRO run's: every parameter set in the engine (under ZeRO-3
    gathered and partitioned again) and the fp32 masters refreshed from them. It was refused."""
    fsdp2 = _straight(cached, "fsdp2")
    step3 = fsdp2.out / "checkpoints" / "step3"
    saved = _convert(step3, tmp_path / "fsdp2.safetensors")
    # zero3 on 2, resumed at step 3 with max_steps=3: trains nothing, exports what it loaded
    zero3 = train(*EQUIV, *PRESETS["zero3"], "trainer.max_steps=3", f"trainer.resume_from={step3}", QUIET,
                  name="zero3")
    assert "model only, from a dcp checkpoint of fsdp2 on 2 rank(s)" in zero3.log, zero3.log[-3000:]
    _same_params(saved, zero3.params())
    # zero2 on 1 on Accelerate continues to step 6: its first step sees the same weights and data
    zero2 = train(*EQUIV, "strategy=zero2", "cluster.devices=1", "trainer.micro_batch_size=8", "backend=accelerate",
                  f"trainer.resume_from={step3}", QUIET, name="zero2")
    assert "optimizer state does not carry over" in zero2.log
    assert zero2.losses[:3] == fsdp2.losses[:3]
    assert_losses_close(fsdp2.losses[3:4], zero2.losses[3:4], rtol=1e-6)
    assert len(zero2.losses) == 6 and zero2.losses[-1] < zero2.losses[3]


@pytest.mark.multiprocess
def test_fsdp2_on_2_resumes_as_tp_on_2(cached, train):
    """The checkpoint's optimizer groups carried fsdp2's foreach=True into tp's, whose groups mix
    DTensors with plain norm weights and step one tensor at a time: the resumed run's first step
    crashed ("aten._foreach_lerp_.Scalar got mixed torch.Tensor and DTensor"). How a run steps
    is its own; the state is the checkpoint's, and the rest of the run is the uninterrupted one."""
    fsdp2 = _straight(cached, "fsdp2")
    step3 = fsdp2.out / "checkpoints" / "step3"
    tp = train(*EQUIV, *CASES["tp"].overrides, f"trainer.resume_from={step3}", QUIET, name="tp")
    assert tp.losses[:3] == fsdp2.losses[:3]
    assert_losses_close(fsdp2.losses[3:], tp.losses[3:], rtol=1e-5)
    assert_params_close(fsdp2.params(), tp.params(), rtol=1e-4)


@pytest.mark.multiprocess
def test_a_deepspeed_checkpoint_under_activation_checkpointing_has_the_plain_models_keys(train, tmp_path):
    """DeepSpeed saves its module's own names, activation checkpointing's wrapper among them:
    convert.py wrote ``layers.0._checkpoint_wrapped_module.attn.wq.weight`` and a torch preset
    could not resume from it. Both read it as the plain model now."""
    zero2 = train(*EQUIV, *PRESETS["zero2"], "strategy.activation_checkpointing=true", "trainer.max_steps=3",
                  CKPT3, QUIET, name="zero2-ac")
    step3 = zero2.out / "checkpoints" / "step3"
    saved = _convert(step3, tmp_path / "zero2.safetensors")
    from recipes.config import compose, describe
    from recipes.gpt import GPT

    GPT(describe(compose(TINY).model)).load_state_dict(saved, strict=True)
    _same_params(zero2.params(), saved)
    single = train(*EQUIV, *PRESETS["single"], "trainer.max_steps=3", f"trainer.resume_from={step3}",
                   QUIET, name="single")
    _same_params(saved, single.params())


@pytest.mark.multiprocess
def test_fsdp2_on_2_resumes_as_single(cached, train, tmp_path):
    """DCP reshards model and optimizer from 2 ranks to 1, and from Lightning to Accelerate: the
    rest of the run is the uninterrupted one."""
    fsdp2 = _straight(cached, "fsdp2")
    step3 = fsdp2.out / "checkpoints" / "step3"
    saved = _convert(step3, tmp_path / "fsdp2.safetensors")
    loaded = train(*EQUIV, *PRESETS["single"], "trainer.max_steps=3", f"trainer.resume_from={step3}",
                   QUIET, name="loaded")
    _same_params(saved, loaded.params())
    single = train(*EQUIV, *PRESETS["single"], "backend=accelerate", f"trainer.resume_from={step3}",
                   QUIET, name="single")
    assert "model and optimizer (DCP, resharded from 2 ranks)" in single.log
    assert single.losses[:3] == fsdp2.losses[:3]
    assert_losses_close(fsdp2.losses[3:], single.losses[3:], rtol=1e-6)
    assert_params_close(fsdp2.params(), single.params(), rtol=1e-5)


# --------------------------------------------------------------------------- faults
def _processes_with(token: str) -> list[int]:
    """Live processes whose environment carries ``token`` (the test's own tree)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if token.encode() in (d / "environ").read_bytes():
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def _faulty(fault: tuple[str, ...], *overrides: str, out: Path,
            torchrun: tuple[str, ...] = ()) -> list[str]:
    """tests/faults.py with ``fault`` around train.py with TINY + ``overrides``."""
    head = [sys.executable, "-m", "torch.distributed.run", *torchrun] if torchrun else [sys.executable]
    return [*head, str(ROOT / "tests" / "faults.py"), *fault, "--", *TINY, *overrides,
            f"hydra.run.dir={out}"]


def _env(token: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "STRATAGEM_TEST": token}


def _events(note: Path) -> dict[str, float]:
    lines = note.read_text().split("\n") if note.exists() else []
    return {w[0]: float(w[1]) for w in (ln.split() for ln in lines) if len(w) == 2}


@pytest.mark.multiprocess
def test_a_killed_rank_ends_the_job_within_the_timeout(tmp_path):
    token, note, timeout = uuid.uuid4().hex, tmp_path / "note", 20
    cmd = _faulty(("--kill-at", "2", "--rank", "1", "--note", str(note)), "strategy=ddp",
                  "cluster.devices=2", "trainer.global_batch_size=8", "trainer.micro_batch_size=4",
                  "trainer.max_steps=500", f"cluster.collective_timeout={timeout}", QUIET,
                  out=tmp_path / "run")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180, env=_env(token))
    ended, log = time.time(), proc.stdout + proc.stderr
    killed = _events(note)["kill1"]
    assert proc.returncode != 0, log[-3000:]
    assert ended - killed <= timeout + 10, f"{ended - killed:.1f}s after the kill\n{log[-3000:]}"
    assert "lost rank 1 of 2" in log and "SIGKILL" in log, log[-3000:]
    time.sleep(0.5)
    assert not _processes_with(token), "a process of the job was left behind"


@pytest.mark.multiprocess
def test_a_rank_stuck_in_a_zero_step_ends_the_job_at_the_timeout_naming_it(tmp_path):
    """Rank 1 hangs as its second optimizer step begins, inside DeepSpeed's ZeRO-2 step; rank 0
    waits in DeepSpeed's all-gather on DeepSpeed's own group. That group had torch's 30-min
    default, not cluster.collective_timeout (the job hung for minutes); then the stuck rank, whose
    stop handler only sets a flag, outlived torch's SIGTERM by 30 s and was never named. Now rank
    0 times out at the timeout, the stuck rank is killed within seconds, and the last line names
    it."""
    token, note, timeout = uuid.uuid4().hex, tmp_path / "note", 10
    cmd = _faulty(("--hang-at", "2", "--rank", "1", "--seconds", "300", "--note", str(note)),
                  "strategy=zero2", "backend=accelerate", "cluster.devices=2", "trainer.max_steps=4",
                  f"cluster.collective_timeout={timeout}", QUIET, out=tmp_path / "run")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150, env=_env(token))
    ended, log = time.time(), proc.stdout + proc.stderr
    assert proc.returncode == 1, log[-3000:]
    hung = _events(note)["hang1"]
    assert ended - hung <= timeout + 12, f"{ended - hung:.1f}s after the hang\n{log[-3000:]}"
    last = log.strip().splitlines()[-1]
    assert "rank 0 of 2 timed out waiting for its peers in a collective" in last, log[-3000:]
    assert "rank 1 (pid " in last and "killed then, stopped responding" in last, last
    time.sleep(0.5)
    assert not _processes_with(token), "a process of the job was left behind"


# CI: Lightning's (its end is teardown's barrier); Accelerate's (its own barrier after the export,
# before the fix) in the slow tier.
@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["lightning", pytest.param("accelerate", marks=pytest.mark.slow)])
def test_rank_0s_writes_at_the_end_outlast_the_collective_timeout(tmp_path, backend):
    """Rank 0 alone writes the plots and params.pt at the end of a run. Its peers used to wait
    for it in a barrier bounded by cluster.collective_timeout (Accelerate's after the export,
    teardown's on Lightning), so a finished run whose writes outlasted it -- a 70B params.pt is
    ~280 GB from one rank -- exited 1 calling rank 0 hung. tests/faults.py holds rank 0 in each
    write, after the real one, for twice the 2 s timeout: the run ends 0, every file whole."""
    token, note, timeout, out = uuid.uuid4().hex, tmp_path / "note", 2, tmp_path / "run"
    cmd = _faulty(("--slow-end", "--seconds", str(2 * timeout), "--note", str(note)), "strategy=ddp",
                  f"backend={backend}", "cluster.devices=2", "trainer.max_steps=2", "trainer.global_batch_size=2",
                  "trainer.micro_batch_size=1", "trainer.save_last=false", "trainer.export_params=true",
                  "callbacks.plots=true", f"cluster.collective_timeout={timeout}", out=out)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180, env=_env(token))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert {"plots0", "export0"} <= set(_events(note)), log[-3000:]  # (both writes were held)
    assert "timed out" not in log and GLOO_ABORT not in log, log[-3000:]
    assert f"trainer.export_params: wrote {out / 'params.pt'}" in log, log[-3000:]
    params = torch.load(out / "params.pt", map_location="cpu", weights_only=True)
    assert "tok_embeddings.weight" in params and "layers.1.attn.wq.weight" in params, sorted(params)[:5]
    assert json.loads((out / "report.json").read_text())["steps"] == 2
    assert (out / "loss.png").stat().st_size > 0
    time.sleep(0.5)
    assert not _processes_with(token), "a process of the job was left behind"


@pytest.mark.unit
def test_rank_0s_end_writes_follow_teardown_and_a_failed_export_names_key_and_path(tmp_path):
    """``train_end`` (every rank, collectives allowed) only merges the report; ``backends.finish``,
    after teardown, writes report.json, runs ``on_report`` once and writes params.pt, and drops
    the parameters from the outcome the launcher gets back. A params.pt that cannot be written
    fails the run naming trainer.export_params and the path, leaving no temp file."""
    from types import SimpleNamespace

    from backends import Outcome, finish
    from observers import Observer, Observers

    class Seen(Observer):
        def __init__(self):
            self.reports = []

        def on_report(self, engine, report):
            self.reports.append(report)

    seen = Seen()
    hub = Observers([seen], meta={"run": "x"}, report_path=tmp_path / "report.json")
    report = hub.train_end(SimpleNamespace(rank=0))
    assert not (tmp_path / "report.json").exists() and seen.reports == []
    outcome = Outcome(rank=0, report=report, params={"w": torch.arange(3.0)})
    finish(outcome, hub, tmp_path)
    assert json.loads((tmp_path / "report.json").read_text()) == report and seen.reports == [report]
    assert torch.equal(torch.load(tmp_path / "params.pt", weights_only=True)["w"], torch.arange(3.0))
    assert outcome.params is None
    finish(outcome, hub, tmp_path)  # (published once)
    assert seen.reports == [report]

    bad = tmp_path / "bad"
    (bad / "params.pt" / "x").mkdir(parents=True)  # a directory where params.pt goes
    with pytest.raises(OSError, match=rf"trainer.export_params=true: writing {bad / 'params.pt'}: Is a directory"):
        finish(Outcome(rank=0, params={"w": torch.ones(2)}), Observers([]), bad)
    assert sorted(p.name for p in bad.iterdir()) == ["params.pt"]


# CI: Accelerate's (its only proof of a signal at a step boundary on several ranks); Lightning's
# SIGUSR1 reaches its ranks in CI through a real Slurm (test_launch.py's requeue test), this
# direct case in the slow tier.
@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", [pytest.param("lightning", marks=pytest.mark.slow), "accelerate"])
def test_a_signal_to_one_rank_stops_every_rank_after_its_step_and_the_resume_is_exact(
        cached, tmp_path, backend):
    """SIGUSR1 (Slurm's warning before the time limit) reaches rank 1 alone after step 4: both
    ranks finish step 4, agree to stop, save it together and exit 128 + 10 with the checkpoint
    named, no report written (checkpoint_every=3 would not have saved 4). Run again: it resumes
    there, and the run ends bitwise equal to the uninterrupted one."""
    straight = _straight(cached, "ddp", backend)
    token, out = uuid.uuid4().hex, tmp_path / "run"
    overrides = (*EQUIV, *PRESETS["ddp"], CKPT3, f"backend={backend}", QUIET)
    proc = subprocess.run(_faulty(("--signal-at", "4", "--rank", "1", "--signum", "USR1"), *overrides, out=out),
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env(token))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 128 + signal.SIGUSR1, log[-4000:]
    assert "stopped by SIGUSR1" in log and "saved a checkpoint" in log, log[-4000:]
    assert (out / "checkpoints" / "step4" / "COMPLETE").is_file(), log[-4000:]
    assert not (out / "report.json").exists() and GLOO_ABORT not in log
    assert not _processes_with(token)
    resumed = run_cli("train.py", *TINY, *overrides, out=out)  # resume_from=auto
    assert "at step 4: model and optimizer" in resumed.log
    assert resumed.losses == straight.losses
    _same_params(straight.params(), resumed.params())



@pytest.mark.unit
def test_the_resume_command_is_the_command_line_with_the_run_directory_pinned(monkeypatch, tmp_path):
    """What a stopped run prints: its own command line as typed (``~logger`` back to the README's
    ``logger=null``), without the run directory and checkpoint it named, then the run directory
    (a default one is named by the clock) and ``trainer.resume_from=auto`` where the command line
    or the config said otherwise."""
    import shlex

    from launchers import resume

    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_JOB_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(ROOT)
    out = ROOT / "outputs" / "2030-01-01" / "00-00-00"
    monkeypatch.setattr(sys, "argv", ["train.py", "strategy=ddp", "~logger", "hydra.run.dir=elsewhere",
                                      "model.name=two words"])
    cmd = shlex.split(resume.command(out))
    assert cmd[1:] == ["train.py", "strategy=ddp", "logger=null", "model.name=two words",
                       f"hydra.run.dir={out}"], cmd  # (absolute: tests/test_resume.py)
    monkeypatch.setattr(sys, "argv", ["train.py", "+trainer.resume_from=/old/step3"])
    assert resume.command(tmp_path).endswith(f"train.py hydra.run.dir={tmp_path.resolve()} trainer.resume_from=auto")
    monkeypatch.setattr(sys, "argv", ["train.py"])
    assert resume.command(tmp_path, None).endswith("trainer.resume_from=auto")  # (a config said null)
    monkeypatch.setattr(sys, "argv", ["train.py", "-m", "--config-name", "mine", "strategy=ddp,fsdp"])
    assert shlex.split(resume.command(tmp_path))[1:4] == ["train.py", "--config-name", "mine"]


def _ctrl_c_job(fault: tuple[str, ...], overrides: tuple[str, ...], out: Path, token: str,
                log: Path) -> subprocess.Popen:
    """The job in a process group of its own, as a terminal's foreground job: os.killpg(pid,
    SIGINT) is Ctrl-C (the launcher and every rank get it)."""
    return subprocess.Popen(_faulty(fault, *overrides, out=out), cwd=ROOT, env=_env(token),
                            stdout=log.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)


def _kill_group(job: subprocess.Popen) -> None:
    """Whatever is left of the job's process group (a test that failed half-way)."""
    try:
        os.killpg(job.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    job.wait(timeout=30)


def _none_left(token: str) -> None:
    time.sleep(0.5)
    left = _processes_with(token)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "a process of the job was left behind"


def _wait_for(note: Path, event: str, job: subprocess.Popen, log: Path, seconds: float = 240) -> None:
    deadline = time.time() + seconds
    while event not in _events(note):
        if job.poll() is not None or time.time() > deadline:
            _kill_group(job)
            pytest.fail(f"no {event!r} (exit {job.poll()}):\n{log.read_text()[-4000:]}")
        time.sleep(0.1)


def _resume_command(log: str) -> list[str]:
    """The command the stopped run printed, to run as printed."""
    import shlex

    lines = [ln for ln in log.splitlines() if "to resume: " in ln]
    assert len(lines) == 1, log[-4000:]
    return shlex.split(lines[0].split("to resume: ", 1)[1])


# CI: the default single process (Lightning's own Ctrl-C handling bypassed) and our launcher's ranks
# on Lightning (its SIGTERM handler replaced); Accelerate's stop is the same step-boundary check
# (proven in CI by the SIGUSR1 test above), its Ctrl-C here in the slow tier.
CTRL_C = [pytest.param("single", "lightning", marks=pytest.mark.slow), ("ddp", "lightning"),
          pytest.param("ddp", "accelerate", marks=pytest.mark.slow)]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("preset", "backend"), CTRL_C)
def test_ctrl_c_saves_after_the_step_and_the_printed_command_resumes_exactly(
        cached, reference, tmp_path, preset, backend):
    """Ctrl-C (SIGINT to the job's process group: the launcher and every rank, as a terminal
    sends it) while step 4 ends: every rank finishes the step, they save step 4 together and the
    job exits 130 -- not Lightning's "Detected KeyboardInterrupt", exit 1 -- printing the command
    that resumes. That command, run as printed, ends bitwise equal to the uninterrupted run. (The
    single-process straight run saves no checkpoint of its own: step 4 is the Ctrl-C's.)"""
    if preset == "single":
        straight, overrides = reference("adamw"), (*EQUIV, *PRESETS["single"], QUIET)
    else:
        straight = _straight(cached, preset, backend)
        overrides = (*EQUIV, *PRESETS[preset], CKPT3, f"backend={backend}", QUIET)
    token, note, out, log = uuid.uuid4().hex, tmp_path / "note", tmp_path / "run", tmp_path / "log"
    job = _ctrl_c_job(("--pause-at", "4", "--rank", "0", "--seconds", "120", "--note", str(note)),
                      overrides, out, token, log)
    try:
        _wait_for(note, "pause0", job, log)
        os.killpg(job.pid, signal.SIGINT)
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            _kill_group(job)
    text = log.read_text()
    assert job.returncode == 128 + signal.SIGINT, text[-4000:]
    assert "Ctrl-C: " in text and "stopped by SIGINT" in text and "after step 4" in text, text[-4000:]
    assert (out / "checkpoints" / "step4" / "COMPLETE").is_file(), text[-4000:]
    assert not (out / "report.json").exists()
    assert "KeyboardInterrupt" not in text and "Traceback" not in text and GLOO_ABORT not in text, text[-4000:]
    _none_left(token)
    cmd = _resume_command(text)
    assert f"hydra.run.dir={out}" in cmd, cmd  # (a default run directory is named by the clock)
    resumed = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, stdin=subprocess.DEVNULL)
    again = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, again[-4000:]
    assert "at step 4: model and optimizer" in again, again[-4000:]
    assert json.loads((out / "report.json").read_text())["losses"] == straight.losses
    _same_params(straight.params(), torch.load(out / "params.pt", map_location="cpu"))


@pytest.mark.multiprocess
def test_a_second_ctrl_c_stops_every_rank_at_once(tmp_path):
    """Ctrl-C, and again while the ranks save (the save slowed): every process ends within
    seconds with 130, the half-written step 4 is left for the next run to remove, and the
    message names the newest checkpoint (step 3) and the command that resumes from it."""
    token, note, out, log = uuid.uuid4().hex, tmp_path / "note", tmp_path / "run", tmp_path / "log"
    overrides = (*EQUIV, *PRESETS["ddp"], CKPT3, QUIET)
    fault = ("--pause-at", "4", "--rank", "0", "--slow-save", "4", "--seconds", "120", "--note", str(note))
    job = _ctrl_c_job(fault, overrides, out, token, log)
    try:
        _wait_for(note, "pause0", job, log)
        os.killpg(job.pid, signal.SIGINT)
        first = time.time()
        _wait_for(note, "saving0", job, log, seconds=60)
        time.sleep(max(0.0, first + 1.5 - time.time()))  # (a second press, not the first passed on)
        os.killpg(job.pid, signal.SIGINT)
        second = time.time()
        job.wait(timeout=30)
        took = time.time() - second
    finally:
        if job.poll() is None:
            _kill_group(job)
    text = log.read_text()
    assert job.returncode == 128 + signal.SIGINT, text[-4000:]
    assert took < 10, f"{took:.1f} s after the second Ctrl-C\n{text[-4000:]}"
    assert "Ctrl-C again: stopped every rank at once" in text, text[-4000:]
    ckpts = out / "checkpoints"
    assert (ckpts / "step3" / "COMPLETE").is_file() and not (ckpts / "step4").exists()
    assert f"the newest checkpoint is {ckpts / 'step3'}" in text and "to resume from it: " in text
    _none_left(token)


HISTORY = (*EQUIV, *PRESETS["single"], "trainer.checkpoint_every=4", "data.val_fraction=0.1",
           "trainer.val_every=2", QUIET)


@pytest.mark.subprocess
@pytest.mark.parametrize("logger", ["csv", pytest.param("wandb", marks=pytest.mark.slow),
                                    pytest.param("tensorboard", marks=pytest.mark.slow)])
def test_a_resumed_run_keeps_one_history(tmp_path, logger):
    """Killed after step 5 (its last checkpoint at step 4), then run again: report.json covers
    steps 1-6 with resumed_from, the validations of steps 2 and 4 come from the checkpoint; the
    logger's record is one run: metrics.csv lists each step once, W&B resumes the same run id,
    TensorBoard purges what step 5 logged before the kill. A second re-run starts nothing."""
    token, out = uuid.uuid4().hex, tmp_path / "run"
    overrides = (*HISTORY, f"logger={logger}")
    env = {**_env(token), "WANDB_MODE": "offline"}
    straight = run_cli("train.py", *TINY, *overrides, out=tmp_path / "straight", env={"WANDB_MODE": "offline"})
    proc = subprocess.run(_faulty(("--kill-at", "5", "--rank", "0"), *overrides, out=out), cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0 and not (out / "report.json").exists(), proc.stderr[-3000:]
    resumed = run_cli("train.py", *TINY, *overrides, out=out, env={"WANDB_MODE": "offline"})
    r = resumed.report
    assert r["losses"] == straight.losses and r["steps"] == 6
    assert r["resumed_from"] == {"step": 4, "path": str(out / "checkpoints" / "step4")}
    assert [v["step"] for v in r["validation"]] == [2, 4, 6]
    assert r["validation"] == straight.report["validation"]
    assert straight.report["resumed_from"] is None
    if logger == "csv":
        rows = list(csv.DictReader((out / "metrics.csv").open()))
        assert [int(x["step"]) for x in rows if x["loss"]] == [1, 2, 3, 4, 5, 6]
        assert [int(x["step"]) for x in rows if x["val_loss"]] == [2, 4, 6]
        assert [float(x["loss"]) for x in rows if x["loss"]] == pytest.approx(straight.losses, rel=1e-6)
    if logger == "wandb":
        kept = (out / "wandb-run-id").read_text().strip()
        runs = sorted(p.name for p in (out / "wandb").glob("offline-run-*"))
        assert len(runs) == 2 and all(name.endswith(f"-{kept}") for name in runs), (kept, runs)
    if logger == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(out / "tensorboard")).Reload()
        assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    again = run_cli("train.py", *TINY, *overrides, out=out, env={"WANDB_MODE": "offline"})
    assert "already finished at step 6" in again.log and "raise trainer.max_steps" in again.log
    assert "Initializing distributed" not in again.log and again.report == r  # the report stands

@pytest.mark.unit
def test_a_run_that_trains_again_sets_the_earlier_report_aside(tmp_path):
    """A resume into a finished run's directory that then failed (a rank raising at step 2 of 4
    more) left that run's report.json ("stopped: max_steps, step 4") and plots: README says a
    failed run leaves none, and a sweep takes report.json for "finished". As a run is to train
    there, the launcher (for_launch's cleanup) moves the earlier record to superseded-<time>/;
    every other file stays; a torchrun worker that is not rank 0 moves nothing."""
    import checkpoints
    from observers.report import RECORD

    run = tmp_path / "run"
    others = ("train.log", "metrics.csv", ".hydra/overrides.yaml", "checkpoints/superseded-x/keep")
    for name in (*RECORD, *others):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(f"earlier {name}")
    job = _validated("trainer.max_steps=4")
    checkpoints.for_launch(job, run, cleanup=False)
    assert all((run / name).is_file() for name in RECORD)
    checkpoints.for_launch(job, run, cleanup=True)
    aside = list(run.glob("superseded-*"))
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == sorted(RECORD), aside
    assert (aside[0] / "report.json").read_text() == "earlier report.json"
    assert not any((run / name).exists() for name in RECORD)
    assert all((run / name).read_text() == f"earlier {name}" for name in others)
    checkpoints.for_launch(job, run, cleanup=True)  # (a restarted worker: nothing left to move)
    assert list(run.glob("superseded-*")) == aside


@pytest.mark.subprocess
def test_a_resume_of_a_finished_run_sets_its_report_aside_as_it_trains(tmp_path):
    """A finished 2-step run, run again: "already finished", its report stands. Continued to 3
    steps: the old report (stopped at step 2) moves to superseded-<time>/ before training, so a
    continuation that fails leaves no report.json (a killed run writes none:
    test_a_resumed_run_keeps_one_history); this one ends with its own."""
    out, overrides = tmp_path / "run", ("trainer.global_batch_size=4", "trainer.micro_batch_size=4", QUIET)
    first = run_cli("train.py", *TINY, *overrides, "trainer.max_steps=2", out=out).report
    again = run_cli("train.py", *TINY, *overrides, "trainer.max_steps=2", out=out)
    assert "already finished at step 2" in again.log and again.report == first
    assert not list(out.glob("superseded-*"))
    longer = run_cli("train.py", *TINY, *overrides, "trainer.max_steps=3", out=out)
    aside = list(out.glob("superseded-*/report.json"))
    assert len(aside) == 1 and json.loads(aside[0].read_text()) == first, aside
    assert "report.json moved to" in longer.log and longer.report["resumed_from"]["step"] == 2
    assert longer.report["steps"] == 3 and (out / "checkpoints" / "step2").is_dir()


@pytest.mark.multiprocess
def test_cluster_torchrun_restarts_resume_from_the_checkpoint(cached, tmp_path):
    """cluster=torchrun with cluster.max_restarts=1 (our launcher is the agent): rank 1 is killed
    after step 4 once; the restarted workers find the step-3 checkpoint themselves (the agent's
    decision before launch was "none yet") and the run ends equal to the uninterrupted one."""
    straight = _straight(cached, "ddp")
    token, once, out = uuid.uuid4().hex, tmp_path / "killed-once", tmp_path / "run"
    cmd = _faulty(("--kill-at", "4", "--rank", "1", "--once", str(once)), *EQUIV, *PRESETS["ddp"],
                  CKPT3, QUIET, "cluster=torchrun", "cluster.nodes=1", "cluster.max_restarts=1", out=out)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env(token))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert once.exists() and "at step 3: model and optimizer" in log, log[-5000:]
    report = json.loads((out / "report.json").read_text())
    assert report["losses"] == straight.losses
    _same_params(straight.params(), torch.load(out / "params.pt", map_location="cpu"))
    assert not _processes_with(token)


@pytest.mark.multiprocess
def test_a_kill_during_a_save_resumes_from_the_previous_checkpoint(reference, tmp_path):
    """checkpoint_every=2; the step-4 save is slowed after its files are written and the whole
    job is SIGKILLed then. The resume ignores and removes the half-written step 4, continues
    from step 2, and ends equal to the uninterrupted run."""
    straight = reference("adamw")
    token, note, out = uuid.uuid4().hex, tmp_path / "note", tmp_path / "run"
    overrides = (*EQUIV, *PRESETS["single"], "trainer.checkpoint_every=2", QUIET)
    job = subprocess.Popen(_faulty(("--slow-save", "4", "--seconds", "120", "--note", str(note)),
                                   *overrides, out=out),
                           cwd=ROOT, env=_env(token), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 180
        while "saving0" not in _events(note) and job.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert "saving0" in _events(note), "the slowed save never started"
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=30)
    ckpts = out / "checkpoints"
    assert (ckpts / "step2" / "COMPLETE").is_file() and not (ckpts / "step4").exists()
    assert any((ckpts / ".tmp-step4").rglob("*.distcp")), "the kill was meant to land mid-save"
    resumed = run_cli("train.py", *TINY, *overrides, out=out)  # resume_from=auto
    assert "removed an interrupted checkpoint save" in resumed.log
    assert f"resumed from {ckpts / 'step2'} at step 2" in resumed.log
    assert not (ckpts / ".tmp-step4").exists()
    assert resumed.losses == straight.losses
    _same_params(straight.params(), resumed.params())


@pytest.mark.multiprocess
@pytest.mark.slow  # (CI: our launcher's restart, cluster.max_restarts, above; outside torchrun in test_launch)
def test_torchrun_restarts_a_killed_rank_and_resumes(cached, tmp_path):
    straight = _straight(cached, "ddp")
    token, once, out = uuid.uuid4().hex, tmp_path / "killed-once", tmp_path / "run"
    cmd = _faulty(("--kill-at", "4", "--rank", "1", "--once", str(once)), *EQUIV, *PRESETS["ddp"],
                  CKPT3, QUIET, out=out,
                  torchrun=("--standalone", "--nproc-per-node=2", "--max-restarts=1",
                            "--monitor-interval=0.5"))
    # torchrun shares its rendezvous store with the workers' process group, and a restarted
    # worker can read a peer's address from the attempt before (pytorch#135712): its switch off
    env = {**_env(token), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert once.exists() and "at step 3: model and optimizer" in log, log[-5000:]
    assert GLOO_ABORT not in log
    report = json.loads((out / "report.json").read_text())
    assert report["losses"] == straight.losses
    _same_params(straight.params(), torch.load(out / "params.pt", map_location="cpu"))
    assert not _processes_with(token)


# --------------------------------------------------------------------------- untrusted files
@pytest.fixture(scope="module")
def good(cached) -> Path:
    """fsdp on 2 ranks (the run tests/test_fsdp.py trains): a DCP checkpoint with a file per rank."""
    return _straight(cached, "fsdp").out / "checkpoints" / "step3"


@pytest.fixture
def model():
    from recipes.config import compose, describe

    return describe(compose(TINY).model)


def _damaged(good: Path, tmp_path: Path, rel: str, how: str) -> Path:
    path = tmp_path / "run" / "checkpoints" / "step3"
    shutil.rmtree(path.parent.parent, ignore_errors=True)
    shutil.copytree(good, path)
    f = path / rel
    data = f.read_bytes()
    if how == "truncate":
        f.write_bytes(data[: len(data) // 2])
    elif how == "garbage":  # the same size: only reading it can tell
        f.write_bytes(os.urandom(len(data)))
    elif how == "delete":
        f.unlink()
    return path



@pytest.mark.unit
def test_when_a_checkpoint_is_due():
    import checkpoints
    from recipes.config import TrainerConfig

    steps = lambda **kw: [s for s in range(1, 11) if checkpoints.due(TrainerConfig(max_steps=10, **kw), s)]  # noqa: E731
    assert steps() == [10]  # save_last: the final model is always there to convert
    assert steps(checkpoint_every=3) == [3, 6, 9, 10]
    assert steps(checkpoint_every=5, save_last=False) == [5, 10] and steps(save_last=False) == []


@pytest.mark.unit
def test_a_resume_names_the_model_settings_no_shape_pins():
    """model.lora.alpha and .dropout, and model.dropout, pass the resume's shape check: what
    differs from the checkpoint's run is named (LoRA's only with adapters)."""
    from checkpoints.resume_settings import model_changes
    from recipes.config import compose, describe

    saved = {"dropout": 0.0, "lora": {"rank": 4, "alpha": 16.0, "dropout": 0.0}}
    lora = describe(compose([*TINY, "model.lora.rank=4", "model.lora.alpha=16"]).model)
    assert model_changes(saved, lora) == []
    lora.lora.alpha, lora.dropout = 32.0, 0.1
    assert [c.split(" (")[0] for c in model_changes(saved, lora)] == ["model.lora.alpha 16 -> 32",
                                                                      "model.dropout 0 -> 0.1"]
    lora.lora.rank = 0
    assert model_changes(saved, lora) == ["model.dropout 0 -> 0.1"]


@functools.cache
def _validated(*overrides: str):
    from recipes.config import compose
    from recipes.job import validate

    return validate(compose([*TINY, *overrides]))


def _config(*overrides: str) -> dict:
    """trainer, model and data of TINY + ``overrides`` as meta.json's ``config`` holds them."""
    from checkpoints.data_stream import this_run

    return this_run(_validated(*overrides))


@pytest.mark.unit
def test_a_resume_names_the_settings_that_decide_the_data_stream():
    """trainer.seed, model.seq_len and the data source decide the sample stream the position
    (step x global batch) is taken in: each that differs from the checkpoint's run is named
    (they changed the data silently); a key the data does not read (data.field and a tokenizer's
    keys for byte text, num_workers, cache_dir, a val_samples above the split's floor) is not."""
    import copy

    from checkpoints.data_stream import changes

    saved, held = _config(), _config("data.val_fraction=0.1")  # (held out: fewer training windows)

    def edited(config: dict, **values) -> dict:
        out = copy.deepcopy(config)
        for key, value in values.items():
            section, name = key.split("__")
            out[section][name] = value
        return out

    assert changes(saved, edited(saved, data__num_workers=2, data__cache_dir="/x", data__field="body")) == []
    assert changes(saved, edited(saved, trainer__seed=7, model__seq_len=64)) == ["trainer.seed 1234 -> 7",
                                                                                 "model.seq_len 32 -> 64"]
    assert changes(saved, _config("data=synthetic")) == ["data.name text -> synthetic"]
    assert changes(saved, edited(saved, data__tokenizer="/tok")) == ["data.tokenizer null -> /tok"]
    assert changes(saved, edited(saved, data__mixture=[{"name": "text", "weight": 1}])) == [
        'data.mixture [] -> [{"name":"text","weight":1}]']
    assert changes(saved, held) == ["data.val_fraction 0.0 -> 0.1"]
    assert changes(held, edited(held, data__val_samples=512)) == []
    assert changes(held, edited(held, data__val_samples=8)) == ["data.val_samples 256 -> 8"]
    assert changes(held, edited(held, data__val_path="/v.txt")) == ["data.val_path null -> /v.txt"]
    del saved["trainer"]["seed"]  # (an older checkpoint without the key: not compared)
    assert changes(saved, edited(held, trainer__seed=7)) == ["data.val_fraction 0.0 -> 0.1"]


@pytest.mark.unit
def test_a_resume_names_a_data_file_changed_under_the_same_path(hf_tokenizer, tmp_path):
    """A data file rewritten (or a tokenizer overwritten in place) under the same data.path is
    another stream as much as a new path is: the run re-tokenized it, then resumed without a
    word. The checkpoint's meta records each source's input fingerprint (tokenized data: the
    token cache's name) and the one resume: warning names the path whose files changed. The same
    files, and an older checkpoint without fingerprints, say nothing; a new data.path is named
    once, as the setting."""
    import copy
    import dataclasses
    from types import SimpleNamespace

    import checkpoints
    from checkpoints.data_stream import stream_note
    from recipes.config import compose
    from recipes.job import validate
    from recipes.tokens import cache_key, input_fingerprints
    from recipes.trainer_config import DataConfig

    tok, docs, other = tmp_path / "tok", tmp_path / "docs.jsonl", tmp_path / "other.jsonl"
    shutil.copytree(hf_tokenizer, tok)
    lines = [json.dumps({"text": f"document {i} of the stream"}) for i in range(40)]
    docs.write_text("\n".join(lines) + "\n")
    shutil.copy(docs, other)

    def said(saved: dict) -> list[str]:
        note = stream_note(SimpleNamespace(meta=saved, step=4, path=tmp_path), run)
        return [note] if note else []

    def touched(f: Path) -> None:  # (a rewrite a second later: the kernel's clock is coarser than ns)
        st = f.stat()
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))

    run = validate(compose([*TINY, "data=jsonl", f"data.path={docs}", f"data.tokenizer={tok}",
                            "model.vocab_size=512"]))
    saved = checkpoints._meta(checkpoints.Handles(None, None, None, rank=0, world_size=1), run, 4)
    cache = cache_key("jsonl", [docs], "text", tok, train_on="all", loader="json")  # (the token cache's name)
    assert saved["inputs"] == {"data.path": cache}
    assert said(saved) == []
    docs.write_text("\n".join(reversed(lines)) + "\n")  # (the same size: `tac docs > docs`)
    touched(docs)
    warned = said(saved)
    assert len(warned) == 1 and warned[0].startswith(
        f"resume: data.path={docs}: its contents changed since the checkpoint (its files' size or "
        "modification time or data.tokenizer's files: input fingerprint"), warned
    assert "resume with the checkpoint's values and data to continue it" in warned[0]
    assert said({k: v for k, v in saved.items() if k != "inputs"}) == []  # (an older checkpoint)
    saved = {**saved, "inputs": input_fingerprints(run.data)}
    config = tok / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": 64}))
    assert len(said(saved)) == 1
    moved = copy.deepcopy(saved)  # (a new path: the setting is named, not also its files)
    moved["config"]["data"]["path"] = str(other)
    moved["inputs"] = input_fingerprints(dataclasses.replace(run.data, path=str(other)))
    warned = said(moved)
    assert len(warned) == 1 and warned[0].startswith(f"resume: data.path {other} -> {docs}: these"), warned
    # pre-tokenized shards (their paths, sizes and times), a mixture's sources by entry
    (tmp_path / "bins").mkdir()
    shard = tmp_path / "bins" / "a.bin"
    shard.write_bytes(bytes(200))
    mixture = DataConfig(mixture=[{"name": "tokens", "path": str(shard.parent), "weight": 1.0},
                                  {"name": "synthetic", "weight": 1.0}])
    before = input_fingerprints(mixture)
    assert list(before) == ["data.mixture[0]"] and before == input_fingerprints(mixture)
    touched(shard)
    assert input_fingerprints(mixture) != before
    assert input_fingerprints(DataConfig(name="tokens", path=str(tmp_path / "gone"))) == {}


def _job(layout: tuple[str, ...], **trainer):
    """TINY validated under ``layout``, with these trainer settings."""
    import dataclasses

    j = _validated(*layout)
    return dataclasses.replace(j, trainer=dataclasses.replace(j.trainer, **trainer))


def _meta_of(was, **written) -> dict:
    """meta.json as the run ``was`` writes it (what the resume checks read); ``written``: other values."""
    import dataclasses

    from omegaconf import OmegaConf

    return {"payload": was.run.checkpoint, "world_size": was.mesh.size, "backend": was.backend,
            "strategy": was.strategy.name, "config": {"trainer": dataclasses.asdict(was.trainer),
                                                      "strategy": OmegaConf.to_container(was.cfg.strategy, resolve=True)},
            **written}


@pytest.mark.unit
def test_a_resume_refuses_what_would_reshape_the_optimizer_state_it_loads():
    """Where the checkpoint's optimizer state loads, another trainer.optimizer (torch DCP raised
    a missing key on every rank after launch, ZeRO ran on silently), SGD's momentum from 0, and
    under DeepSpeed another number of parameter groups are refused before launch; a load of the
    model only (another engine, world size, ZeRO-3-or-not, or precision under DeepSpeed) starts the
    optimizer fresh and takes any."""
    from types import SimpleNamespace

    from checkpoints.resume_settings import optimizer_refusal

    job = _job

    def refusal(was, now, **written) -> str | None:  # (written: meta.json's world_size, backend)
        return optimizer_refusal(SimpleNamespace(meta=_meta_of(was, **written), path="ckpt"), now)

    single, ddp, zero2 = ("strategy=single",), ("strategy=ddp", "cluster.devices=2"), ("strategy=zero2", "cluster.devices=2")
    zero3 = ("strategy=zero3", "cluster.devices=2")
    for layout in (ddp, zero2, zero3):
        assert refusal(job(layout), job(layout)) is None
        why = refusal(job(layout), job(layout, optimizer="sgd"))
        assert why.startswith("trainer.optimizer=sgd, the checkpoint's run adamw:") and "trainer.optimizer=adamw" in why
    assert "trainer.optimizer=adamw, the checkpoint's run sgd" in refusal(job(ddp, optimizer="sgd"), job(single))
    assert refusal(job(ddp), job(zero2, optimizer="sgd")) is None  # (the model only, optimizer fresh)
    for written in ({"world_size": 1}, {"backend": "accelerate"}):
        assert refusal(job(zero2), job(zero2, optimizer="sgd"), **written) is None, written
    assert refusal(job(zero2), job(zero3, optimizer="sgd")) is None  # (ZeRO-3's layout: the model only)
    sgd = job(single, optimizer="sgd")
    assert refusal(sgd, job(single, optimizer="sgd", momentum=0.9)).startswith(
        "trainer.momentum=0.9, the checkpoint's run 0")
    assert refusal(job(single, optimizer="sgd", momentum=0.9), sgd) is None
    assert refusal(job(ddp), job(ddp, weight_decay=0.1)) is None  # (DCP keys the state by parameter)
    why = refusal(job(zero2), job(zero2, weight_decay=0.1))
    assert why.startswith("trainer.weight_decay=0.1 with trainer.no_decay=true: 2 optimizer parameter group(s), "
                          "the checkpoint's run 1") and "trainer.no_decay=false" in why
    assert refusal(job(zero2), job(zero2, weight_decay=0.1, no_decay=False)) is None


@pytest.mark.unit
def test_a_zero_resume_at_another_precision_loads_the_model_only():
    """DeepSpeed keeps its ZeRO optimizer state per precision (bf16's files are
    bf16_zero_pp_rank_*_optim_states.pt, fp16's carry a dynamic loss scaler): zero2 and zero3 resumed
    at another trainer.precision passed the preflight and --dry-run, then every rank died with
    FileNotFoundError for the other kind's file. The precision is one of the whole load's
    conditions: the model loads and the optimizer starts fresh (so any optimizer is taken), and the
    resume line says so, naming trainer.precision. DCP's state loads at any precision."""
    from types import SimpleNamespace

    import checkpoints
    from checkpoints.resume_settings import loads_optimizer, optimizer_refusal

    zero2, zero3 = ("strategy=zero2", "cluster.devices=2"), ("strategy=zero3", "cluster.devices=2")
    for layout in (zero2, zero3):
        for was, now in (("32", "bf16-mixed"), ("bf16-mixed", "32")):
            meta = _meta_of(_job(layout, precision=was))
            assert loads_optimizer(meta, _job(layout, precision=was)), (layout, was)
            assert not loads_optimizer(meta, _job(layout, precision=now)), (layout, was, now)
            ckpt = SimpleNamespace(meta=meta, path="ckpt", step=6)
            line = checkpoints.resume_line(ckpt, _job(layout, precision=now))
            assert line.startswith("resume: ckpt (step 6, ") and "the model only" in line, line
            assert f"trainer.precision={was}" in line and "starts fresh" in line, line
            assert optimizer_refusal(ckpt, _job(layout, precision=now, optimizer="sgd")) is None
    assert "the model only" not in checkpoints.resume_line(  # (the same precision: model and optimizer)
        SimpleNamespace(meta=_meta_of(_job(zero2)), path="ckpt", step=6), _job(zero2))
    ddp = ("strategy=ddp", "cluster.devices=2")
    assert loads_optimizer(_meta_of(_job(ddp)), _job(ddp, precision="bf16-mixed"))


def _model(*overrides: str):
    from recipes.config import compose, describe

    return describe(compose([*TINY, *overrides]).model)


def _model_config(*overrides: str) -> dict:
    """The model section of meta.json's config as a run of TINY + ``overrides`` writes it."""
    from omegaconf import OmegaConf

    from recipes.config import compose

    return OmegaConf.to_container(compose([*TINY, *overrides]).model, resolve=True)


@pytest.mark.unit
def test_a_resume_refuses_another_model_of_the_same_shapes():
    """Attention heads regrouped at the same shapes, another rotary base or norm epsilon, tied
    embeddings (one of the two trained matrices silently dropped), another MoE top_k: each passed
    the shape check and resumed another model from the checkpoint's weights, without a word. Any
    model key that is what the weights compute is refused before launch, by name, with the
    checkpoint's value and the fix; the settings a resume takes (dropout, LoRA's alpha and
    dropout, a MoE model's capacity and balancing weight) are named instead, and a key an older
    checkpoint lacks is not compared."""
    import checkpoints
    from checkpoints.resume_settings import model_changes, model_refusal

    saved = _model_config()
    assert model_refusal(saved, _model()) is None
    assert model_refusal(saved, _model("model.dropout=0.1")) is None
    heads = _model("model.n_heads=8", "model.n_kv_heads=4")
    assert checkpoints.shapes(heads) == checkpoints.shapes(_model())  # (the shape check passes it)
    assert model_refusal(saved, heads) == (
        "model.n_heads=8 (the checkpoint's run: 4), model.n_kv_heads=4 (the checkpoint's run: 2): "
        "the checkpoint's weights are another model's -- these keys decide the parameters' shapes or "
        "what the weights compute; resume with model.n_heads=4 model.n_kv_heads=2, or start "
        "a new run with trainer.resume_from=null")
    for key, new, old in (("rope_theta", "500.0", "10000.0"), ("norm_eps", "0.5", "1e-05"),
                          ("tie_embeddings", "true", "false")):
        why = model_refusal(saved, _model(f"model.{key}={new}"))
        assert why.startswith(f"model.{key}={new} (the checkpoint's run: {old}): ") and \
            f"resume with model.{key}={old}, or" in why, why
    assert model_refusal({k: v for k, v in saved.items() if k != "rope_theta"}, _model("model.rope_theta=500")) is None
    moe = _model_config("model=gpt_moe_nano")
    assert "model.top_k=1 (the checkpoint's run: 2)" in model_refusal(moe, _model("model=gpt_moe_nano", "model.top_k=1"))
    routing = _model("model=gpt_moe_nano", "model.capacity_factor=1.5", "model.aux_loss_coef=0.1")
    assert model_refusal(moe, routing) is None
    assert model_changes(moe, routing) == ["model.capacity_factor 2 -> 1.5", "model.aux_loss_coef 0.01 -> 0.1"]
    assert model_changes(saved, _model("model.aux_loss_coef=0.1")) == []  # (a dense model has none)


HF = ("model=hf", "model.pretrained=false", "data.tokenizer=null")
"""model=hf built from a config.json alone (``_llama``): no weights to read."""


def _llama(d: Path, **config) -> Path:
    """A directory holding a tiny Llama's config.json (``config``: other values)."""
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, **config}))
    return d


def _written(run_dir: Path, *overrides: str, step: int = 3) -> Path:
    """The checkpoint of ``step`` as a run of TINY + ``overrides`` writes it, but for the model and
    optimizer files: its meta.json (checkpoints ``_meta``) under a manifest -- what every check
    before the file check reads."""
    import checkpoints
    from checkpoints import store

    temp = store.temp_for(run_dir, step)
    (temp / "rng").mkdir(parents=True)
    (temp / "rng" / "rank0.pt").write_bytes(b"")  # (read() asks every rank's file be there)
    was = _validated(*overrides)
    meta = checkpoints._meta(checkpoints.Handles(None, None, None, rank=0, world_size=1), was, step)
    meta["config"] |= _config(*overrides)  # (resolved, as in a Hydra run: model=hf's ${hf:...} keys)
    store.commit(temp, store.path_for(run_dir, step), meta)
    return store.path_for(run_dir, step)


@pytest.mark.unit
def test_a_resume_refuses_a_transformers_model_whose_config_json_differs(tmp_path):
    """model=hf reads its keys from model.path's config.json (an override of them is refused):
    a path whose config.json gives another rotary base is refused naming the key and pointing
    at the model the checkpoint's run read; the same config.json elsewhere (the model moved) is
    the same model. LoRA's rank and target modules are the adapters' (their order is not); the
    built-in GPT's unused LoRA keys are not compared."""
    from checkpoints.resume_settings import model_refusal

    a, moved, other = _llama(tmp_path / "a"), _llama(tmp_path / "moved"), _llama(tmp_path / "other", rope_theta=500000.0)
    hf = HF
    lora = ("model.lora.rank=4", "model.lora.target_modules=[q_proj,v_proj]")
    saved = _model_config(*hf, f"model.path={a}", *lora)
    assert model_refusal(saved, _model(*hf, f"model.path={moved}", *lora)) is None
    assert model_refusal(saved, _model(*hf, f"model.path={a}", "model.lora.rank=4",
                                       "model.lora.target_modules=[v_proj,q_proj]", "model.lora.alpha=8")) is None
    why = model_refusal(saved, _model(*hf, f"model.path={other}", *lora))
    assert why.startswith("model.rope_theta=500000.0 (the checkpoint's run: 10000.0): ") and \
        f"point model.path at a model whose config.json gives the checkpoint's values (its run's: model.path={a})" \
        in why and "resume with model.rope_theta" not in why, why
    why = model_refusal(saved, _model(*hf, f"model.path={a}", "model.lora.rank=8",
                                      "model.lora.target_modules=[q_proj,v_proj]"))
    assert why.startswith("model.lora.rank=8 (the checkpoint's run: 4)") and "resume with model.lora.rank=4," in why
    assert model_refusal({**_model_config(), "lora": {"target_modules": ["o_proj"]}}, _model()) is None


@pytest.mark.unit
def test_a_resume_refused_for_a_model_key_names_the_key_not_a_parameters_shape(tmp_path):
    """README: a changed model.lora.rank or lora.target_modules is refused before launch in one
    line naming the key, both values and the fix. Through ``checked`` (train.py's preflight,
    --dry-run's, a sweep's) the shape check ran first and its line won, naming no key: "parameter
    '...k_proj.lora_A.default.weight' has shape [4, 64] in the checkpoint but [8, 64] ...", "...
    is missing from the checkpoint (a different model.* shape?)". The key's line comes first now,
    a built-in model's reshaping key (model.dim) too."""
    import checkpoints
    from strategies import ConfigError

    path = _llama(tmp_path / "llama")
    lora = (*HF, f"model.path={path}", "model.lora.rank=4", "model.lora.target_modules=[q_proj,v_proj]")
    ckpt = _written(tmp_path / "lora", *lora)
    for change, says in ((("model.lora.rank=8",), "model.lora.rank=8 (the checkpoint's run: 4)"),
                         (("model.lora.target_modules=[q_proj,k_proj,v_proj]",),
                          "model.lora.target_modules=[q_proj,k_proj,v_proj] (the checkpoint's run: [q_proj,v_proj])")):
        job = _validated(*lora, *change, f"trainer.resume_from={ckpt}", "trainer.max_steps=8")
        with pytest.raises(ConfigError) as e:
            checkpoints.checked(job)
        assert f"- trainer.resume_from={ckpt}: {says}: the checkpoint's weights are another model's" in \
            str(e.value), str(e.value)
        assert "resume with model.lora." in str(e.value) and "parameter '" not in str(e.value), str(e.value)
    nano = _written(tmp_path / "nano")
    with pytest.raises(ConfigError, match=r"model\.dim=128 \(the checkpoint's run: 32\): .*resume with model\.dim=32"):
        checkpoints.checked(_validated("model.dim=128", f"trainer.resume_from={nano}"))


@pytest.mark.unit
def test_the_dry_run_of_a_resume_notes_what_the_launch_warns(tmp_path):
    """--dry-run of a resume printed the resume: line alone, not the warnings the launch logs (a
    longer cosine schedule, a model setting, the data stream, the global batch): read as a
    preview of the launch, it said nothing differed. It prints each as a note:, in the launch's
    words (checkpoints/resume_settings.py ``notes``: for_launch logs the same)."""
    from launchers.dry_run import _resume

    was = ("trainer.scheduler=cosine", "trainer.max_steps=6", "trainer.global_batch_size=8")
    ckpt = _written(tmp_path / "run", *was)
    job = _validated(*was, "trainer.max_steps=10", "model.dropout=0.1", "trainer.seed=7",
                     "trainer.global_batch_size=16", f"trainer.resume_from={ckpt}")
    lines = _resume(job, job.cfg, False).splitlines()
    assert lines[0].startswith(f"resume: {ckpt} (step 3, single on 1 rank(s))"), lines
    assert [line.split(":")[0] for line in lines[1:]] == ["note"] * 4, lines
    said = "\n".join(lines)
    for part in ("note: resume: trainer.global_batch_size=16, the checkpoint's run 8: the data continues at sample 48",
                 "note: resume: trainer.seed 1234 -> 7: these decide the data stream",
                 "note: resume: this run's model settings differ from the checkpoint's run's and apply from step 4 "
                 "on: model.dropout 0 -> 0.1",
                 "note: resume: this run's schedule differs from the checkpoint's run's and applies from step 4 on "
                 "(the lr follows this run's schedule): trainer.max_steps 6 -> 10 (the cosine decay ends there"):
        assert part in said, said
    done = _validated(*was, "trainer.max_steps=3", f"trainer.resume_from={ckpt}")
    assert _resume(done, done.cfg, False).splitlines()[1] == (  # (then the schedule's max_steps 6 -> 3)
        f"note: resume: {ckpt} is at step 3 = trainer.max_steps: nothing is left to train; the run loads it "
        "and reports it (raise trainer.max_steps to continue)")


@pytest.mark.subprocess
def test_plan_py_checks_a_resume_as_train_py_does_without_torch(tmp_path):
    """plan.py with trainer.resume_from=<path> never ran the resume check: rc 0 and a 'run it:'
    command train.py refuses (model.rope_theta=500 against a checkpoint of 10000). It runs the
    check's meta.json part now (checkpoints ``checked(files=False)``: every refusal, not past
    trainer.max_steps), without torch: a refusal is its line, exit 2; a path not on this machine
    (a cluster's) is said not checked."""
    from tests.conftest import engines_loaded

    import plan
    from core.knobs import paths_elsewhere
    from recipes.config import compose
    from recipes.job import CONFIG, validate

    ckpt = _written(tmp_path / "run")
    proc, engines = engines_loaded("plan.py", *TINY, f"trainer.resume_from={ckpt}", "model.rope_theta=500")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"trainer.resume_from={ckpt}: model.rope_theta=500.0 (the checkpoint's run: 10000.0): " in proc.stderr
    assert "run it:" not in proc.stdout and "Traceback" not in proc.stderr, proc.stdout[-2000:]
    assert not {"torch", "lightning", "deepspeed", "transformers"} & set(engines), engines
    ok = validate(compose([*TINY, f"trainer.resume_from={ckpt}", "trainer.max_steps=10"]), depth=CONFIG)
    assert plan.resume_checked(ok) is None  # (its files are not read: _written wrote none)
    with paths_elsewhere(lambda path: True):  # (as plan.py validates: the cluster's files)
        gone = validate(compose([*TINY, f"trainer.resume_from={tmp_path / 'elsewhere'}"]), depth=CONFIG)
    assert plan.resume_checked(gone) == (f"note: trainer.resume_from={tmp_path / 'elsewhere'} is not on this "
                                         "machine: plan.py did not check it (train.py does, before launch)")


@pytest.mark.unit
def test_a_resume_names_each_schedule_key_that_differs():
    """A longer cosine schedule (max_steps raised), another warm-up, decay or scheduler apply from
    the checkpoint's step on (the lr follows this run's schedule) and README says the log names
    each: it named only the next step's lr (and nothing at all while the checkpoint was in warm-up).
    One resume: warning names each key by its value in both runs; max_steps only where it ends a
    decay (decay_steps null), min_lr_ratio and the decay's end only where both runs decay."""
    import dataclasses
    from types import SimpleNamespace

    from checkpoints.resume_settings import schedule_changes, schedule_note
    from recipes.trainer_config import TrainerConfig

    def changes(was: dict, **now) -> list[str]:
        return schedule_changes(dataclasses.asdict(TrainerConfig(**was)), TrainerConfig(**(was | now)))

    cosine = {"scheduler": "cosine", "max_steps": 12, "warmup_steps": 5}
    assert changes(cosine) == [] and changes(cosine, lr=0.1, seed=7) == []
    assert changes(cosine, max_steps=20) == ["trainer.max_steps 12 -> 20 (the cosine decay ends there: "
                                             "trainer.decay_steps is null)"]
    assert changes(cosine, warmup_steps=10) == ["trainer.warmup_steps 5 -> 10"]
    assert changes(cosine, scheduler="linear", min_lr_ratio=0.1) == ["trainer.scheduler cosine -> linear",
                                                                      "trainer.min_lr_ratio 0.0 -> 0.1"]
    assert changes(cosine, decay_steps=20) == ["trainer.decay_steps null -> 20"]
    assert changes(cosine | {"decay_steps": 12}, max_steps=20) == []  # (the decay ends where it did)
    assert changes({"max_steps": 12}, max_steps=20, min_lr_ratio=0.5) == []  # (constant: neither applies)
    assert changes({"max_steps": 12}, scheduler="cosine") == ["trainer.scheduler constant -> cosine"]
    ckpt = SimpleNamespace(meta={"config": {"trainer": dataclasses.asdict(TrainerConfig(**cosine))}}, step=3)
    said = schedule_note(ckpt, SimpleNamespace(trainer=TrainerConfig(**(cosine | {"max_steps": 20}))))
    assert said == ("resume: this run's schedule differs from the checkpoint's run's and applies from step 4 "
                    "on (the lr follows this run's schedule): trainer.max_steps 12 -> 20 (the cosine decay "
                    "ends there: trainer.decay_steps is null)"), said


@pytest.mark.multiprocess  # (reads a checkpoint the cache trains)
def test_a_resume_from_a_real_checkpoint_says_a_new_data_stream(good, caplog):
    """With the meta.json a run wrote: the same settings say nothing; a new seed and seq_len are
    one warning (another optimizer: test_another_optimizer_is_refused_before_launch)."""
    import logging

    import checkpoints
    from recipes.config import compose
    from recipes.job import validate

    def launch(*overrides: str) -> list[str]:
        caplog.clear()
        job = validate(compose([*TINY, *EQUIV, *PRESETS["fsdp"], f"trainer.resume_from={good}", *overrides]))
        checkpoints.for_launch(job, good.parent.parent, cleanup=False)
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    caplog.set_level(logging.INFO)
    assert launch() == []
    said = launch("trainer.seed=7", "model.seq_len=64")
    assert len(said) == 1 and said[0].startswith("resume: trainer.seed 1234 -> 7; model.seq_len 32 -> 64: these "
                                                 "decide the data stream, so the data does not continue"), said


@pytest.mark.unit
def test_written_files_are_as_readable_as_the_umask_allows(tmp_path):
    """Temp file + rename must not leave the temp file's private 0600: a teammate reads the
    report or a converted model copied to a shared directory."""
    from observers.files import atomic_write_text

    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "report.json", "{}")
        os.umask(0o077)
        atomic_write_text(tmp_path / "private.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "report.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "private.json").stat().st_mode & 0o777 == 0o600

@pytest.mark.multiprocess  # (reads a checkpoint the cache trains)
@pytest.mark.parametrize(("rel", "how", "says"), [
    ("dcp/__0_0.distcp", "truncate", "is truncated or altered"),
    ("dcp/.metadata", "garbage", "is not DCP metadata"),
    ("rng/rank0.pt", "garbage", "is not a readable checkpoint file"),
    ("meta.json", "garbage", "is corrupt"),
    ("COMPLETE", "delete", "has no COMPLETE marker"),
])
def test_a_damaged_checkpoint_names_the_file(good, tmp_path, model, rel, how, says):
    import checkpoints

    path = _damaged(good, tmp_path, rel, how)
    with pytest.raises(checkpoints.CheckpointError) as e:
        checkpoints.resolve(str(path), path.parent.parent, model)
    assert says in str(e.value) and str(path / rel if how != "delete" else path) in str(e.value)


@pytest.mark.unit
def test_a_run_directory_named_as_a_checkpoint_names_its_checkpoints(tmp_path):
    """convert.py <run> (not <run>/checkpoints/step<N>) said "has no COMPLETE marker: the save
    did not finish"; it names the run's newest checkpoint instead."""
    from checkpoints.store import CheckpointError, read

    for step in (2, 10):
        (tmp_path / "checkpoints" / f"step{step}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"step{step}" / "COMPLETE").write_text("{}")
    with pytest.raises(CheckpointError, match=rf"{tmp_path} is a run directory, not one of its checkpoints: "
                                              rf"name one, {tmp_path}/checkpoints/step10 \(the newest\)"):
        read(tmp_path)


@pytest.mark.unit
def test_a_lightning_users_own_checkpoint_gets_the_tool_that_reads_it(tmp_path):
    """convert.py on what a user's Trainer wrote under fsdp/fsdp2 (DCP shards and meta.pt) or ZeRO
    (DeepSpeed's latest + checkpoint/) said "the save did not finish"; it names the tool that
    gives its full weights."""
    from checkpoints.store import CheckpointError, read

    dcp, zero = tmp_path / "step=3.ckpt", tmp_path / "last.ckpt"
    dcp.mkdir()
    (dcp / "__0_0.distcp").write_bytes(b"")
    (dcp / "meta.pt").write_bytes(b"")
    (zero / "checkpoint").mkdir(parents=True)
    (zero / "latest").write_text("global_step3")
    for path, tool in ((dcp, "dcp_to_torch_save(path, 'model.pt')"),
                       (zero, "convert_zero_checkpoint_to_fp32_state_dict(path, 'model.pt')")):
        with pytest.raises(CheckpointError) as e:
            read(path)
        assert f"{path} is a checkpoint a Lightning Trainer wrote" in str(e.value) and tool in str(e.value)
        assert "did not finish" not in str(e.value)


@pytest.mark.multiprocess
def test_dcp_metadata_is_read_safely(good, tmp_path, model):
    """DCP unpickles its metadata; a pickle that would run code is refused before DCP sees it."""
    import pickle

    import checkpoints

    path = _damaged(good, tmp_path, "dcp/.metadata", "keep")

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    meta = path / "dcp" / ".metadata"
    meta.write_bytes(pickle.dumps(Evil()))
    marker = json.loads((path / "COMPLETE").read_text())  # forged manifest: sizes match
    marker["files"]["dcp/.metadata"] = meta.stat().st_size
    (path / "COMPLETE").write_text(json.dumps(marker))
    with pytest.raises(checkpoints.CheckpointError, match="is not allowed in DCP metadata"):
        checkpoints.resolve(str(path), path.parent.parent, model)


@pytest.mark.multiprocess
def test_a_different_model_shape_names_the_key(good, model):
    import dataclasses

    import checkpoints

    wider = dataclasses.replace(model, dim=model.dim * 2)
    with pytest.raises(checkpoints.CheckpointError,
                       match=r"parameter '[\w.]+' has shape \[\d+, \d+\] in the checkpoint but"):
        checkpoints.resolve(str(good), good.parent.parent, wider)


@pytest.mark.multiprocess
def test_a_bad_checkpoint_is_refused_before_launch(good, train, tmp_path):
    path = _damaged(good, tmp_path, "dcp/__0_0.distcp", "truncate")
    run = train(*EQUIV, *PRESETS["ddp"], f"trainer.resume_from={path}", QUIET, name="refused", check=False)
    assert run.proc.returncode == 2, run.log[-3000:]
    assert f"{path / 'dcp' / '__0_0.distcp'} is truncated" in run.log
    assert "trainer.resume_from=" in run.log and "null to start fresh" in run.log
    assert "Initializing distributed" not in run.log and "Traceback" not in run.log


@pytest.mark.multiprocess
def test_another_optimizer_is_refused_before_launch(good, train):
    """The audit's crash: an AdamW checkpoint resumed with trainer.optimizer=sgd raised torch DCP's
    missing key on every rank after launch; now one line, exit 2, no process started."""
    run = train(*EQUIV, *PRESETS["ddp"], "trainer.optimizer=sgd", f"trainer.resume_from={good}", QUIET,
                name="sgd", check=False, timeout=120)
    assert run.proc.returncode == 2, run.log[-3000:]
    assert "trainer.optimizer=sgd, the checkpoint's run adamw" in run.log
    assert "Initializing distributed" not in run.log and "Traceback" not in run.log


# --------------------------------------------------------------------------- the store alone
@pytest.mark.unit
def test_commit_discovery_pruning_and_cleanup(tmp_path):
    from checkpoints import store

    def save(step: int, finish: bool = True) -> None:
        temp = store.temp_for(tmp_path, step)
        (temp / "dcp").mkdir(parents=True)
        (temp / "dcp" / "x").write_text("x" * step)
        if finish:
            store.commit(temp, store.path_for(tmp_path, step), {"step": step})

    assert store.latest(tmp_path) is None
    for step in (2, 4, 10):
        save(step)
    save(12, finish=False)  # killed mid-save
    assert store.latest(tmp_path).name == "step10"  # numeric order, not text
    assert store.read(store.latest(tmp_path)).step == 10
    assert [p.name for p in store.prune(tmp_path, 2)] == ["step2"]
    assert [p.name for p in store.complete(tmp_path)] == ["step4", "step10"]
    assert [p.name for p in store.clean(tmp_path)] == [".tmp-step12"]
    assert sorted(p.name for p in store.directory(tmp_path).iterdir()) == ["step10", "step4"]


@pytest.mark.unit
def test_pruning_never_removes_the_checkpoint_saved_or_resumed(tmp_path):
    """As a run starts (timeline.at_start) it prunes to trainer.keep_last -- a lower one frees a
    full disk before the next save -- but never the checkpoint it resumes, even where that is not
    the newest (per-host directories resume the newest whole one); after a save, never the one
    just saved, which the log then names."""
    from types import SimpleNamespace

    from checkpoints import store, timeline

    for step in (2, 4, 6):
        temp = store.temp_for(tmp_path, step)
        temp.mkdir(parents=True)
        store.commit(temp, store.path_for(tmp_path, step), {"step": step})
    job = SimpleNamespace(trainer=SimpleNamespace(resume_from="auto", keep_last=1, keep_best=False))
    timeline.at_start(job, store.read(store.path_for(tmp_path, 4)), tmp_path)
    assert [p.name for p in store.complete(tmp_path)] == ["step4", "step6"]
    assert timeline.pruned(job, tmp_path, 4, None) == []  # (step 4 "just saved": kept)
    assert [p.name for p in timeline.pruned(job, tmp_path, 6, None)] == ["step4"]


@pytest.mark.multiprocess  # (reads a checkpoint the cache trains)
def test_zero2_ep_refuses_a_foreign_checkpoint_before_launch_and_zero2_takes_its_model(good):
    """zero2_ep splits the experts over ranks and resumes only from its own checkpoints; the other
    ZeRO presets take any checkpoint's model (test_fsdp2_on_2_resumes_as_zero3_on_2_...)."""
    import checkpoints
    from recipes.config import compose
    from recipes.job import validate

    ckpt = checkpoints.resolve(str(good), good.parent.parent)
    job = validate(compose([*TINY, *EQUIV, "model=gpt_moe_nano", "strategy=zero2_ep", "cluster.devices=2",
                            "trainer.micro_batch_size=4"]))
    why = checkpoints.refusal(ckpt, job)
    assert why and "written by fsdp on 2 rank(s)" in why and "strategy=fsdp cluster.devices=2" in why
    for preset in ("zero2", "ddp"):
        assert checkpoints.refusal(ckpt, validate(compose([*TINY, *EQUIV, *PRESETS[preset]]))) is None


@pytest.mark.subprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("moment", ["at 0.5 s", "mid-start-up"])
def test_a_requeue_signal_during_start_up_is_held_until_the_first_step(tmp_path, moment):
    """SIGUSR1 (Slurm's requeue warning) before the run has taken its signals -- half a second
    in, among the imports, or while the engine builds -- no longer kills the process (its default
    action): train.py takes it first thing, and the run stops after its first step with a
    checkpoint and the resume command, as a signal during training does."""
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "train.py"), *TINY, "strategy=single", "trainer.max_steps=50",
           "callbacks=none", f"hydra.run.dir={out}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seen = []
    try:
        if moment == "at 0.5 s":
            time.sleep(0.5)
        else:  # the engine is being built: Lightning's strategy line
            for line in proc.stdout:
                seen.append(line)
                if "strategy: single" in line:
                    break
        os.kill(proc.pid, signal.SIGUSR1)
        log = "".join(seen) + proc.communicate(timeout=240)[0]
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGUSR1, log[-3000:]
    assert "stopped by SIGUSR1 after step 1" in log, log[-3000:]
    assert (out / "checkpoints" / "step1").is_dir() and "to resume:" in log


@pytest.mark.unit
def test_per_rank_state_is_matched_by_the_keys_that_make_it_not_by_the_presets_name(tmp_path):
    """Userconf audit F3: two user presets over ddp (`defaults: [ddp, _self_]`, one `comm_hook:
    topk`, the other `int8`) both carry the name `ddp`, so an int8 run resumed a top-k checkpoint
    and started from its error-feedback residuals, where ddp_topk -> ddp_int8 is refused. What
    makes the state (the comm hook and its keys, the sync settings) decides, not the name."""
    from checkpoints import refusal
    from checkpoints.store import RANK_STATE, Checkpoint
    from recipes.compose import compose_chosen
    from recipes.job import validate

    mine = tmp_path / "mine" / "strategy"
    mine.mkdir(parents=True)
    for hook in ("topk", "int8"):
        (mine / f"my_{hook}.yaml").write_text(f"defaults: [ddp, _self_]\ncomm_hook: {hook}\nstart_step: 1\n")

    def job(*overrides: str):
        cfg, _, origin = compose_chosen([*TINY, "--config-dir", str(tmp_path / "mine"), "cluster.devices=2", *overrides])
        return validate(cfg, origin=origin)

    topk, int8 = job("strategy=my_topk"), job("strategy=my_int8")
    assert topk.strategy.name == int8.strategy.name == "ddp"
    ckpt = tmp_path / "step2"
    (ckpt / RANK_STATE).mkdir(parents=True)
    for r in range(2):
        (ckpt / RANK_STATE / f"rank{r}.pt").write_bytes(b"")
    written = Checkpoint(ckpt, _meta_of(topk))
    assert refusal(written, topk) is None
    assert refusal(written, job("strategy=ddp_topk", "strategy.start_step=1")) is None  # (the same state)
    why = refusal(written, int8)
    assert why is not None and why.startswith("strategy=my_int8 keeps state of its own on each rank (int8's "
                                              "error-feedback residuals)"), why
    assert refusal(written, job("strategy=my_topk", "strategy.topk_ratio=0.1")) is None  # (residuals by parameter)
    sgd = job("strategy=ddp_powersgd")
    factors = Checkpoint(ckpt, _meta_of(sgd))
    assert refusal(factors, job("strategy=ddp_powersgd", "strategy.powersgd_warmup_steps=5")) is None
    assert refusal(factors, job("strategy=ddp_powersgd", "strategy.powersgd_rank=2")) is not None  # (P, Q shapes)
