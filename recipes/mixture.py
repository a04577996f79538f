"""``data.mixture``: several data sources in one run, each drawn with its weight.

    data.mixture=[{name:text,weight:0.7},{name:chat,path:/data/chats.jsonl,weight:0.3}]

Each entry is one source: ``name`` (a data group: text, jsonl, parquet, chat, tokens,
synthetic), that group's options as ``conf/data/<name>.yaml`` sets them (the entry's own keys
win: ``path``, ``field``, ``tokenizer``, ``val_fraction``, ...), and ``weight`` (> 0; the weights
are normalised). ``data.packing`` and ``data.num_workers`` are the run's (one layout for every
source); ``model.seq_len`` is the run's one window length. A top-level ``data.tokenizer`` is
inherited by the sources that read a tokenizer and set none (``INHERITED``); any other top-level
source key set beside the mixture (``data.val_fraction``, ``data.cache_dir``, ...) is refused,
naming the entry key to set instead: no source would read it. An empty list (the default) is
today's single source, bit for bit.

Sampling. Each source's windows are built as a lone source's are (its held-out windows taken
out first). A mixture *epoch* has as many samples as the sources' training windows together,
N; source s gets ``quota_s``: N x its weight, rounded by largest remainder (at least 1). Its
samples are its windows in a seeded order, repeated when the quota is larger than its windows
(up-sampled), the first quota of them when smaller (down-sampled: the same seeded subset every
epoch). The global-batch sampler (recipes/data.py) then shuffles the N positions per epoch from
the seed as it does any dataset: every rank, every world size and a resumed run read the same
order, and in any run the samples of source s are hypergeometric around weight_s x samples
(exact at each whole epoch). Masked sources (data=chat) keep their counted targets per window,
so the loss stays token-true over the global batch (``CountedShare``).

Validation: each source holds out its own windows (its ``val_fraction`` or ``val_path``, at most
its ``val_samples``); the validation set is their concatenation, in entry order, unweighted.

report.json ``data.mixture``: per source, in entry order, ``name``, ``path``, ``weight``
(normalised), ``windows`` (its training windows), ``samples`` (its quota per mixture epoch),
``tokens`` and ``loss_tokens`` (the targets of its samples in the run's trainer.max_steps
global batches, counted from the sampler's order, and those the loss counts) and ``share``
(its tokens over all sources' tokens).
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any

from recipes.trainer_config import DATASETS, DataConfig

RUN_WIDE = ("packing", "num_workers", "mixture")
"""DataConfig keys that are the run's, not a source's."""
ENTRY_KEYS = tuple(f.name for f in dataclasses.fields(DataConfig) if f.name not in RUN_WIDE) + ("weight",)
INHERITED = ("tokenizer",)
"""Top-level data keys a source takes when its entry does not set one (and its group reads one):
the run's one tokenizer. The other top-level source keys, set beside a mixture, are refused."""
EXAMPLE = "data.mixture=[{name:text,weight:0.7},{name:chat,path:/data/chats.jsonl,weight:0.3}]"


# ------------------------------------------------------------------ the config, at validate
def _group_defaults(name: str, model_path: str | None) -> dict[str, Any]:
    """conf/data/<name>.yaml's values, its interpolations (the tokenizer: the model's directory)
    resolved against ``model.path``."""
    from omegaconf import OmegaConf

    from core.conf import CONF_DIR

    root = OmegaConf.create({"model": {"path": model_path}, "d": OmegaConf.load(CONF_DIR / "data" / f"{name}.yaml")})
    return OmegaConf.to_container(root, resolve=True)["d"]


def _entry_problems(i: int, entry: Any) -> list[str]:
    key = f"data.mixture[{i}]"
    if not isinstance(entry, dict):
        return [f"{key}={entry!r}: each entry is a source, {{name:<data group>,weight:<number>,...}}; "
                f"e.g. {EXAMPLE}"]
    out = []
    name = entry.get("name")
    if name not in DATASETS:
        out.append(f"{key}.name={name!r}: must be one of {', '.join(DATASETS)} (a data group); "
                   f"set {key}.name to one of them")
    w = entry.get("weight")
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0:
        out.append(f"{key}.weight={w!r}: must be a number > 0 (the weights are normalised); "
                   f"set {key}.weight, e.g. 0.3")
    for k in sorted(set(entry) - set(ENTRY_KEYS)):
        why = ("is the run's, one for every source: set data." + k) if k in RUN_WIDE else \
            "the run has one window length, model.seq_len, for every source: remove it" if k == "seq_len" else \
            f"is not a key of a source (known: {', '.join(ENTRY_KEYS)}); remove it"
        out.append(f"{key}.{k}={entry[k]!r}: {why}")
    return out


