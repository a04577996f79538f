"""Expert parallelism over DeepSpeed (zero2_ep) is not built for Accelerate: refused by name, as
fsdp_ep is (fsdp2_ep.py)."""

from __future__ import annotations

from backends.accelerate.families import builds
from backends.accelerate.families.fsdp2_ep import Refused
from strategies.families.deepspeed_ep import ZeroEPConfig

builds(ZeroEPConfig)(type("ZeroEPRefused", (Refused,), {}))
