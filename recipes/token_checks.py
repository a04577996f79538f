"""Checks of the data keys before launch (``data_problems``, what recipes/job.py runs), read
cheaply from what recipes/token_inputs.py finds: the inputs, the record field, the chat template,
the tokenizer's EOS and vocabulary; and the largest token id of pre-tokenized shards
(``data=tokens``): ``shard_max_ids`` reads each shard's once and caches it under the cache
directory, keyed by the shard's path, size and modification time; and the build's warning on
shards too short for a window (``say_short_shards``).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from recipes.data_size import _rank0, no_sample, windows
from recipes.token_inputs import (DISK, EXAMPLES, SUFFIXES, TOKENIZER_FIX, Inputs, TokenizerInfo,
                                  _messages_problem, chat_template_of, default_cache_dir, file_keys,
                                  not_tokenizer_json, record_keys, resolve_inputs, splits_of,
                                  tokenizer_info)

log = logging.getLogger("recipes.tokens")  # (the tokens cache's logger, as before the split)

# ---------------------------------------------------------------------------- checks before launch
def data_problems(data: Any, model: Any | None) -> list[str]:
    """What the data keys name, read cheaply (JSON files, a parquet schema, file sizes, cached
    shard statistics; no tokenizer is loaded): inputs, the record field, the chat template, the
    tokenizer's EOS and vocabulary, the largest token id of pre-tokenized shards."""
    from core import knobs

    name, out = data.name, []
    if name == "synthetic":
        return out
    example = EXAMPLES[name]
    if data.path is None and name != "text":
        out.append(f"data={name} needs data.path (null now): set data.path={example}"
                   + (" or a directory of *.bin shards" if name == "tokens" else ""))
    vocab = getattr(model, "vocab_size", None)
    vocab = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None
    hf = getattr(model, "is_hf", False)
    read: dict[str, Inputs] = {}
    for key, value in (("data.path", data.path), ("data.val_path", data.val_path)):
        if not value or knobs.elsewhere(value):
            continue
        try:
            read[key] = inputs = resolve_inputs(name, value, splits_of(key))
        except OSError as e:  # (a directory on the way this user may not enter)
            out.append(cannot_read(key, value, [(Path(e.filename or value), e)]))
            continue
        except ValueError as e:
            out.append(f"{key}={value}: {e}"
                       + (", or data.path=null for the bundled corpus" if name == "text" and
                          key == "data.path" and "does not exist" in str(e) else ""))
            continue
        if failed := unreadable(inputs.files):
            out.append(cannot_read(key, value, failed, len(inputs.files)))
            continue
        if key == "data.val_path" and "data.path" in read and (
                shared := _shared_files(value, inputs, data.path, read["data.path"])):
            out.append(shared)
            continue
        if name == "tokens":
            out += (_shard_problems(key, value, inputs.files, data, vocab, hf)
                    or _window_problems(key, value, inputs.files, 2 if data.dtype == "uint16" else 4, model))
        elif name == "text" and not data.tokenized:
            if len(inputs.files) != 1 or inputs.disk is not None:
                out.append(f"{key}={value}: data=text without a tokenizer reads one file's bytes: "
                           f"point {key} at a file, or set data.tokenizer to tokenize a directory, "
                           "glob or save_to_disk directory")
            else:
                out += _window_problems(key, value, inputs.files, 1, model)
        elif name in ("jsonl", "parquet", "chat") or inputs.disk is not None:
            out += _record_problems(key, value, inputs, data)
    if name in ("jsonl", "parquet", "chat") and data.tokenizer is None:
        out.append(f"data={name} needs a tokenizer, and data.tokenizer is null ({null_why(model)}): "
                   "set data.tokenizer=<a tokenizer directory or tokenizer.json>")
    if data.tokenized and data.tokenizer is not None and not knobs.elsewhere(data.tokenizer):
        out += tokenizer_problems(data.tokenizer, vocab, chat=name == "chat", hf=hf)
    return out


def unreadable(files: Iterable[Path]) -> list[tuple[Path, OSError]]:
    """The files this process cannot open and read (no read permission, an I/O error), each
    with its error: the checks before launch read little of them, the ranks read them whole."""
    out = []
    for f in files:
        try:
            with open(f, "rb") as handle:
                handle.read(1)
        except OSError as e:
            out.append((Path(f), e))
    return out


