"""Tokenize jsonl / parquet / chat / text inputs once, into a cached memory-mapped token file.

    stream = token_file(kind="jsonl", path="/data/corpus/", field="text", tokenizer="/models/tok")

An input (``data.path``) is a file, a directory (its files of the kind, in name order), a glob
(``/data/**/*.parquet``, in name order) or a ``datasets.save_to_disk`` directory
(``resolve_inputs``); a data=text ``.txt`` file is one document, its text as written (CRLF kept).
Each document is tokenized (no special tokens added) and followed by the
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

Where each document ends is a third file (one int64 per document, the index of its EOS), and
the meta counts the EOS tokens inside documents: an instruct tokenizer's EOS is often its
end-of-turn marker too (Llama 3's ``<|eot_id|>``, Qwen's ``<|im_end|>``), so EOS tokens alone
do not say where a conversation ends (recipes/data.py ``DocumentRows``, recipes/packing.py).

The cache file is named by a hash of everything that decides its content: the input files
(absolute path, size, modification time), the field, the loader, ``train_on``, and the
tokenizer's files (their bytes, the chat template included). A changed input or tokenizer gets a
new file; an unchanged one is read, not re-tokenized (a checkpoint records the name,
``input_fingerprints``, so a resume on changed data says so). Its meta records the largest token id, so
the ids are checked against ``model.vocab_size`` without reading the tokens again. Every rank may
call ``token_file`` at once (before or after the process group exists, on one node or several
sharing a file system): an exclusive ``flock`` on a lock file lets the first one tokenize while
the others wait, and the token file appears by atomic rename only when complete, so no rank ever
reads a partial file. Whichever rank tokenizes, the console is told who does and how far it got
(recipes/token_progress.py), and the meta records who built the file and when, so a rank that
waited does not call it cached (``TokenFile.origin``).

Beside this module, by job: recipes/token_inputs.py (what an input is and holds, read
cheaply), recipes/token_checks.py (the checks before launch, ``data_problems``, and the shards'
largest ids, ``shard_max_ids``), recipes/chat_tokens.py (conversations to tokens and their loss
mask). Their public names are importable from here too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import DataError
from recipes.chat_tokens import chat_tokens
from recipes.token_checks import (bad_record, cast_problem, data_problems, shard_id_problem,
                                  shard_max_ids, tokenizer_problems)
from recipes.token_inputs import (DISK, EOS_NAMES, EXAMPLES, JSON_SUFFIXES, LOADERS, SUFFIXES,
                                  TOKENIZER_FIX, Inputs, TokenizerInfo, chat_template_of,
                                  default_cache_dir, record_keys, resolve_inputs, splits_of,
                                  tokenizer_info)
from recipes.token_progress import Turn, registered, take, this_rank

log = logging.getLogger(__name__)

FORMAT_VERSION = 3  # bump when the cache's layout or tokenization rule changes
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")


# ---------------------------------------------------------------------------- the cache
def cache_key(kind: str, paths: Iterable[Path], field: str, tokenizer: Path, *,
              train_on: str | None = None, loader: str | None = None) -> str:
    h = hashlib.sha256()
    inputs = []
    for p in paths:
        st = p.stat()
        inputs.append([str(p.resolve()), st.st_size, st.st_mtime_ns])
    loader = loader or LOADERS.get(kind, kind)
    text = {"newlines": "kept"} if loader == "text" else {}  # (a cache from before read CRLF as LF)
    h.update(json.dumps({"v": FORMAT_VERSION, "kind": kind, "loader": loader, "field": field,
                         "train_on": train_on, "inputs": inputs, **text}).encode())
    files = ([tokenizer / n for n in TOKENIZER_FILES if (tokenizer / n).is_file()]
             if tokenizer.is_dir() else [tokenizer])
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:24]


def input_fingerprints(data: Any) -> dict[str, str]:
    """What each training source (``data.path``, or each ``data.mixture[i]``) reads, as it is
    now: tokenized data's token-cache name (``cache_key``: its files' paths, sizes and modification
    times, the tokenizer's files); other data's files the same way (a preference set's tokenizer
    too). A checkpoint records them (checkpoints ``_meta``) and a resume compares them
    (checkpoints/data_stream.py): a file rewritten or a tokenizer overwritten under the same key
    is another stream. None for a source of nothing a user edits (the bundled corpus, synthetic
    data) or that cannot be read now (the data checks say so)."""
    if getattr(data, "mixture", None):
        from recipes.mixture import source_config

        sources = [(f"data.mixture[{i}]", source_config(e, data)) for i, e in enumerate(data.mixture)]
    else:
        sources = [("data.path", data)]
    out = {}
    for label, src in sources:
        if src.name == "synthetic" or src.path is None:
            continue
        with contextlib.suppress(OSError, ValueError, TypeError):
            out[label] = _fingerprint(src)
    return out


def _fingerprint(src: Any) -> str:
    kind, tok = src.name, Path(str(src.tokenizer)).expanduser()
    if src.tokenized and kind != "preference":  # (as token_file names the cache)
        inputs, chat = resolve_inputs(kind, src.path), kind == "chat"
        return cache_key(kind, inputs.files, src.messages_field if chat else src.field, tok,
                         train_on=src.train_on if chat else "all", loader=inputs.loader)
    files = resolve_inputs(kind, src.path).files if kind == "tokens" else (Path(src.path).expanduser(),)
    if kind == "preference":
        return cache_key(kind, files, "", tok)
    h = hashlib.sha256(json.dumps([kind, [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns]
                                          for f in files]]).encode())
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
    ends_path: Path
    """Each document's (conversation's) last token, its EOS: one int64 per document."""
    eos_inside: int
    """EOS tokens inside documents (a chat template whose end-of-turn marker is the EOS)."""
    built: bool
    """This call tokenized it (False: read from the cache)."""
    built_by: int | None = None
    """The rank that tokenized it (None: a cache older than that record)."""
    built_at: float | None = None
    """When its tokenization ended (seconds since the epoch; None: not recorded)."""
    build_seconds: float | None = None
    waited: float = 0.0
    """Seconds this call waited for another process's tokenization of it."""

    def origin(self, since: float) -> str:
        """How this call came by it, for the data line, ``since`` the run's start (seconds since
        the epoch): tokenized by this call, tokenized by another rank (or another job) during
        this run -- this call waited for it, or it ended after ``since`` -- or ``cached``."""
        took = f" in {self.build_seconds:.0f} s" if self.build_seconds is not None else ""
        if self.built:
            return f"tokenized{took}"
        if self.waited or (self.built_at is not None and self.built_at >= since):
            who = f" on rank {self.built_by}" if self.built_by is not None else " by another process"
            return f"tokenized{who}{took}" + (f"; waited {self.waited:.0f} s" if self.waited >= 1 else "")
        return "cached"

    def array(self) -> Any:
        import numpy as np

        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))

    def mask(self) -> Any:
        """The loss mask (a uint8 memmap), or None when every token counts."""
        import numpy as np

        if self.mask_path is None:
            return None
        return np.memmap(self.mask_path, dtype=np.uint8, mode="r", shape=(self.n_tokens,))

    def ends(self) -> Any:
        """Where each document ends (the index of its EOS): data.packing=pad's rows."""
        import numpy as np

        return np.memmap(self.ends_path, dtype=np.int64, mode="r", shape=(self.n_docs,))


