"""A Lightning user's module under ZeRO-3 that writes into its parameters or uses one outside a
module's forward, one ``Trainer.fit`` per case, in one launch of 2 CPU ranks.

    python tests/zero3_user_script.py <out.json> <case> [<case> ...]

Cases (each a fresh module and Trainer, strategy zero3 with every tensor partitioned,
``strategy.param_persistence_threshold=0``, unless said):

* ``init``: ``configure_model`` builds the layers, then ``torch.nn.init.normal_`` on a built
  child's weight (the audit's CM=1 INIT=1: lost without a word before the refusal);
* ``xavier``: the same with ``torch.nn.init.xavier_uniform_`` (fails on the empty tensor before it
  writes);
* ``writes``: tries other writes in ``configure_model`` (each caught, its error recorded), then
  writes the initialisation under ``deepspeed.zero.GatheredParameters(..., modifier_rank=0)`` and
  trains;
* ``penalty``: an L2 penalty on the module's own ``W`` in ``training_step``;
* ``penalty_forward``: the same penalty computed in the module's forward;
* ``penalty_gathered``: on a copy of ``W`` taken inside ``deepspeed.zero.GatheredParameters``;
* ``penalty_threshold``: the ``penalty`` case with ``strategy.param_persistence_threshold`` above
  ``W``'s size.

Rank 0 writes, per case, the per-step losses (averaged over the ranks) or the error the fit
stopped with, and the same steps in plain torch in one process (SGD, the whole batch); what a
callback sees of a partitioned weight; for ``writes``, what the module and the strategy hold
after fit, and Lightning's checkpoint converted (``<out.json's folder>/ckpt``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from backends.lightning import stratagem_strategy

GLOBAL_BATCH, STEPS, D, H = 8, 3, 8, 16


def initialise(module: "User") -> None:
    """The user's initialisation of an already-built child's weight."""
    torch.nn.init.normal_(module.block[0].weight, std=0.5, generator=torch.Generator().manual_seed(1))


class User(L.LightningModule):
    def __init__(self, case: str, plain: bool = False) -> None:
        super().__init__()
        self.case, self.block, self.writes = case, None, {}
        if plain:
            self.configure_model()

    def configure_model(self) -> None:
        if self.block is not None:
            return
        torch.manual_seed(0)
        self.block = torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.Tanh(), torch.nn.Linear(H, 1))
        self.W = torch.nn.Parameter(torch.randn(D, D) * 0.3)
        if self.case == "init":
            initialise(self)
        elif self.case == "xavier":
            torch.nn.init.xavier_uniform_(self.block[0].weight)
        elif self.case == "writes" and hasattr(self.block[0].weight, "ds_id"):  # (built under zero.Init)
            self.try_writes()
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.block[0].parameters()), modifier_rank=0):
                initialise(self)
        elif self.case == "writes":  # (the plain run)
            initialise(self)

    def try_writes(self) -> None:
        w = self.block[0].weight
        tries = {"data.normal_": lambda: w.data.normal_(),
                 "copy_": lambda: w.copy_(torch.ones(H, D)),
                 "setitem": lambda: w.__setitem__(0, 1.0),
                 "iadd": lambda: w.__iadd__(1.0),
                 "detach.zero_": lambda: w.detach().zero_(),
                 "data=": lambda: setattr(w, "data", torch.ones(H, D)),
                 "bias.fill_": lambda: self.block[2].bias.fill_(0.0)}
        for name, write in tries.items():
            try:
                with torch.no_grad():
                    write()
                self.writes[name] = None
            except Exception as e:
                self.writes[name] = f"{type(e).__name__}: {e}"
        self.writes["reads"] = [list(w.shape), float(w.detach().sum()), len(list(self.parameters()))]

    def forward(self, x):
        out = self.block(x @ self.W).squeeze(-1)
        return (out, self.W.pow(2).sum()) if self.case == "penalty_forward" else out

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        if self.case == "penalty_forward":
            out, penalty = out
        elif self.case == "penalty_gathered":
            import deepspeed

            with deepspeed.zero.GatheredParameters([self.W]):
                w = self.W.clone()
            penalty = w.pow(2).sum()
        elif self.case.startswith("penalty"):
            penalty = self.W.pow(2).sum()
        else:
            penalty = 0.0
        loss = torch.nn.functional.mse_loss(out, y) + 0.01 * penalty
        self.log("loss", loss, sync_dist=True, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        data = dataset()
        world = self.trainer.world_size
        sampler = DistributedSampler(data, num_replicas=world, rank=self.global_rank, shuffle=False)
        return DataLoader(data, batch_size=GLOBAL_BATCH // world, sampler=sampler)


def dataset() -> TensorDataset:
    x = torch.randn(STEPS * GLOBAL_BATCH, D, generator=torch.Generator().manual_seed(2))
    return TensorDataset(x, torch.sin(x.sum(dim=1)))


def plain(case: str, weights: bool = False) -> Any:
    """The case's steps in torch alone, one process, the whole batch a step: the losses, or
    (``weights``) the final parameters."""
    model = User(case, plain=True)
    opt = model.configure_optimizers()
    losses = []
    for x, y in DataLoader(dataset(), batch_size=GLOBAL_BATCH):
        opt.zero_grad()
        out = model(x)
        out = out[0] if case == "penalty_forward" else out
        loss = torch.nn.functional.mse_loss(out, y) + (0.01 * model.W.pow(2).sum() if "penalty" in case else 0)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return {k: v.detach().clone() for k, v in model.state_dict().items()} if weights else losses


class Losses(L.Callback):
    """The step's loss; in a partitioned run, what a callback sees of a weight: its local numel,
    and its numel and sum inside ``GatheredParameters`` (collective: every rank gathers)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.seen: list[list[float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["loss"]))
        w = pl_module.block[0].weight
        if hasattr(w, "ds_id"):
            import deepspeed

            local = w.numel()
            with deepspeed.zero.GatheredParameters([w]):
                self.seen.append([local, w.numel(), float(w.detach().sum())])


