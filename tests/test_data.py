"""Data: tokenized jsonl/parquet/text through `datasets` with a cached token memmap, exact
packing, pre-tokenized shards, the held-out split, and validation equal on every world size."""

from __future__ import annotations

import csv
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from recipes.config import DataConfig, compose
from recipes.data import CORPUS, IGNORE, TokenWindows, ValidationBatches, build_datasets, data_facts
from recipes.job import CONFIG, validate
from strategies import ConfigError
from tests.conftest import ROOT, TINY, run_cli

SHAPE = SimpleNamespace(seq_len=16, vocab_size=512)


def _docs(n: int = 40) -> list[str]:
    """``n`` documents of varied lengths (50-450 characters) cut from the bundled corpus."""
    text = CORPUS.read_text()
    return [text[i * 500 : i * 500 + 50 + (i * 137) % 400] for i in range(n)]


def _jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def _expected(tokenizer_dir: Path, docs: list[str]) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return [t for d in docs for t in (*tok(d, add_special_tokens=False)["input_ids"], tok.eos_token_id)]


def _data(**kw) -> DataConfig:
    return DataConfig(**kw)


@pytest.mark.unit
def test_packing_is_exact(hf_tokenizer, tmp_path):
    """Every token of every document once, in order, one EOS after each; the windows read the
    stream once (stride seq_len, seq_len + 1 tokens each)."""
    from recipes.tokens import token_file

    docs = _docs()
    src = _jsonl(tmp_path / "d.jsonl", docs)
    stream = token_file(kind="jsonl", path=src, field="text", tokenizer=hf_tokenizer,
                        cache_dir=tmp_path / "cache")
    arr = stream.array()
    assert arr.dtype == np.uint16 and stream.vocab_size == 512 and stream.n_docs == len(docs)
    expected = _expected(hf_tokenizer, docs)
    assert arr.tolist() == expected
    assert int((arr == stream.eos_id).sum()) == len(docs) and arr[-1] == stream.eos_id
    windows = TokenWindows([arr], SHAPE.seq_len)
    inputs = np.concatenate([windows[i][0].numpy() for i in range(len(windows))])
    assert inputs.tolist() == expected[: len(windows) * SHAPE.seq_len]
    x, y = windows[3]
    assert y[:-1].tolist() == x[1:].tolist() and len(windows) == (len(expected) - 1) // SHAPE.seq_len


