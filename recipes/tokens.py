"""Tokenize jsonl / parquet / chat / text inputs once, into a cached memory-mapped token file.

    stream = token_file(kind="jsonl", path="/data/corpus/", field="text", tokenizer="/models/tok")

An input (``data.path``) is a file, a directory (its files of the kind, in name order), a glob
(``/data/**/*.parquet``, in name order) or a ``datasets.save_to_disk`` directory
(``resolve_inputs``). Each document is tokenized (no special tokens added) and followed by the
tokenizer's EOS; the documents are concatenated in input order into one flat token stream, stored
as ``uint16`` when the vocabulary is below 65536 (else ``uint32``) and read back with
``numpy.memmap``; recipes/data.py cuts it into ``seq_len + 1`` windows, so one cache serves every
sequence length.

``kind="chat"``: each record holds a conversation, a list of ``{role, content}`` messages
(``field``), rendered with the tokenizer's chat template. With ``train_on="assistant"`` a second
file, one byte per token, says which tokens the loss counts: those of the assistant turns as the
template renders them (what ``render(messages[:i], add_generation_prompt=True)`` adds up to
``render(messages[:i+1])``: the reply and its end-of-turn marker, not the header that prompts
it). A template with ``{% generation %}`` blocks marks them itself (transformers'
``return_assistant_tokens_mask``). A token counts when its first character is inside an
assistant turn; the EOS appended between conversations does not.

The cache file is named by a hash of everything that decides its content: the input files
(absolute path, size, modification time), the field, the loader, ``train_on``, and the
tokenizer's files (their bytes, the chat template included). A changed input or tokenizer gets a
new file; an unchanged one is read, not re-tokenized. Its meta records the largest token id, so
the ids are checked against ``model.vocab_size`` without reading the tokens again. Every rank may
call ``token_file`` at once (before or after the process group exists, on one node or several
sharing a file system): an exclusive ``flock`` on a lock file lets the first one tokenize while
the others wait, and the token file appears by atomic rename only when complete, so no rank ever
reads a partial file.

Pre-tokenized shards (``data=tokens``): ``shard_max_ids`` reads each shard's largest id once and
caches it under the cache directory, keyed by the shard's path, size and modification time.

Cheap checks for before launch (no heavy imports): ``data_problems`` (what recipes/job.py
runs), from ``tokenizer_info`` (vocabulary size and EOS from the tokenizer's JSON files),
``chat_template_of``, and the first record or schema of the input.
"""

from __future__ import annotations

import bisect
import contextlib
import glob
import gzip
import hashlib
import itertools
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # bump when the cache's layout or tokenization rule changes
LOADERS = {"jsonl": "json", "parquet": "parquet", "text": "text"}  # data.name -> datasets loader
JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
SUFFIXES = {"jsonl": JSON_SUFFIXES, "parquet": (".parquet",), "text": (".txt",),
            "chat": (*JSON_SUFFIXES, ".parquet"), "tokens": (".bin",)}
"""A directory's files that an input of each kind reads."""
EXAMPLES = {"jsonl": "/path/to/data.jsonl", "parquet": "/path/to/data.parquet", "text": "/path/to/data.txt",
            "chat": "/path/to/chats.jsonl", "tokens": "/path/to/data.bin"}
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eos|>")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")
DISK = "disk"  # the loader of a save_to_disk directory
GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


def default_cache_dir() -> Path:
    return Path("~/.cache/stratagem/tokens").expanduser()


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


def resolve_inputs(kind: str, path: str | Path) -> Inputs:
    """The files ``path`` names for ``data=<kind>``: a file; a directory's files with the kind's
    suffixes (``SUFFIXES``), in name order; a glob's files in name order (``**`` recurses); or a
    ``datasets.save_to_disk`` directory (a Dataset, or a DatasetDict's ``train`` split; not for
    kind ``tokens``). ValueError says what is wrong (without the key: the caller names it)."""
    raw = str(path)
    p = Path(raw).expanduser()
    disk = None
    if p.is_dir():
        if (p / "dataset_dict.json").is_file():
            splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
            if "train" not in splits:
                raise ValueError(f"a save_to_disk DatasetDict without a 'train' split (it has: "
                                 f"{', '.join(splits) or 'none'}): point it at one split's directory")
            p = p / "train"
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
    opener = gzip.open if f.name.endswith(".gz") else open
    with opener(f, "rt") as lines:
        for line in lines:
            if line.strip():
                return json.loads(line)
    return None


