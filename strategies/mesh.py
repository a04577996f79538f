"""The one object that owns the process arithmetic: nodes x devices = dp x tp x pp, and batches.

Every other module asks a ``World`` instead of multiplying sizes itself, so an inconsistent
layout fails here, before any process starts, with the arithmetic printed.
"""

from __future__ import annotations

from dataclasses import dataclass


class ConfigError(ValueError):
    """A configuration problem found before launch. The message lists every problem at once."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid configuration ({len(self.problems)} problem(s)):\n{lines}")


@dataclass(frozen=True)
class World:
    """How many processes run and how they split into parallel dimensions.

    ``devices`` is processes per node (Lightning's ``devices``, torchrun's ``nproc_per_node``).
    """

    nodes: int = 1
    devices: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def size(self) -> int:
        return self.nodes * self.devices

    @property
    def dp(self) -> int:
        """Data-parallel degree: the ranks that see different samples of one global batch."""
        return self.size // (self.tp * self.pp)

    def problems(self) -> list[str]:
        """The parallel arithmetic (nodes and devices >= 1 are the cluster fields' own checks)."""
        out = []
        if self.tp < 1 or self.pp < 1:
            out.append(f"tp={self.tp}, pp={self.pp}: parallel degrees must be >= 1")
        elif self.size % (self.tp * self.pp):
            out.append(
                f"dp({self.size / (self.tp * self.pp):g}) * tp({self.tp}) * pp({self.pp}) "
                f"!= world size {self.size} (nodes {self.nodes} x devices {self.devices}): "
                "choose tp * pp that divides the world size"
            )
        return out


@dataclass(frozen=True)
class Batch:
    """global = micro x dp x accumulation, with accumulation derived."""

    global_size: int
    micro_size: int
    dp: int

    @property
    def accumulation(self) -> int:
        return self.global_size // (self.micro_size * self.dp)

    def problems(self) -> list[str]:
        g, m, dp = self.global_size, self.micro_size, self.dp
        if g < 1 or m < 1:
            return [f"trainer.global_batch_size={g}, trainer.micro_batch_size={m}: both must be >= 1"]
        if g % (m * dp):
            lo = max(m * dp, (g // (m * dp)) * m * dp)
            return [
                f"trainer.global_batch_size={g} is not divisible by micro_batch_size({m}) x "
                f"data-parallel size({dp}) = {m * dp}: global = micro x dp x accumulation needs "
                f"{g} / {m * dp} = {g / (m * dp):g} to be an integer; "
                f"use global_batch_size={lo} or {lo + m * dp}, or change micro_batch_size"
            ]
        return []
