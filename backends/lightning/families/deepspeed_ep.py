"""Expert parallelism over DeepSpeed on Lightning (strategies/families/deepspeed_ep.py): ``zero2_ep``
is refused before launch (its config's ``problems``); its builder is the DeepSpeed one, so that it
is reachable from Lightning's registry by name and refused there (``check``) with the same
sentence."""

from __future__ import annotations

from backends.lightning.families import builds
from backends.lightning.families.deepspeed import CPUCapableDeepSpeedStrategy
from strategies.families.deepspeed_ep import ZeroEPConfig


@builds(ZeroEPConfig)
class ExpertParallelDeepSpeedStrategy(CPUCapableDeepSpeedStrategy):
    """Refused at ``check`` (strategies/families/deepspeed_ep.py says why)."""