def record_keys(inputs: Inputs) -> tuple[list[str], Any] | None:
    """(the keys / columns of the input's records, the first JSON record or None), read from
    the first file's first line, parquet schema or save_to_disk features; None when unknown
    (text; a .json file holding one JSON document, which ``datasets`` reads whole)."""
    if inputs.loader == DISK:
        features = json.loads((inputs.disk / "dataset_info.json").read_text()).get("features") or {}
        return list(features), None
    first = inputs.files[0]
    if inputs.loader == "parquet":
        import pyarrow.parquet as pq

        return pq.read_schema(first).names, None
    if inputs.loader == "json":
        try:
            record = _first_json_record(first)
        except json.JSONDecodeError:
            if first.name.endswith((".json", ".json.gz")):
                return None  # not JSON lines: a whole JSON document
            raise
        return (list(record), record) if isinstance(record, dict) else ([], record)
    return None


def _messages_problem(value: Any) -> str | None:
    """Why a record's messages are not a list of {role, content}, or None."""
    if not isinstance(value, list) or not value:
        return f"a {type(value).__name__}, not a non-empty list of messages"
    bad = next((m for m in value if not (isinstance(m, dict) and "role" in m and "content" in m)), None)
    return None if bad is None else f"holds {str(bad)[:80]!r}, not a {{role, content}} message"


# ---------------------------------------------------------------------------- checks before launch
def data_problems(data: Any, model: Any | None) -> list[str]:
    """What the data keys name, read cheaply (JSON files, a parquet schema, file sizes, cached
    shard statistics; no tokenizer is loaded): inputs, the record field, the chat template, the
    tokenizer's EOS and vocabulary, the largest token id of pre-tokenized shards."""
    from strategies import checks

    name, out = data.name, []
    if name == "synthetic":
        return out
    example = EXAMPLES[name]
    if data.path is None and name != "text":
        out.append(f"data={name} needs data.path (null now): set data.path={example}"
                   + (" or a directory of *.bin shards" if name == "tokens" else ""))
    vocab = getattr(model, "vocab_size", None)
    vocab = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None
    for key, value in (("data.path", data.path), ("data.val_path", data.val_path)):
        if not value or checks.elsewhere(value):
            continue
        try:
            inputs = resolve_inputs(name, value)
        except (ValueError, OSError) as e:
            out.append(f"{key}={value}: {e}"
                       + (", or data.path=null for the bundled corpus" if name == "text" and
                          key == "data.path" and "does not exist" in str(e) else ""))
            continue
        if name == "tokens":
            out += _shard_problems(key, value, inputs.files, data, vocab)
        elif name == "text" and not data.tokenized:
            if len(inputs.files) != 1 or inputs.disk is not None:
                out.append(f"{key}={value}: data=text without a tokenizer reads one file's bytes: "
                           f"point {key} at a file, or set data.tokenizer to tokenize a directory, "
                           "glob or save_to_disk directory")
        elif name in ("jsonl", "parquet", "chat") or inputs.disk is not None:
            out += _record_problems(key, value, inputs, data)
    if name in ("jsonl", "parquet", "chat") and data.tokenizer is None:
        out.append(f"data={name} needs a tokenizer, and data.tokenizer is null (the model has no "
                   "model.path to take one from): set data.tokenizer=<a tokenizer directory or "
                   "tokenizer.json>")
    if data.tokenized and data.tokenizer is not None and not checks.elsewhere(data.tokenizer):
        out += tokenizer_problems(data.tokenizer, vocab, chat=name == "chat")
    return out


def _record_problems(key: str, value: str, inputs: Inputs, data: Any) -> list[str]:
    chat = data.name == "chat"
    field, knob = (data.messages_field, "data.messages_field") if chat else (data.field, "data.field")
    try:
        found = record_keys(inputs)
    except Exception as e:  # noqa: BLE001  (not JSON, not parquet)
        kind = inputs.loader if chat else data.name
        return [f"{key}={value}: not readable as {kind} ({str(e).splitlines()[0]}): point {key} "
                f"at {' / '.join(SUFFIXES[data.name])} files or choose data=<its kind>"]
    if found is None:
        return []
    keys, record = found
    what = "column" if inputs.loader in ("parquet", DISK) else "key"
    if field not in keys:
        return [f"{knob}={field!r} is not a {what} of {value}'s records (it has: "
                f"{', '.join(map(str, keys)) or 'none'}): set {knob}=<one of them>"]
    if chat and record is not None and (why := _messages_problem(record[field])) is not None:
        return [f"{key}={value}: the first record's {field!r} is {why}: data=chat reads "
                f"{knob} as a list of {{\"role\": ..., \"content\": ...}} messages"]
    return []


