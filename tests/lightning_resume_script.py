"""A Lightning user's own resume: ``ModelCheckpoint`` saves at step 3, ``fit(ckpt_path=...)``
continues, on a preset that keeps state of its own on each rank.

    python tests/lightning_resume_script.py <preset> <out dir> [<ckpt to resume>]

Two epochs of 3 SGD steps of a small regression on 2 CPU ranks (its own DistributedSampler, in
order), the preset as a user would build it with a short warm-up (``start_step=1``). Rank 0
writes ``<out dir>/result.json``: the per-step losses (averaged over the ranks) and the final
parameters of rank 0 (local SGD's replica is rank 0's own).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import strategies  # noqa: F401  (our presets join Lightning's registry)
from backends.lightning.families import build
from strategies.presets import load

PER_RANK, STEPS = 4, 3  # per epoch


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True, on_step=True, on_epoch=False)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.losses.append(float(self.trainer.callback_metrics["loss"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(STEPS * PER_RANK * 2, 16, generator=g)
        data = TensorDataset(x, x.sum(1, keepdim=True).sin())
        return DataLoader(data, batch_size=PER_RANK, sampler=DistributedSampler(data, shuffle=False))


def main(preset: str, out: Path, ckpt: str | None) -> None:
    knob = {"ddp_powersgd": {"powersgd_warmup_steps": 2}}.get(preset, {"start_step": 1})
    strategy = build(replace(load(preset), **knob))
    saves = L.pytorch.callbacks.ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=STEPS, save_top_k=-1,
                                                filename="{step}")
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=2, callbacks=[saves],
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    model = Regression()
    trainer.fit(model, ckpt_path=ckpt)
    if trainer.global_rank == 0:
        params = {k: v.tolist() for k, v in model.net.state_dict().items()}
        (out / "result.json").write_text(json.dumps({"losses": model.losses, "params": params}))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
