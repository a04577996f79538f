"""What every family's Lightning builder shares, and the registration of our presets in
Lightning's ``StrategyRegistry``.

One strategy, whichever way it is reached: a family's ``lightning()`` builds a strategy that
carries its preset (``PresetStrategy``) and takes everything else from Lightning at setup —
nodes and devices from the Trainer, precision from its precision plugin, the block class from
the model. train.py and ``Trainer(strategy="<preset>")`` therefore build the same object, and
both check the preset's problems against the world Lightning really runs (``check``).

Registration: importing ``strategies`` must not import Lightning (plan.py and ``--cfg job`` stay
fast), yet a user who imports our presets expects ``Trainer(strategy="zero3")`` to work. So
``register_when_lightning_loads()`` registers at once if Lightning's strategies module is
already imported, and otherwise adds a one-shot import hook that registers right after it is.
Our entries replace Lightning's own ``ddp`` and ``fsdp``: see docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from dataclasses import asdict
from typing import Any

from strategies.base import Run, StrategyConfig
from strategies.mesh import ConfigError, World

LIGHTNING_STRATEGIES = "lightning.pytorch.strategies"
# Lightning's precision flags -> ours.
_PRECISION = {"32-true": "32", "32": "32", "bf16-mixed": "bf16-mixed", "16-mixed": "16-mixed"}


class PresetStrategy:
    """Mixin for a Lightning strategy built from a preset: put it first in the bases."""

    preset: StrategyConfig

    def world(self) -> World:
        """The world as Lightning set it up (nodes x processes per node)."""
        devices = getattr(self, "num_processes", 1) or 1
        return World(nodes=getattr(self, "num_nodes", 1) or 1, devices=devices,
                     tp=getattr(self.preset, "tp", 1), pp=getattr(self.preset, "pp", 1))

    def run(self) -> Run:
        from lightning.pytorch.accelerators import CPUAccelerator

        on_cpu = self.accelerator is None or isinstance(self.accelerator, CPUAccelerator)
        flag = str(getattr(self.precision_plugin, "precision", "32-true"))
        return Run(accelerator="cpu" if on_cpu else "gpu", precision=_PRECISION.get(flag, flag))

    def check(self) -> None:
        """The preset's problems on the world Lightning runs: the same sentences train.py
        prints before launch, raised here for a strategy reached through the registry."""
        from strategies import checks

        problems = (checks.problems(self.preset, "strategy") + self.world().problems()
                    or self.preset.problems(self.world(), self.run()))
        if problems:
            raise ConfigError(problems)

    def setup_environment(self) -> None:
        self.check()
        super().setup_environment()

    def describe(self) -> dict[str, Any]:
        """What this strategy will apply, as plain data (logged once; compared in tests)."""
        return {"class": type(self).__name__, "preset": asdict(self.preset),
                **self.engine_settings()}

    def engine_settings(self) -> dict[str, Any]:
        return {}


def set_timeout(strategy: Any, seconds: float) -> None:
    """How long the strategy's process group lets a collective wait for a lost peer
    (``cluster.collective_timeout``). Lightning's strategies take ``timeout`` only at construction,
    which for our presets happens before the cluster is known (the registry path), so it is set
    here, on the attribute their ``setup_distributed`` hands to ``init_process_group`` (DDP, FSDP,
    ModelParallel) and ``deepspeed.init_distributed``. A strategy without a process group
    (single device) has no such attribute and is left alone."""
    from datetime import timedelta

    if hasattr(strategy, "_timeout"):
        strategy._timeout = timedelta(seconds=seconds)


def _preset_factory(name: str):
    def build() -> Any:
        from strategies.presets import load

        return load(name).lightning()

    build.__name__ = f"stratagem_{name}"
    return build


def register() -> None:
    """Register every preset in Lightning's StrategyRegistry (idempotent)."""
    from lightning.pytorch.strategies import FSDPStrategy, StrategyRegistry

    from strategies.presets import names

    for name in names():
        StrategyRegistry.register(name, _preset_factory(name), override=True,
                                  description=f"stratagem preset conf/strategy/{name}.yaml")
    # Lightning refuses FSDP on CPU by *name*, from FSDPStrategy's own list of the names it
    # registered, before it consults the registry. Our entry under that name is not Lightning's
    # FSDPStrategy any more (ours runs on CPU), so the name leaves that list.
    FSDPStrategy._registered_strategies[:] = [
        n for n in FSDPStrategy._registered_strategies if n not in names()]


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A one-shot import hook: let ``module`` load as usual, then call ``then``."""

    def __init__(self, module: str, then) -> None:
        self.module, self.then, self.loader = module, then, None

    def find_spec(self, fullname, path, target=None):
        if fullname != self.module:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        self.loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.then()


def register_when_lightning_loads() -> None:
    if LIGHTNING_STRATEGIES in sys.modules:
        register()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(LIGHTNING_STRATEGIES, register))