def tokenizer_problems(path: str, vocab: int | None, *, chat: bool = False,
                       info_of: Callable[[Path], TokenizerInfo] = tokenizer_info) -> list[str]:
    p = Path(path).expanduser()
    if p.is_dir() and not any((p / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        return [f"data.tokenizer={path}: the directory has no tokenizer.json or "
                "tokenizer_config.json (data.tokenizer defaults to model.path): point it at a "
                "tokenizer saved with save_pretrained, or data.tokenizer=null for byte tokens "
                "(data=text)"]
    try:
        info = info_of(p)
        template = chat_template_of(p) if chat else None
    except Exception as e:  # noqa: BLE001  (not JSON)
        return [f"data.tokenizer={path}: unreadable tokenizer files ({str(e).splitlines()[0]}): "
                "point it at a tokenizer saved with save_pretrained or tokenizers' save()"]
    out = []
    if info.vocab_size is not None and vocab is not None and info.vocab_size > vocab:
        out.append(f"data.tokenizer={path} has {info.vocab_size} token ids but model.vocab_size="
                   f"{vocab}: its ids would index past the embedding; set model.vocab_size>="
                   f"{info.vocab_size} or use the model's own tokenizer")
    if info.vocab_size is not None and info.eos_id is None:
        out.append(f"data.tokenizer={path} names no EOS token (documents are packed with EOS "
                   "between them): set eos_token in its tokenizer_config.json")
    if chat and template is None:
        out.append(f"data.tokenizer={path} has no chat template (no chat_template in its "
                   "tokenizer_config.json, no chat_template.jinja), and data=chat renders each "
                   "conversation with it: point data.tokenizer at a tokenizer that has one (a chat "
                   "model's directory), add a Jinja chat_template to its tokenizer_config.json (or "
                   "a chat_template.jinja file), or use data=jsonl on pre-rendered text")
    return out


def _shard_problems(key: str, value: str, files: tuple[Path, ...], data: Any, vocab: int | None) -> list[str]:
    size = 2 if data.dtype == "uint16" else 4
    odd = [f"{key}: {f} has {f.stat().st_size} bytes, not a multiple of {size} "
           f"(data.dtype={data.dtype}): set data.dtype to the shards' type (uint16, uint32)"
           for f in files if f.stat().st_size % size]
    if odd or vocab is None:
        return odd
    return [p for p in [shard_id_problem(key, value, files, data.dtype, vocab, data.cache_dir)] if p]


def shard_id_problem(key: str, value: Any, files: Iterable[Path], dtype: str, vocab: int,
                     cache_dir: str | Path | None) -> str | None:
    """The error for the first shard holding an id >= ``vocab`` (None when all fit)."""
    files = list(files)
    for f, top in zip(files, shard_max_ids(files, dtype, cache_dir)):
        if top >= vocab:
            return (f"{key}={value}: shard {f.name} holds token id {top} but model.vocab_size={vocab} "
                    f"(the embedding has ids 0..{vocab - 1}; training would fail with an IndexError): "
                    f"set model.vocab_size>={top + 1}, or check data.dtype={dtype} and that the shards "
                    "were made with the model's tokenizer")
    return None


# ---------------------------------------------------------------------------- shard statistics
def shard_max_ids(files: Iterable[Path], dtype: str, cache_dir: str | Path | None = None) -> list[int]:
    """The largest token id of each ``data=tokens`` shard (-1 for an empty one), read once and
    cached in ``cache_dir`` (``shard-<hash>.json``: keyed by the shard's absolute path, size,
    modification time and dtype; an unwritable cache only costs the re-read)."""
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    out = []
    for f in files:
        f = Path(f).expanduser()
        st = f.stat()
        key = hashlib.sha256(json.dumps([str(f.resolve()), st.st_size, st.st_mtime_ns, dtype]).encode())
        entry = cache / f"shard-{key.hexdigest()[:24]}.json"
        try:
            out.append(int(json.loads(entry.read_text())["max_id"]))
            continue
        except (OSError, ValueError, KeyError):
            pass
        top = _max_id(f, dtype)
        try:
            cache.mkdir(parents=True, exist_ok=True)
            tmp = entry.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"max_id": top, "shard": str(f), "size": st.st_size, "dtype": dtype}))
            os.replace(tmp, entry)
        except OSError as e:
            log.warning("could not cache %s's largest token id in %s: %s", f, cache, e)
        out.append(top)
    return out


