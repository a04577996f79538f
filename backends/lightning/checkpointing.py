"""Checkpoints under Lightning: one Callback that calls the engine-neutral ``checkpoints`` package
with the Trainer's objects. Lightning's own checkpointing (``ModelCheckpoint``, ``ckpt_path``)
is not used: its format differs per strategy (a file, a DCP directory with Lightning's keys, a
DeepSpeed directory with Lightning's client state), which would tie a checkpoint to Lightning
and to the preset that wrote it.

Restore happens in ``on_fit_start``: after the strategy has wrapped the model and built the
optimizer, before the fit loop asks for the dataloader (``GlobalBatchData`` starts the sample
stream at ``trainer.global_step``, which the restore sets).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import lightning as L

import checkpoints
from backends.lightning.bridge import LightningEngine
from backends.lightning.module import MODEL_PREFIX
from observers import startup

if TYPE_CHECKING:
    from observers import Observers
    from recipes.evaluation import Validator
    from recipes.job import Job


def handles(trainer: L.Trainer, job: Job) -> checkpoints.Handles:
    configs = trainer.lr_scheduler_configs
    return checkpoints.Handles(model=trainer.strategy.model, optimizer=trainer.optimizers[0],
                               scheduler=configs[0].scheduler if configs else None,
                               rank=trainer.global_rank, world_size=trainer.world_size,
                               format=job.run.checkpoint, prefix=MODEL_PREFIX,
                               full_model=lambda: trainer.strategy.full_state_dict(prefix=MODEL_PREFIX),
                               rank_state=getattr(trainer.strategy, "rank_state", lambda _: None)(MODEL_PREFIX))


def set_global_step(trainer: L.Trainer, step: int) -> None:
    """Lightning's step counters, as its own restore would set them for ``step`` optimizer steps
    (automatic optimization: the optimizer-step tracker and the logger's step)."""
    loop = trainer.fit_loop.epoch_loop
    tracker = loop.automatic_optimization.optim_progress.optimizer.step.total
    tracker.ready = tracker.completed = step
    loop._batches_that_stepped = step


class Checkpointing(L.Callback):
    """Save every ``trainer.checkpoint_every`` optimizer steps and the last; restore ``trainer.resume_from``;
    stop cleanly on SIGUSR1/SIGTERM/SIGINT (checkpoints/interrupt.py): after the step every rank is in,
    all save together and the run raises ``Interrupted``. Each checkpoint carries the observers'
    record (``Observers.history``); a resumed run hands it back to them."""

    def __init__(self, job: Job, out: Path, observers: Observers, validator: Validator | None = None):
        self.job, self.out, self.observers, self.validator = job, out, observers, validator
        self._saved: tuple[int, Path | None] = (-1, None)
        self._checked = -1
        self.interrupt = checkpoints.interruption()

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        startup.mark("rendezvous")  # (Lightning's setup_environment: the process group)
        # Lightning registers its own signal handlers after setup and on_fit_start, for the fit:
        # its SIGTERM handler broadcasts from inside the handler -- while the other rank may be in
        # another collective: a deadlock -- and makes the loop raise on the next batch. Ours (a
        # flag) go in again the moment it has registered (its ``_signal_connector``; where a
        # Lightning has none, at on_train_start). At its teardown Lightning restores the handlers
        # it found: ours, installed first by the backend.
        connector = getattr(trainer, "_signal_connector", None)
        register = getattr(connector, "register_signal_handlers", None)
        if register is not None and not getattr(register, "_then_ours", False):
            def register_then_ours() -> None:
                register()
                self.interrupt.install()

            register_then_ours._then_ours = True
            connector.register_signal_handlers = register_then_ours

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.interrupt.install()  # (see setup)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        startup.mark("model_build")  # (configure_model, the strategy's wrapping, the optimizer)
        ckpt = checkpoints.start(self.job, self.out, rank=trainer.global_rank,
                                 world_size=trainer.world_size, device=trainer.strategy.root_device)
        if ckpt is not None:
            set_global_step(trainer, checkpoints.load(handles(trainer, self.job), ckpt))
            self._saved = (ckpt.step, ckpt.path)
            if self.validator is not None:
                self.validator.resume(ckpt.history(), ckpt.step)
            self.observers.resume(LightningEngine(trainer), ckpt.step, ckpt.path, ckpt.history())
        self._checked = trainer.global_step
        startup.mark("checkpoint_load")  # (then the strategy hands back what the restore freed: preset.py)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._checked:  # inside an accumulation window: no optimizer step yet
            return
        self._checked = step
        # (the ObserverBridge, the callback before this one, has validated this step)
        decision = self.validator.decide(self.job.trainer, step) if self.validator is not None else None
        if checkpoints.due(self.job.trainer, step, decision):
            self._save(trainer, step)
        if decision is not None and decision.stop:  # trainer.early_stopping: every rank alike
            trainer.should_stop = True
            return
        if step >= self.job.trainer.max_steps:  # done: the run ends and reports as usual
            return
        signum = self.interrupt.requested(trainer.strategy.root_device)
        if signum:
            raise checkpoints.Interrupted(signum, step, self._save(trainer, step))

    def _save(self, trainer: L.Trainer, step: int) -> Path:
        if self._saved[0] != step:
            self._saved = (step, checkpoints.save(handles(trainer, self.job), self.job, self.out, step,
                                                  self.observers.history()))
        return self._saved[1]
