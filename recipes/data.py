"""Datasets and the global-batch sampler.

Data order is a function of the seed and the global batch only: step k trains on samples
``k*G .. k*G+G-1`` of a seeded stream of epoch permutations, and data-parallel rank r takes the
r-th contiguous slice of that global batch, cut into micro-batches. So the union over ranks at
step k is the same set whatever the data-parallel size or accumulation — the property the
equivalence tests stand on. Resuming at step s starts the stream at s (no skipped batches).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

CORPUS = Path(__file__).parent / "assets" / "corpus.txt"


class TextDataset(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` byte tokens from a UTF-8 text file."""

    def __init__(self, path: str | Path | None, seq_len: int):
        data = Path(path or CORPUS).read_bytes()
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.seq_len = seq_len
        if len(self) < 1:
            raise ValueError(f"data.path={path}: {len(data)} bytes is shorter than one sample "
                             f"of model.seq_len + 1 = {seq_len + 1} bytes")

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i * self.seq_len : (i + 1) * self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


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

    def _sample(self, position: int) -> int:
        epoch, offset = divmod(position, self.n)
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            self._perm = (epoch, torch.randperm(self.n, generator=g))
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


def build_dataset(data_cfg, shape, seed: int) -> Dataset:
    if data_cfg.name == "text":
        return TextDataset(data_cfg.path, shape.seq_len)
    return SyntheticDataset(data_cfg.num_samples, shape.seq_len, shape.vocab_size, seed)