def _conflicts(data: DataConfig) -> list[str]:
    """Top-level data keys that name a source of their own beside the mixture."""
    out = [f"data.{k}={getattr(data, k)} with data.mixture: the mixture's entries name the sources; "
           f"remove data.{k} and set it inside the entry it belongs to (data.mixture[i].{k})"
           for k in ("path", "val_path") if getattr(data, k) is not None]
    if data.packing != "concat":
        out.append(f"data.packing={data.packing} with data.mixture: a mixture packs with concat only "
                   "(allowed: concat); set data.packing=concat or train one source alone")
    return out


def _top_level(data: DataConfig, model_path: str | None) -> tuple[dict[str, Any], list[str]]:
    """The top-level source keys the user set beside the mixture (they differ from the defaults
    of data=<its group>): those a source inherits (``INHERITED``), and a problem for each other
    one, which no source would read (``path`` and ``val_path``: ``_conflicts``)."""
    defaults = {**dataclasses.asdict(DataConfig()), **_group_defaults(data.name, model_path)}
    inherited, out = {}, []
    for k in ENTRY_KEYS:
        if k in ("name", "path", "val_path", "weight") or getattr(data, k) == defaults.get(k):
            continue
        if k in INHERITED:
            inherited[k] = getattr(data, k)
        else:
            out.append(f"data.{k}={getattr(data, k)} with data.mixture: each source has its own, and the "
                       f"top-level one is not read: remove data.{k} and set it inside the entries it "
                       f"belongs to (data.mixture[i].{k})")
    return inherited, out


def settle(data: DataConfig, model: Any | None) -> tuple[DataConfig, list[str]]:
    """``data`` with each mixture entry completed (its group's defaults, the top-level keys it
    inherits, ``INHERITED``, then its own keys), and every problem of the entries: the entry's
    keys, each source's declared checks and its inputs (recipes/tokens.py ``data_problems``),
    prefixed with ``data.mixture[i]``; and of the top-level keys beside them."""
    from core import knobs
    from recipes.token_checks import mixture_shared_files
    from recipes.tokens import data_problems

    inherited, ignored = _top_level(data, getattr(model, "path", None))
    out = _conflicts(data) + ignored
    settled, read, checked = [], set(), []
    for i, entry in enumerate(data.mixture):
        bad = _entry_problems(i, entry)
        out += bad
        if bad:
            continue
        group = _group_defaults(entry["name"], getattr(model, "path", None))
        read |= inherited.keys() & group.keys()
        values = {**group, **{k: v for k, v in inherited.items() if k in group}, **entry}
        src = source_config(values, data)
        key = f"data.mixture[{i}]"
        declared = knobs.problems(src, key)
        out += declared
        if not declared:
            checked.append((i, src))
            out += [f"{key} (data={src.name}): {p}" for p in data_problems(src, model)]
            vocab = getattr(model, "vocab_size", None)
            if src.name == "text" and not src.tokenized and isinstance(vocab, int) and vocab < 256:
                out.append(f"{key}: byte tokens of data=text need model.vocab_size >= 256 "
                           f"(it is {vocab}): set model.vocab_size=256 or {key}.tokenizer")
        settled.append({**dataclasses.asdict(src), "weight": float(entry["weight"])})
    out += mixture_shared_files(checked)
    if len(settled) == len(data.mixture):  # (every entry read)
        out += [f"data.{k}={inherited[k]} with data.mixture: no source reads one (data=tokens and "
                f"synthetic do not): remove data.{k}" for k in sorted(inherited.keys() - read)]
    for s in settled:
        for k in RUN_WIDE:
            s.pop(k)
    shared = {s["tokenizer"] if s["name"] != "synthetic" else None for s in settled}
    tokenizer = shared.pop() if len(shared) == 1 else data.tokenizer  # (what callbacks.samples encodes with)
    return dataclasses.replace(data, mixture=settled, tokenizer=tokenizer), out


def one_tokenizer(data: DataConfig) -> bool:
    """Every source reads one tokenizer (or all bytes): the run's prompts have one encoding."""
    return len({s.get("tokenizer") for s in data.mixture if s.get("name") != "synthetic"}) <= 1


def source_config(entry: dict[str, Any], data: DataConfig) -> DataConfig:
    """One source as a lone data config: its keys (not ``weight``), the run-wide keys of ``data``."""
    keys = {k: v for k, v in entry.items() if k in ENTRY_KEYS and k != "weight"}
    return DataConfig(**keys, packing=data.packing, num_workers=data.num_workers)


def validates(mixture: list[Any]) -> bool:
    """Some source holds out validation windows (the settled entries)."""
    return any(isinstance(e, dict) and (e.get("val_path") is not None or (e.get("val_fraction") or 0) > 0)
               for e in mixture)


