"""Our presets in Lightning's ``StrategyRegistry``, for users of plain Lightning:
``import strategies`` then ``Trainer(strategy="zero3")``. Called by ``strategies`` right after
Lightning's strategies module is imported (core/hooks.py), so it imports nothing else of
Lightning; each entry is a small factory that builds the preset's strategy only when Lightning
asks for it.

Lightning's own entries are never replaced: a preset whose name Lightning already registers
(``ddp``, ``fsdp``) joins under ``stratagem_<name>``, so importing a library does not change what
``Trainer(strategy="ddp")`` means. Every preset is also registered as ``stratagem_<name>``.

A registry name carries no preset keys; ``stratagem_strategy(preset, "strategy.<key>=<value>", ...)``
builds the same strategy with them, for ``Trainer(strategy=...)`` (as ``stratagem_accelerator``
does for an Accelerate script).
"""

from __future__ import annotations

import atexit
from typing import Any

PREFIX = "stratagem_"


def _factory(name: str):
    def build() -> Any:
        from backends.lightning.families import build as build_strategy
        from strategies.presets import load

        return build_strategy(load(name))

    build.__name__ = f"{PREFIX}{name}"
    return build


def stratagem_strategy(strategy: str, *overrides: str) -> Any:
    """The Lightning strategy of preset ``strategy`` (its name, or its registry name
    ``stratagem_<name>``) with ``overrides``, the preset's keys as on train.py's command line
    (``"strategy.find_unused_parameters=true"``), for ``Trainer(strategy=...)``: the object
    ``Trainer(strategy="<preset>")`` builds, with those keys. A key the preset does not have, or a
    value it does not take, is a ``ConfigError`` naming it (``strategies.presets.load``)."""
    from backends.lightning.families import build as build_strategy
    from strategies.presets import load, names

    if strategy not in names() and strategy.removeprefix(PREFIX) in names():
        strategy = strategy.removeprefix(PREFIX)
    _teardown_registered()
    return build_strategy(load(strategy, overrides))


def entries() -> dict[str, str]:
    """Registry name -> preset name, for every preset."""
    from lightning.pytorch.strategies import StrategyRegistry

    from strategies.presets import names

    out = {}
    for name in names():
        out[f"{PREFIX}{name}"] = name
        theirs = name in StrategyRegistry and "stratagem preset" not in StrategyRegistry[name]["description"]
        if not theirs:
            out[name] = name
    return out


def register() -> None:
    """Register every preset in Lightning's StrategyRegistry (idempotent), and the exit teardown of
    a user's own script: no process group and none of the run's garbage left to interpreter
    finalization, whichever strategy trained (``backends.teardown_at_exit``)."""
    from lightning.pytorch.strategies import StrategyRegistry

    for key, name in entries().items():
        StrategyRegistry.register(key, _factory(name), override=True,
                                  description=f"stratagem preset conf/strategy/{name}.yaml")
    _teardown_registered()


def _teardown_registered() -> None:
    atexit.unregister(_teardown_at_exit)  # once, however often this is called
    atexit.register(_teardown_at_exit)


def _teardown_at_exit() -> None:
    # (looked up at exit: ``register`` runs inside ``import backends`` when Lightning came first)
    from backends import teardown_at_exit

    teardown_at_exit()