def _max_id(f: Path, dtype: str, chunk: int = 1 << 26) -> int:
    import numpy as np

    if f.stat().st_size < np.dtype(dtype).itemsize:
        return -1
    a = np.memmap(f, dtype=dtype, mode="r")
    return max(int(a[i : i + chunk].max()) for i in range(0, len(a), chunk))


# ---------------------------------------------------------------------------- the cache
def cache_key(kind: str, paths: Iterable[Path], field: str, tokenizer: Path, *,
              train_on: str | None = None, loader: str | None = None) -> str:
    h = hashlib.sha256()
    inputs = []
    for p in paths:
        st = p.stat()
        inputs.append([str(p.resolve()), st.st_size, st.st_mtime_ns])
    h.update(json.dumps({"v": FORMAT_VERSION, "kind": kind, "loader": loader or LOADERS.get(kind, kind),
                         "field": field, "train_on": train_on, "inputs": inputs}).encode())
    files = ([tokenizer / n for n in TOKENIZER_FILES if (tokenizer / n).is_file()]
             if tokenizer.is_dir() else [tokenizer])
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:24]


@dataclass(frozen=True)
class TokenFile:
    path: Path
    """The flat token array (raw, native byte order)."""
    dtype: str
    n_tokens: int
    n_docs: int
    eos_id: int
    vocab_size: int
    max_id: int
    """The largest token id in the file."""
    n_loss_tokens: int
    """Tokens the loss counts (all of them without a mask)."""
    mask_path: Path | None
    """data=chat, train_on=assistant: one uint8 per token, 1 where the loss counts it."""
    built: bool
    """This call tokenized it (False: read from the cache)."""

    def array(self) -> Any:
        import numpy as np

        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))

    def mask(self) -> Any:
        """The loss mask (a uint8 memmap), or None when every token counts."""
        import numpy as np

        if self.mask_path is None:
            return None
        return np.memmap(self.mask_path, dtype=np.uint8, mode="r", shape=(self.n_tokens,))


def token_file(*, kind: str, path: str | Path, field: str, tokenizer: str | Path,
               cache_dir: str | Path | None = None, train_on: str = "assistant") -> TokenFile:
    """The cached token stream of ``path`` (tokenized now if no cache matches). ``field``: the
    text column, or the messages column (``kind="chat"``); ``train_on`` (chat): ``assistant``
    writes a loss mask, ``all`` none."""
    import fcntl

    inputs = resolve_inputs(kind, path)
    tok = Path(tokenizer).expanduser()
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    train_on = train_on if kind == "chat" else "all"
    key = cache_key(kind, inputs.files, field, tok, train_on=train_on, loader=inputs.loader)
    meta_path, bin_path = cache / f"{key}.json", cache / f"{key}.bin"
    mask_path = cache / f"{key}.mask.bin" if train_on == "assistant" else None
    with open(cache / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first caller tokenizes; the others wait here
        try:
            built = not meta_path.is_file()
            if built:
                _build(kind, inputs, field, tok, train_on, bin_path, mask_path, meta_path, source=str(path))
            meta = json.loads(meta_path.read_text())
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return TokenFile(bin_path, meta["dtype"], meta["n_tokens"], meta["n_docs"], meta["eos_id"],
                     meta["vocab_size"], meta["max_id"], meta["n_loss_tokens"], mask_path, built)


def load_tokenizer(path: Path) -> Any:
    """A transformers tokenizer from a directory, or a fast one from a tokenizer.json."""
    if path.is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(path))


def _load(inputs: Inputs, kind: str, scratch: str) -> Any:
    if inputs.loader == DISK:
        from datasets import load_from_disk

        return load_from_disk(str(inputs.disk))
    from datasets import load_dataset

    kwargs = {"sample_by": "document"} if inputs.loader == "text" else {}
    return load_dataset(inputs.loader, data_files=[str(f) for f in inputs.files], split="train",
                        cache_dir=scratch, **kwargs)


