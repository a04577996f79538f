"""Validation, engine-neutral: the loss of the held-out samples, as a sum over their tokens.

Each backend calls ``Validator.run`` after the optimizer steps ``validation_steps`` names, with a
function that runs one batch through the model as the engine wraps it (under no_grad, in eval
mode) and returns ``loss_sums``: (sum of token losses, number of tokens). Padding targets are
``IGNORE`` (recipes/data.py's ``ValidationBatches``), so they add nothing; the sums are added
over every rank (ranks of one data-parallel replica -- tensor or pipeline peers -- hold the same
sums, which scales both by the same factor) and divided: the mean token loss over the same
samples on every world size, and its perplexity.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from recipes.data import IGNORE, ValidationBatches, validation_steps
from recipes.stopping import Decision, decide


def loss_sums(logits: Any, targets: torch.Tensor) -> torch.Tensor:
    """[sum of next-token cross entropies, token count] of one batch, fp32, padding ignored."""
    logits = getattr(logits, "logits", logits)  # a transformers model's output
    total = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE,
                            reduction="sum")
    return torch.stack([total, (targets != IGNORE).sum().to(total.dtype)])


def batch_sums(model: Any, batch: tuple[torch.Tensor, torch.Tensor], chunk: int = 0) -> torch.Tensor:
    """``loss_sums`` of one batch through ``model`` (as the engine wraps it); ``chunk``
    (trainer.loss_chunk > 0): the model sums them itself, that many tokens' logits at a time."""
    tokens, targets = batch
    if chunk > 0:
        return model(tokens, targets=targets, loss_chunk=chunk)
    return loss_sums(model(tokens), targets)


class Validator:
    """When to validate, and on what: the validation set in this rank's batches; and the run's
    validations so far (``records``), which ``decide`` judges (trainer.keep_best,
    trainer.early_stopping: recipes/stopping.py)."""

    def __init__(self, dataset: Any, *, micro_batch: int, val_every: int, max_steps: int):
        self.dataset, self.micro_batch = dataset, micro_batch
        self.due = validation_steps(val_every, max_steps)
        self.records: list[dict[str, Any]] = []

    def resume(self, history: dict[str, Any], step: int) -> None:
        """A resumed run: the validations its checkpoint of ``step`` carries (``history.json``)."""
        self.records = [dict(v) for v in history.get("validation", []) if v["step"] <= step]

    def decide(self, trainer: Any, step: int) -> Decision:
        """After optimizer step ``step``: keep its checkpoint as the best, stop the run (both
        backends act on this one answer, the same on every rank)."""
        return decide(self.records, trainer, step)

    def run(self, step_fn: Callable[[tuple[torch.Tensor, torch.Tensor], int], torch.Tensor], *,
            dp_rank: int, dp_size: int, device: Any, step: int,
            seq: tuple[int, ...] | None = None) -> dict[str, Any]:
        """``step_fn(batch, index)`` -> ``loss_sums`` of the batch; returns this validation's
        record (the same on every rank). ``seq``: (rank, degree[, balanced]) of this rank's sequence shard
        (Ulysses: the sums of a sequence group's shards add up to the samples' sums)."""
        import torch.distributed as dist

        batches = ValidationBatches(self.dataset, micro_batch=self.micro_batch, dp_rank=dp_rank,
                                    dp_size=dp_size, seq=seq)
        sums = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for i, (x, y) in enumerate(batches):
                sums += step_fn((x.to(device), y.to(device)), i).detach().double().cpu()
        if dist.is_available() and dist.is_initialized():
            on = sums.to(device)
            dist.all_reduce(on)
            sums = on.cpu()
        loss = float(sums[0] / sums[1]) if sums[1] > 0 else float("nan")
        record = {"step": step, "loss": loss, "perplexity": math.exp(min(loss, 700.0)),
                  "samples": len(self.dataset)}
        self.records.append(record)
        return dict(record)