def token_file(*, kind: str, path: str | Path, field: str, tokenizer: str | Path,
               cache_dir: str | Path | None = None, train_on: str = "assistant",
               key: str = "data.path", rank: int | None = None) -> TokenFile:
    """The cached token stream of ``path`` (tokenized now if no cache matches). ``field``: the
    text column, or the messages column (``kind="chat"``); ``train_on`` (chat): ``assistant``
    writes a loss mask, ``all`` none. ``key``: the input's key (``data.val_path`` reads a
    DatasetDict's validation split, ``splits_of``), which its errors name. ``rank``: the
    caller's rank in the job, which the console is told (default: the launcher's, ``this_rank``)."""
    import fcntl

    inputs = resolve_inputs(kind, path, splits_of(key))
    tok = Path(tokenizer).expanduser()
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    train_on = train_on if kind == "chat" else "all"
    name = cache_key(kind, inputs.files, field, tok, train_on=train_on, loader=inputs.loader)
    meta_path, bin_path = cache / f"{name}.json", cache / f"{name}.bin"
    mask_path = cache / f"{name}.mask.bin" if train_on == "assistant" else None
    ends_path = cache / f"{name}.ends.bin"
    turn = Turn(str(path), cache / f"{name}.progress", this_rank() if rank is None else rank)
    fresh = not meta_path.is_file()  # (a cache from before: read under the lock, nothing said)
    waited = 0.0
    with open(cache / f"{name}.lock", "w") as lock, \
            (registered(turn) if fresh else contextlib.nullcontext()):
        # the first caller tokenizes; the others wait here (and say for whom: token_progress.py)
        if fresh:
            waited = take(lock, turn, meta_path)
        else:
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            built = not meta_path.is_file()
            if built:
                turn.start(files=len(inputs.files), size=sum(f.stat().st_size for f in inputs.files))
                _build(kind, inputs, field, tok, train_on, bin_path, mask_path, ends_path, meta_path,
                       source=str(path), key=key, turn=turn)
            meta = json.loads(meta_path.read_text())
        finally:
            turn.done()  # (its progress file, before the next rank takes the lock)
            fcntl.flock(lock, fcntl.LOCK_UN)
    by = meta.get("built") or {}
    return TokenFile(bin_path, meta["dtype"], meta["n_tokens"], meta["n_docs"], meta["eos_id"],
                     meta["vocab_size"], meta["max_id"], meta["n_loss_tokens"], mask_path, ends_path,
                     meta["eos_inside"], built, by.get("rank"), by.get("at"), by.get("seconds"),
                     0.0 if built else waited)