def _build(kind: str, inputs: Inputs, field: str, tok_path: Path, train_on: str, bin_path: Path,
           mask_path: Path | None, meta_path: Path, *, source: str) -> None:
    import numpy as np
    from tqdm.auto import tqdm

    tok = load_tokenizer(tok_path)
    eos = tok.eos_token_id if tok.eos_token_id is not None else tokenizer_info(tok_path).eos_id
    if eos is None:
        raise ValueError(f"data.tokenizer={tok_path}: the tokenizer has no EOS token (documents are "
                         "packed with EOS between them): set eos_token in its tokenizer_config.json")
    if kind == "chat" and not getattr(tok, "chat_template", None):
        raise ValueError(f"data.tokenizer={tok_path} has no chat template, and data=chat renders "
                         "each conversation with it: point data.tokenizer at a tokenizer with a "
                         "chat_template (tokenizer_config.json or chat_template.jinja)")
    vocab = len(tok)
    dtype = np.uint16 if vocab < 2**16 else np.uint32
    column = "text" if kind == "text" and inputs.loader == "text" else field
    tmp = bin_path.with_suffix(f".tmp{os.getpid()}")
    tmp_mask = mask_path.with_suffix(f".tmp{os.getpid()}") if mask_path is not None else None
    n_tokens = n_docs = n_loss = 0
    max_id = -1
    # datasets converts the input to Arrow in its own cache: a scratch directory, removed after
    with tempfile.TemporaryDirectory(dir=bin_path.parent, prefix="datasets-") as scratch:
        ds = _load(inputs, kind, scratch)
        if column not in ds.column_names:
            raise ValueError(f"data.path={source}: the records have no {column!r} column (they have: "
                             f"{', '.join(ds.column_names)}): set data."
                             f"{'messages_field' if kind == 'chat' else 'field'}=<one of them>")
        log.info("tokenizing %s (%d files, %d records, field %r) with %s -> %s", source,
                 len(inputs.files), len(ds), column, tok_path, bin_path)
        try:
            with open(tmp, "wb") as out, (open(tmp_mask, "wb") if tmp_mask else contextlib.nullcontext()) as mout, \
                    tqdm(total=len(ds), unit="doc", desc="tokenizing", disable=None) as bar:
                for batch in ds.iter(batch_size=1000):
                    docs = batch[column]
                    if kind == "chat":
                        ids, masks = chat_tokens(tok, docs, eos, first=n_docs, source=source,
                                                 assistant_only=mask_path is not None)
                    else:
                        ids = [[*d, eos] for d in tok(docs, add_special_tokens=False)["input_ids"]]
                        masks = None
                    flat = np.fromiter((t for doc in ids for t in doc), dtype=np.int64)
                    if len(flat):
                        max_id = max(max_id, int(flat.max()))
                    flat.astype(dtype).tofile(out)
                    if masks is not None:
                        m = np.fromiter((b for doc in masks for b in doc), dtype=np.uint8, count=len(flat))
                        m.tofile(mout)
                        n_loss += int(m.sum())
                    n_tokens += len(flat)
                    n_docs += len(docs)
                    bar.update(len(docs))
            if mask_path is None:
                n_loss = n_tokens
            elif n_loss == 0:
                raise ValueError(f"data.path={source}: no assistant message in any conversation, so "
                                 "data.train_on=assistant leaves nothing to train on: check the "
                                 "records' roles, or set data.train_on=all")
            if mask_path is not None:
                os.replace(tmp_mask, mask_path)
            os.replace(tmp, bin_path)
        finally:
            tmp.unlink(missing_ok=True)
            if tmp_mask is not None:
                tmp_mask.unlink(missing_ok=True)
            del ds
    meta = {"dtype": np.dtype(dtype).name, "n_tokens": n_tokens, "n_docs": n_docs, "eos_id": eos,
            "vocab_size": vocab, "max_id": max_id, "n_loss_tokens": n_loss, "source": source,
            "files": len(inputs.files), "field": column, "train_on": train_on if kind == "chat" else None,
            "tokenizer": str(tok_path)}
    tmp_meta = meta_path.with_suffix(f".tmp{os.getpid()}")
    tmp_meta.write_text(json.dumps(meta, indent=1))
    os.replace(tmp_meta, meta_path)  # the cache entry exists once its meta does


