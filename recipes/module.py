"""The Lightning side of the recipe: a causal-LM LightningModule and its data module."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from recipes.data import GlobalBatchSampler
from recipes.gpt import GPT, GPTShape


class CausalLM(L.LightningModule):
    """Next-token prediction on a ``GPT``; the model is built in ``configure_model`` so sharding
    strategies can build it their way (DeepSpeed's ``zero.Init``, FSDP2's ``fully_shard``)."""

    def __init__(self, shape: GPTShape, *, lr: float, weight_decay: float = 0.0,
                 warmup_steps: int = 0, seed: int = 0, parallelize=None, optimizer=None):
        super().__init__()
        self.shape, self.lr, self.weight_decay, self.warmup_steps = shape, lr, weight_decay, warmup_steps
        self.seed = seed
        self.parallelize = parallelize  # strategy hook applied to the built model (FSDP2, TP, AC)
        self.optimizer_factory = optimizer or torch.optim.AdamW  # the strategy's AdamW
        self.model: GPT | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        # Same seed on every rank and in the single-process reference: identical initial weights.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            self.model = GPT(self.shape)
        if self.parallelize is not None:
            self.model = self.parallelize(self.model, self.device_mesh)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = self.model.loss(tokens, targets)
        self.log("loss", loss.detach(), prog_bar=True, on_step=True, on_epoch=False, batch_size=len(tokens))
        return loss

    def configure_optimizers(self):
        # The wrapped model's parameters: FSDP1 with use_orig_params=False registers the root
        # unit's flat parameter on the wrapper, not on this module.
        params = self.trainer.model.parameters() if self._trainer is not None else self.parameters()
        opt = self.optimizer_factory(params, lr=self.lr, betas=(0.9, 0.95), eps=1e-8,
                                     weight_decay=self.weight_decay)
        warm = max(self.warmup_steps, 0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (warm + 1)))
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
        return DataLoader(self.dataset, batch_sampler=sampler, num_workers=self.num_workers)
