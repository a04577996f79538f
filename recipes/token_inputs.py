"""What a data input is and what it holds, read cheaply (no heavy imports): ``resolve_inputs``
(``data.path`` as a file, a directory of the kind's files in name order, a glob, or a
``datasets.save_to_disk`` directory: a DatasetDict's train split for data.path, its validation
else test split for data.val_path), ``tokenizer_info`` (vocabulary size and EOS from the
tokenizer's JSON files), ``chat_template_of`` and ``record_keys`` (the first record or schema).
recipes/token_checks.py builds the checks before launch on them; recipes/tokens.py the cache.
"""

from __future__ import annotations

import glob
import gzip
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.conf import cache_dir

LOADERS = {"jsonl": "json", "parquet": "parquet", "text": "text"}  # data.name -> datasets loader
JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
SUFFIXES = {"jsonl": JSON_SUFFIXES, "parquet": (".parquet",), "text": (".txt",),
            "chat": (*JSON_SUFFIXES, ".parquet"), "tokens": (".bin",)}
"""A directory's files that an input of each kind reads."""
EXAMPLES = {"jsonl": "/path/to/data.jsonl", "parquet": "/path/to/data.parquet", "text": "/path/to/data.txt",
            "chat": "/path/to/chats.jsonl", "tokens": "/path/to/data.bin"}
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eos|>")
DISK = "disk"  # the loader of a save_to_disk directory
GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


def default_cache_dir() -> Path:
    return cache_dir("tokens")



# ---------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Inputs:
    """What ``data.path`` names, resolved: the files to read, or a save_to_disk directory."""

    files: tuple[Path, ...]
    """The data files, in reading order (a save_to_disk directory: its files, for the cache key)."""
    loader: str
    """The ``datasets`` loader (json, parquet, text), or ``disk`` (``load_from_disk``)."""
    disk: Path | None = None
    """The save_to_disk Dataset directory (one split)."""


def _is_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def _listing(p: Path, limit: int = 8) -> str:
    names = sorted(f.name for f in p.iterdir())
    return ", ".join(names[:limit]) + (f", ... ({len(names)} entries)" if len(names) > limit else "") or "nothing"


TRAIN_SPLITS = ("train",)
VAL_SPLITS = ("validation", "test")
"""The split of a save_to_disk DatasetDict that ``data.path`` reads, and those ``data.val_path``
reads (the first it has)."""


def splits_of(key: str) -> tuple[str, ...]:
    """The DatasetDict splits the input ``key`` names reads: ``data.val_path``'s, else the training ones."""
    return VAL_SPLITS if key.endswith("val_path") else TRAIN_SPLITS


def resolve_inputs(kind: str, path: str | Path, splits: tuple[str, ...] = TRAIN_SPLITS) -> Inputs:
    """The files ``path`` names for ``data=<kind>``: a file; a directory's files with the kind's
    suffixes (``SUFFIXES``), in name order; a glob's files in name order (``**`` recurses); or a
    ``datasets.save_to_disk`` directory (a Dataset, or a DatasetDict's first split of ``splits``:
    ``train`` for data.path, ``validation`` else ``test`` for data.val_path, ``splits_of``; not
    for kind ``tokens``). ValueError says what is wrong (without the key: the caller names it)."""
    raw = str(path)
    p = Path(raw).expanduser()
    disk = None
    if p.is_dir():
        if (p / "dataset_dict.json").is_file():
            p = p / _split(p, splits)
        if (p / "state.json").is_file() and (p / "dataset_info.json").is_file():
            disk = p
        if disk is not None:
            if kind == "tokens":
                raise ValueError("a save_to_disk directory holds records, not token shards: use "
                                 "data=jsonl / parquet / chat with it, or a directory of *.bin shards")
            files = tuple(sorted(f for f in p.rglob("*") if f.is_file()))
            return Inputs(files, DISK, disk)
        files = tuple(sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(SUFFIXES[kind])))
        if not files:
            raise ValueError(f"a directory without {' / '.join('*' + s for s in SUFFIXES[kind])} files "
                             f"(it holds: {_listing(p)}): point it at a file, a directory of them, a glob "
                             f"such as {p}/**/*{SUFFIXES[kind][0]}, or a save_to_disk directory")
    elif p.is_file():
        files = (p,)
    elif _is_glob(raw):
        files = tuple(sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file()))
        if not files:
            raise ValueError("the glob matches no file: check the pattern (** matches any depth)")
    else:
        raise ValueError("does not exist: point it at an existing file, a directory of them, a glob "
                         "or (tokenized data) a save_to_disk directory")
    return Inputs(files, _loader(kind, files))