# ---------------------------------------------------------------------------- chat
def chat_tokens(tok: Any, conversations: list[Any], eos: int, *, assistant_only: bool = True,
                first: int = 0, source: str = "data.path") -> tuple[list[list[int]], list[list[int]] | None]:
    """Each conversation's tokens (rendered with ``tok``'s chat template, EOS appended unless
    the template ends with it) and, with ``assistant_only``, its loss mask (1: an assistant
    token). ``first``: the index of the first conversation (for errors)."""
    template = tok.chat_template
    if assistant_only and isinstance(template, str) and GENERATION.search(template):
        return _generation_masks(tok, conversations, eos, first, source)
    texts, spans = [], []
    for n, messages in enumerate(conversations):
        if (why := _messages_problem(messages)) is not None:
            raise ValueError(f"{source}: record {first + n}'s messages are {why}")
        try:
            text, sp = _render(tok, messages, assistant_only)
        except Exception as e:
            raise ValueError(f"{source}: record {first + n} does not render with the chat template "
                             f"of data.tokenizer: {e}") from e
        texts.append(text)
        spans.append(sp)
    ids_out: list[list[int]] = []
    masks_out: list[list[int]] | None = [] if assistant_only else None
    if tok.is_fast:
        enc = tok(texts, add_special_tokens=False, return_offsets_mapping=assistant_only)
        for k, ids in enumerate(enc["input_ids"]):
            ids = list(ids)
            if assistant_only:
                masks_out.append(_span_mask([a for a, _ in enc["offset_mapping"][k]], spans[k]))
            ids_out.append(ids)
    else:  # no offsets: tokenize the pieces between span boundaries separately
        for text, sp in zip(texts, spans):
            cuts = sorted({0, len(text), *(b for s in sp for b in s)})
            ids, mask = [], []
            for a, b in itertools.pairwise(cuts):
                piece = tok(text[a:b], add_special_tokens=False)["input_ids"]
                ids += piece
                mask += [int(any(s <= a < e for s, e in sp))] * len(piece)
            ids_out.append(ids)
            if assistant_only:
                masks_out.append(mask)
    for k, ids in enumerate(ids_out):
        if not ids or ids[-1] != eos:
            ids.append(eos)
            if masks_out is not None:
                masks_out[k].append(0)
    return ids_out, masks_out


def _render(tok: Any, messages: list[dict], spans: bool) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns."""
    def render(msgs: list[dict], prompt: bool) -> str:
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt)

    full = render(messages, False)
    out: list[tuple[int, int]] = []
    if not spans:
        return full, out
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        try:
            before = render(messages[:i], True)
        except Exception:  # (a template that cannot render no messages)
            if i:
                raise
            before = ""
        after = render(messages[: i + 1], False)
        if not (after.startswith(before) and full.startswith(after)):
            raise ValueError(
                f"the template does not render the conversation incrementally (message {i}'s "
                "rendering is not a prefix of the whole), so its assistant tokens cannot be told "
                "apart: mark them with {% generation %} ... {% endgeneration %} in the template, or "
                "set data.train_on=all")
        out.append((len(before), len(after)))
    return full, out


def _span_mask(starts: list[int], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose first character lies in one of the (sorted, disjoint) spans."""
    lo = [s for s, _ in spans]
    mask = []
    for a in starts:
        i = bisect.bisect_right(lo, a) - 1
        mask.append(int(i >= 0 and a < spans[i][1]))
    return mask


def _generation_masks(tok: Any, conversations: list[Any], eos: int, first: int, source: str
                      ) -> tuple[list[list[int]], list[list[int]]]:
    """A template's own ``{% generation %}`` blocks as the loss mask."""
    ids_out, masks_out = [], []
    for n, messages in enumerate(conversations):
        if (why := _messages_problem(messages)) is not None:
            raise ValueError(f"{source}: record {first + n}'s messages are {why}")
        try:
            enc = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
        except Exception as e:
            raise ValueError(f"{source}: record {first + n} does not render with the chat template "
                             f"of data.tokenizer: {e}") from e
        ids, mask = list(enc["input_ids"]), [int(b) for b in enc["assistant_masks"]]
        if not ids or ids[-1] != eos:
            ids.append(eos)
            mask.append(0)
        ids_out.append(ids)
        masks_out.append(mask)
    return ids_out, masks_out