def cannot_read(key: str, value: Any, failed: list[tuple[Path, OSError]], total: int = 1) -> str:
    """The one line for ``unreadable``'s answer: the key, its value, the first file that failed
    (and how many of ``total``), why, and the fix."""
    f, e = failed[0]
    why = e.strerror or str(e)
    same = str(f) == str(Path(str(value)).expanduser())
    which = ("it" if same else f"{f}") if total == 1 else f"{len(failed)} of its {total} files, the first {f}"
    mode = "a+rx" if os.path.isdir(f) else "a+r"
    fix = (f"give this user read permission (chmod {mode} {f}) or point {key} at readable data"
           if e.errno in (errno.EACCES, errno.EPERM) else f"check the file system, or point {key} at readable data")
    return f"{key}={value}: cannot read {which} ({why}): {fix}"


def _window_problems(key: str, value: Any, files: Iterable[Path], itemsize: int, model: Any) -> list[str]:
    """Data of no ``model.seq_len + 1``-token window, from the files' sizes (the ranks refuse it,
    recipes/data.py ``TokenWindows``, after launch)."""
    seq_len = getattr(model, "seq_len", None)
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        return []
    lengths = [Path(f).stat().st_size // itemsize for f in files]
    return [] if windows(lengths, seq_len) else [no_sample(f"{key}={value}", sum(lengths), seq_len)]


def say_short_shards(key: str, value: Any, files: list[Path], lengths: list[int], seq_len: int,
                     shown: int = 5) -> None:
    """data=tokens: rank 0 warns, once as the data is built (recipes/data.py), of the shards of
    ``lengths`` tokens too short for one ``seq_len + 1``-token window: windows do not cross shards,
    so their tokens are never read (an empty shard is refused before launch, ``_shard_problems``,
    and data of no window at all, ``_window_problems``). The count, the first ``shown`` with their
    token counts, the fix."""
    short = [(Path(f), n) for f, n in zip(files, lengths) if not windows([n], seq_len)]
    if not short or len(short) == len(files) or not _rank0():
        return
    root = os.path.commonpath([str(Path(f).parent) for f in files])
    named = ", ".join(f"{os.path.relpath(f, root)} ({n} tokens)" for f, n in short[:shown])
    more = f" and {len(short) - shown} more" if len(short) > shown else ""
    log.warning("%s=%s: %d of its %d shards hold fewer than model.seq_len + 1 = %d tokens, so no window "
                "(windows do not cross shards) and their %d tokens are never read: %s%s; concatenate "
                "the small shards into larger ones, or lower model.seq_len (a shard of n tokens holds a "
                "window from model.seq_len=n-1 down)", key, value,
                len(short), len(files), seq_len + 1, sum(n for _, n in short), named, more)


def _shared_files(value: Any, val: Inputs, path: Any, train: Inputs, val_key: str = "data.val_path",
                  path_key: str = "data.path") -> str | None:
    """The error for a ``data.val_path`` (``val_key``) that reads files ``data.path`` (``path_key``:
    its own, or another mixture entry's) reads too (the same ones: a file and a glob of it, a
    directory and its files; or some: a validation file inside the training directory or glob),
    naming them and the side to narrow; None when they share none."""
    train_files = {f.resolve(): f for f in train.files}
    val_files = {f.resolve(): f for f in val.files}
    shared = [f for r, f in val_files.items() if r in train_files]
    if not shared:
        return None
    rest_val = [f for r, f in val_files.items() if r not in train_files]
    rest_train = [f for r, f in train_files.items() if r not in val_files]
    if not rest_val and not rest_train:
        return (f"{val_key}={value}: the same files as {path_key}={path}, so the validation loss "
                f"would be a training loss: point {val_key} at held-out data, or remove it and "
                f"set {val_key.removesuffix('val_path')}val_fraction")
    named = ", ".join(map(str, shared[:3])) + (f" and {len(shared) - 3} more" if len(shared) > 3 else "")
    which = (f"its file {shared[0]} is also" if len(val.files) == 1 else
             f"{len(shared)} of its {len(val.files)} files {'is' if len(shared) == 1 else 'are'} also")
    whose = f"one of {path_key}={path}'s" + ("" if len(val.files) == 1 else f" ({named})")

    def alone(key: str, files: list[Path], what: str) -> str:
        them = "it" if len(shared) == 1 else "them"
        where = f"{key}={files[0]}" if len(files) == 1 else f"a glob or directory that leaves {them} out"
        return f"point {key} at the {what} files alone ({where})"

    fix = " or ".join([alone(path_key, rest_train, "training")] * bool(rest_train)
                      + [alone(val_key, rest_val, "held-out")] * bool(rest_val))
    return (f"{val_key}={value}: {which} {whose}, so the validation loss would be partly a "
            f"training loss: {fix}")


def mixture_shared_files(sources: list[tuple[int, Any]]) -> list[str]:
    """data.mixture: each entry's ``val_path`` that reads files another entry's ``path`` trains
    on (``_shared_files``; an entry's own pair is ``data_problems``'), one line per pair naming
    both; and each entry's ``val_fraction`` whose files another entry's ``path`` reads
    (``_held_out_shared``). ``sources``: (index, the settled source config); inputs that do not
    resolve are skipped (``data_problems`` names them)."""
    from core import knobs

    def inputs(src: Any, key: str) -> Inputs | None:
        value = getattr(src, key)
        if not value or knobs.elsewhere(value):
            return None
        try:
            return resolve_inputs(src.name, value, splits_of(key))
        except (OSError, ValueError):
            return None

    train = {i: inputs(src, "path") for i, src in sources}
    out = []
    for i, src in sources:
        if (val := inputs(src, "val_path")) is None:
            out += _held_out_shared(i, src, sources, train)
            continue
        out += [line for j, other in sources if j != i and train[j] is not None and (
            line := _shared_files(src.val_path, val, other.path, train[j],
                                  f"data.mixture[{i}].val_path", f"data.mixture[{j}].path"))]
    return out


def _held_out_shared(i: int, src: Any, sources: list[tuple[int, Any]],
                     train: dict[int, Inputs | None]) -> list[str]:
    """Entry ``i``'s ``val_fraction`` holds out the last windows of its own files; another entry
    whose ``path`` reads any of those files trains on them (unless it is the same source, which
    holds out the same windows). One line per such entry. (data=jsonl's own default val_fraction
    is 0.01: two entries over one file with other tokenizers leak at their defaults.)"""
    if not getattr(src, "val_fraction", 0) or train[i] is None:
        return []
    mine = {f.resolve() for f in train[i].files}
    out = []
    for j, other in sources:
        if j == i or train[j] is None or other == src:  # (the same source twice: the same windows held out)
            continue
        shared = [f for f in train[j].files if f.resolve() in mine]
        if shared:
            named = ", ".join(map(str, shared[:3])) + (f" and {len(shared) - 3} more" if len(shared) > 3 else "")
            out.append(f"data.mixture[{i}].val_fraction={src.val_fraction} holds out windows of "
                       f"data.mixture[{i}].path={src.path}, but data.mixture[{j}].path={other.path} "
                       f"trains on the same file{'s' if len(shared) > 1 else ''} ({named}), so the "
                       f"validation loss would be partly a training loss: give the two entries "
                       f"separate files, or validate on held-out data (data.mixture[{i}].val_path)")
    return out


def null_why(model: Any | None) -> str:
    """Why data.tokenizer is null: set so over its default, or no model.path to default to."""
    if getattr(model, "path", None) is not None:
        return (f"set so, over its default model.path={model.path}; remove data.tokenizer=null to "
                "take the model's")
    return "the model has no model.path to take one from"


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
    if inputs.loader == "json" and record is None:
        return [f"{key}={value}: holds no records (its {'file is' if len(inputs.files) == 1 else 'files are'} "
                f"empty or blank lines only): point {key} at {data.name} data with records"]
    what = "column" if inputs.loader in ("parquet", DISK) else "key"
    if field not in keys:
        return [f"{knob}={field!r} is not a {what} of {value}'s records (it has: "
                f"{', '.join(map(str, keys)) or 'none'}): set {knob}=<one of them>"]
    if (other := _other_files(key, value, inputs, field, knob)) is not None:
        return [other]
    if chat and record is not None and (why := _messages_problem(record[field])) is not None:
        return [f"{key}={value}: the first record's {field!r} is {why}: data=chat reads "
                f"{knob} as a list of {{\"role\": ..., \"content\": ...}} messages"]
    roles = {str(m["role"]) for m in record[field]} if chat and record is not None else set()
    if data.train_on == "assistant" and roles - ROLES and "assistant" not in roles:
        return [f"{key}={value}: the first record's roles are {', '.join(sorted(roles))}, none of them "
                "'assistant', and data.train_on=assistant trains on the assistant turns alone: name "
                f"the roles as chat templates do ({', '.join(sorted(ROLES))}), or set data.train_on=all"]
    return []


def _other_files(key: str, value: Any, inputs: Inputs, field: str, knob: str) -> str | None:
    """A file after the first that the run cannot read as the first: its first record (a parquet
    file: its columns) without the field, or a parquet column the first file lacks (datasets
    reads every file with the first one's columns: "Couldn't cast"). A JSON file's later records
    may hold keys its first lacks, so a JSON key the first file's first record lacks is left to
    the run (``cast_problem``)."""
    if inputs.loader not in ("json", "parquet"):
        return None
    found = [(f, k) for f in inputs.files if (k := file_keys(f, inputs.loader)) is not None]
    if len(found) < 2:
        return None
    parquet, (first, first_keys) = inputs.loader == "parquet", found[0]
    for f, keys in found[1:]:
        if field not in keys:
            whose, have = ("columns have", "have") if parquet else ("first record has", "has")
            return (f"{key}={value}: {f}'s {whose} no {field!r} (it has: {', '.join(keys) or 'none'}), "
                    f"while {first.name}'s {have}: every file must hold {knob}={field!r}: fix that "
                    f"file, or point {key} at the files that have it")
        if parquet and (extra := [c for c in keys if c not in first_keys]):
            return (f"{key}={value}: {f} has the column{'s' * (len(extra) > 1)} {', '.join(extra)} "
                    f"that {first.name} (the first file: {', '.join(first_keys)}) lacks, and datasets "
                    "reads every file with the first one's columns: give the files the same "
                    f"columns, or point {key} at files of one layout")
    return None


def cast_problem(key: str, inputs: Inputs, error: Any) -> str | None:
    """After the run's ``datasets`` failed to cast a file to the first file's columns (its
    ``CastError``): the first later file whose records hold a key the first's lack, read whole,
    and those keys; None when none is found."""
    new = [c for c in error.table_column_names if c not in error.requested_column_names]
    what = "column" if inputs.loader == "parquet" else "key"
    for f in inputs.files[1:]:
        extra = [c for c in file_keys(f, inputs.loader, whole=True) or () if c in new]
        if extra:
            return (f"{key}={f}: its records have the {what}{'s' * (len(extra) > 1)} {', '.join(extra)} "
                    f"that {inputs.files[0].name}'s (the first file's: "
                    f"{', '.join(error.requested_column_names)}) lack, and datasets reads every file "
                    f"with the first one's {what}s: give every file's records the same {what}s, or "
                    f"point {key} at files of one layout")
    return None


def bad_record(batch: dict[str, list[Any]], column: str, first: int, what: str) -> str:
    """The error for the first record of ``batch`` whose ``column`` is not a string (the field
    missing, which Arrow reads as null, null, or another type), found while tokenizing
    (recipes/tokens.py; the checks above read the first record): its number, counted from 1
    over the input's records (``first`` of them before the batch), and what it holds."""
    i = next(i for i, d in enumerate(batch[column]) if not isinstance(d, str))
    value = batch[column][i]
    if value is None:
        why = f"it has: {', '.join(k for k in batch if k != column and batch[k][i] is not None) or 'nothing'}"
    else:
        kind = type(value).__name__
        why = f"its {column!r} is {'an' if kind[0] in 'aeiou' else 'a'} {kind}: {str(value)[:60]}"
    return f"{what}: record {first + i + 1} has no {column!r} string ({why}): fix or remove it"


ROLES = {"system", "user", "assistant", "tool"}
"""The roles chat templates know: a first record with others and no assistant names its roles
otherwise (ShareGPT's human / gpt)."""


def tokenizer_problems(path: str, vocab: int | None, *, chat: bool = False, hf: bool = False,
                       info_of: Callable[[Path], TokenizerInfo] = tokenizer_info) -> list[str]:
    """``hf``: the model is a transformers model, its vocabulary config.json's (not a knob)."""
    p = Path(path).expanduser()
    if p.is_dir() and not any((p / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        return [f"data.tokenizer={path}: the directory has no tokenizer.json or "
                "tokenizer_config.json (data.tokenizer defaults to model.path): point it at a "
                "tokenizer saved with save_pretrained"
                + ("" if chat else ", or data.tokenizer=null for byte tokens (data=text)")]
    if p.is_file() and (why := not_tokenizer_json(p)) is not None:
        home = any((p.parent / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json"))
        fix = (f"point data.tokenizer at its directory (data.tokenizer={p.parent}) or at a tokenizer.json"
               if home else TOKENIZER_FIX)
        return [f"data.tokenizer={path}: not a tokenizer.json ({why}): {fix}"]
    try:
        info = info_of(p)
        template = chat_template_of(p) if chat else None
    except Exception as e:  # noqa: BLE001  (not JSON)
        return [f"data.tokenizer={path}: unreadable tokenizer files ({str(e).splitlines()[0]}): "
                "point it at a tokenizer saved with save_pretrained or tokenizers' save()"]
    out = []
    if info.vocab_size is not None and vocab is not None and info.vocab_size > vocab:
        out.append(f"data.tokenizer={path} has {info.vocab_size} token ids but {vocab_named(vocab, hf)}: "
                   f"its ids would index past the embedding; {vocab_fix(info.vocab_size, hf)}")
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


def _shard_problems(key: str, value: str, files: tuple[Path, ...], data: Any, vocab: int | None,
                    hf: bool) -> list[str]:
    size = 2 if data.dtype == "uint16" else 4
    odd = [f"{key}: {f} has {f.stat().st_size} bytes, not a multiple of {size} "
           f"(data.dtype={data.dtype}): set data.dtype to the shards' type (uint16, uint32)"
           for f in files if f.stat().st_size % size]
    odd += [f"{key}={value}: shard {f} is empty (0 bytes), which cannot be read as tokens: remove "
            f"it, or point {key} at the shards that hold tokens" for f in files if not f.stat().st_size]
    if odd or vocab is None:
        return odd
    return [p for p in [shard_id_problem(key, value, files, data.dtype, vocab, data.cache_dir, hf=hf)] if p]


def shard_id_problem(key: str, value: Any, files: Iterable[Path], dtype: str, vocab: int,
                     cache_dir: str | Path | None, *, hf: bool = False) -> str | None:
    """The error for the first shard holding an id >= ``vocab`` (None when all fit)."""
    files = list(files)
    try:
        tops = shard_max_ids(files, dtype, cache_dir)
    except OSError as e:  # (unreadable since the check before launch: its one line)
        return cannot_read(key, value, [(Path(e.filename or files[0]), e)])
    for f, top in zip(files, tops):
        if top >= vocab:
            return (f"{key}={value}: shard {f.name} holds token id {top} but {vocab_named(vocab, hf)} "
                    f"(the embedding has ids 0..{vocab - 1}; training would fail with an IndexError): "
                    f"{vocab_fix(top + 1, hf)}; check data.dtype={dtype} and that the shards were "
                    "made with the model's tokenizer")
    return None


def vocab_named(vocab: int, hf: bool) -> str:
    """The model's vocabulary as the user sets it: a knob of ours, or a transformers model's
    config.json (``hf``), where it is not one."""
    return f"the model's vocabulary (config.json's vocab_size) is {vocab}" if hf else f"model.vocab_size={vocab}"


def vocab_fix(need: int, hf: bool) -> str:
    """The fix for ids up to ``need - 1`` past the vocabulary (see ``vocab_named``)."""
    if hf:
        return (f"use the model's own tokenizer (data.tokenizer defaults to model.path), or a model "
                f"whose vocabulary covers {need} ids")
    return f"set model.vocab_size>={need} or use the model's own tokenizer"


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
