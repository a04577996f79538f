"""single on Accelerate: one process, no plugin."""

from __future__ import annotations

from backends.accelerate.families import Builder, builds
from strategies.families.single import SingleConfig


@builds(SingleConfig)
class Single(Builder):
    pass