def _split(p: Path, splits: tuple[str, ...]) -> str:
    """The first of ``splits`` the DatasetDict ``p`` has (ValueError naming its splits if none)."""
    have = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
    found = next((s for s in splits if s in have), None)
    if found is None:
        wanted = " or ".join(repr(s) for s in splits)
        fix = "the directory of the split to validate on" if splits == VAL_SPLITS else "one split's directory"
        raise ValueError(f"a save_to_disk DatasetDict with no {wanted} split (it has: "
                         f"{', '.join(have) or 'none'}): point it at {fix} ({p}/<split>)")
    return found


def _loader(kind: str, files: Iterable[Path]) -> str:
    if kind != "chat":
        return LOADERS.get(kind, kind)
    kinds = {"parquet" if f.name.endswith(".parquet") else "json" for f in files}
    if len(kinds) > 1:
        raise ValueError("mixes parquet and JSON files: data=chat reads one kind per input; "
                         "point it at a glob of one of them")
    return kinds.pop()


# ---------------------------------------------------------------------------- cheap reads
@dataclass(frozen=True)
class TokenizerInfo:
    vocab_size: int | None
    """Ids the tokenizer can produce (max id + 1), None when only the tokenizer itself knows."""
    eos_id: int | None


TOKENIZER_FIX = "point data.tokenizer at a tokenizer directory (saved with save_pretrained) or at a tokenizer.json"
TOKENIZER_JSON_MAX = 512 << 20  # (the largest tokenizer.json files are tens of MB; this is data)


def not_tokenizer_json(path: Path) -> str | None:
    """Why the file ``path`` is not a tokenizers JSON, the one file transformers' fast tokenizer
    loads alone (a tokenizer_config.json, a data file, a sentencepiece model), or None."""
    size = path.stat().st_size
    if size > TOKENIZER_JSON_MAX:
        return f"a {size / 2**30:.1f} GiB file"
    try:
        spec = json.loads(path.read_bytes())
    except ValueError as e:  # (JSONDecodeError, UnicodeDecodeError)
        return f"not JSON: {str(e).splitlines()[0]}"
    if isinstance(spec, dict) and "model" in spec:
        return None
    config = "; tokenizer_config.json holds a tokenizer directory's settings" if path.name == "tokenizer_config.json" else ""
    return f"a JSON file without the tokenizer's \"model\"{config}"


def _tokenizer_json(path: Path) -> Path | None:
    p = path / "tokenizer.json" if path.is_dir() else path
    return p if p.is_file() and p.suffix == ".json" else None


def tokenizer_info(path: str | Path) -> TokenizerInfo:
    """Vocabulary size and EOS id from the tokenizer's JSON files alone (no transformers)."""
    path = Path(path).expanduser()
    tj = _tokenizer_json(path)
    if tj is None:
        return TokenizerInfo(None, None)
    spec = json.loads(tj.read_text())
    ids = dict((spec.get("model") or {}).get("vocab") or {})
    if isinstance((spec.get("model") or {}).get("vocab"), list):  # unigram: [[piece, score], ...]
        ids = {piece: i for i, (piece, _) in enumerate(spec["model"]["vocab"])}
    for t in spec.get("added_tokens") or []:
        ids[t["content"]] = t["id"]
    vocab = max(ids.values()) + 1 if ids else None
    return TokenizerInfo(vocab, _eos_id(path, ids))


def _eos_id(path: Path, ids: dict[str, int]) -> int | None:
    """The EOS the tokenizer's config names, else a conventional EOS token in its vocabulary."""
    if path.is_dir():
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            f = path / name
            if f.is_file():
                eos = json.loads(f.read_text()).get("eos_token")
                eos = eos.get("content") if isinstance(eos, dict) else eos
                if isinstance(eos, str) and eos in ids:
                    return ids[eos]
    return next((ids[n] for n in EOS_NAMES if n in ids), None)


