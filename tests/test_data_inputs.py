"""What a data input gives, and what the run says about it (the data-semantics audit): a
``data.val_path`` DatasetDict's validation split (it read the training split), a validation input
that is the training input, a one-line JSON array, a bad record after the first (a tokenizers
traceback), the top-level data keys beside ``data.mixture`` (ignored, or not inherited),
``trainer.val_every`` without a validation split, a dataset smaller than a global batch, and
the key a too-short ``data.val_path`` is named by."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from recipes.config import DataConfig, compose
from recipes.data import CORPUS, build_datasets, data_facts
from recipes.job import CONFIG, validate
from strategies import ConfigError

pytest.importorskip("datasets")  # the hf extra

SHAPE = SimpleNamespace(seq_len=16, vocab_size=512)


def _docs(n: int = 40) -> list[str]:
    """``n`` documents of varied lengths (50-450 characters) cut from the bundled corpus."""
    text = CORPUS.read_text()
    return [text[i * 500 : i * 500 + 50 + (i * 137) % 400] for i in range(n)]


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        validate(compose(["model=gpt_nano", "cluster.accelerator=cpu", *overrides]), depth=CONFIG)
    return str(e.value)


def _windows_of(dataset) -> list[list[int]]:
    return [dataset[i][0].tolist() for i in range(len(dataset))]


# ------------------------------------------------------------------ finding 1: val_path's split
@pytest.mark.unit
def test_a_val_path_dataset_dict_validates_on_its_validation_split(hf_tokenizer, tmp_path):
    """data.val_path at a save_to_disk DatasetDict read its train split -- the training data --
    and said nothing: it reads the validation split (else test), and one without either is
    refused before launch naming data.val_path, its splits and the fix; data.path still reads
    the train split."""
    from datasets import Dataset, DatasetDict

    docs = _docs(60)
    rows = [{"text": d} for d in docs]
    DatasetDict({"train": Dataset.from_list(rows[:40]), "validation": Dataset.from_list(rows[40:50]),
                 "test": Dataset.from_list(rows[50:])}).save_to_disk(str(tmp_path / "dict"))
    DatasetDict({"train": Dataset.from_list(rows[:40]),
                 "test": Dataset.from_list(rows[50:])}).save_to_disk(str(tmp_path / "dict_test"))
    DatasetDict({"train": Dataset.from_list(rows[:40]),
                 "extra": Dataset.from_list(rows[50:])}).save_to_disk(str(tmp_path / "dict_train"))
    kw = {"name": "jsonl", "tokenizer": str(hf_tokenizer), "cache_dir": str(tmp_path / "c"), "val_samples": None}
    _jsonl(tmp_path / "train.jsonl", rows[:40])
    _jsonl(tmp_path / "validation.jsonl", rows[40:50])
    _jsonl(tmp_path / "test.jsonl", rows[50:])

    def windows(path: str, val_path: str) -> tuple[list, list]:
        train, val = build_datasets(DataConfig(path=path, val_path=val_path, **kw), SHAPE, 0)
        return _windows_of(train), _windows_of(val)

    want_train, want_val = windows(str(tmp_path / "train.jsonl"), str(tmp_path / "validation.jsonl"))
    assert windows(str(tmp_path / "dict"), str(tmp_path / "dict")) == (want_train, want_val)
    assert windows(str(tmp_path / "dict"), str(tmp_path / "dict_test"))[1] == \
        windows(str(tmp_path / "train.jsonl"), str(tmp_path / "test.jsonl"))[1]

    tok = f"data.tokenizer={hf_tokenizer}"
    ok = ("data=jsonl", tok, "model.vocab_size=512", f"data.cache_dir={tmp_path / 'c'}")
    validate(compose(["model=gpt_nano", "cluster.accelerator=cpu", *ok, f"data.path={tmp_path / 'dict'}",
                      f"data.val_path={tmp_path / 'dict'}"]), depth=CONFIG)
    said = _problems(*ok, f"data.path={tmp_path / 'dict'}", f"data.val_path={tmp_path / 'dict_train'}")
    assert (f"data.val_path={tmp_path / 'dict_train'}: a save_to_disk DatasetDict with no 'validation' or "
            "'test' split (it has: train, extra): point it at the directory of the split to validate on "
            f"({tmp_path / 'dict_train'}/<split>)") in said, said
    assert said.count("\n") == 1, said  # (one line)


@pytest.mark.unit
def test_a_val_path_that_is_the_training_input_is_refused(hf_tokenizer, tmp_path):
    """data.val_path naming data.path's files (the same file, or a glob of the same directory)
    validated on the training data, silently: refused before launch, one line."""
    (tmp_path / "d").mkdir()
    src = _jsonl(tmp_path / "d" / "a.jsonl", [{"text": d} for d in _docs(10)])
    ok = ("data=jsonl", f"data.tokenizer={hf_tokenizer}", "model.vocab_size=512")
    for path, val_path in ((src, src), (tmp_path / "d", f"{tmp_path}/d/*.jsonl")):
        said = _problems(*ok, f"data.path={path}", f"data.val_path={val_path}")
        assert (f"data.val_path={val_path}: the same files as data.path={path}, so the validation loss "
                "would be a training loss: point data.val_path at held-out data, or remove it and set "
                "data.val_fraction") in said, said
        assert said.count("\n") == 1, said
    other = _jsonl(tmp_path / "v.jsonl", [{"text": d} for d in _docs(3)])
    validate(compose(["model=gpt_nano", "cluster.accelerator=cpu", *ok, f"data.path={src}",
                      f"data.val_path={other}"]), depth=CONFIG)


# ------------------------------------------------------------------ finding 2: a JSON array
@pytest.mark.unit
def test_a_one_line_json_array_is_a_list_of_records(hf_tokenizer, tmp_path):
    """A compact .json array (one line) was refused "(it has: none)" while the same records
    pretty-printed trained: its first record's keys are checked, and it tokenizes."""
    from recipes.token_inputs import record_keys, resolve_inputs
    from recipes.tokens import token_file

    docs = _docs(30)
    compact = tmp_path / "docs.json"
    compact.write_text(json.dumps([{"text": d, "id": i} for i, d in enumerate(docs)]))
    assert record_keys(resolve_inputs("jsonl", compact))[0] == ["text", "id"]
    validate(compose(["model=gpt_nano", "cluster.accelerator=cpu", "data=jsonl", f"data.path={compact}",
                      f"data.tokenizer={hf_tokenizer}", "model.vocab_size=512"]), depth=CONFIG)
    said = _problems("data=jsonl", f"data.path={compact}", f"data.tokenizer={hf_tokenizer}",
                     "model.vocab_size=512", "data.field=body")
    assert "data.field='body' is not a key of" in said and "(it has: text, id)" in said
    stream = token_file(kind="jsonl", path=compact, field="text", tokenizer=hf_tokenizer, cache_dir=tmp_path / "c")
    assert stream.n_docs == 30


