"""The run report: ``report.json`` in the run's output directory, written by rank 0, atomically.

Keys (documented in README): strategy, backend, world_size, global_batch_size,
micro_batch_size, accumulation, losses, final_loss, steps, wall_seconds, tokens_per_second,
config; plus what other callbacks add through ``sections`` (memory, communication, plan).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write via a temp file in the same directory and rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class RunReport(L.Callback):
    """Records the global-batch loss of every optimizer step and writes the report at the end.

    The loss of a step is the mean over all its micro-batches on all data-parallel ranks, i.e.
    the loss of the global batch, reduced once per optimizer step.
    """

    def __init__(self, path: str | Path, *, meta: dict[str, Any], tokens_per_step: int):
        self.path = Path(path)
        self.meta = meta
        self.tokens_per_step = tokens_per_step
        self.sections: dict[str, Any] = {}  # other callbacks add their sections here
        self.losses: list[float] = []
        self._micro: list[torch.Tensor] = []
        self._seen_step = 0
        self._start = self._last = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._seen_step = trainer.global_step
        self._start = self._last = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        # Lightning hands back loss / accumulate_grad_batches; undo it to get the micro-batch mean.
        self._micro.append(loss.detach().float() * trainer.accumulate_grad_batches)
        if trainer.global_step == self._seen_step:
            return  # still accumulating
        steps = trainer.global_step - self._seen_step
        self._seen_step = trainer.global_step
        local = torch.stack(self._micro).mean()
        self._micro.clear()
        self.losses.append(float(trainer.strategy.reduce(local, reduce_op="mean")))
        now = time.perf_counter()
        pl_module.log("tok/s", steps * self.tokens_per_step / max(now - self._last, 1e-9),
                      prog_bar=True, on_step=True, on_epoch=False, rank_zero_only=True)
        self._last = now

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        wall = time.perf_counter() - self._start
        if trainer.global_rank != 0:
            return
        report = {
            **self.meta,
            "steps": len(self.losses),
            "losses": self.losses,
            "final_loss": self.losses[-1] if self.losses else None,
            "wall_seconds": wall,
            "tokens_per_second": len(self.losses) * self.tokens_per_step / wall if wall > 0 else 0.0,
            **self.sections,
        }
        atomic_write_text(self.path, json.dumps(report, indent=2) + "\n")