@pytest.mark.unit
def test_cache_reused_then_invalidated(hf_tokenizer, tmp_path):
    """The second call reads the cache (no tokenization, the file untouched); a changed input
    file gets a new cache entry; two ranks racing tokenize once."""
    from recipes.tokens import token_file

    src = _jsonl(tmp_path / "d.jsonl", _docs(10))
    kw = {"kind": "jsonl", "path": src, "field": "text", "tokenizer": hf_tokenizer,
          "cache_dir": tmp_path / "c"}
    first = token_file(**kw)
    mtime = first.path.stat().st_mtime_ns
    again = token_file(**kw)
    assert first.built and not again.built and again.path == first.path
    assert again.path.stat().st_mtime_ns == mtime
    time.sleep(0.01)
    _jsonl(src, _docs(11))
    changed = token_file(**kw)
    assert changed.built and changed.path != first.path and changed.n_docs == 11

    results = []
    kw["cache_dir"] = tmp_path / "race"
    threads = [threading.Thread(target=lambda: results.append(token_file(**kw))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.built for r in results) == [False, False, True]
    assert len({r.path for r in results}) == 1


@pytest.mark.unit
def test_whichever_rank_tokenizes_rank_0_says_so_and_reports_its_progress(hf_tokenizer, tmp_path, caplog,
                                                                          monkeypatch):
    """Rank 1 wins the cache's lock (any rank may; only rank 0's INFO reaches the console): rank 0
    says it waits for rank 1, the start-up watcher reports rank 1's progress on rank 0 while it
    waits (here at a short interval), and rank 0's data line says "tokenized on rank 1", not
    "cached" (it said "cached" for a cache this run had just built); "cached" is said of a cache
    from before the run."""
    from backends.common import extensions
    from observers import startup
    from recipes import token_progress
    from recipes.tokens import token_file

    monkeypatch.setattr(token_progress, "PROGRESS_S", 0.0)  # (every batch; 1 s in a run)
    caplog.set_level(logging.INFO)
    src = _jsonl(tmp_path / "d.jsonl", _docs(40) * 50)  # (2,000 documents: about a second here)
    kw = {"kind": "jsonl", "path": src, "field": "text", "tokenizer": hf_tokenizer, "cache_dir": tmp_path / "c"}
    got = {}
    one = threading.Thread(target=lambda: got.update({1: token_file(**kw, rank=1)}))
    with extensions.watch(first_s=0.0, every_s=0.0, poll_s=0.01):
        one.start()
        deadline = time.monotonic() + 60
        while not list((tmp_path / "c").glob("*.progress")) and time.monotonic() < deadline:
            time.sleep(0.002)  # (rank 1 holds the lock and tokenizes)
        got[0] = token_file(**kw, rank=0)
        one.join(timeout=60)
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"tokenizing {src} on rank 1") for m in said), said
    assert any(m.startswith(f"waiting for rank 1 (pid {os.getpid()}") and f"to tokenize {src}" in m
               for m in said), said
    still = [m for m in said if m.startswith(f"still tokenizing {src} on rank 1: ")]
    assert still and any(" documents (" in m for m in still), said
    assert any(m.endswith(" so far") or " so far;" in m for m in still), still
    assert got[1].built and not got[0].built and got[0].waited > 0
    assert not list((tmp_path / "c").glob("*.progress"))  # (removed with the cache complete)
    before = time.time() - 3600
    assert got[1].origin(since=before).startswith("tokenized in ")
    assert got[0].origin(since=before).startswith("tokenized on rank 1 in "), got[0].origin(since=before)
    caplog.clear()
    data = _data(name="jsonl", path=str(src), tokenizer=str(hf_tokenizer), cache_dir=str(tmp_path / "c"))
    build_datasets(data, SHAPE, 0)  # (this process's run began before rank 1 built it)
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: ")]
    assert line.endswith(f"{got[1].path.name}, tokenized on rank 1 in {got[1].build_seconds:.0f} s)"), line
    monkeypatch.setattr(startup, "_start", startup.now())  # a later run: the cache is from before it
    caplog.clear()
    build_datasets(data, SHAPE, 0)
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: ")]
    assert line.endswith(f"({got[1].path.name}, cached)"), line


@pytest.mark.unit
def test_the_progress_lines_say_documents_done_of_the_total(tmp_path):
    """What the tokenizing rank writes as it goes, and the line any rank of this machine or
    another says from it: reading into Arrow first, then documents done of the total."""
    from recipes.token_progress import Turn

    builder = Turn("/data/corpus", tmp_path / "k.progress", rank=1)
    waiter = Turn("/data/corpus", tmp_path / "k.progress", rank=0)
    builder.start(files=3, size=40_000_000)
    line = waiter.still()
    assert line.startswith("still tokenizing /data/corpus on rank 1: reading 3 files (40.0 MB) into Arrow, "), line
    builder.update(total=40_000)
    builder.update(docs=12_000, force=True)
    line = waiter.still()
    assert line.startswith("still tokenizing /data/corpus on rank 1: 12,000 of 40,000 documents (30%), "), line
    assert "; waiting " in line and "; waiting " not in builder.still()
    builder.done()
    assert not (tmp_path / "k.progress").exists()


