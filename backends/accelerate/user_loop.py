"""What the hook's ``Accelerator`` (user.py) does in a user's own loop beyond Accelerate's: an LR
scheduler prepared alone under ZeRO (``AloneSchedules``), and the model an eval scores under
``local_sgd`` and ``diloco`` (``Rank0Replica``).

Accelerate's DeepSpeed path wraps a scheduler only when it is prepared in the same call as the
model; ``scheduler = accelerator.prepare(scheduler)`` after it came back bare: it stepped on every
micro-batch (LR 0.08, 0.06 after two steps of 4 where DDP's is 0.09, 0.08) and was never saved,
so a resume restarted the schedule. The hook wraps and registers it as Accelerate does on DDP
(``prepare_scheduler``: once a process per optimizer step, none on an accumulating micro-batch;
``save_state`` / ``load_state`` carry it). One prepared with the model stays Accelerate's.

Between two averagings every rank trains a replica of its own, and an eval loop that gathers its
metric across the ranks (``accelerator.gather_for_metrics``, each rank scoring its share of the
samples) adds up each rank's score of its own replica: a number that belongs to no model (rank
0's on its batches, rank 1's on the others). ``with accelerator.rank0_replica():`` makes every
rank hold rank 0's replica -- the model ``get_state_dict`` / ``save_model`` write -- inside the
block and its own again after it, bit for bit (backends/common/replica.py, as train.py's loop and
the Lightning bridge validate), so the training after an eval is the training without one. It
does nothing under other presets or in one process.

Outside the block, the first ``gather_for_metrics`` while the replicas differ (an optimizer step
since the last averaging: ``replicas_apart``), or ``gather`` / ``reduce`` with the model in eval
mode (a training loop gathers its loss in train mode: each replica's own, as it should), makes
rank 0 log one warning a run naming the fix. train.py's loop builds a plain ``Accelerator``, not
the hook's, and validates inside ``rank0_replica`` already.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)


class AloneSchedules:
    """The hook's ``prepare`` under ZeRO: an LR scheduler in a call without the model, wrapped and
    registered as on DDP; a base of its ``Accelerator`` subclass, before ``Accelerator``."""

    stratagem: tuple[str, str]

    def prepare(self, *args: Any, **kw: Any) -> Any:
        out = super().prepare(*args, **kw)  # (Accelerator's, next in the bases)
        import torch
        from torch.optim.lr_scheduler import LRScheduler

        if self.stratagem[1] != "deepspeed" or any(isinstance(a, torch.nn.Module) for a in args):
            return out
        one = (out,) if len(args) == 1 else out  # (Accelerate returns one object bare)
        one = tuple(self.prepare_scheduler(o) if isinstance(o, LRScheduler) else o for o in one)
        return one[0] if len(args) == 1 else one


class Rank0Replica:
    """The hook's ``rank0_replica`` and its one warning, a base of its ``Accelerator`` subclass
    (before ``Accelerator``); ``stratagem_builder``: the preset's builder, set on the subclass."""

    stratagem: tuple[str, str]
    stratagem_builder: Any = None
    _scoring = False
    _told = False

    def _sync(self) -> Any:
        return getattr(self.stratagem_builder, "synchronizer", None)  # (the ddp family's, after prepare)

    @contextmanager
    def rank0_replica(self) -> Iterator[None]:
        """Inside: every rank's prepared model holds rank 0's replica (under ``local_sgd`` /
        ``diloco`` at more than one process; otherwise nothing changes); after (also on an
        error): each rank's own, bit for bit. Every rank enters it (a broadcast)."""
        from backends.common.replica import rank0_replica

        was, self._scoring = self._scoring, True
        try:
            with rank0_replica(self._sync(), getattr(self, "_parts", {}).get("model")):
                yield
        finally:
            self._scoring = was

    def _say_own_replicas(self, call: str, in_eval: bool = False) -> None:
        if self._told or self._scoring:
            return
        model = getattr(self, "_parts", {}).get("model")
        if in_eval and (model is None or model.training):
            return
        from backends.common.replica import replicas_apart

        if not replicas_apart(self._sync()):
            return
        self._told = True
        if self.is_main_process:
            log.warning(
                f"accelerator.{call}() under strategy={self.stratagem[0]} on {self.num_processes} processes "
                "while the ranks' replicas differ (steps since the last averaging): each rank scored its own "
                "replica, so the gathered metric mixes them and is no model's score; score rank 0's replica "
                "(the model save_model / get_state_dict write) on every rank with `with "
                "accelerator.rank0_replica(): <your eval loop>` (each rank's own is back after it). Told once")

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        self._say_own_replicas("gather_for_metrics")
        return super().gather_for_metrics(input_data, use_gather_object)  # (Accelerator's, next in the bases)

    def gather(self, tensor: Any) -> Any:
        self._say_own_replicas("gather", in_eval=True)
        return super().gather(tensor)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        self._say_own_replicas("reduce", in_eval=True)
        return super().reduce(tensor, reduction, scale)
