"""``objective=dpo`` and ``data=preference`` checked before launch (recipes/job.py): what pairs
with what, the data's file and tokenizer, and the layouts recipes/dpo.py does not train.
Torch-free (plan.py reads it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# the layouts whose micro-batches hold whole pairs and whole sequences (recipes/dpo.py)
SPLITS = {"tp": "tensor", "pp": "pipeline", "cp": "context", "sp": "sequence (Ulysses)"}


def data_problems(data: Any, model: Any | None) -> list[str]:
    """``data=preference``: a .jsonl data.path and a tokenizer with a chat template."""
    from core import knobs
    from recipes.token_checks import null_why, tokenizer_problems

    out = []
    if data.path is None:
        out.append("data=preference needs data.path (null now): set data.path=/path/to/pairs.jsonl "
                   "(records {prompt, chosen, rejected})")
    elif not knobs.elsewhere(data.path) and not Path(data.path).expanduser().is_file():
        out.append(f"data.path={data.path}: no such file; data=preference reads one .jsonl file of "
                   "{prompt, chosen, rejected} records")
    if data.tokenizer is None:
        out.append("data=preference needs a tokenizer with a chat template, and data.tokenizer is "
                   f"null ({null_why(model)}): set data.tokenizer=<a tokenizer directory>")
    elif not knobs.elsewhere(data.tokenizer):
        vocab = getattr(model, "vocab_size", None)
        out += [p.replace("data=chat", "data=preference")
                for p in tokenizer_problems(data.tokenizer, vocab if isinstance(vocab, int) else None,
                                            chat=True, hf=getattr(model, "is_hf", False))]
    return out


def problems(objective: Any, data: Any, trainer: Any) -> list[str]:
    """objective=dpo with the data and the trainer (and data=preference with the objective)."""
    dpo = objective is not None and objective.name == "dpo"
    if not dpo:
        return ([] if data.name != "preference" else
                ["data=preference holds preference pairs, which only objective=dpo trains on "
                 f"(objective={getattr(objective, 'name', None)}); set objective=dpo, or another data"])
    out = []
    if data.name != "preference":
        out.append(f"objective=dpo trains on preference pairs, and data={data.name}; allowed: "
                   "data=preference; set data=preference data.path=/path/to/pairs.jsonl")
    if data.packing != "pad":
        out.append(f"data.packing={data.packing}: objective=dpo reads one sequence per row; allowed: "
                   "pad; set data.packing=pad (data=preference's default)")
    if data.val_fraction > 0 or data.val_path is not None:
        out.append("data.val_fraction / data.val_path: objective=dpo has no held-out evaluation yet; "
                   "set data.val_fraction=0 data.val_path=null")
    if trainer.loss_chunk > 0:
        out.append(f"trainer.loss_chunk={trainer.loss_chunk}: objective=dpo needs each sequence's "
                   "log-probability from the whole logits; set trainer.loss_chunk=0")
    return out


# data keys data=preference does not read -> the data kinds that do
UNREAD_BY_PAIRS = {"field": "jsonl, parquet", "messages_field": "chat", "train_on": "chat"}


def unread_problems(objective: Any, data: Any) -> list[str]:
    """Keys set away from their defaults that the chosen objective or data kind does not read
    (they would do nothing): objective.beta / label_smoothing under objective=lm, data.field /
    messages_field / train_on under data=preference. One line each: the key, its value, what
    reads it, the fix."""
    from recipes.job_checks import unread_keys
    from recipes.trainer_config import DataConfig

    out = [] if objective is None else unread_keys(objective, "objective")
    if data is not None and data.name == "preference":
        default = DataConfig()
        out += [f"data.{key}={getattr(data, key)} applies to data={kinds} only; data=preference does not "
                "read it (it reads each record's prompt, chosen and rejected, and counts the response "
                "tokens): remove it"
                for key, kinds in UNREAD_BY_PAIRS.items() if getattr(data, key) != getattr(default, key)]
    return out


def layout_problems(objective: Any, mesh: Any, preset: str) -> list[str]:
    """objective=dpo on the preset's mesh: data parallelism only."""
    if objective is None or objective.name != "dpo":
        return []
    out = []
    for key, what in SPLITS.items():
        degree = getattr(mesh, key, 1)
        if degree > 1:
            out.append(f"strategy={preset}: objective=dpo runs on data-parallel presets only (a "
                       f"pair's rows whole on one rank), and this one has {what} parallelism "
                       f"{key}={degree}; use strategy=single, ddp, fsdp, fsdp2 or zero1/2/3")
    return out
