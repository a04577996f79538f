"""What users' data files give (the user-data audit): a ``data.val_path`` file that is also one of
``data.path``'s, ``data.tokenizer`` pointing at a file that is not a tokenizer.json, a UTF-8-BOM
jsonl, files whose records have other keys or columns, held-out windows beyond
``data.val_samples``, data=chat's record numbers, and data=text's CRLF line ends."""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from recipes.config import DataConfig, compose
from recipes.data import CORPUS, build_datasets
from recipes.job import CONFIG, validate
from strategies import ConfigError

pytest.importorskip("datasets")  # the hf extra

SHAPE = SimpleNamespace(seq_len=16, vocab_size=512)
MODEL = SimpleNamespace(vocab_size=512, seq_len=16)


def _docs(n: int = 40) -> list[str]:
    """``n`` documents of varied lengths (50-450 characters) cut from the bundled corpus."""
    text = CORPUS.read_text()
    return [text[i * 500 : i * 500 + 50 + (i * 137) % 400] for i in range(n)]


def _jsonl(path: Path, records: list[dict], prefix: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prefix + "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def _problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        validate(compose(["model=gpt_nano", "cluster.accelerator=cpu", *overrides]), depth=CONFIG)
    return e.value.problems


def _data_problems(**kw) -> list[str]:
    from recipes.token_checks import data_problems

    return data_problems(DataConfig(**kw), MODEL)


# ------------------------------------------------------------------ 1: val_path inside data.path
@pytest.mark.unit
def test_a_val_path_file_inside_the_training_inputs_is_refused(hf_tokenizer, tmp_path):
    """A directory holding train.jsonl and val.jsonl, data.path at the directory and data.val_path
    at val.jsonl: the 20 validation documents were trained on too, silently (only the same files
    were refused). Refused before launch like them, naming the shared file and the fix; the same
    for a glob and for data=tokens shards; and a data.val_path reading more than data.path."""
    tv = tmp_path / "tv"
    train = _jsonl(tv / "train.jsonl", [{"text": d} for d in _docs(10)])
    val = _jsonl(tv / "val.jsonl", [{"text": d} for d in _docs(3)])
    tok = (f"data.tokenizer={hf_tokenizer}", "model.vocab_size=512", "data=jsonl")
    for path in (tv, f"{tv}/*.jsonl"):
        said = _problems(*tok, f"data.path={path}", f"data.val_path={val}")
        assert said == [f"data.val_path={val}: its file {val} is also one of data.path={path}'s, so the "
                        "validation loss would be partly a training loss: point data.path at the "
                        f"training files alone (data.path={train})"], said
    # data.val_path reads the training file and another: the other is the held-out one
    other = _jsonl(tmp_path / "more" / "test.jsonl", [{"text": d} for d in _docs(3)])
    both = f"{tmp_path}/*/t*.jsonl"
    said = _problems(*tok, f"data.path={train}", f"data.val_path={both}")
    assert said == [f"data.val_path={both}: 1 of its 2 files is also one of data.path={train}'s "
                    f"({train}), so the validation loss would be partly a training loss: point "
                    f"data.val_path at the held-out files alone (data.val_path={other})"], said
    # data=tokens: a shard directory and one of its shards
    shards = tmp_path / "shards"
    shards.mkdir()
    for name in ("000.bin", "001.bin", "002.bin"):
        np.arange(200, dtype=np.uint16).tofile(shards / name)
    said = _problems("data=tokens", f"data.path={shards}", f"data.val_path={shards / '002.bin'}",
                     f"data.cache_dir={tmp_path / 'c'}")
    assert said == [f"data.val_path={shards / '002.bin'}: its file {shards / '002.bin'} is also one of "
                    f"data.path={shards}'s, so the validation loss would be partly a training loss: point "
                    "data.path at the training files alone (a glob or directory that leaves it out)"], said
    # the same files are still the same sentence; separate files pass
    said = _problems(*tok, f"data.path={tv}", f"data.val_path={tv}/*")
    assert said == [f"data.val_path={tv}/*: the same files as data.path={tv}, so the validation loss "
                    "would be a training loss: point data.val_path at held-out data, or remove it "
                    "and set data.val_fraction"], said
    validate(compose(["model=gpt_nano", "cluster.accelerator=cpu", *tok, f"data.path={train}",
                      f"data.val_path={val}"]), depth=CONFIG)


def _two_sources(first: str, path: Path | str) -> str:
    """data.mixture of two jsonl entries at weight 0.5: ``first``'s keys, and one training on
    ``path`` that holds out nothing."""
    return (f"data.mixture=[{{name:jsonl,{first},weight:0.5}},"
            f"{{name:jsonl,path:{path},val_fraction:0,weight:0.5}}]")


@pytest.mark.unit
def test_a_mixture_entrys_val_path_inside_another_entrys_path_is_refused(hf_tokenizer, tmp_path):
    """data.mixture: entry 0 validating on val.jsonl, entry 1 training on the directory that holds
    it passed the checks and --dry-run ("0 ok") and ran: source 1 read 140 records from 2 files,
    so the validation loss was scored on data entry 1 trains on (only an entry's own data.path
    was compared). Refused before launch naming both entries, the shared file and the fix; the
    same files are the same sentence; an entry's val_path apart from every path passes."""
    tv = tmp_path / "tv"
    train = _jsonl(tv / "train.jsonl", [{"text": d} for d in _docs(10)])
    val = _jsonl(tv / "val.jsonl", [{"text": d} for d in _docs(3)])
    tok = (f"data.tokenizer={hf_tokenizer}", "model.vocab_size=512")

    def mixture(path: Path | str) -> str:
        return _two_sources(f"path:{train},val_path:{val}", path)

    said = _problems(*tok, mixture(tv))
    assert said == [f"data.mixture[0].val_path={val}: its file {val} is also one of "
                    f"data.mixture[1].path={tv}'s, so the validation loss would be partly a training "
                    "loss: point data.mixture[1].path at the training files alone "
                    f"(data.mixture[1].path={train})"], said
    said = _problems(*tok, mixture(val))
    assert said == [f"data.mixture[0].val_path={val}: the same files as data.mixture[1].path={val}, so "
                    "the validation loss would be a training loss: point data.mixture[0].val_path at "
                    "held-out data, or remove it and set data.mixture[0].val_fraction"], said
    validate(compose(["model=gpt_nano", "cluster.accelerator=cpu", *tok, mixture(train)]), depth=CONFIG)


@pytest.mark.unit
def test_a_mixture_entrys_held_out_windows_in_another_entrys_path_are_refused(hf_tokenizer, tmp_path):
    """data.mixture: entry 0 holding out data.val_fraction of train.jsonl while entry 1 trains on
    the directory that holds train.jsonl passed the checks: entry 1 trained on the windows entry 0
    validated on. Refused before launch naming both entries and the shared file; entries on
    separate files, or without val_fraction, pass."""
    tv = tmp_path / "tv"
    train = _jsonl(tv / "train.jsonl", [{"text": d} for d in _docs(10)])
    other = _jsonl(tmp_path / "other" / "more.jsonl", [{"text": d} for d in _docs(10)])
    tok = (f"data.tokenizer={hf_tokenizer}", "model.vocab_size=512")

    def mixture(path: Path | str, fraction: float = 0.2) -> str:
        return _two_sources(f"path:{train},val_fraction:{fraction}", path)

    said = _problems(*tok, mixture(tv))
    assert said == [f"data.mixture[0].val_fraction=0.2 holds out windows of data.mixture[0].path="
                    f"{train}, but data.mixture[1].path={tv} trains on the same file ({train}), so "
                    "the validation loss would be partly a training loss: give the two entries "
                    "separate files, or validate on held-out data (data.mixture[0].val_path)"], said
    validate(compose(["model=gpt_nano", "cluster.accelerator=cpu", *tok, mixture(other)]), depth=CONFIG)
    validate(compose(["model=gpt_nano", "cluster.accelerator=cpu", *tok, mixture(tv, 0)]), depth=CONFIG)


# ------------------------------------------------------------------ 2: a file that is no tokenizer
@pytest.mark.unit
def test_a_tokenizer_file_that_is_not_a_tokenizer_json_is_one_line(hf_tokenizer, tmp_path):
    """data.tokenizer at the directory's tokenizer_config.json, or at a jsonl: the checks and
    --dry-run passed, the run died in a 44-line transformers traceback (exit 1). One line before
    launch naming the key and the fix (the directory, or its tokenizer.json); and a tokenizer that
    fails to load after launch (the checks skipped) is one DataError line."""
    from core.errors import DataError
    from recipes.token_checks import tokenizer_problems
    from recipes.tokens import token_file

    config = hf_tokenizer / "tokenizer_config.json"
    data = _jsonl(tmp_path / "d" / "a.jsonl", [{"text": d} for d in _docs(5)])
    assert tokenizer_problems(str(config), 512) == [
        f"data.tokenizer={config}: not a tokenizer.json (a JSON file without the tokenizer's "
        "\"model\"; tokenizer_config.json holds a tokenizer directory's settings): point "
        f"data.tokenizer at its directory (data.tokenizer={hf_tokenizer}) or at a tokenizer.json"]
    said = tokenizer_problems(str(data), 512)
    assert len(said) == 1 and said[0].startswith(f"data.tokenizer={data}: not a tokenizer.json (not JSON: "), said
    assert said[0].endswith(": point data.tokenizer at a tokenizer directory (saved with save_pretrained) "
                            "or at a tokenizer.json"), said
    said = _problems("data=jsonl", f"data.path={data}", f"data.tokenizer={config}", "model.vocab_size=512")
    assert len(said) == 1 and said[0].startswith(f"data.tokenizer={config}: not a tokenizer.json"), said
    # the directory and its tokenizer.json pass
    assert tokenizer_problems(str(hf_tokenizer), 512) == []
    assert tokenizer_problems(str(hf_tokenizer / "tokenizer.json"), 512) == []
    # after launch (a tokenizer that passes no check): one DataError line
    for bad in (config, data):
        with pytest.raises(DataError) as e:
            token_file(kind="jsonl", path=data, field="text", tokenizer=bad, cache_dir=tmp_path / "c")
        said = str(e.value)
        assert said.startswith(f"data.tokenizer={bad}: cannot load a tokenizer from it ("), said
        assert said.endswith("): point data.tokenizer at a tokenizer directory (saved with save_pretrained) "
                             "or at a tokenizer.json") and "\n" not in said, said


# ------------------------------------------------------------------ 3: a UTF-8 BOM
@pytest.mark.unit
def test_a_utf8_bom_jsonl_is_read_as_datasets_reads_it(hf_tokenizer, tmp_path):
    """A jsonl written with a BOM (Windows editors, PowerShell) was refused before launch as "not
    readable as jsonl (Unexpected UTF-8 BOM)", though datasets reads it: the check reads it too,
    plain and gzipped, and it tokenizes to the same tokens as without the BOM."""
    from recipes.tokens import token_file

    records = [{"body": d} for d in _docs(8)]
    bom = _jsonl(tmp_path / "bom" / "a.jsonl", records, prefix="\ufeff")
    plain = _jsonl(tmp_path / "plain" / "a.jsonl", records)
    gz = tmp_path / "gz" / "a.jsonl.gz"
    gz.parent.mkdir()
    gz.write_bytes(gzip.compress(bom.read_bytes()))
    for path in (bom, gz):
        assert _data_problems(name="jsonl", path=str(path), field="body", tokenizer=str(hf_tokenizer)) == []
    said = _data_problems(name="jsonl", path=str(bom), field="text", tokenizer=str(hf_tokenizer))
    assert said == [f"data.field='text' is not a key of {bom}'s records (it has: body): set "
                    "data.field=<one of them>"], said
    def tokens(path: Path) -> list[int]:
        return token_file(kind="jsonl", path=path, field="body", tokenizer=hf_tokenizer,
                          cache_dir=tmp_path / "c").array().tolist()
    assert tokens(bom) == tokens(plain) == tokens(gz)
    # a broken line further down: the line named is that one, not the BOM's
    from core.errors import DataError

    broken = tmp_path / "broken.jsonl"
    broken.write_text(bom.read_text(encoding="utf-8").replace('{"body"', '{"body" 1', 3).replace('{"body" 1', '{"body"', 2),
                      encoding="utf-8")
    with pytest.raises(DataError) as e:
        tokens(broken)
    assert str(e.value).startswith(f"data.path={broken}: line 3 is not JSON ("), str(e.value)


# ------------------------------------------------------------------ 4: files of other columns
@pytest.mark.unit
def test_files_whose_records_have_other_keys_are_named(hf_tokenizer, tmp_path):
    """a.jsonl's records hold 'body', b.jsonl's 'text': the run failed after launch with
    "data.path=<dir>: datasets cannot read it as json (Couldn't cast)", naming neither the file
    nor the columns. Before launch, each file's first record (a parquet file's schema) is read:
    a file without the field, or a parquet file with a column the first lacks, is named with its
    columns; what only the whole file shows (a jsonl's later file with a key the first file's
    records lack) is named after launch, in one line."""
    from core.errors import DataError
    from recipes.tokens import token_file

    tok = str(hf_tokenizer)
    bad = tmp_path / "bad"
    a = _jsonl(bad / "a.jsonl", [{"body": d} for d in _docs(5)])
    b = _jsonl(bad / "b.jsonl", [{"text": d} for d in _docs(5)])
    said = _data_problems(name="jsonl", path=str(bad), field="body", tokenizer=tok)
    assert said == [f"data.path={bad}: {b}'s first record has no 'body' (it has: text), while {a.name}'s "
                    "has: every file must hold data.field='body': fix that file, or point data.path at "
                    "the files that have it"], said

    import pyarrow as pa
    import pyarrow.parquet as pq

    pqd = tmp_path / "pq"
    pqd.mkdir()
    pq.write_table(pa.Table.from_pylist([{"body": d} for d in _docs(5)]), pqd / "a.parquet")
    pq.write_table(pa.Table.from_pylist([{"body": d, "id": i} for i, d in enumerate(_docs(5))]), pqd / "b.parquet")
    said = _data_problems(name="parquet", path=str(pqd), field="body", tokenizer=tok)
    assert said == [f"data.path={pqd}: {pqd / 'b.parquet'} has the column id that a.parquet (the first "
                    "file: body) lacks, and datasets reads every file with the first one's columns: "
                    "give the files the same columns, or point data.path at files of one layout"], said
    pq.write_table(pa.Table.from_pylist([{"text": d} for d in _docs(5)]), pqd / "b.parquet")
    said = _data_problems(name="parquet", path=str(pqd), field="body", tokenizer=tok)
    assert said == [f"data.path={pqd}: {pqd / 'b.parquet'}'s columns have no 'body' (it has: text), while "
                    "a.parquet's have: every file must hold data.field='body': fix that file, or point "
                    "data.path at the files that have it"], said
    # after launch: b.jsonl's later record adds a key; its first record looks like a.jsonl's
    later = tmp_path / "later"
    _jsonl(later / "a.jsonl", [{"body": d} for d in _docs(5)])
    b = _jsonl(later / "b.jsonl", [{"body": "x"}, {"body": "y", "id": 3}])
    assert _data_problems(name="jsonl", path=str(later), field="body", tokenizer=tok) == []
    with pytest.raises(DataError) as e:
        token_file(kind="jsonl", path=later, field="body", tokenizer=hf_tokenizer, cache_dir=tmp_path / "c")
    assert str(e.value) == (f"data.path={b}: its records have the key id that a.jsonl's (the first file's: "
                            "body) lack, and datasets reads every file with the first one's keys: give "
                            "every file's records the same keys, or point data.path at files of one "
                            "layout"), str(e.value)
    # no file found holding the new key: datasets' own explaining line is kept
    from datasets.table import CastError

    from recipes.token_inputs import resolve_inputs
    from recipes.tokens import _unreadable

    cast = CastError("Couldn't cast\nbody: string\nbody2: string\nto\n{'body': Value('string')}\nbecause "
                     "column names don't match", table_column_names=["body", "body2"], requested_column_names=["body"])
    failed = RuntimeError("An error occurred while generating the dataset")
    failed.__cause__ = cast
    assert _unreadable(resolve_inputs("jsonl", later), failed) == (
        f"data.path={later}: datasets cannot read it as json (Couldn't cast: there are 1 new columns ({{'body2'}}))")


# ------------------------------------------------------------------ 5: held out, never validated
@pytest.mark.unit
def test_held_out_windows_beyond_val_samples_are_said(caplog, monkeypatch, hf_tokenizer, tmp_path):
    """data.val_fraction=0.5 of 847 windows held out 424 and data.val_samples=256 validated 256:
    168 windows (20% of the data) were neither trained on nor validated, and nothing said so.
    The split stays (the held-out windows stay out of training, as the fraction says); rank 0
    warns with the count and the fix, and --dry-run notes it (the count where the windows are
    known before launch: byte text, shards, a token cache; else from how many on it starts)."""
    from launchers import dry_run
    from recipes.data_size import held_out_notes

    text = tmp_path / "t.txt"
    text.write_text(CORPUS.read_text()[: 100 * 16 + 1])  # 100 windows of 16
    monkeypatch.delenv("RANK", raising=False)
    cfg = DataConfig(name="text", path=str(text), val_fraction=0.5, val_samples=8)
    with caplog.at_level(logging.INFO, logger="recipes.data"):
        train, val = build_datasets(cfg, SHAPE, 0)
    assert (len(train), len(val)) == (50, 8)  # (the split as before)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    want = ("data.val_fraction=0.5 of 100 samples holds out 50 and data.val_samples=8 validates the "
            "first 8: the other 42 held-out samples (42% of the data) are neither trained on nor "
            "validated; raise data.val_samples to 50 (null: all), or lower data.val_fraction to 0.08")
    assert said == [f"validation: {want}"], said
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="recipes.data"):
        build_datasets(DataConfig(name="text", path=str(text), val_fraction=0.08, val_samples=8), SHAPE, 0)
        build_datasets(DataConfig(name="text", path=str(text), val_fraction=0.5, val_samples=None), SHAPE, 0)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]

    assert held_out_notes(cfg, MODEL) == [want]
    assert held_out_notes(DataConfig(name="text", path=str(text), val_fraction=0.08, val_samples=8), MODEL) == []
    src = _jsonl(tmp_path / "d.jsonl", [{"text": d} for d in _docs(40)])
    tokenized = DataConfig(name="jsonl", path=str(src), tokenizer=str(hf_tokenizer), val_fraction=0.5,
                           val_samples=8, cache_dir=str(tmp_path / "c"))
    assert held_out_notes(tokenized, MODEL) == [
        "data.val_fraction=0.5 holds out more samples than data.val_samples=8 validates once the data "
        "holds 18 or more (not counted before it is tokenized): those past the first 8 are neither "
        "trained on nor validated; raise data.val_samples (null: all), or lower data.val_fraction"]
    n = len(build_datasets(dataclasses.replace(tokenized, val_fraction=0.0), MODEL, 0)[0])
    held = max(1, round(n * 0.5))
    assert held_out_notes(tokenized, MODEL)[0].startswith(
        f"data.val_fraction=0.5 of {n} samples holds out {held} and data.val_samples=8 validates the first "
        f"8: the other {held - 8} held-out samples"), held_out_notes(tokenized, MODEL)

    capsys_out = _dry_run(dry_run, ["model=gpt_nano", "cluster.accelerator=cpu", "data=text",
                                    f"data.path={text}", "data.val_fraction=0.5", "data.val_samples=2",
                                    f"hydra.run.dir={tmp_path / 'run'}", "--dry-run"])
    assert "note: data.val_fraction=0.5 of 50 samples holds out 25 and data.val_samples=2 validates the " \
           "first 2: the other 23 held-out samples" in capsys_out, capsys_out


