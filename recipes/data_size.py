"""What the run says about the size of its data (recipes/data.py builds it): the held-out split
``data.val_fraction`` takes (``held_out``, grown to ``VAL_MIN_SAMPLES``) and the log's word on a
small one, or on held-out samples past ``data.val_samples``, neither trained on nor validated
(``say_split``; ``held_out_notes``: --dry-run's notes of them); and a training set smaller than
a global batch, whose samples repeat inside each step (``epochs``: report.json's
``data.epochs``, and a warning at start); a step with no counted target (``say_empty_step``). Torch-free; rank 0 logs, on the ``recipes.data`` logger."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("recipes.data")

CORPUS = Path(__file__).parent / "assets" / "corpus.txt"
"""The bundled text (data=text's default)."""

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


def unused_held_out(data_cfg: Any, n: int) -> str | None:
    """The held-out samples ``data.val_fraction`` takes of ``n`` past the first
    ``data.val_samples``, which validation reads: neither trained on (held out) nor validated.
    The split stays as the fraction says (a held-out window is out of training), so the line
    says how many and the two fixes; None when there are none."""
    fraction, cap = data_cfg.val_fraction, data_cfg.val_samples
    if data_cfg.val_path is not None or fraction <= 0 or cap is None:
        return None
    held = held_out(n, fraction, cap)
    if held <= cap or held >= n:  # (none past it; or none left to train on: an error)
        return None
    unused = held - cap
    share = 100 * unused / n
    return (f"data.val_fraction={fraction} of {n} samples holds out {held} and data.val_samples={cap} "
            f"validates the first {cap}: the other {unused} held-out samples "
            f"({f'{share:.0f}' if share >= 1 else f'{share:.2g}'}% of the data) are neither trained on "
            f"nor validated; raise data.val_samples to {held} (null: all), or lower data.val_fraction "
            f"to {_fraction_for(cap, n)}")


def _fraction_for(samples: int, n: int) -> str:
    """The largest fraction of 3 significant digits that holds out at most ``samples`` of ``n``."""
    exact = samples / n
    digits = max(0, 2 - math.floor(math.log10(exact)))
    return f"{math.floor(exact * 10**digits + 1e-9) / 10**digits:.{digits}f}".rstrip("0").rstrip(".")


def held_out_notes(data: Any, model: Any) -> list[str]:
    """--dry-run's notes of held-out samples past ``data.val_samples`` (``unused_held_out``), per
    source: counted where the samples are known before launch (byte text, token shards, synthetic
    data, a token cache already built), else from how many samples on there would be some."""
    if getattr(data, "mixture", None):
        from recipes.mixture import source_config

        return [f"data.mixture[{i}]: {line}" for i, entry in enumerate(data.mixture)
                for line in held_out_notes(source_config(entry, data), model)]
    fraction, cap = data.val_fraction, data.val_samples
    if data.val_path is not None or fraction <= 0 or cap is None or data.name == "preference":
        return []
    n = samples_before_launch(data, model.seq_len)
    if n is not None:
        return [line] if (line := unused_held_out(data, n)) else []
    first = max(1, math.ceil((cap + 0.5) / fraction) - 1)
    while max(1, round(first * fraction)) <= cap:
        first += 1
    return [f"data.val_fraction={fraction} holds out more samples than data.val_samples={cap} validates "
            f"once the data holds {first} or more (not counted before it is tokenized): those past the "
            f"first {cap} are neither trained on nor validated; raise data.val_samples (null: all), or "
            "lower data.val_fraction"]


def samples_before_launch(data: Any, seq_len: int) -> int | None:
    """The samples ``data.path`` gives, where known without tokenizing: synthetic data's, byte
    text's and token shards' windows (from file sizes), a token cache's windows (its meta, found
    by the name recipes/tokens.py gives it); None otherwise (no cache yet, ``data.packing=pad``'s
    rows, an input the checks refuse)."""
    from recipes.token_inputs import default_cache_dir, resolve_inputs

    try:
        if data.name == "synthetic":
            return data.num_samples
        if data.name == "tokens":
            size = 2 if data.dtype == "uint16" else 4
            return windows([f.stat().st_size // size for f in resolve_inputs("tokens", data.path).files], seq_len)
        if not data.tokenized:
            return windows([Path(data.path or CORPUS).expanduser().stat().st_size], seq_len)
        if data.packing == "pad" or data.path is None:
            return None
        from recipes.tokens import input_fingerprints

        name = input_fingerprints(data).get("data.path")  # (the token cache's name)
        cache = Path(data.cache_dir).expanduser() if data.cache_dir else default_cache_dir()
        return windows([json.loads((cache / f"{name}.json").read_text())["n_tokens"]], seq_len) if name else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def say_split(data_cfg: Any, n: int | None, size: int) -> None:
    """Rank 0 logs, once, a held-out split grown to the minimum (info) or one still below it, or a
    ``data.val_path`` below it (a warning); and held-out samples past ``data.val_samples``
    (``unused_held_out``, a warning). ``n``: the samples a fraction was taken of."""
    if not _rank0():
        return
    if n is not None and (unused := unused_held_out(data_cfg, n)):
        log.warning("validation: %s", unused)
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


def say_empty_step(step: int, samples: int) -> bool:
    """A step whose global batch holds no target the loss counts (recipes/data.py
    ``CountedShare``; every rank knows it from the sampler's order, no communication) logs loss
    0 and trains on nothing, which reads as a perfect step: rank 0 warns, once per run, at the
    first one. Returns True: said (or another rank's to say)."""
    if _rank0():
        log.warning("step %d: its global batch of %d samples holds no target the loss counts (with "
                    "data.train_on=assistant: no assistant token in them), so the step logs loss 0 "
                    "and trains on nothing (later such steps are not said again); check the data's "
                    "assistant turns against model.seq_len, or set data.train_on=all", step + 1, samples)
    return True
