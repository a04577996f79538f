"""Datasets and the global-batch sampler.

Data order is a function of the seed and the global batch only: step k trains on samples
``k*G .. k*G+G-1`` of a seeded stream of epoch permutations, and data-parallel rank r takes the
r-th contiguous slice of that global batch, cut into micro-batches. So the union over ranks at
step k is the same set whatever the data-parallel size or accumulation — the property the
equivalence tests stand on. Resuming at step s starts the stream at s (no skipped batches).

Token streams (the bundled text's bytes, a tokenized jsonl/parquet/chat/text cache from
recipes/tokens.py, pre-tokenized shards) are cut into non-overlapping ``seq_len + 1`` windows
(stride ``seq_len``: a window's last token is the next one's first, so every token is read once
as input and once as target). A chat stream's loss mask (recipes/chat_tokens.py) is cut the same way:
a target the loss does not count is ``IGNORE``, which every backend's loss skips
(recipes/training.py ``token_loss``, recipes/evaluation.py), and the loss is token-true over the
global batch (``CountedShare``). With ``data.packing=concat`` (the default) packed documents are
not isolated from each other: a window's tokens attend to the earlier documents in it;
``document`` masks them apart in the model, ``pad`` serves one per row (``DocumentRows``; see
recipes/packing.py). Validation holds out
the last windows of the stream (``data.val_fraction``) or reads ``data.val_path``;
``ValidationBatches`` serves the same fixed held-out samples on every world size.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from core.errors import DataError
# (VAL_MIN_SAMPLES and held_out: importable from here, as before they moved)
from recipes.data_size import (CORPUS, VAL_MIN_SAMPLES, epochs, held_out, no_sample, say_empty_step,  # noqa: F401
                               say_split, windows)

log = logging.getLogger(__name__)


IGNORE = -100  # a target cross entropy skips (torch's default ignore_index)


class TokenWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens over one or more flat token arrays
    (numpy memmaps or arrays; windows never cross arrays), as int64 (inputs, targets).
    ``masks``: per array, None or a same-length 0/1 array; a target whose token is 0 there is
    ``IGNORE``. ``n_loss``: per array, its count of 1s (known from the cache; else counted)."""

    def __init__(self, arrays: list[Any], seq_len: int, *, what: str = "data",
                 masks: list[Any] | None = None, n_loss: list[int | None] | None = None):
        self.arrays, self.seq_len = list(arrays), seq_len
        self.masks = list(masks) if masks is not None else [None] * len(self.arrays)
        self.n_loss = list(n_loss) if n_loss is not None else [None] * len(self.arrays)
        counts = [windows([len(a)], seq_len) for a in self.arrays]
        self.starts = list(itertools.accumulate(counts, initial=0))
        if len(self) < 1:
            raise DataError(no_sample(what, sum(len(a) for a in self.arrays), seq_len))

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        a = bisect.bisect_right(self.starts, i) - 1
        j = (i - self.starts[a]) * self.seq_len
        chunk = torch.from_numpy(np.asarray(self.arrays[a][j : j + self.seq_len + 1], dtype=np.int64))
        x, y = chunk[:-1], chunk[1:]
        if self.masks[a] is not None:
            counted = torch.from_numpy(np.asarray(self.masks[a][j + 1 : j + self.seq_len + 1], dtype=bool))
            y = y.masked_fill(~counted, IGNORE)
        return x, y

    def counted(self) -> np.ndarray | None:
        """Each window's targets the loss counts (data=chat's mask, read once a window at a
        time); None where every target counts (no mask)."""
        if all(m is None for m in self.masks):
            return None
        s, parts = self.seq_len, []
        for a, mask in enumerate(self.masks):
            n = self.starts[a + 1] - self.starts[a]
            parts.append(np.full(n, s, dtype=np.int64) if mask is None else
                         np.asarray(mask[1:1 + n * s], dtype=bool).reshape(n, s).sum(1, dtype=np.int64))
        return np.concatenate(parts)

    def counts(self, first: int = 0, stop: int | None = None) -> tuple[int, int]:
        """(targets, targets the loss counts) of windows ``first .. stop - 1``: the targets of
        consecutive windows of one array are one contiguous run of its tokens."""
        stop = len(self) if stop is None else stop
        tokens = loss = 0
        for a, arr in enumerate(self.arrays):
            lo, hi = max(first, self.starts[a]), min(stop, self.starts[a + 1])
            if lo >= hi:
                continue
            n = (hi - lo) * self.seq_len
            tokens += n
            mask = self.masks[a]
            if mask is None:
                loss += n
                continue
            i, j = (lo - self.starts[a]) * self.seq_len + 1, (hi - self.starts[a]) * self.seq_len + 1
            if self.n_loss[a] is not None and n > len(arr) // 2:  # the smaller read: the rest
                loss += self.n_loss[a] - _ones(mask, 0, i) - _ones(mask, j, len(arr))
            else:
                loss += _ones(mask, i, j)
        return tokens, loss


