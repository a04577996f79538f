"""A Lightning module as Lightning's documentation writes one -- no ``configure_model``, the
layers built in ``__init__``, every step hook -- run through every Trainer entry in a row with one
of our presets by name:

    python tests/lightning_calls_script.py <strategy> <out.json>

fit, validate, test, test again, predict, on 2 CPU ranks. Rank 0 writes each call's metrics (the
logged loss, averaged over the ranks) and the number of predictions.
"""

from __future__ import annotations

import json
import sys

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import strategies  # noqa: F401  (our presets join Lightning's registry)


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))

    def _loss(self, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def _data(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(32, 16, generator=g)
        return DataLoader(TensorDataset(x, torch.sin(x.sum(dim=1, keepdim=True))), batch_size=4)

    train_dataloader = val_dataloader = test_dataloader = predict_dataloader = _data


def main(strategy: str, out: str) -> None:
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=2, limit_test_batches=2, limit_predict_batches=2)
    module, done = Regression(), []
    trainer.fit(module)
    done.append(("fit", {}))
    for call in ("validate", "test", "test"):
        done.append((call, getattr(trainer, call)(module)[0]))
    predictions = trainer.predict(module)
    done.append(("predict", {"batches": len(predictions)}))
    if trainer.global_rank == 0:
        with open(out, "w") as f:
            json.dump({"calls": done, "strategy": type(trainer.strategy).__name__}, f)
    if dist.is_initialized():  # gloo aborts at exit without this
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