def load_tokenizer(path: Path) -> Any:
    """A transformers tokenizer from a directory, or a fast one from a tokenizer.json; one that
    does not load is a DataError naming ``data.tokenizer`` (the checks before launch read its
    JSON files only: a directory's files may still fail to load)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        if path.is_dir():
            return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        return PreTrainedTokenizerFast(tokenizer_file=str(path))
    except Exception as e:  # noqa: BLE001  (tokenizers' Exception, transformers' OSError / ValueError)
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(f"data.tokenizer={path}: cannot load a tokenizer from it ({why}): {TOKENIZER_FIX}") from e


def _load(inputs: Inputs, kind: str, scratch: str, key: str = "data.path") -> Any:
    if inputs.loader == DISK:
        from datasets import load_from_disk

        return load_from_disk(str(inputs.disk))
    from datasets import Dataset, load_dataset

    files = [str(f) for f in inputs.files]
    said = logging.getLogger(f"datasets.packaged_modules.{inputs.loader}.{inputs.loader}")
    level = said.level
    said.setLevel(logging.CRITICAL)  # (its "Failed to load JSON ... in row 3": ours names the line)
    try:
        if inputs.loader == "text":  # (not datasets' text loader: it reads CRLF and CR as LF)
            return Dataset.from_generator(_text_documents, gen_kwargs={"files": files}, cache_dir=scratch)
        return load_dataset(inputs.loader, data_files=files, split="train", cache_dir=scratch)
    except Exception as e:  # noqa: BLE001  (datasets' DatasetGenerationError, pyarrow's: a bad file)
        raise DataError(_unreadable(inputs, e, key)) from e
    finally:
        said.setLevel(level)


def _text_documents(files: list[str]) -> Iterable[dict[str, str]]:
    """data=text: each file one document, its text as written (UTF-8; CRLF and CR kept)."""
    for f in files:
        with open(f, encoding="utf-8", newline="") as text:
            yield {"text": text.read()}


def _unreadable(inputs: Inputs, error: Exception, key: str = "data.path") -> str:
    """What datasets could not read, as one sentence: for JSON lines, the first line that is not
    a JSON object (datasets names an Arrow row, not a line of the file)."""
    if inputs.loader == "json":
        for f in (f for f in inputs.files if f.name.endswith(".jsonl")):
            with open(f, encoding="utf-8-sig", errors="replace") as lines:  # (a BOM: datasets' too)
                for n, line in enumerate(lines, 1):
                    try:
                        ok = not line.strip() or isinstance(json.loads(line), dict)
                    except ValueError as bad:
                        ok, why = False, f"not JSON ({getattr(bad, 'msg', bad)}, column {getattr(bad, 'colno', '?')})"
                    else:
                        why = "not a JSON object"
                    if not ok:
                        return f"{key}={f}: line {n} is {why}: fix or remove that line"
    cause = _cast_error(error) or error.__cause__ or error
    cast = hasattr(cause, "table_column_names")  # (datasets' CastError: a later file's other columns)
    if cast and (said := cast_problem(key, inputs, cause)):
        return said
    lines = str(cause).strip().splitlines()
    why = lines[0] if lines else type(error).__name__
    if cast and callable(getattr(cause, "details", None)):
        why += f": {cause.details()}"  # (its first line is "Couldn't cast", the columns below it)
    return (f"{key}={inputs.files[0] if len(inputs.files) == 1 else inputs.files[0].parent}: "
            f"datasets cannot read it as {inputs.loader} ({why})")


def _cast_error(error: BaseException) -> BaseException | None:
    """datasets' CastError (a later file's other columns) in ``error``'s chain: its cause from
    datasets 4.7 on, the context of the error it raised ``from None`` before that."""
    seen = 0
    while error is not None and seen < 8:
        if hasattr(error, "table_column_names"):
            return error
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


def _tokenizer(tok_path: Path, kind: str) -> tuple[Any, int]:
    """The tokenizer and its EOS id, refused without an EOS (or, for chat, a chat template)."""
    tok = load_tokenizer(tok_path)
    eos = tok.eos_token_id if tok.eos_token_id is not None else tokenizer_info(tok_path).eos_id
    if eos is None:
        raise DataError(f"data.tokenizer={tok_path}: the tokenizer has no EOS token (documents are "
                        "packed with EOS between them): set eos_token in its tokenizer_config.json")
    if kind == "chat" and not getattr(tok, "chat_template", None):
        raise DataError(f"data.tokenizer={tok_path} has no chat template, and data=chat renders "
                        "each conversation with it: point data.tokenizer at a tokenizer with a "
                        "chat_template (tokenizer_config.json or chat_template.jinja)")
    return tok, eos


def _build(kind: str, inputs: Inputs, field: str, tok_path: Path, train_on: str, bin_path: Path,
           mask_path: Path | None, ends_path: Path, meta_path: Path, *, source: str,
           key: str = "data.path", turn: Turn) -> None:
    import numpy as np
    from tqdm.auto import tqdm

    tok, eos = _tokenizer(tok_path, kind)
    vocab = len(tok)
    dtype = np.uint16 if vocab < 2**16 else np.uint32
    column = "text" if kind == "text" and inputs.loader == "text" else field
    tmp = bin_path.with_suffix(f".tmp{os.getpid()}")
    tmp_mask = mask_path.with_suffix(f".tmp{os.getpid()}") if mask_path is not None else None
    tmp_ends = ends_path.with_suffix(f".tmp{os.getpid()}")
    n_tokens = n_docs = n_loss = eos_inside = 0
    max_id = -1
    # datasets converts the input to Arrow in its own cache: a scratch directory, removed after
    with tempfile.TemporaryDirectory(dir=bin_path.parent, prefix="datasets-") as scratch:
        ds = _load(inputs, kind, scratch, key)
        if column not in ds.column_names:
            raise DataError(f"{key}={source}: the records have no {column!r} column (they have: "
                            f"{', '.join(ds.column_names)}): set data."
                            f"{'messages_field' if kind == 'chat' else 'field'}=<one of them>")
        log.info("tokenizing %s: %d records in %d files, field %r, with %s -> %s", source,
                 len(ds), len(inputs.files), column, tok_path, bin_path)
        turn.update(total=len(ds))
        try:
            with open(tmp, "wb") as out, open(tmp_ends, "wb") as eout, \
                    (open(tmp_mask, "wb") if tmp_mask else contextlib.nullcontext()) as mout, \
                    tqdm(total=len(ds), unit="doc", desc="tokenizing", disable=None) as bar:
                for batch in ds.iter(batch_size=1000):
                    docs = batch[column]
                    if kind == "chat":
                        ids, masks = chat_tokens(tok, docs, eos, first=n_docs, source=f"{key}={source}",
                                                 assistant_only=mask_path is not None)
                    else:
                        if not all(isinstance(d, str) for d in docs):  # (cheap beside tokenizing)
                            raise DataError(bad_record(batch, column, n_docs, f"{key}={source}"))
                        ids = [[*d, eos] for d in tok(docs, add_special_tokens=False)["input_ids"]]
                        masks = None
                    flat = np.fromiter((t for doc in ids for t in doc), dtype=np.int64)
                    if len(flat):
                        max_id = max(max_id, int(flat.max()))
                    flat.astype(dtype).tofile(out)
                    ends = n_tokens + np.cumsum([len(doc) for doc in ids], dtype=np.int64) - 1
                    ends.tofile(eout)  # (each document ends in its EOS: chat_tokens, above)
                    eos_inside += int((flat == eos).sum()) - len(ids)
                    if masks is not None:
                        m = np.fromiter((b for doc in masks for b in doc), dtype=np.uint8, count=len(flat))
                        m.tofile(mout)
                        n_loss += int(m.sum())
                    n_tokens += len(flat)
                    n_docs += len(docs)
                    bar.update(len(docs))
                    turn.update(docs=n_docs)
            if mask_path is None:
                n_loss = n_tokens
            elif n_loss == 0:
                raise DataError(f"{key}={source}: no assistant message in any conversation, so "
                                "data.train_on=assistant leaves nothing to train on: check the "
                                "records' roles, or set data.train_on=all")
            if mask_path is not None:
                os.replace(tmp_mask, mask_path)
            os.replace(tmp_ends, ends_path)
            os.replace(tmp, bin_path)
        finally:
            for t in (tmp, tmp_ends, tmp_mask):
                if t is not None:
                    t.unlink(missing_ok=True)
            del ds
    _write_meta(meta_path, {
        "dtype": np.dtype(dtype).name, "n_tokens": n_tokens, "n_docs": n_docs, "eos_id": eos,
        "vocab_size": vocab, "max_id": max_id, "n_loss_tokens": n_loss, "eos_inside": eos_inside,
        "source": source, "files": len(inputs.files), "field": column,
        "train_on": train_on if kind == "chat" else None, "tokenizer": str(tok_path),
        "built": turn.record()})


def _write_meta(meta_path: Path, meta: dict[str, Any]) -> None:
    """The cache entry exists once its meta does (written last, by atomic rename)."""
    tmp_meta = meta_path.with_suffix(f".tmp{os.getpid()}")
    tmp_meta.write_text(json.dumps(meta, indent=1))
    os.replace(tmp_meta, meta_path)


__all__ = [  # (the names callers import from here; each lives in the module of its job)
    "DISK", "EOS_NAMES", "EXAMPLES", "FORMAT_VERSION", "JSON_SUFFIXES", "LOADERS", "SUFFIXES",
    "TOKENIZER_FILES", "Inputs", "TokenFile", "TokenizerInfo", "cache_key", "chat_template_of",
    "chat_tokens", "data_problems", "default_cache_dir", "input_fingerprints", "load_tokenizer",
    "record_keys", "resolve_inputs", "shard_id_problem", "shard_max_ids", "token_file", "tokenizer_info",
    "tokenizer_problems"]
