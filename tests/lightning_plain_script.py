"""A plain Lightning script that imports our presets and trains with Lightning's own ``ddp``:

    python tests/lightning_plain_script.py [--collector]

Nothing of ours trains: ``import strategies`` only puts the presets in Lightning's registry, and
``Trainer(strategy="ddp", accelerator="cpu", devices=2)`` is Lightning's DDPStrategy on gloo. The
script does no cleanup of its own (no ``destroy_process_group``): the process must exit 0 without
"terminate called without an active exception" as it stands.

The Trainer lives in ``main()``, so after ``fit`` its graph (module, DDP wrapper, optimizer,
tensors) is cyclic garbage that some later collection frees, in whichever thread allocates when
it runs -- in rank 0 there is always a second thread, Lightning's child-process observer.
``--collector`` makes that the rule instead of the odd case: automatic collection is off, a
background thread collects the run's garbage as the main thread exits, and the main thread, once
it has the GIL back, keeps it to the end. If that garbage is still there when the interpreter
finalizes, the background thread is inside torch's deallocation with the GIL released;
finalization kills it on its way back (pthread_exit), and the forced unwind through torch's C++
frames is std::terminate: SIGABRT, exit 134 on rank 0 (every run, before the exit teardown that
``import strategies`` registers: backends.teardown_at_exit).
"""

from __future__ import annotations

import gc
import sys
import threading

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import strategies  # noqa: F401  (our presets join Lightning's registry)


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Tiny(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4))


if __name__ == "__main__":
    collector = "--collector" in sys.argv[1:]
    if collector:
        gc.disable()
    main()
    if collector:
        collecting = threading.Event()

        def collect() -> None:
            collecting.set()
            gc.collect()

        # Once the main thread has the GIL back, it keeps it to the end (or until it blocks).
        sys.setswitchinterval(1.0)
        threading.Thread(target=collect, daemon=True, name="collector").start()
        collecting.wait()
