"""The settings that decide the data a resumed run reads, compared with the checkpoint's run's
before launch (checkpoints ``for_launch``).

The data position is step x global batch in one sample stream (recipes/data.py
``GlobalBatchSampler``): the training windows -- ``model.seq_len`` + 1 tokens each, cut from the
data source (its group, path, tokenizer, packing, field, held-out split; a mixture's sources) --
in the epoch orders ``trainer.seed`` draws. Another global batch moves the position
(``batch_note``); another value of any setting here keeps the position but
changes the stream under it: the resumed run reads other samples than the ones the checkpoint's
run would have read next (a new seed's permutation repeats some of the epoch's samples and skips
others; longer windows are other tokens; another source is other data, from sample step x global
batch of it). ``stream_note`` names each that differs in one warning. The checkpoint's values are
meta.json's resolved config (``Job.config()`` when it was saved); this run's are read the same
way (``this_run``), so like is compared with like; a key an older checkpoint lacks is not compared.
The same warning names a source whose settings are the same but whose files are not
(``input_changes``): meta.json's ``inputs``, each source's fingerprint when it was saved
(recipes/tokens.py ``input_fingerprints``: the token cache's name), against the files now."""

from __future__ import annotations

import json
import logging
from typing import Any

from recipes.data_size import VAL_MIN_SAMPLES

log = logging.getLogger(__name__)

TOKENIZED = ("jsonl", "parquet", "chat", "preference")
"""data.name values read through a tokenizer (and data=text with one: ``DataConfig.tokenized``)."""

HELD_OUT = ("data.val_fraction", "data.val_samples", "data.val_path")
_ABSENT = object()


def changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The settings deciding the sample stream that differ between the checkpoint's run's
    resolved config (``saved``) and this run's (``now``), as ``key old -> new``: a key counts
    where either run's data reads it (a tokenizer only for tokenized data, ``num_samples`` only
    for synthetic data, ...)."""
    keys = list(dict.fromkeys(_deciding(saved) + _deciding(now)))
    if _held_out(saved) != _held_out(now):
        keys += HELD_OUT  # (the ones whose values differ are named)
    changed = []
    for key in keys:
        old, new = _get(saved, key), _get(now, key)
        if old is not _ABSENT and new is not _ABSENT and old != new:
            changed.append(f"{key} {_shown(old)} -> {_shown(new)}")
    return changed


def stream_note(ckpt: Any, job: Any) -> str | None:
    """One warning naming every setting that decides the data stream and differs from the
    checkpoint's run (``changes``); None when none does."""
    saved, now = ckpt.meta.get("config"), this_run(job)
    changed = changes(saved, now) if isinstance(saved, dict) else []
    edited = input_changes(ckpt.meta.get("inputs"), saved, now, job.data) if isinstance(saved, dict) else []
    if not (changed or edited):
        return None
    return (f"resume: {'; '.join(changed + edited)}: these decide the data stream, so the data does not "
            f"continue where the checkpoint's run stopped -- from step {ckpt.step + 1} on the run reads this "
            f"stream from sample {ckpt.step * job.batch.global_size} (step x global batch), not the samples "
            f"that run would have read next; resume with the checkpoint's values{' and data' if edited else ''} "
            "to continue it")


SOURCE_KEYS = ("name", "path", "tokenizer", "field", "messages_field", "train_on", "dtype")
"""The data keys a source's fingerprint hashes the inputs of (the same keys, another fingerprint:
the files themselves changed)."""


def input_changes(inputs: Any, saved: dict[str, Any], now: dict[str, Any], data: Any) -> list[str]:
    """Each source whose settings are the checkpoint's run's but whose input fingerprint
    (meta.json's ``inputs``) is not the one its files give now: a data file rewritten, appended or
    regenerated under the same path, a tokenizer directory overwritten in place. Not compared:
    a checkpoint without ``inputs`` (older), a source whose settings differ (``changes`` names
    them), one unreadable now."""
    if not isinstance(inputs, dict) or not inputs:
        return []
    from recipes.tokens import input_fingerprints

    current, out = input_fingerprints(data), []
    for label, old in inputs.items():
        new, source = current.get(label), _source(now, label)
        if new is None or new == old or source is _ABSENT or source != _source(saved, label):
            continue
        key = "data.path" if label == "data.path" else f"{label}.path"
        name, tok = source.get("name"), source.get("tokenizer")
        tokenizer = " or data.tokenizer's files" if name in TOKENIZED or (name == "text" and tok) else ""
        out.append(f"{key}={source.get('path')}: its contents changed since the checkpoint (its files' "
                   f"size or modification time{tokenizer}: input fingerprint {old} -> {new})")
    return out


