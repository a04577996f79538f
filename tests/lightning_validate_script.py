"""A Lightning user's own validation under local SGD: ``validation_step`` in their module,
Lightning's loop, ``Trainer(strategy=<local_sgd built with start_step=1, sync_every=100>)``, so
the two ranks' replicas differ from step 2 on.

    python tests/lightning_validate_script.py <out dir>

One epoch of 3 SGD steps on 2 CPU ranks, validated at its end (8 samples, 4 per rank) with a
``ModelCheckpoint`` saving there, then ``trainer.validate`` again. Rank 0 writes
``<out dir>/result.json``: the logged val_loss of both validations, each rank's own replica's
loss on the whole validation set (computed locally), whether each rank's parameters came back
bit for bit after the fit's validation, and whether the checkpoint holds each rank's own replica.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import strategies  # noqa: F401  (our presets join Lightning's registry)
from backends.lightning.families import build
from backends.lightning.families.ddp import RANK_STATE
from strategies.presets import load


def _data(n: int, seed: int) -> TensorDataset:
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, x.sum(1, keepdim=True).sin())


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        data = _data(24, 1)
        return DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False))

    def val_dataloader(self) -> DataLoader:
        data = _data(8, 2)
        return DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False))


class Before(L.Callback):
    """Each rank's parameters as validation starts (callbacks run before the strategy's hook)."""

    def on_validation_start(self, trainer, pl_module) -> None:
        self.own = [p.detach().clone() for p in pl_module.parameters()]


def main(out: Path) -> None:
    strategy = build(replace(load("local_sgd"), start_step=1, sync_every=100))
    saves = L.pytorch.callbacks.ModelCheckpoint(dirpath=out / "ckpt", filename="last", save_on_train_epoch_end=False)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=1, callbacks=[saves, before := Before()],
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    model = Regression()
    trainer.fit(model)
    at_fit = float(trainer.callback_metrics["val_loss"])
    own = [p.detach().clone() for p in model.parameters()]
    back = all(torch.equal(a, b) for a, b in zip(before.own, own))
    x, y = _data(8, 2).tensors
    with torch.no_grad():
        mine = float(torch.nn.functional.mse_loss(model.net(x), y))
    saved = torch.load(out / "ckpt" / "last.ckpt", weights_only=False)[RANK_STATE]["ranks"][trainer.global_rank]
    in_ckpt = all(torch.equal(v, p) for v, p in zip(saved["replica"].values(), own))
    # (Lightning's own trainer.validate copies rank 0's module to every rank for good: not ours)
    at_validate = float(trainer.validate(model, verbose=False)[0]["val_loss"])
    every: list = [None] * 2
    dist.all_gather_object(every, {"own_loss": mine, "back": back, "in_ckpt": in_ckpt})
    if trainer.global_rank == 0:
        (out / "result.json").write_text(json.dumps({"at_fit": at_fit, "at_validate": at_validate,
                                                     "ranks": every}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
