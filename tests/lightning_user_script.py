"""A Lightning user's own script: their module and data, our presets by name.

    python tests/lightning_user_script.py <strategy> <devices> <out.json> [meta]

Trains 5 SGD steps of a small regression on a fixed dataset, 8 samples per step split over the
ranks in order (the module's own DistributedSampler), with ``Trainer(strategy=<name>)``. Rank 0
writes the per-step loss (averaged over the ranks), the strategy's class and the parameter
bytes rank 0 holds. ``meta``: the layers are built on the meta device, as Lightning's FSDP2
docs show (Lightning gives them storage after sharding and calls ``reset_parameters``); rank 0
also writes the largest initial weight of the first layer.
"""

from __future__ import annotations

import json
import sys

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import strategies  # noqa: F401  (our presets join Lightning's registry)

GLOBAL_BATCH, STEPS = 8, 5


class Regression(L.LightningModule):
    """Layers built in configure_model, as Lightning recommends for sharded strategies."""

    def __init__(self, meta: bool = False) -> None:
        super().__init__()
        self.net: torch.nn.Module | None = None
        self.meta, self.first_weight = meta, None

    def configure_model(self) -> None:
        if self.net is None:
            torch.manual_seed(0)
            with torch.device("meta") if self.meta else torch.device("cpu"):
                self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                               torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                               torch.nn.Linear(64, 1))

    def on_train_start(self) -> None:
        w = self.net[0].weight
        self.first_weight = float((w.full_tensor() if hasattr(w, "full_tensor") else w).abs().max())

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        # In order, split over the ranks: step k of every run sees samples 8k .. 8k+7.
        g = torch.Generator().manual_seed(1)
        x = torch.randn(STEPS * GLOBAL_BATCH, 16, generator=g)
        data = TensorDataset(x, torch.sin(x.sum(dim=1, keepdim=True)))
        world = self.trainer.world_size
        sampler = DistributedSampler(data, num_replicas=world, rank=self.global_rank, shuffle=False)
        return DataLoader(data, batch_size=GLOBAL_BATCH // world, sampler=sampler)


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["loss"]))


def main(strategy: str, devices: int, out: str, meta: bool = False) -> None:
    losses = Losses()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[losses], use_distributed_sampler=False)
    module = Regression(meta)
    trainer.fit(module)
    held = sum(getattr(p, "to_local", lambda p=p: p)().numel() * p.element_size()
               for p in trainer.strategy.model.parameters())
    if trainer.global_rank == 0:
        with open(out, "w") as f:
            json.dump({"losses": losses.losses, "strategy": type(trainer.strategy).__name__,
                       "params_bytes_rank0": held, "first_weight": module.first_weight}, f)
    if dist.is_initialized():  # gloo aborts at exit without this
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:] == ["meta"])