def _source(config: dict[str, Any], label: str) -> Any:
    """The settings of the source ``label`` (``data.path``, ``data.mixture[i]``) in ``config``."""
    data = config.get("data") or {}
    if label == "data.path":
        return {k: data.get(k) for k in SOURCE_KEYS}
    index, entries = label[len("data.mixture["):-1], data.get("mixture") or []
    if not index.isdigit() or int(index) >= len(entries) or not isinstance(entries[int(index)], dict):
        return _ABSENT
    entry = {k: v for k, v in entries[int(index)].items() if k != "weight"}
    return {**entry, "tokenizer": entry.get("tokenizer", data.get("tokenizer"))}


def this_run(job: Any) -> dict[str, Any]:
    """The trainer, model and data sections of this run's config as meta.json holds the
    checkpoint's run's (``Job.config()``), resolved section by section: outside a Hydra run (a
    test, a query) the paths group's ``${hydra:...}`` leaves the whole config unresolved."""
    from omegaconf import OmegaConf

    return {k: OmegaConf.to_container(job.cfg[k], resolve=True) for k in ("trainer", "model", "data")}


def _deciding(config: dict[str, Any]) -> list[str]:
    """The keys that decide the training stream under ``config`` (its data kind's)."""
    data = config.get("data") or {}
    keys = ["trainer.seed", "model.seq_len"]
    if data.get("mixture"):  # (each entry: a source's own keys; packing and a tokenizer inherited)
        return [*keys, "data.mixture", "data.tokenizer", "data.packing"]
    name = data.get("name")
    keys.append("data.name")
    if name == "synthetic":
        return [*keys, "data.num_samples"]
    keys.append("data.path")
    if name == "tokens":
        keys.append("data.dtype")
    if name in TOKENIZED or (name == "text" and data.get("tokenizer") is not None):
        keys += ["data.tokenizer", "data.packing", "data.messages_field" if name == "chat" else "data.field"]
    return keys


def _held_out(config: dict[str, Any]) -> Any:
    """What decides how many windows ``data.val_fraction`` holds out of training
    (recipes/data_size.py ``held_out``; ``data.val_path`` holds out none); None: none."""
    data = config.get("data") or {}
    if data.get("mixture") or data.get("name") == "preference" or data.get("val_path") is not None:
        return None
    fraction, cap = data.get("val_fraction") or 0, data.get("val_samples")
    return (fraction, min(VAL_MIN_SAMPLES, cap if cap is not None else VAL_MIN_SAMPLES)) if fraction > 0 else None


def _get(config: dict[str, Any], key: str) -> Any:
    value: Any = config
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _ABSENT
        value = value[part]
    return value


def _shown(value: Any) -> str:
    """As an override writes it (null, true, a mixture's list as JSON)."""
    if value is None or isinstance(value, (bool, list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def batch_note(ckpt: Any, job: Any) -> str | None:
    """The data position is step x global batch (the stream's order is the seed's alone): a
    resume at another trainer.global_batch_size continues elsewhere in the stream than where
    the checkpoint's run stopped. Said once, with the value that continues exactly."""
    seen, size = ckpt.meta.get("samples_seen"), job.batch.global_size
    if seen is None or seen == ckpt.step * size:
        return None
    was, at = seen // max(ckpt.step, 1), ckpt.step * size
    moved = f"{seen}-{at - 1} are skipped" if at > seen else f"{at}-{seen - 1} are seen again"
    return (f"resume: trainer.global_batch_size={size}, the checkpoint's run {was}: the data continues at "
            f"sample {at} of the stream, where that run had consumed {seen} (samples {moved}); "
            f"trainer.global_batch_size={was} continues where it stopped")