def chat_template_of(path: str | Path) -> str | None:
    """The chat template a tokenizer directory carries (tokenizer_config.json's
    ``chat_template``, chat_template.jinja or chat_template.json), None when it has none (a bare
    tokenizer.json never has one)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        return None
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    for name in ("chat_template.json", "tokenizer_config.json"):
        f = path / name
        if f.is_file():
            t = json.loads(f.read_text()).get("chat_template")
            if isinstance(t, list):  # named templates: [{name, template}, ...]
                t = next((x.get("template") for x in t if x.get("name") == "default"), None)
            if isinstance(t, str) and t.strip():
                return t
    return None


def _first_json_record(f: Path) -> Any:
    """The first non-blank line, parsed; a JSON array on it (a compact .json file) is a list of
    records: its first. UTF-8, a byte-order mark skipped (as ``datasets`` reads JSON)."""
    opener = gzip.open if f.name.endswith(".gz") else open
    with opener(f, "rt", encoding="utf-8-sig") as lines:
        for line in lines:
            if line.strip():
                record = json.loads(line)
                return record[0] if isinstance(record, list) and record else record
    return None


def file_keys(f: Path, loader: str, *, whole: bool = False) -> list[str] | None:
    """The keys of one file's records: a parquet file's columns (its schema); a JSON file's first
    record's, or with ``whole`` every record's, in the order they first appear (the run's
    error, after ``datasets`` failed: it reads the file whole); None when unknown (no record,
    a line that is not JSON, a JSON document over several lines without ``whole``)."""
    if loader == "parquet":
        import pyarrow.parquet as pq

        return pq.read_schema(f).names
    opener = gzip.open if f.name.endswith(".gz") else open
    try:
        if not whole:
            record = _first_json_record(f)
            return list(record) if isinstance(record, dict) else None
        with opener(f, "rt", encoding="utf-8-sig") as text:
            records: Iterable[Any] = (json.loads(line) for line in text if line.strip())
            if f.name.endswith((".json", ".json.gz")):  # (one document, a list of records or one; or lines)
                whole_text = text.read()
                try:
                    doc = json.loads(whole_text)
                    records = doc if isinstance(doc, list) else [doc]
                except ValueError:
                    records = (json.loads(line) for line in whole_text.splitlines() if line.strip())
            keys: dict[str, None] = {}
            for record in records:
                keys.update(dict.fromkeys(record if isinstance(record, dict) else ()))
            return list(keys) or None
    except (OSError, ValueError):
        return None


def record_keys(inputs: Inputs) -> tuple[list[str], Any] | None:
    """(the keys / columns of the input's records, the first JSON record or None), read from
    the first file's first line (a one-line JSON array: its first record; the next file's when
    it has none: ``([], None)`` when no file has one), parquet schema or save_to_disk features;
    None when unknown (text; a .json file holding one JSON document over
    several lines, which ``datasets`` reads whole)."""
    if inputs.loader == DISK:
        features = json.loads((inputs.disk / "dataset_info.json").read_text()).get("features") or {}
        return list(features), None
    first = inputs.files[0]
    if inputs.loader == "parquet":
        import pyarrow.parquet as pq

        return pq.read_schema(first).names, None
    if inputs.loader == "json":
        record = None
        for f in inputs.files:  # (the first file's first record; the next file's if it has none)
            try:
                record = _first_json_record(f)
            except json.JSONDecodeError:
                if f.name.endswith((".json", ".json.gz")):
                    return None  # not JSON lines: a whole JSON document
                raise
            if record is not None:
                break
        return (list(record), record) if isinstance(record, dict) else ([], record)
    return None


def _messages_problem(value: Any) -> str | None:
    """Why a record's messages are not a list of {role, content}, or None."""
    if not isinstance(value, list) or not value:
        return f"a {type(value).__name__}, not a non-empty list of messages"
    bad = next((m for m in value if not (isinstance(m, dict) and "role" in m and "content" in m)), None)
    return None if bad is None else (f"a list holding {str(bad)[:80]!r}, which is not a {{role, content}} "
                                     "message")
