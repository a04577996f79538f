"""A Lightning client as Lightning's documentation writes one -- the layers built in ``__init__``
(no ``configure_model``), every step hook, plain DataLoaders (Lightning adds the distributed
sampler) -- and no stratagem import beyond ``import strategies``; one of our presets by name:

    python tests/lightning_client_script.py <strategy> <devices> <out.json> [<gradient_clip_val> [<optimizer>]]

fit (3 steps), validate, test, predict, fit again (3 more steps on the same Trainer), validate,
on ``devices`` CPU ranks, 8 samples per step over all ranks (SGD, or one of ``OPTIMIZERS``). Rank 0 writes each call's
result: the training losses (averaged over the ranks), the evaluation loss, the predictions'
count and sum -- so a run can be compared with the same script on one process.
"""

from __future__ import annotations

import json
import sys

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import strategies  # noqa: F401  (our presets join Lightning's registry)

GLOBAL_BATCH, STEPS = 8, 3
OPTIMIZERS = {"sgd": lambda params: torch.optim.SGD(params, lr=0.1),
              "adamw": lambda params: torch.optim.AdamW(params, lr=0.01)}


class Regression(L.LightningModule):
    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        self.optimizer = optimizer
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                       torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return OPTIMIZERS[self.optimizer](self.parameters())

    def _loader(self, samples: int, seed: int) -> DataLoader:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(samples, 16, generator=g)
        return DataLoader(TensorDataset(x, torch.sin(x.sum(dim=1, keepdim=True))),
                          batch_size=GLOBAL_BATCH // self.trainer.world_size)

    def train_dataloader(self):
        return self._loader(STEPS * GLOBAL_BATCH, 1)

    def val_dataloader(self):
        return self._loader(2 * GLOBAL_BATCH, 2)

    test_dataloader = val_dataloader

    def predict_dataloader(self):
        return self._loader(GLOBAL_BATCH, 3)


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def _predicted(trainer, batches) -> dict:
    local = torch.stack([torch.cat(batches).sum(), torch.tensor(float(sum(len(b) for b in batches)))])
    if dist.is_initialized():
        dist.all_reduce(local)
    return {"sum": float(local[0]), "count": int(local[1])}


def main(strategy: str, devices: int, out: str, clip: float | None, optimizer: str = "sgd") -> None:
    losses = Losses()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[losses], gradient_clip_val=clip,
                        num_sanity_val_steps=0)
    module, done = Regression(optimizer), []
    trainer.fit(module)
    done.append(["fit", {"losses": losses.losses[:]}])
    done.append(["validate", trainer.validate(module, verbose=False)[0]])
    done.append(["test", trainer.test(module, verbose=False)[0]])
    done.append(["predict", _predicted(trainer, trainer.predict(module))])
    trainer.fit_loop.epoch_loop.max_steps = 2 * STEPS  # what Trainer(max_steps=) sets
    trainer.fit(module)
    done.append(["fit", {"losses": losses.losses[STEPS:]}])
    done.append(["validate", trainer.validate(module, verbose=False)[0]])
    if trainer.global_rank == 0:
        with open(out, "w") as f:
            json.dump({"calls": done, "strategy": type(trainer.strategy).__name__}, f)
    if dist.is_initialized():  # gloo aborts at exit without this
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]) if len(sys.argv) > 4 else None,
         *sys.argv[5:6])
