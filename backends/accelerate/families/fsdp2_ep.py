"""Expert parallelism (fsdp_ep, and zero2_ep: deepspeed_ep.py) is not built for Accelerate: refused
by name."""

from __future__ import annotations

from backends.accelerate.families import Builder, builds
from strategies.families.fsdp2_ep import FSDP2EPConfig


class Refused(Builder):
    def problems(self) -> list[str]:
        return [f"strategy={self.preset.name} (expert parallelism) is not supported by "
                "backend=accelerate: Accelerate's plugins shard every parameter over the same "
                "data-parallel group and have no expert-parallel group or token all-to-all; "
                "backend=lightning runs it"]


builds(FSDP2EPConfig)(type("FSDP2EPRefused", (Refused,), {}))