def whole(trainer: L.Trainer, module: User, case: str, where: Path) -> dict:
    """After fit: what ``module.state_dict()`` holds (numel), and the largest difference from
    plain torch's final weights of the strategy's ``full_state_dict()`` and of Lightning's
    checkpoint converted by its ``convert_zero_checkpoint_to_fp32_state_dict``."""
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    want = plain(case, weights=True)
    numel = {k: v.numel() for k, v in module.state_dict().items()}
    full = trainer.strategy.full_state_dict()
    trainer.save_checkpoint(where / "ckpt")
    out = {"state_dict_numel": numel, "full_state_dict": diff(want, full)}
    if trainer.global_rank == 0:
        converted = convert_zero_checkpoint_to_fp32_state_dict(where / "ckpt", where / "ckpt.pt")
        out["checkpoint"] = diff(want, converted["state_dict"])
    return out


def diff(want: dict, got: dict) -> float | str:
    if set(want) != set(got):
        return f"keys {sorted(got)}"
    return max(float((want[k] - got[k].float()).abs().max()) for k in want)


def fit(case: str, where: Path) -> dict:
    threshold = 10**6 if case == "penalty_threshold" else 0
    losses, module = Losses(), User(case)
    trainer = L.Trainer(strategy=stratagem_strategy("zero3", f"strategy.param_persistence_threshold={threshold}"),
                        accelerator="cpu", devices=2, max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[losses],
                        use_distributed_sampler=False)
    out: dict = {"plain": plain(case)}
    try:
        trainer.fit(module)
        out["losses"], out["callback_saw"] = losses.losses, losses.seen
        if case == "writes":
            out["after_fit"] = whole(trainer, module, case, where)
    except Exception as e:  # (the run's one error, as the user sees it)
        out["error"] = f"{type(e).__name__}: {e}"
    out["writes"] = module.writes
    return out


def main(out: str, cases: list[str]) -> None:
    results = {case: fit(case, Path(out).parent) for case in cases}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()  # (gloo aborts at exit without it)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
