"""What the bad-input audit found the run refusing only after launch, or not at all, and what
``--dry-run`` and a sweep's preflight called fine: data this user cannot read (a rank's traceback;
now one line naming the key, the file and the fix), an empty token shard (numpy's "cannot mmap an
empty file" in the rank), text data of no sample and a ``trainer.resume_from`` that is no
checkpoint (refused by the run, passed by the dry run), an empty jsonl (told to fix data.field), a
checkpoint at ``trainer.max_steps`` (Lightning wrote no report) or past it (nothing said), the run
directory a refused job left behind, and ZeRO-3's compile refusal advising the preset in use.
"""

from __future__ import annotations

import contextlib
import mmap  # noqa: F401  (numpy.memmap imports it at first use: here, before the uid is nobody's)
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from launchers import sweep
from recipes.config import DataConfig, compose
from recipes.job import RUN, validate
from recipes.token_checks import data_problems, shard_id_problem
from strategies import ConfigError
from tests.conftest import TINY, run_cli

NOBODY = 65534
POINT = ("model=gpt_nano", "cluster.accelerator=cpu", "trainer.max_steps=2")


@pytest.fixture
def public():
    """A directory every user may enter (pytest's own tmp_path is its owner's alone)."""
    path = Path(tempfile.mkdtemp(prefix="refused-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


@contextlib.contextmanager
def cannot_read(*paths: Path):
    """``paths`` unreadable to this process, for real: mode 000, and as root (whom modes do not
    stop) the effective uid of nobody while the block runs; the real uid stays root's, to return."""
    for p in paths:
        p.chmod(0)
    root = os.geteuid() == 0
    if root:
        os.seteuid(NOBODY)
    try:
        yield
    finally:
        if root:
            os.seteuid(0)


def _shard(path: Path, n: int) -> Path:
    (np.arange(n) % 256).astype(np.uint16).tofile(path)  # (ids within gpt_nano's vocabulary)
    return path


# ------------------------------------------------------------------ data
@pytest.mark.unit
def test_unreadable_data_is_one_line_naming_the_key_the_file_and_the_fix(public):
    """data=text read the file in the rank (a PermissionError traceback after launch, the dry run
    said "would start"); data=tokens crashed in the check itself; data=jsonl blamed the format."""
    text = public / "np.txt"
    text.write_text("hello " * 100)
    shards = public / "tk"
    shards.mkdir()
    _shard(shards / "a.bin", 3000)
    _shard(shards / "b.bin", 3000)
    records = public / "np.jsonl"
    records.write_text('{"text": "hello"}\n')
    model = validate(compose(list(POINT)), depth=RUN).model
    with cannot_read(text, shards / "b.bin", records):
        said = {"text": data_problems(DataConfig(name="text", path=str(text)), model),
                "tokens": data_problems(DataConfig(name="tokens", path=str(shards)), model),
                "jsonl": data_problems(DataConfig(name="jsonl", path=str(records)), model),
                # (a rank's own check, after launch: its one line, not a traceback)
                "rank": shard_id_problem("data.path", shards, [shards / "b.bin"], "uint16", 512,
                                         public / "cache")}
    fix = "give this user read permission (chmod a+r"
    assert said["text"] == [f"data.path={text}: cannot read it (Permission denied): {fix} {text}) "
                            "or point data.path at readable data"], said["text"]
    assert said["tokens"] == [f"data.path={shards}: cannot read 1 of its 2 files, the first {shards / 'b.bin'} "
                              f"(Permission denied): {fix} {shards / 'b.bin'}) or point data.path at "
                              "readable data"], said["tokens"]
    assert said["jsonl"][0].startswith(f"data.path={records}: cannot read it (Permission denied): {fix}")
    assert not any("not readable as jsonl" in p for p in said["jsonl"]), said["jsonl"]
    assert said["rank"].startswith(f"data.path={shards}: cannot read"), said["rank"]


@pytest.mark.unit
def test_an_empty_token_shard_and_empty_text_are_refused_by_the_dry_run_and_the_preflight(public):
    """Both passed ``--dry-run``; the run crashed on the empty shard (numpy: cannot mmap an empty
    file) and refused the text only in its ranks. The dry run and a sweep's preflight share
    ``sweep.check_point``, which validates as the run does."""
    shards = public / "tke"
    shards.mkdir()
    (shards / "a.bin").touch()
    _shard(shards / "b.bin", 3000)
    empty = public / "e.txt"
    empty.touch()
    short = public / "tks"
    short.mkdir()
    _shard(short / "a.bin", 20)  # (gpt_nano's window is 33 tokens)
    checked = sweep.preflight([[*POINT, "data=tokens", f"data.path={shards}"],
                               [*POINT, f"data.path={empty}"],
                               [*POINT, "data=tokens", f"data.path={short}"]], local=True)
    said = [p.problems for p in checked.points]
    assert said[0] == [f"data.path={shards}: shard {shards / 'a.bin'} is empty (0 bytes), which cannot be "
                       "read as tokens: remove it, or point data.path at the shards that hold tokens"], said[0]
    tail = "hold no sample of model.seq_len + 1 = 33 tokens (per shard): use more data or a shorter model.seq_len"
    assert said[1] == [f"data.path={empty}: 0 tokens {tail}"], said[1]
    assert said[2] == [f"data.path={short}: 20 tokens {tail}"], said[2]


@pytest.mark.unit
def test_an_empty_jsonl_says_it_holds_no_records(tmp_path):
    """It said data.field='text' is not a key of its records (it has: none): no data.field fixes that."""
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n\n")
    said = data_problems(DataConfig(name="jsonl", path=str(empty), tokenizer="/nonexistent"), None)
    assert f"data.path={empty}: holds no records (its file is empty or blank lines only): point data.path " \
           "at jsonl data with records" in said, said
    assert not any("data.field" in p for p in said), said
    # a first file without records and a second with them: the second's keys are the records'
    (tmp_path / "f.jsonl").write_text('{"body": "x"}\n')
    said = data_problems(DataConfig(name="jsonl", path=str(tmp_path), tokenizer="/nonexistent"), None)
    assert any("data.field='text' is not a key" in p and "it has: body" in p for p in said), said


# ------------------------------------------------------------------ resume
@pytest.mark.unit
def test_a_resume_from_that_is_no_checkpoint_is_refused_by_the_dry_run_and_the_preflight(tmp_path):
    """The run refused these (checkpoints.for_launch) after Hydra made its directory; --dry-run and
    the preflight said "would start". Both call the run's own check, ``checkpoints.checked``."""
    (tmp_path / "ed").mkdir()
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    checked = sweep.preflight([[*POINT, f"trainer.resume_from={tmp_path / 'ed'}"],
                               [*POINT, f"trainer.resume_from={tmp_path / 'run'}"]], local=True)
    said = [" ".join(p.problems) for p in checked.points]
    assert said[0].startswith(f"trainer.resume_from={tmp_path / 'ed'}: ") and "COMPLETE" in said[0], said[0]
    assert f"{tmp_path / 'run'} holds no complete checkpoint (a run directory" in said[1], said[1]


@pytest.mark.subprocess
@pytest.mark.timeout(300)
def test_a_checkpoint_at_max_steps_reports_and_one_past_it_is_refused_before_launch(tmp_path):
    """Resumed at trainer.max_steps, Lightning skipped its loop and wrote no report.json, no
    summary, nothing about why (Accelerate reported); past it, the same in silence. At it, the run
    says so and reports what it loaded on both backends; past it is a mistake, refused before
    launch (by ``checkpoints.checked``, the dry run's check too), and the refused run leaves no run
    directory behind."""
    quiet = (*TINY, "callbacks=none")
    straight = run_cli("train.py", *quiet, "trainer.max_steps=3", out=tmp_path / "straight")
    step3 = straight.out / "checkpoints" / "step3"
    at = run_cli("train.py", *quiet, "trainer.max_steps=3", f"trainer.resume_from={step3}", out=tmp_path / "at")
    assert f"resume: {step3} is at step 3 = trainer.max_steps: nothing is left to train" in at.log, at.log[-3000:]
    assert "done: 3 steps" in at.log and at.report["losses"] == straight.losses, at.log[-3000:]
    past = [*quiet, "trainer.max_steps=2", f"trainer.resume_from={step3}"]
    refused = run_cli("train.py", *past, out=tmp_path / "new" / "past", check=False)
    assert refused.proc.returncode == 2 and "Traceback" not in refused.log, refused.log[-3000:]
    assert (f"trainer.resume_from={step3} is at step 3, past trainer.max_steps=2: set trainer.max_steps "
            "above 3 to continue it (=3 only loads it), or resume an earlier checkpoint") in refused.log
    assert not (tmp_path / "new").exists()  # (made for the refused job: gone with it)
    # a directory that existed keeps everything, Hydra's files too
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes").write_text("mine")
    run_cli("train.py", *TINY, "trainer.lr=0", out=tmp_path / "mine", check=False)
    assert (tmp_path / "mine" / "notes").read_text() == "mine" and (tmp_path / "mine" / ".hydra").is_dir()


# ------------------------------------------------------------------ advice
@pytest.mark.unit
def test_zero3_compile_refusal_names_a_fix_other_than_the_preset_in_use():
    """strategy=zero2 strategy.stage=3 trainer.compile=true was told to use strategy=zero2."""
    base = ["cluster.devices=2", "cluster.accelerator=cpu", "trainer.compile=true"]
    with pytest.raises(ConfigError) as e:
        validate(compose([*base, "strategy=zero2", "strategy.stage=3"]), depth=RUN)
    assert ("engine.compile); set strategy.stage=2, or use strategy=fsdp2, or set trainer.compile=false"
            in str(e.value)), str(e.value)
    with pytest.raises(ConfigError) as e:
        validate(compose([*base, "strategy=zero3"]), depth=RUN)
    assert "use strategy=zero2 or strategy=fsdp2, or set trainer.compile=false" in str(e.value), str(e.value)