# ------------------------------------------------------------------ the datasets, in the ranks
def build(data: DataConfig, shape: Any, seed: int) -> tuple[Any, Any]:
    """(the training mixture, the sources' held-out windows concatenated, or None)."""
    from torch.utils.data import ConcatDataset

    from recipes.data import build_datasets

    trains, vals, labels, weights = [], [], [], []
    for entry in data.mixture:
        src = source_config(entry, data)
        train, val = build_datasets(src, shape, seed)
        trains.append(train)
        vals += [val] if val is not None else []
        labels.append({"name": src.name, "path": src.path})
        weights.append(entry["weight"])
    return Mixture(trains, weights, seed, labels), (ConcatDataset(vals) if vals else None)


def quotas(weights: list[float], n: int) -> list[int]:
    """``n`` samples split by the normalised ``weights``: largest remainder (ties: the earlier
    source), then at least one sample per source."""
    total = float(sum(weights))
    exact = [w / total * n for w in weights]
    q = [int(x) for x in exact]
    order = sorted(range(len(q)), key=lambda s: (q[s] - exact[s], s))
    for s in order[: n - sum(q)]:
        q[s] += 1
    return [max(1, x) for x in q]


class Mixture:
    """The training set of a mixture (a map-style dataset): positions ``offsets[s] ..
    offsets[s+1]`` are source s's quota, each its ``local[s]`` window of that source (a seeded
    order of its windows, tiled to the quota). The sampler shuffles the positions."""

    def __init__(self, sources: list[Any], weights: list[float], seed: int, labels: list[dict[str, Any]]):
        import itertools

        import numpy as np
        import torch

        from recipes.data import _unwrap

        self.sources, self.labels = sources, labels
        total = float(sum(weights))
        self.weights = [w / total for w in weights]
        self.quota = quotas(weights, sum(len(s) for s in sources))
        self.offsets = list(itertools.accumulate(self.quota, initial=0))
        self.local = []
        for s, (src, q) in enumerate(zip(sources, self.quota)):
            g = torch.Generator().manual_seed(seed * 7919 + 104729 * (s + 1))
            self.local.append(np.resize(torch.randperm(len(src), generator=g).numpy(), q))
        self.seq_len = getattr(_unwrap(sources[0])[0], "seq_len", 1)

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitem__(self, i: int) -> Any:
        if not 0 <= i < len(self):
            raise IndexError(i)
        s = bisect.bisect_right(self.offsets, i) - 1
        return self.sources[s][int(self.local[s][i - self.offsets[s]])]

    def source_of(self) -> Any:
        """Each position's source."""
        import numpy as np

        return np.repeat(np.arange(len(self.quota)), self.quota)

    def _counted(self, full: bool) -> Any:
        import numpy as np

        from recipes.data import counted_per_sample

        if getattr(self, "_memo", None) is not None:  # (a chat source's mask is read once)
            return self._memo[1] if self._memo[0] or full else None
        parts, masked = [], False
        for src, local in zip(self.sources, self.local):
            c = counted_per_sample(src)
            masked = masked or c is not None
            parts.append(np.full(len(local), self.seq_len, dtype=np.int64) if c is None else c[local])
        self._memo = (masked, np.concatenate(parts))
        return self._memo[1] if masked or full else None

    def counted(self) -> Any:
        """Each position's targets the loss counts; None where no source masks any."""
        return self._counted(full=False)

    def counts(self, first: int = 0, stop: int | None = None) -> tuple[int, int]:
        """(targets, targets the loss counts) of positions ``first .. stop - 1``."""
        counted = self._counted(full=True)[first:stop]
        return len(counted) * self.seq_len, int(counted.sum())

    def facts(self, steps: int, global_batch: int, seed: int) -> list[dict[str, Any]]:
        """report.json ``data.mixture``: per source, what the run's ``steps`` global batches draw
        from it, in the sampler's order (``GlobalBatchSampler.epoch_order``)."""
        import numpy as np

        from recipes.data import GlobalBatchSampler

        n, source, counted = len(self), self.source_of(), self._counted(full=True)
        epochs, rest = divmod(steps * global_batch, n)
        head = GlobalBatchSampler.epoch_order(n, seed, epochs).numpy()[:rest]
        k = len(self.quota)
        samples = epochs * np.asarray(self.quota) + np.bincount(source[head], minlength=k)
        loss = epochs * np.bincount(source, weights=counted, minlength=k) \
            + np.bincount(source[head], weights=counted[head], minlength=k)
        tokens = samples * self.seq_len
        return [{**self.labels[s], "weight": round(self.weights[s], 6), "windows": len(self.sources[s]),
                 "samples": self.quota[s], "tokens": int(tokens[s]), "loss_tokens": int(loss[s]),
                 "share": round(float(tokens[s] / max(1, tokens.sum())), 6)} for s in range(k)]
