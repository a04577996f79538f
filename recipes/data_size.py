"""What the run says about the size of its data (recipes/data.py builds it): the held-out split
``data.val_fraction`` takes (``held_out``, grown to ``VAL_MIN_SAMPLES``) and the log's word on a
small one (``say_split``); and a training set smaller than a global batch, whose samples repeat
inside each step (``epochs``: report.json's ``data.epochs``, and a warning at start).
Torch-free; rank 0 logs, on the ``recipes.data`` logger."""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("recipes.data")

VAL_MIN_SAMPLES = 16
"""The fewest samples a held-out split (``data.val_fraction``) holds: a validation loss over
fewer windows is noise, which ``trainer.keep_best`` and early stopping would act on. A fraction
that gives fewer grows to this, but never past a tenth of the data nor past ``data.val_samples``
(what is evaluated); the run's log says so. ``data.val_path`` is taken as given (warned when
smaller)."""


def _rank0() -> bool:
    return int(os.environ.get("RANK") or 0) == 0


def windows(lengths: list[int], seq_len: int) -> int:
    """The ``seq_len + 1``-token windows arrays of ``lengths`` tokens hold (recipes/data.py
    ``TokenWindows``: stride ``seq_len``, none across arrays)."""
    return sum(max(0, (n - 1) // seq_len) for n in lengths)


def no_sample(what: str, tokens: int, seq_len: int) -> str:
    """The error for data that holds no window: the run's (``TokenWindows``) and the check's
    before launch (recipes/token_checks.py) alike."""
    return (f"{what}: {tokens} tokens hold no sample of model.seq_len + 1 = {seq_len + 1} tokens "
            "(per shard): use more data or a shorter model.seq_len")


def held_out(n: int, fraction: float, val_samples: int | None) -> int:
    """How many of ``n`` samples ``data.val_fraction`` holds out: the fraction (at least one), grown
    to ``VAL_MIN_SAMPLES`` where a tenth of the data and ``data.val_samples`` allow."""
    asked = max(1, round(n * fraction))
    floor = min(VAL_MIN_SAMPLES, n // 10, val_samples if val_samples is not None else n)
    return max(asked, floor)


def say_split(data_cfg: Any, n: int | None, size: int) -> None:
    """Rank 0 logs, once, a held-out split grown to the minimum (info) or one still below it, or a
    ``data.val_path`` below it (a warning). ``n``: the samples a fraction was taken of."""
    if not _rank0():
        return
    asked = None if n is None else max(1, round(n * data_cfg.val_fraction))
    if asked is not None and size > asked:
        log.info("validation: data.val_fraction=%s of %d samples is %d; held out %d instead (at least "
                 "%d where a tenth of the data allows; data.val_path sets the split exactly)",
                 data_cfg.val_fraction, n, asked, size, VAL_MIN_SAMPLES)
    wanted = min(VAL_MIN_SAMPLES, data_cfg.val_samples or VAL_MIN_SAMPLES)
    if size < wanted:
        source = f"data.val_path={data_cfg.val_path}" if n is None else f"data.val_fraction={data_cfg.val_fraction} of {n} samples"
        log.warning("validation on %d sample(s) only (%s): a loss over so few means little; use more "
                    "data, a larger data.val_fraction or a data.val_path of %d or more", size, source, wanted)


def epochs(n: int, steps: int, global_batch: int) -> float | None:
    """report.json's ``data.epochs``: the passes over the ``n`` training samples that ``steps``
    global batches make. A training set smaller than a global batch repeats samples inside
    each step (the sampler's epoch stream wraps, recipes/data.py ``GlobalBatchSampler``): rank 0
    warns, once, at start."""
    if n <= 0:
        return None
    if n < global_batch and _rank0():
        log.warning("the training data holds %d samples, fewer than a global batch "
                    "(trainer.global_batch_size=%d): each step draws every sample about %g times "
                    "(%g epochs in the run); use more data or a smaller trainer.global_batch_size",
                    n, global_batch, round(global_batch / n, 2), round(steps * global_batch / n, 2))
    return round(steps * global_batch / n, 6)
