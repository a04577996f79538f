"""Tokenize jsonl / parquet / text files once, into a cached memory-mapped token file.

    stream = token_file(kind="jsonl", path="chat.jsonl", field="text", tokenizer="/models/tok")

Each document is tokenized (no special tokens added) and followed by the tokenizer's EOS; the
documents are concatenated in file order into one flat token stream, stored as ``uint16`` when
the vocabulary is below 65536 (else ``uint32``) and read back with ``numpy.memmap``; recipes/
data.py cuts it into ``seq_len + 1`` windows, so one cache serves every sequence length.

The cache file is named by a hash of everything that decides its content: the input files
(absolute path, size, modification time), the field, the loader, and the tokenizer's files
(their bytes). A changed input or tokenizer gets a new file; an unchanged one is read, not
re-tokenized. Every rank may call ``token_file`` at once (before or after the process group
exists, on one node or several sharing a file system): an exclusive ``flock`` on a lock file
lets the first one tokenize while the others wait, and the token file appears by atomic rename
only when complete, so no rank ever reads a partial file.

Cheap checks for before launch (no heavy imports): ``tokenizer_info`` reads a tokenizer's
vocabulary size and EOS from its JSON files; ``missing_field`` reads the first record.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when the cache's layout or tokenization rule changes
LOADERS = {"jsonl": "json", "parquet": "parquet", "text": "text"}  # data.name -> datasets loader
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eos|>")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def default_cache_dir() -> Path:
    return Path("~/.cache/stratagem/tokens").expanduser()


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


def missing_field(kind: str, path: str | Path, field: str) -> list[str] | None:
    """The keys of the first record when it lacks ``field`` (None when it has it, or for text)."""
    path = Path(path).expanduser()
    if kind == "jsonl":
        with path.open() as f:
            for line in f:
                if line.strip():
                    record = json.loads(line)
                    keys = list(record) if isinstance(record, dict) else []
                    return None if field in keys else keys
        return None
    if kind == "parquet":
        import pyarrow.parquet as pq

        names = pq.read_schema(path).names
        return None if field in names else names
    return None


# ---------------------------------------------------------------------------- the cache
def cache_key(kind: str, paths: list[Path], field: str, tokenizer: Path) -> str:
    h = hashlib.sha256()
    inputs = []
    for p in paths:
        st = p.stat()
        inputs.append([str(p.resolve()), st.st_size, st.st_mtime_ns])
    h.update(json.dumps({"v": FORMAT_VERSION, "loader": LOADERS[kind], "field": field,
                         "inputs": inputs}).encode())
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
    built: bool
    """This call tokenized it (False: read from the cache)."""

    def array(self) -> Any:
        import numpy as np

        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))


def token_file(*, kind: str, path: str | Path, field: str, tokenizer: str | Path,
               cache_dir: str | Path | None = None) -> TokenFile:
    """The cached token stream of ``path`` (tokenized now if no cache matches)."""
    import fcntl

    src, tok = Path(path).expanduser(), Path(tokenizer).expanduser()
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    key = cache_key(kind, [src], field, tok)
    meta_path, bin_path = cache / f"{key}.json", cache / f"{key}.bin"
    with open(cache / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first caller tokenizes; the others wait here
        try:
            built = not meta_path.is_file()
            if built:
                _build(kind, src, field, tok, bin_path, meta_path)
            meta = json.loads(meta_path.read_text())
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return TokenFile(bin_path, meta["dtype"], meta["n_tokens"], meta["n_docs"], meta["eos_id"],
                     meta["vocab_size"], built)


def load_tokenizer(path: Path) -> Any:
    """A transformers tokenizer from a directory, or a fast one from a tokenizer.json."""
    if path.is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(path))


def _build(kind: str, src: Path, field: str, tok_path: Path, bin_path: Path, meta_path: Path) -> None:
    import numpy as np
    from datasets import load_dataset
    from tqdm.auto import tqdm

    tok = load_tokenizer(tok_path)
    eos = tok.eos_token_id if tok.eos_token_id is not None else tokenizer_info(tok_path).eos_id
    if eos is None:
        raise ValueError(f"data.tokenizer={tok_path}: the tokenizer has no EOS token (documents are "
                         "packed with EOS between them): set eos_token in its tokenizer_config.json")
    vocab = len(tok)
    dtype = np.uint16 if vocab < 2**16 else np.uint32
    kwargs = {"sample_by": "document"} if kind == "text" else {}
    column = "text" if kind == "text" else field
    tmp = bin_path.with_suffix(f".tmp{os.getpid()}")
    n_tokens = n_docs = 0
    # datasets converts the input to Arrow in its own cache: a scratch directory, removed after
    with tempfile.TemporaryDirectory(dir=bin_path.parent, prefix="datasets-") as scratch:
        ds = load_dataset(LOADERS[kind], data_files=str(src), split="train", cache_dir=scratch,
                          **kwargs)
        n_docs = len(ds)
        log.info("tokenizing %s (%d documents, field %r) with %s -> %s", src, n_docs, column,
                 tok_path, bin_path)
        try:
            with open(tmp, "wb") as out, tqdm(total=n_docs, unit="doc", desc="tokenizing",
                                              disable=None) as bar:
                for batch in ds.iter(batch_size=1000):
                    texts = batch[column]
                    ids = tok(texts, add_special_tokens=False)["input_ids"]
                    flat = [t for doc in ids for t in (*doc, eos)]
                    np.asarray(flat, dtype=dtype).tofile(out)
                    n_tokens += len(flat)
                    bar.update(len(texts))
            os.replace(tmp, bin_path)
        finally:
            tmp.unlink(missing_ok=True)
            del ds
    meta = {"dtype": np.dtype(dtype).name, "n_tokens": n_tokens, "n_docs": n_docs, "eos_id": eos,
            "vocab_size": vocab, "source": str(src), "field": column, "tokenizer": str(tok_path)}
    tmp_meta = meta_path.with_suffix(f".tmp{os.getpid()}")
    tmp_meta.write_text(json.dumps(meta, indent=1))
    os.replace(tmp_meta, meta_path)  # the cache entry exists once its meta does
