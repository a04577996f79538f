"""The recipe as Lightning sees it: a thin LightningModule and DataModule over recipes/.

The module only adapts: the model, loss, optimizer and schedule are recipes/training.py's; the
strategy applies parallelism to the model after ``configure_model`` builds it (see each
family's Lightning builder), so nothing here depends on the preset.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from parallel.float8 import precompute_after_step
from recipes import evaluation, training
from recipes.data import CountedShare, GlobalBatchSampler, train_loader

if TYPE_CHECKING:
    from recipes.config import ModelConfig, TrainerConfig

# Where the plain model sits in this module (state-dict keys start with it).
MODEL_PREFIX = "model."


class CausalLM(L.LightningModule):
    """Next-token prediction. The model is built in ``configure_model`` so sharding strategies
    can build it their way (DeepSpeed's ``zero.Init``) and shard it before the optimizer."""

    def __init__(self, shape: ModelConfig, trainer_cfg: TrainerConfig):
        super().__init__()
        self.shape, self.trainer_cfg = shape, trainer_cfg
        self.model: torch.nn.Module | None = None
        self._names: tuple[list[str], frozenset[str]] = ([], frozenset())  # plain; no decay
        self.share: CountedShare | None = None  # the training set's token-true loss weights
        self.objective = None  # objective=dpo: recipes/dpo.py Dpo

    def configure_model(self) -> None:
        if self.model is None:
            strategy = self._trainer and self.trainer.strategy
            self.model = training.build_model(self.shape, self.trainer_cfg.seed,
                                              meta=getattr(strategy, "builds_on_meta", False),
                                              gather=getattr(strategy, "gather_parameters", None))
            self._names = ([n for n, _ in self.model.named_parameters()], training.no_decay_names(self.model))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        step = self.trainer.global_step if self._trainer is not None else 0
        return training.loss(self.model, batch, self.trainer_cfg.loss_chunk, self.step_share(),
                             self.objective, step)

    def on_train_epoch_end(self) -> None:
        # (the run is one epoch; before the bridge's on_train_end writes report.json)
        if self.objective is not None:
            self.objective.publish()

    def step_share(self) -> float:
        """This optimizer step's ``CountedShare`` (Lightning's global_step counts optimizer
        steps, so it holds through an accumulation window)."""
        return 1.0 if self.share is None else self.share(self.trainer.global_step)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor | None], batch_idx: int) -> torch.Tensor:
        """[sum of token losses, tokens] (recipes/evaluation.py averages them over every rank);
        without targets, the logits (callbacks.samples' greedy generation, recipes/samples.py)."""
        if batch[1] is None:
            return self.model(batch[0])
        return evaluation.batch_sums(self.model, batch, self.trainer_cfg.loss_chunk)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                    gradient_clip_algorithm=None) -> None:
        # Our strategies measure the global norm (logged as grad_norm) and clip, each where its
        # gradients live (shards, meshes, pipeline stages); another strategy: Lightning's way.
        clip = getattr(self.trainer.strategy, "clip_grad_norm", None)
        if clip is not None:
            clip(optimizer, float(gradient_clip_val or 0.0))
        else:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self):
        # The wrapped model's parameters: FSDP1 with use_orig_params=False registers the root
        # unit's flat parameter on the wrapper, not on this module.
        named = self.trainer.model.named_parameters() if self._trainer is not None else self.named_parameters()
        groups = training.param_groups(named, self.trainer_cfg, *self._names)
        # a strategy that regroups them (zero2_ep: the experts in DeepSpeed's moe groups)
        regroup = getattr(self.trainer.strategy, "optimizer_groups", None) if self._trainer else None
        opt = training.build_optimizer(regroup(groups) if regroup else groups, self.trainer_cfg)
        precompute_after_step(self, opt)  # (float8 weights gathered by FSDP2: their scales)
        sched = training.build_scheduler(opt, self.trainer_cfg)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class GlobalBatchData(L.LightningDataModule):
    """Serves this rank's micro-batches through ``GlobalBatchSampler``, resuming at the
    trainer's global step (so a restored run continues with the batches it had not seen)."""

    def __init__(self, dataset: Dataset, *, global_batch: int, micro_batch: int, steps: int,
                 seed: int, num_workers: int = 0):
        super().__init__()
        self.dataset, self.global_batch, self.micro_batch = dataset, global_batch, micro_batch
        self.steps, self.seed, self.num_workers = steps, seed, num_workers

    def train_dataloader(self) -> DataLoader:
        strategy = self.trainer.strategy
        dp = getattr(strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
        sampler = GlobalBatchSampler(
            len(self.dataset), global_batch=self.global_batch, micro_batch=self.micro_batch,
            dp_rank=dp["rank"], dp_size=dp["num_replicas"], seed=self.seed, steps=self.steps,
            start_step=self.trainer.global_step,
        )
        # Ulysses: this rank's sequence shard of its sequence group's samples
        seq = getattr(strategy, "sequence_shard", None)
        return train_loader(self.dataset, sampler, self.num_workers, seq, self.seed)