def _dry_run(dry_run, argv: list[str]) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert dry_run.main(argv) == 0, out.getvalue()
    return out.getvalue()


# ------------------------------------------------------------------ 6: chat's record numbers
@pytest.mark.unit
def test_chat_record_numbers_count_from_one(hf_tokenizer):
    """data=chat called the 6th record "record 5" where data=jsonl calls it "record 6" (counted
    from 1, token_checks.bad_record): both count from 1, with or without {% generation %}."""
    from transformers import AutoTokenizer

    from core.errors import DataError
    from recipes.chat_tokens import chat_tokens

    tok = AutoTokenizer.from_pretrained(str(hf_tokenizer))
    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    convs = [good] * 5 + [[{"role": "user"}]] + [good]
    templates = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}",
                 "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}")
    for template in templates:
        tok.chat_template = template
        for first, number in ((0, 6), (1000, 1006)):
            with pytest.raises(DataError) as e:
                chat_tokens(tok, convs, tok.eos_token_id, first=first, source="data.path=x")
            assert str(e.value).startswith(f"data.path=x: record {number}'s messages are a list holding"), str(e.value)


# ------------------------------------------------------------------ 7: CRLF in data=text
@pytest.mark.unit
def test_text_with_a_tokenizer_keeps_the_files_line_ends(hf_tokenizer, tmp_path):
    """data=text with a tokenizer read .txt files in universal-newline mode: CRLF became LF (15002
    tokens where the files' text gives 15005). The tokens are the files' text, each file one
    document followed by EOS, CR and CRLF kept; a file that is not UTF-8 is still one line."""
    from transformers import AutoTokenizer

    from core.errors import DataError
    from recipes.tokens import token_file

    d = tmp_path / "txt"
    d.mkdir()
    texts = ["line one\r\nline two\r\n\r\nend\r\n", "old mac\rlines\r", "unix\nonly\n", ""]
    for i, t in enumerate(texts):
        (d / f"f{i}.txt").write_bytes(t.encode())
    tok = AutoTokenizer.from_pretrained(str(hf_tokenizer))
    want = [t for text in texts for t in [*tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id]]
    got = token_file(kind="text", path=d, field="text", tokenizer=hf_tokenizer, cache_dir=tmp_path / "c")
    assert got.array().tolist() == want and got.n_docs == 4
    (d / "f9.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(DataError) as e:
        token_file(kind="text", path=d, field="text", tokenizer=hf_tokenizer, cache_dir=tmp_path / "c")
    assert str(e.value).startswith(f"data.path={d}: datasets cannot read it as text ("), str(e.value)
    assert "utf-8" in str(e.value) and "\n" not in str(e.value), str(e.value)
