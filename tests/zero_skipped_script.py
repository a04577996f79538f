"""A Lightning user's module whose ``odd`` layer runs only on odd steps, under a ZeRO preset.

    python tests/zero_skipped_script.py <strategy> <out.json> [never]

4 SGD steps in one process. ``never``: the ``odd`` layer is never called (that trains exactly
under ZeRO). Writes the per-step losses and plain torch's, or the error the run stopped with.
"""

from __future__ import annotations

import json
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import strategies  # noqa: F401  (our presets join Lightning's registry)


class Skips(L.LightningModule):
    def __init__(self, never: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.odd, self.never, self.losses = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), never, []

    def loss(self, x, step: int):
        h = self.a(x)
        if not self.never and step % 2 == 1:
            h = h + self.odd(h)
        loss = (h ** 2).mean()
        self.losses.append(float(loss))
        return loss

    def training_step(self, batch, i):
        return self.loss(batch[0], self.global_step)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 4, generator=torch.Generator().manual_seed(1))),
                          batch_size=2)


def plain(never: bool) -> list[float]:
    """The same 4 steps with torch alone (a parameter whose grad is None is left alone)."""
    model = Skips(never)
    opt = model.configure_optimizers()
    for step, (x,) in enumerate(model.train_dataloader()):
        opt.zero_grad()
        loss = model.loss(x, step)
        loss.backward()
        opt.step()
    return model.losses


if __name__ == "__main__":
    never = sys.argv[3:] == ["never"]
    reference = plain(never)
    model = Skips(never)
    trainer = L.Trainer(strategy=sys.argv[1], accelerator="cpu", devices=1, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    try:
        trainer.fit(model)
        out = {"losses": model.losses, "plain": reference}
    except Exception as e:  # (the run's one error, as the user sees it)
        out = {"error": f"{type(e).__name__}: {e}", "losses": model.losses, "plain": reference}
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
