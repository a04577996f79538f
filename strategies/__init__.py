"""Strategy plugins: typed configs that build Lightning strategies, plus the layout data the
planner and profiles read.

Importing this package registers every preset of ``conf/strategy/`` in Lightning's
``StrategyRegistry`` under its file name, so ``lightning.Trainer(strategy="zero3")`` works
without train.py. The registry entry is a small factory: the preset's YAML is composed only when
Lightning asks for it, and heavy libraries (DeepSpeed) are imported only then.
"""

from __future__ import annotations

from strategies import ddp, fsdp, fsdp2, single, zero  # noqa: F401  (each family registers itself)
from strategies.base import Layout, Run, StrategyConfig, as_config, families, family
from strategies.mesh import Batch, ConfigError, World
from strategies.presets import load, names

__all__ = ["Batch", "ConfigError", "Layout", "Run", "StrategyConfig", "World", "as_config",
           "families", "family", "load", "names", "register_lightning"]


class _LightningPreset:
    """Factory Lightning's registry calls: preset name -> configured Lightning Strategy."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self):
        import os

        import torch

        cfg = load(self.name)
        world = World(nodes=int(os.environ.get("NUM_NODES", 1)),
                      devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        run = Run(accelerator="gpu" if torch.cuda.is_available() else "cpu")
        if type(cfg).parallelize is not StrategyConfig.parallelize:
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(f"strategy={self.name!r} shards the model in the LightningModule's "
                           f"configure_model: call strategies.load({self.name!r}).parallelize("
                           "model, self.device_mesh) there, or the model trains unsharded")
        return cfg.lightning(world, run)


def register_lightning() -> None:
    """Register every preset in Lightning's StrategyRegistry (idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry

    # Lightning's own entries of the same name ("ddp", "fsdp") are replaced on purpose: ours run
    # on CPU too and match what `strategy=<name>` means in train.py.
    for name in names():
        StrategyRegistry.register(name, _LightningPreset(name), override=True,
                                  description=f"stratagem preset conf/strategy/{name}.yaml")


register_lightning()