@pytest.mark.unit
def test_parquet_and_text_read_the_same_tokens(hf_tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from recipes.tokens import token_file

    docs = _docs(8)
    pq.write_table(pa.table({"body": docs}), tmp_path / "d.parquet")
    par = token_file(kind="parquet", path=tmp_path / "d.parquet", field="body",
                     tokenizer=hf_tokenizer, cache_dir=tmp_path / "c")
    assert par.array().tolist() == _expected(hf_tokenizer, docs)
    (tmp_path / "d.txt").write_text(docs[0])  # a text file is one document
    txt = token_file(kind="text", path=tmp_path / "d.txt", field="text",
                     tokenizer=hf_tokenizer / "tokenizer.json", cache_dir=tmp_path / "c")
    assert txt.array().tolist() == _expected(hf_tokenizer, docs[:1])


@pytest.mark.unit
def test_token_shards(tmp_path):
    """data=tokens: a directory of shards in name order, windows within each shard."""
    a, b = np.arange(50, dtype=np.uint32) + 70000, np.arange(40, dtype=np.uint32)
    (tmp_path / "s").mkdir()
    a.tofile(tmp_path / "s" / "000.bin")
    b.tofile(tmp_path / "s" / "001.bin")
    shape = SimpleNamespace(seq_len=16, vocab_size=70050)  # the ids reach 70049
    kw = {"dtype": "uint32", "cache_dir": str(tmp_path / "c")}
    train, val = build_datasets(_data(name="tokens", path=str(tmp_path / "s"), **kw), shape, 0)
    assert val is None and len(train) == 3 + 2
    x, y = train[0]
    assert x.tolist() == a[:16].tolist() and y.tolist() == a[1:17].tolist()
    assert train[3][0].tolist() == b[:16].tolist()
    one = build_datasets(_data(name="tokens", path=str(tmp_path / "s" / "001.bin"), **kw), shape, 0)[0]
    assert len(one) == 2
    glob = build_datasets(_data(name="tokens", path=str(tmp_path / "s" / "0*.bin"), **kw), shape, 0)[0]
    assert len(glob) == 5 and glob[3][0].tolist() == b[:16].tolist()
    assert data_facts(train) == {"tokens": 5 * 16, "loss_tokens": 5 * 16}


@pytest.mark.unit
def test_a_shard_too_short_for_a_window_is_named(tmp_path, caplog, monkeypatch):
    """data=tokens: a shard shorter than one window (windows do not cross shards) was dropped
    without a word, while an empty one stops the run before launch. One warning at the build
    names such shards (a count, the first few with their tokens), the window length and the fix."""
    monkeypatch.delenv("RANK", raising=False)
    (tmp_path / "s").mkdir()
    for name, n in (("a", 1000), ("b", 20), ("c", 700)):
        np.arange(n, dtype=np.uint16).tofile(tmp_path / "s" / f"{name}.bin")
    shape, kw = SimpleNamespace(seq_len=32, vocab_size=1000), {"cache_dir": str(tmp_path / "c")}

    def said(path: Path) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            train = build_datasets(_data(name="tokens", path=str(path), **kw), shape, 0)[0]
        assert len(train) == 31 + 0 + 21
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    warned = said(tmp_path / "s")
    assert warned == [f"data.path={tmp_path / 's'}: 1 of its 3 shards hold fewer than model.seq_len + 1 = 33 "
                      "tokens, so no window (windows do not cross shards) and their 20 tokens are never "
                      "read: b.bin (20 tokens); concatenate the small shards into larger ones, or lower "
                      "model.seq_len (a shard of n tokens holds a window from model.seq_len=n-1 down)"]
    for i in range(7):
        np.arange(5 + i, dtype=np.uint16).tofile(tmp_path / "s" / f"d{i}.bin")
    warned = said(tmp_path / "s")
    assert len(warned) == 1 and "8 of its 10 shards" in warned[0] and "their 76 tokens" in warned[0]
    assert "b.bin (20 tokens), d0.bin (5 tokens), d1.bin (6 tokens), d2.bin (7 tokens), d3.bin (8 tokens) " \
           "and 3 more;" in warned[0]
    for f in [tmp_path / "s" / "b.bin", *(tmp_path / "s").glob("d*.bin")]:
        f.unlink()
    assert said(tmp_path / "s") == []  # (every shard holds a window)


@pytest.mark.unit
def test_held_out_split_and_validation_batches():
    """The last windows are held out; every rank runs as many batches, and the union over the
    ranks is each validation sample once (padding has only IGNORE targets)."""
    train, val = build_datasets(_data(name="text", val_fraction=0.01, val_samples=7), SHAPE, 0)
    full = build_datasets(_data(name="text"), SHAPE, 0)[0]
    assert len(train) + round(len(full) * 0.01) == len(full) and len(val) == 7
    assert val[0][0].tolist() == full[len(train)][0].tolist()
    for dp in (1, 2, 4):
        seen = []
        lengths = set()
        for r in range(dp):
            batches = list(ValidationBatches(val, micro_batch=2, dp_rank=r, dp_size=dp))
            lengths.add(len(batches))
            for x, y in batches:
                seen += [x[i, 0].item() for i in range(len(y)) if (y[i] != IGNORE).all()]
                assert all((y[i] == IGNORE).all() or (y[i] != IGNORE).all() for i in range(len(y)))
        assert len(lengths) == 1
        assert sorted(seen) == sorted(val[i][0][0].item() for i in range(len(val)))


def _problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        validate(compose(["model=gpt_nano", "cluster.accelerator=cpu", *overrides]), depth=CONFIG)
    return str(e.value)


@pytest.mark.subprocess
def test_bad_data_fails_before_launch(hf_tokenizer, tmp_path):
    src = _jsonl(tmp_path / "d.jsonl", _docs(3), field="body")
    tok = f"data.tokenizer={hf_tokenizer}"
    msg = _problems("data=jsonl", f"data.path={tmp_path / 'nope.jsonl'}", tok, "model.vocab_size=512")
    assert "data.path" in msg and "nope.jsonl" in msg and "does not exist" in msg
    msg = _problems("data=jsonl", f"data.path={src}", tok, "model.vocab_size=512")
    assert "data.field='text'" in msg and "body" in msg and "set data.field" in msg
    msg = _problems("data=jsonl", f"data.path={src}", "data.field=body", tok)  # gpt_nano: vocab 256
    assert "has 512 token ids but model.vocab_size=256" in msg and "model.vocab_size>=512" in msg
    msg = _problems("data=jsonl", f"data.path={src}", "data.field=body")
    assert "data=jsonl needs a tokenizer" in msg and "data.tokenizer=" in msg
    msg = _problems("data=tokens")
    assert "data=tokens needs data.path" in msg
    (tmp_path / "odd.bin").write_bytes(b"abc")
    msg = _problems("data=tokens", f"data.path={tmp_path / 'odd.bin'}")
    assert "not a multiple of 2" in msg and "data.dtype" in msg
    # the good config passes, and validating it imports neither datasets nor transformers
    code = ("import sys; from recipes.config import compose; from recipes.job import validate, CONFIG;"
            f"validate(compose(['model=gpt_nano','data=jsonl','data.path={src}','data.field=body',"
            f"'{tok}','model.vocab_size=512','cluster.accelerator=cpu']), depth=CONFIG);"
            "assert not {'datasets','transformers','torch'} & set(sys.modules), sorted(sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


# Validation through the CLI: the tokenized jsonl, the held-out tail, a validation after step 1
# and the final one; the 2-rank sharded and pipelined runs, and the Accelerate loop, average the
# same samples as one process.
VAL = ("model.vocab_size=512", "data=jsonl", "data.val_fraction=0.1", "data.val_samples=7",
       "trainer.val_every=1", "trainer.max_steps=2", "trainer.global_batch_size=8",
       "trainer.micro_batch_size=4", "callbacks=none")


VAL_RUNS = {"fsdp2": ("strategy=fsdp2", "cluster.devices=2"),
            "zero3": ("strategy=zero3", "cluster.devices=2"),
            # the schedule's forward-only eval: 2 x 4 pipeline micro-batches per step
            "pipeline": ("strategy=pipeline", "cluster.devices=2", "trainer.micro_batch_size=2"),
            "accelerate": ("backend=accelerate", "strategy=fsdp2", "cluster.devices=2")}


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
# (CI: validation's equality on ddp, a pipeline and Ulysses with masked chat data, tests/test_chat.py)
@pytest.mark.parametrize("others", [pytest.param(("fsdp2", "zero3"), marks=pytest.mark.slow),
                                    pytest.param(("pipeline", "accelerate"), marks=pytest.mark.slow)],
                         ids=["sharded", "pipeline-accelerate"])
def test_validation_loss_equal_across_world_sizes(hf_tokenizer, tmp_path, others):
    src = _jsonl(tmp_path / "d.jsonl", _docs(60))
    data = (f"data.path={src}", f"data.tokenizer={hf_tokenizer}", f"data.cache_dir={tmp_path / 'c'}")
    runs = {}
    for name, extra in {"single": ("strategy=single", "logger=csv"), **{o: VAL_RUNS[o] for o in others}}.items():
        runs[name] = run_cli("train.py", *TINY, *VAL, *data, *extra, out=tmp_path / name, timeout=300)
    ref = runs["single"].report["validation"]
    assert [v["step"] for v in ref] == [1, 2] and ref[0]["samples"] == 7
    assert abs(ref[0]["perplexity"] - np.exp(ref[0]["loss"])) < 1e-6 * ref[0]["perplexity"]
    for name in others:
        got = runs[name].report["validation"]
        assert [v["step"] for v in got] == [1, 2]
        for a, b in zip(ref, got):
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (name, ref, got)
    assert "tokenized" in runs["single"].log and "cached" in runs[others[0]].log
    rows = [r for r in csv.DictReader((tmp_path / "single" / "metrics.csv").open()) if r["val_loss"]]
    assert [(int(r["step"]), float(r["val_loss"])) for r in rows] == [(v["step"], v["loss"]) for v in ref]