# ------------------------------------------------------------------ finding 3: a bad record
@pytest.mark.unit
def test_a_bad_record_after_the_first_is_a_data_error_naming_it(hf_tokenizer, tmp_path):
    """A record after the first without a text string (the field missing, null, a number) ended
    in a raw tokenizers TypeError (exit 1): a DataError (train.py's one line, exit 2) naming the
    key, the file, the record and the field."""
    from core.errors import DataError
    from recipes.tokens import token_file

    good = [{"text": d, "title": "t"} for d in _docs(12)]
    cases = {"missing": ({"title": "no text here"}, "has no 'text' string (it has: title)"),
             "null": ({"text": None, "title": "x"}, "has no 'text' string (it has: title)"),
             "number": ({"text": 5, "title": "x"}, "has no 'text' string (its 'text' is an int: 5)")}
    for name, (bad, why) in cases.items():
        src = _jsonl(tmp_path / f"{name}.jsonl", [*good[:5], bad, *good[5:]])
        with pytest.raises(DataError) as e:
            token_file(kind="jsonl", path=src, field="text", tokenizer=hf_tokenizer, cache_dir=tmp_path / "c")
        assert str(e.value) == f"data.path={src}: record 6 {why}: fix or remove it"
    src = tmp_path / "missing.jsonl"
    with pytest.raises(DataError, match=r"^data\.val_path=.*: record 6 has no 'text' string"):
        token_file(kind="jsonl", path=src, field="text", tokenizer=hf_tokenizer, cache_dir=tmp_path / "c",
                   key="data.val_path")