def _ones(mask: Any, i: int, j: int, chunk: int = 1 << 26) -> int:
    return sum(int(np.count_nonzero(mask[k : min(j, k + chunk)])) for k in range(i, j, chunk))


class TextDataset(TokenWindows):
    """Byte tokens of a UTF-8 text file (the bundled corpus by default)."""

    def __init__(self, path: str | Path | None, seq_len: int, key: str = "data.path"):
        data = Path(path or CORPUS).read_bytes()
        super().__init__([np.frombuffer(data, dtype=np.uint8)], seq_len, what=f"{key}={path}")


class DocumentRows(Dataset):
    """``data.packing=pad``: one document per row of ``seq_len + 1`` tokens (inputs, targets),
    a longer document continuing on further rows (stride ``seq_len``, as windows cut the
    stream), padded with EOS inputs and ``IGNORE`` targets. ``mask``: data=chat's loss mask;
    ``ends``: each document's last token (its EOS; recipes/tokens.py), else every EOS ends one."""

    def __init__(self, array: Any, seq_len: int, eos: int, *, mask: Any = None, ends: Any = None):
        self.array, self.seq_len, self.eos, self.mask = array, seq_len, eos, mask
        ends = np.flatnonzero(np.asarray(array) == eos) if ends is None else np.asarray(ends)
        bounds = np.concatenate([[0], ends[ends > 0]])  # document k: bounds[k] .. bounds[k + 1]
        if len(bounds) < 2:
            raise DataError(f"data.packing=pad: the token stream holds no document ending in EOS ({eos})")
        lo, hi = bounds[:-1], bounds[1:]
        pieces = -(-(hi - lo) // seq_len)  # rows per document
        doc = np.repeat(np.arange(len(lo)), pieces)
        k = np.arange(len(doc)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        self.first = lo[doc] + k * seq_len  # each row's first input and its end (exclusive),
        self.stop = np.minimum(self.first + seq_len, hi[doc])  # whose last target is the EOS

    def __len__(self) -> int:
        return len(self.first)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = int(self.first[i]), int(self.stop[i])
        n = b - a
        x = torch.full((self.seq_len,), self.eos, dtype=torch.int64)
        y = torch.full((self.seq_len,), IGNORE, dtype=torch.int64)
        x[:n] = torch.from_numpy(np.asarray(self.array[a:b], dtype=np.int64))
        y[:n] = torch.from_numpy(np.asarray(self.array[a + 1:b + 1], dtype=np.int64))
        if self.mask is not None:
            counted = torch.from_numpy(np.asarray(self.mask[a + 1:b + 1], dtype=bool))
            y[:n] = y[:n].masked_fill(~counted, IGNORE)
        return x, y

    def counted(self) -> np.ndarray:
        """Each row's targets the loss counts (recipes/data.py ``counted_per_sample``)."""
        if self.mask is None:
            return (self.stop - self.first).astype(np.int64)
        ones = np.concatenate([[0], np.cumsum(np.asarray(self.mask, dtype=np.int64))])
        return ones[self.stop + 1] - ones[self.first + 1]

    def counts(self, first: int = 0, stop: int | None = None) -> tuple[int, int]:
        """(targets, targets the loss counts) of rows ``first .. stop - 1``: report.json's
        ``data``; padding is neither."""
        rows = slice(first, stop)
        return int((self.stop[rows] - self.first[rows]).sum()), int(self.counted()[rows].sum())


class SyntheticDataset(Dataset):
    """Random tokens, generated per index from a fixed seed: no I/O, reproducible."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int = 0):
        self.num_samples, self.seq_len, self.vocab_size, self.seed = num_samples, seq_len, vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        chunk = torch.randint(self.vocab_size, (self.seq_len + 1,), generator=g)
        return chunk[:-1], chunk[1:]


class GlobalBatchSampler:
    """Yields this rank's micro-batches (lists of indices), step after step.

    A batch sampler for ``DataLoader(batch_sampler=...)``; Lightning must not replace it
    (``use_distributed_sampler=False``).
    """

    def __init__(self, n: int, *, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int,
                 seed: int, steps: int, start_step: int = 0):
        if global_batch % (micro_batch * dp_size):
            raise ValueError(f"global batch {global_batch} is not micro {micro_batch} x dp {dp_size} x k")
        self.n, self.global_batch, self.micro_batch = n, global_batch, micro_batch
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.steps, self.start_step = steps, start_step
        self.accumulation = global_batch // (micro_batch * dp_size)
        self.batch_size = micro_batch  # what engines read off a batch sampler (DeepSpeed's micro batch)
        self._perm: tuple[int, torch.Tensor] | None = None

    @staticmethod
    def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
        """The order of ``n`` samples in epoch ``epoch`` of the stream (a seeded permutation)."""
        return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))

    def _sample(self, position: int) -> int:
        epoch, offset = divmod(position, self.n)
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, self.epoch_order(self.n, self.seed, epoch))
        return int(self._perm[1][offset])

    def global_indices(self, step: int) -> list[int]:
        first = step * self.global_batch
        return [self._sample(first + j) for j in range(self.global_batch)]

    def __iter__(self):
        per_rank = self.global_batch // self.dp_size
        for step in range(self.start_step, self.steps):
            mine = self.global_indices(step)[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
            for a in range(self.accumulation):
                yield mine[a * self.micro_batch : (a + 1) * self.micro_batch]

    def __len__(self) -> int:
        # The whole run is one Lightning epoch; a resumed run's restored batch count plus what
        # this iterator still yields adds up to this length.
        return self.steps * self.accumulation


class CountedShare:
    """Token-true loss weights: the share of the targets of step ``step``'s global batch that the
    loss counts (1.0 where every target counts: unmasked data). Every rank computes it from the
    sampler's order and each sample's counted targets, with no communication.

    A micro-batch's loss is its sum of token losses over (its targets x this share): averaged
    over micro-batches and the ranks the gradient is averaged over, that is the sum of every
    counted token's loss in the global batch over their number, whatever the micro batch,
    accumulation, data-parallel, pipeline or sequence layout. Unmasked data divides by the
    micro-batch's target count, as a per-micro-batch mean does: the same numbers bit for bit.
    A step whose global batch counts no target divides by 1 (loss and gradient 0, no NaN for
    early stopping to act on): said once (recipes/data_size.py ``say_empty_step``)."""

    def __init__(self, dataset: Dataset, *, global_batch: int, seed: int):
        self.counted = counted_per_sample(dataset)
        self.order = GlobalBatchSampler(len(dataset), global_batch=global_batch, micro_batch=global_batch,
                                        dp_rank=0, dp_size=1, seed=seed, steps=0)
        self.seq_len = getattr(_unwrap(dataset)[0], "seq_len", 1)
        self._last: tuple[int, float] = (-1, 1.0)
        self._said = False

    def __call__(self, step: int) -> float:
        if self.counted is None:
            return 1.0
        if self._last[0] != step:
            idx = self.order.global_indices(step)
            n = int(self.counted[idx].sum())
            if n == 0 and not self._said:
                self._said = say_empty_step(step, len(idx))
            self._last = (step, max(n, 1) / (len(idx) * self.seq_len))
        return self._last[1]


def _unwrap(dataset: Dataset) -> tuple[Dataset, list[Any]]:
    """(the dataset under any ``Subset``s, their indices from the innermost out)."""
    chain: list[Any] = []
    while isinstance(dataset, Subset):
        chain.append(dataset.indices)
        dataset = dataset.dataset
    return dataset, chain[::-1]


def counted_per_sample(dataset: Dataset) -> np.ndarray | None:
    """Each sample's number of targets the loss counts, or None when every target counts (no
    loss mask, no padding): the base dataset's ``counted``, through the subsets that cut it."""
    base, chain = _unwrap(dataset)
    counts = getattr(base, "counted", lambda: None)()
    if counts is None:
        return None
    for indices in chain:
        counts = counts[np.asarray(indices)]
    return counts


def shard_index(length: int, rank: int, degree: int, balanced: bool = False) -> Any:
    """The positions of a ``length``-token window that sequence-parallel rank ``rank`` of
    ``degree`` holds: its contiguous 1/degree (Ulysses), or with ``balanced`` torch's head-tail
    load balancing for causal ring attention (context parallelism): chunks ``rank`` and
    ``2 x degree - 1 - rank`` of 2 x degree, from torch's own balancer."""
    t = length // degree
    if not balanced:
        return slice(rank * t, (rank + 1) * t)
    return _head_tail(length, degree)[rank * t:(rank + 1) * t]


@functools.lru_cache(maxsize=8)
def _head_tail(length: int, degree: int) -> torch.Tensor:
    from torch.distributed.tensor.experimental._context_parallel import _HeadTailLoadBalancer

    return _HeadTailLoadBalancer(length, degree, "cpu")._generate_indices()[0]


def sequence_shard(batch: Any, rank: int, degree: int, balanced: bool = False) -> Any:
    """This sequence-parallel rank's part of every tensor's sequence (dim 1, ``shard_index``):
    the ranks of one sequence group read the same samples, each its shard."""
    if degree <= 1:
        return batch
    def cut(x: torch.Tensor) -> torch.Tensor:
        return x[:, shard_index(x.shape[1], rank, degree, balanced)].contiguous()
    return type(batch)(cut(x) for x in batch)


class SequenceShard:
    """A DataLoader ``collate_fn``: the default collation, then ``sequence_shard``."""

    def __init__(self, rank: int, degree: int, balanced: bool = False):
        self.rank, self.degree, self.balanced = rank, degree, balanced

    def __call__(self, samples: list[Any]) -> Any:
        from torch.utils.data import default_collate

        return sequence_shard(default_collate(samples), self.rank, self.degree, self.balanced)


def train_loader(data: Dataset, sampler: GlobalBatchSampler, num_workers: int, seq: Any, seed: int) -> Any:
    """The training DataLoader of both backends (``seq``: this rank's Ulysses sequence shard, or
    None). Its own generator: a DataLoader's iterator draws its workers' base seed from the
    global RNG otherwise, and a resumed run, which makes a new iterator after restoring the
    checkpoint's RNG, would then draw other dropout masks than the run it continues."""
    from torch.utils.data import DataLoader

    return DataLoader(data, batch_sampler=sampler, num_workers=num_workers,
                      collate_fn=SequenceShard(*seq) if seq else None,
                      generator=torch.Generator().manual_seed(seed))


def shards(path: str | Path) -> list[Path]:
    """``data=tokens``: the file, a directory's ``*.bin`` files, or a glob's files, in name order."""
    from recipes.token_inputs import resolve_inputs

    return list(resolve_inputs("tokens", path).files)


def _stream(data_cfg, path: str | Path | None, shape: Any, key: str) -> Dataset:
    """The windows of one input (``data.path`` or ``data.val_path``, named by ``key``). Token
    ids past ``model.vocab_size`` are refused here (the embedding would raise an IndexError)."""
    seq_len, vocab = shape.seq_len, shape.vocab_size
    if data_cfg.name == "tokens":
        from recipes.token_checks import say_short_shards, shard_id_problem

        files = shards(path)
        problem = shard_id_problem(key, path, files, data_cfg.dtype, vocab, data_cfg.cache_dir,
                                   hf=getattr(shape, "is_hf", False))
        if problem:
            raise DataError(problem)
        arrays = [np.memmap(f, dtype=data_cfg.dtype, mode="r") for f in files]
        say_short_shards(key, path, files, [len(a) for a in arrays], seq_len)  # (windows cross none)
        return TokenWindows(arrays, seq_len, what=f"{key}={path}")
    if data_cfg.tokenized:
        from recipes.tokens import token_file

        chat = data_cfg.name == "chat"
        stream = token_file(kind=data_cfg.name, path=path or CORPUS,
                            field=data_cfg.messages_field if chat else data_cfg.field,
                            tokenizer=data_cfg.tokenizer, cache_dir=data_cfg.cache_dir,
                            train_on=data_cfg.train_on, key=key)
        from observers.startup import started_at

        log.info("data: %s -> %d tokens (%d in the loss), %d documents (%s, %s)", path or CORPUS,
                 stream.n_tokens, stream.n_loss_tokens, stream.n_docs, stream.path.name,
                 stream.origin(since=started_at()))  # ("cached" only if from before this run)
        if stream.max_id >= vocab:
            from recipes.token_checks import vocab_fix, vocab_named

            hf = getattr(shape, "is_hf", False)
            raise DataError(f"{key}={path}: token id {stream.max_id} (data.tokenizer={data_cfg.tokenizer} "
                            f"has {stream.vocab_size} ids) but {vocab_named(vocab, hf)}: "
                            f"{vocab_fix(stream.max_id + 1, hf)}")
        eos = getattr(shape, "document_eos", None)
        if eos is not None and eos != stream.eos_id:
            raise DataError(f"data.packing=document: the model masks documents at EOS id {eos} "
                            f"but {key}={path} was packed with {stream.eos_id}: set data.tokenizer "
                            "to the tokenizer the data was packed with")
        if data_cfg.packing == "pad":
            return DocumentRows(stream.array(), seq_len, stream.eos_id, mask=stream.mask(), ends=stream.ends())
        if data_cfg.packing == "document" and stream.eos_inside:
            raise DataError(_eos_inside(key, path, stream, data_cfg))
        return TokenWindows([stream.array()], seq_len, what=f"{key}={path}", masks=[stream.mask()],
                            n_loss=[stream.n_loss_tokens])
    return TextDataset(path, seq_len, key)


def _eos_inside(key: str, path: Any, stream: Any, data_cfg: Any) -> str:
    """data.packing=document cannot tell this data's documents apart: EOS inside them."""
    where = ("conversations (the chat template ends turns with it)" if data_cfg.name == "chat"
             else "documents' text")
    return (f"data.packing=document with {key}={path}: attention and positions restart at each EOS "
            f"(id {stream.eos_id}), but data.tokenizer={data_cfg.tokenizer}'s EOS occurs "
            f"{stream.eos_inside} times inside the {stream.n_docs} {where}, which would be cut "
            "there: set data.packing=pad (one document per row, cut only at each one's end) or "
            "data.packing=concat")


def build_datasets(data_cfg, shape, seed: int) -> tuple[Dataset, Dataset | None]:
    """(training set, validation set or None). The validation set is ``data.val_path``'s windows,
    or the last ``data.val_fraction`` of the windows (held out of training); at most
    ``data.val_samples`` of them, the first ones. ``data.mixture``: recipes/mixture.py ``build``."""
    if data_cfg.name == "preference":  # objective=dpo's pairs (no held-out split)
        from recipes.dpo import preference_pairs

        return preference_pairs(data_cfg, shape), None
    if getattr(data_cfg, "mixture", None):
        from recipes.mixture import build

        return build(data_cfg, shape, seed)
    if data_cfg.name == "synthetic":
        full: Dataset = SyntheticDataset(data_cfg.num_samples, shape.seq_len, shape.vocab_size, seed)
    else:
        full = _stream(data_cfg, data_cfg.path, shape, "data.path")
    train, val = full, None
    if data_cfg.val_path is not None:
        val = _stream(data_cfg, data_cfg.val_path, shape, "data.val_path")
    elif data_cfg.val_fraction > 0:
        n = len(full)
        held = held_out(n, data_cfg.val_fraction, data_cfg.val_samples)
        if held >= n:
            raise DataError(f"data.val_fraction={data_cfg.val_fraction} of {n} samples leaves none "
                            "to train on: lower data.val_fraction or use more data")
        train, val = Subset(full, range(n - held)), Subset(full, range(n - held, n))
    if val is not None and data_cfg.val_samples is not None and len(val) > data_cfg.val_samples:
        val = Subset(val, range(data_cfg.val_samples))
    if val is not None:
        say_split(data_cfg, None if data_cfg.val_path is not None else len(full), len(val))
    return train, val


def data_facts(dataset: Dataset, run: tuple[int, int, int] | None = None) -> dict[str, Any]:
    """report.json's ``data``: the training set's ``tokens`` (targets: samples x seq_len) and
    ``loss_tokens``, those the loss counts (fewer than tokens only for data=chat with
    data.train_on=assistant); a mixture adds ``mixture``, per source what the run's
    ``run`` = (max_steps, global batch, seed) draws from it (recipes/mixture.py); with ``run``,
    ``epochs``: max_steps x global batch / samples (recipes/data_size.py, which warns at start
    when the training set is smaller than a global batch)."""
    facts = _counted_facts(dataset, run)
    return facts if run is None else {**facts, "epochs": epochs(len(dataset), run[0], run[1])}


def _counted_facts(dataset: Dataset, run: tuple[int, int, int] | None) -> dict[str, Any]:
    if hasattr(dataset, "facts"):  # data.mixture
        tokens, loss = dataset.counts()
        return {"tokens": tokens, "loss_tokens": loss, **({"mixture": dataset.facts(*run)} if run else {})}
    first, stop = 0, None
    if isinstance(dataset, Subset) and isinstance(dataset.indices, range) and dataset.indices.step == 1:
        first, stop, dataset = dataset.indices.start, dataset.indices.stop, dataset.dataset
    if hasattr(dataset, "counts"):  # TokenWindows, packing's DocumentRows
        tokens, loss = dataset.counts(first, stop)
    elif isinstance(dataset, SyntheticDataset):
        tokens = loss = ((stop if stop is not None else len(dataset)) - first) * dataset.seq_len
    else:  # (not one of build_datasets')
        return {"tokens": None, "loss_tokens": None}
    return {"tokens": tokens, "loss_tokens": loss}


class ValidationBatches:
    """This data-parallel rank's share of the validation set, in micro-batches: sample ``i`` goes
    to rank ``i % dp_size``, and every rank runs the same number of batches (the short ones are
    padded with a sample whose targets are all ``IGNORE``), so sharded models run matching
    collectives and the loss averages the same samples whatever the world size."""

    def __init__(self, dataset: Dataset, *, micro_batch: int, dp_rank: int, dp_size: int,
                 seq: tuple[int, ...] | None = None):
        self.dataset, self.micro_batch = dataset, micro_batch
        self.seq = seq  # (rank, degree[, balanced]): this rank's sequence shard, or the whole
        n = len(dataset)
        per_rank = -(-n // dp_size)
        self.n_batches = -(-per_rank // micro_batch)
        mine = list(range(dp_rank, n, dp_size))
        self.indices = mine + [-1] * (self.n_batches * micro_batch - len(mine))

    def __len__(self) -> int:
        return self.n_batches

    def _sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.dataset[max(i, 0)]
        return (x, torch.full_like(y, IGNORE)) if i < 0 else (x, y)

    def __iter__(self):
        for b in range(self.n_batches):
            xs, ys = zip(*(self._sample(i) for i in self.indices[b * self.micro_batch:
                                                                 (b + 1) * self.micro_batch]))
            yield sequence_shard((torch.stack(xs), torch.stack(ys)), *(self.seq or (0, 1)))


def validation_steps(val_every: int, max_steps: int, start: int = 0) -> set[int]:
    """Optimizer-step counts after which validation runs: every ``val_every`` and the last."""
    due = set(range(val_every, max_steps + 1, val_every)) if val_every else set()
    return {s for s in due | {max_steps} if s > start}
