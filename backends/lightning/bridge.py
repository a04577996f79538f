"""One thin Lightning ``Callback`` that feeds the engine-neutral observers.

Lightning calls back per micro-batch; observers think in optimizer steps. The bridge starts a
step at its first micro-batch, and ends it when ``trainer.global_step`` advances, handing the
observers the global-batch loss: the mean of this rank's micro-batch losses, reduced over the
ranks by the strategy.

Validation runs here too, after the optimizer steps the ``Validator`` names: each batch goes
through ``strategy.validation_step`` (the module's ``validation_step`` reached through whatever
wraps it: DDP, FSDP, a DeepSpeed engine; a pipeline strategy runs its schedule's forward-only
``eval``), not through Lightning's validation loop, whose sampler and per-epoch cadence would
not give the same fixed samples on every world size. Under local_sgd and diloco every rank
validates rank 0's replica (backends/common/replica.py), as the Accelerate loop does.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from backends.common.replica import rank0_replica
from observers import Observers
from recipes.evaluation import Validator


class LightningEngine:
    """The ``observers.Engine`` view of a Trainer."""

    def __init__(self, trainer: L.Trainer):
        self.trainer = trainer

    @property
    def rank(self) -> int:
        return self.trainer.global_rank

    @property
    def world_size(self) -> int:
        return self.trainer.world_size

    @property
    def model(self) -> Any:
        return self.trainer.strategy.model

    @property
    def optimizers(self) -> list[Any]:
        return list(self.trainer.strategy.optimizers)

    def held_bytes(self, what: str) -> int:
        return self.trainer.strategy.held_bytes(what)

    def grad_norm(self) -> float | None:
        measured = getattr(self.trainer.strategy, "grad_norm", None)
        return measured() if measured is not None else None

    def logits(self, tokens: torch.Tensor) -> Any:
        """Through ``strategy.validation_step`` (the wrapper's forward, the precision's context)
        with no targets: the module's ``validation_step`` returns the logits."""
        strategy = self.trainer.strategy
        return strategy.validation_step((tokens.to(strategy.root_device), None), 0)


class ObserverBridge(L.Callback):
    def __init__(self, observers: Observers, validator: Validator | None = None):
        self.observers, self.validator = observers, validator
        self.report: dict[str, Any] = {}
        self._micro: list[torch.Tensor] = []
        self._step = 0
        self._in_step = False
        self.started = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.started = True
        self._step = trainer.global_step
        self.observers.meta["engine"] = {"strategy": type(trainer.strategy).__name__,
                                         "wrapped_model": type(trainer.strategy.model).__name__}
        self.observers.train_start(LightningEngine(trainer), self._step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        engine = LightningEngine(trainer)
        if not self._in_step:
            self._in_step = True
            self.observers.step_start(engine, self._step)
        self.observers.forward_start(engine, self._step)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.observers.forward_end(LightningEngine(trainer), self._step)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.observers.before_optimizer_step(LightningEngine(trainer), self._step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        # Lightning hands back loss / accumulate_grad_batches; undo it to get the micro-batch mean.
        self._micro.append(loss.detach().float() * trainer.accumulate_grad_batches)
        if trainer.global_step == self._step:
            return  # still accumulating
        engine = LightningEngine(trainer)
        self.observers.step_work_end(engine, self._step)
        local = torch.stack(self._micro).mean()
        self._micro.clear()
        self._step, self._in_step = trainer.global_step, False
        loss = float(trainer.strategy.reduce(local, reduce_op="mean"))
        self.observers.step_end(engine, self._step, loss)
        if self.validator is not None and self._step in self.validator.due:
            self.observers.validation_start(engine, self._step)
            # (local_sgd, diloco: every rank validates rank 0's replica, its own put back after)
            with rank0_replica(getattr(trainer.strategy, "synchronizer", None), trainer.strategy.model):
                self.observers.validation_end(engine, self._step, self._validate(trainer))

    def _validate(self, trainer: L.Trainer) -> dict[str, Any]:
        strategy = trainer.strategy
        dp = getattr(strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
        model = strategy.model
        was = model.training
        model.eval()
        try:
            return self.validator.run(strategy.validation_step, dp_rank=dp["rank"],
                                      dp_size=dp["num_replicas"], device=strategy.root_device,
                                      step=self._step, seq=getattr(strategy, "sequence_shard", None))
        finally:
            model.train(was)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pipeline = getattr(trainer.strategy, "pipeline_report", None)
        if pipeline is not None and (section := pipeline()) is not None:
            self.observers.meta["pipeline"] = section  # collective: every rank calls it
        self.report = self.observers.train_end(LightningEngine(trainer))

    def untrained(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """After ``fit``: a run restored at ``trainer.max_steps`` (an explicit checkpoint path
        there, which only loads) has had Lightning skip its loop and with it the train hooks, and
        wrote no report; it reports what it loaded, as Accelerate's loop does."""
        if self.started:
            return
        self.on_train_start(trainer, pl_module)
        pl_module.on_train_epoch_end()  # (DPO's report section, as after a trained epoch)
        self.on_train_end(trainer, pl_module)