# ------------------------------------------------------------------ finding 5: mixture's top level
@pytest.mark.unit
def test_top_level_data_keys_beside_a_mixture_are_inherited_or_refused(hf_tokenizer, tmp_path):
    """data.val_fraction beside data.mixture was ignored in silence (no validation), and a
    top-level data.tokenizer was not inherited while the error said "data.tokenizer is null":
    the tokenizer is inherited by the sources that read one and do not set their own; a key the
    mixture would ignore is refused, naming where it goes."""
    src = _jsonl(tmp_path / "d.jsonl", [{"text": d} for d in _docs(10)])
    src2 = _jsonl(tmp_path / "d2.jsonl", [{"text": d} for d in _docs(10)])  # (one file for both would
    own = tmp_path / "own"  # leak: data=jsonl holds out 0.01 of each, tokenized two ways)
    own.mkdir()
    for f in Path(hf_tokenizer).iterdir():
        (own / f.name).write_bytes(f.read_bytes())
    mixture = (f"data.mixture=[{{name:jsonl,path:{src},weight:0.5}},{{name:jsonl,path:{src2},"
               f"tokenizer:{own},weight:0.3}},{{name:synthetic,weight:0.2}}]")
    job = validate(compose(["model=gpt_nano", "cluster.accelerator=cpu", "model.vocab_size=512", mixture,
                            f"data.tokenizer={hf_tokenizer}"]), depth=CONFIG)
    first, second, synthetic = job.data.mixture
    assert first["tokenizer"] == str(hf_tokenizer) and second["tokenizer"] == str(own)
    assert synthetic["tokenizer"] is None
    said = _problems("model.vocab_size=512", mixture, f"data.tokenizer={hf_tokenizer}",
                     "data.val_fraction=0.05", "data.val_samples=8")
    assert ("data.val_fraction=0.05 with data.mixture: each source has its own, and the top-level one is "
            "not read: remove data.val_fraction and set it inside the entries it belongs to "
            "(data.mixture[i].val_fraction)") in said, said
    assert "data.val_samples=8 with data.mixture" in said and "(data.mixture[i].val_samples)" in said
    assert said.count("\n") == 2, said
    # the group defaults (data=text's, data=jsonl's val_fraction 0.01) are not the user's: no problem
    validate(compose(["model=gpt_nano", "cluster.accelerator=cpu", "model.vocab_size=512", "data=jsonl",
                      mixture, f"data.tokenizer={hf_tokenizer}"]), depth=CONFIG)


# ------------------------------------------------------------------ finding 6: val_every, no split
@pytest.mark.unit
def test_val_every_without_a_validation_split_is_refused():
    """trainer.val_every=N with no validation split validated nothing, silently (keep_best is
    refused there): refused before launch; its default (0) and a split are fine."""
    said = _problems("trainer.val_every=2")
    assert ("trainer.val_every=2 validates every 2 steps, and the data has no validation split: set "
            "data.val_fraction (e.g. 0.05) or data.val_path; or remove it") in said, said
    assert said.count("\n") == 1, said
    said = _problems("trainer.val_every=2", "data.mixture=[{name:text,weight:1},{name:synthetic,weight:1}]")
    assert "trainer.val_every=2 validates every 2 steps, and no source of data.mixture holds out " \
           "validation: set data.mixture[i].val_fraction (e.g. 0.05) or data.mixture[i].val_path" in said, said
    said = _problems("trainer.val_every=2", "trainer.keep_best=true")  # (keep_best says it already)
    assert "trainer.keep_best=true judges" in said and "trainer.val_every=2 validates" not in said
    for ok in ((), ("trainer.val_every=2", "data.val_fraction=0.05")):
        validate(compose(["model=gpt_nano", "cluster.accelerator=cpu", *ok]), depth=CONFIG)


# ------------------------------------------------------------------ finding 7: a tiny dataset
@pytest.mark.unit
def test_a_dataset_smaller_than_a_global_batch_is_said_and_epochs_reported(caplog, monkeypatch, tmp_path):
    """4 windows under a global batch of 16: every step held each window 4 times, silently. Rank
    0 warns once at start, naming the samples, the global batch and the repeats; report.json's
    data has ``epochs`` (max_steps x global batch / samples)."""
    tiny = tmp_path / "tiny.txt"
    tiny.write_text(CORPUS.read_text()[: 4 * 16 + 1])
    train = build_datasets(DataConfig(name="text", path=str(tiny)), SHAPE, 0)[0]
    assert len(train) == 4
    monkeypatch.delenv("RANK", raising=False)
    with caplog.at_level(logging.INFO, logger="recipes.data"):
        facts = data_facts(train, (3, 16, 0))
    assert facts == {"tokens": 64, "loss_tokens": 64, "epochs": 12.0}
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == ["the training data holds 4 samples, fewer than a global batch "
                      "(trainer.global_batch_size=16): each step draws every sample about 4 times "
                      "(12 epochs in the run); use more data or a smaller "
                      "trainer.global_batch_size"], warned
    caplog.clear()
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level(logging.INFO, logger="recipes.data"):
        assert data_facts(train, (3, 16, 0))["epochs"] == 12.0
    assert not caplog.records
    monkeypatch.delenv("RANK")
    full = build_datasets(DataConfig(name="text"), SHAPE, 0)[0]
    with caplog.at_level(logging.INFO, logger="recipes.data"):
        assert data_facts(full, (3, 16, 0))["epochs"] == round(3 * 16 / len(full), 6)
    assert not caplog.records


# ------------------------------------------------------------------ finding 10: the key named
@pytest.mark.unit
def test_a_too_short_val_path_is_named_by_its_own_key(tmp_path):
    """A data.val_path too short for one window was reported as data.path=...: the key at fault."""
    from core.errors import DataError

    short = tmp_path / "short.txt"
    short.write_text("short\n")
    with pytest.raises(DataError) as e:
        build_datasets(DataConfig(name="text", val_path=str(short)), SHAPE, 0)
    assert str(e.value).startswith(f"data.val_path={short}: 6 tokens hold no sample"), str(e.value)
