"""What the hook's ``Accelerator`` (user.py) does in a user's own loop beyond Accelerate's: an LR
scheduler prepared alone under ZeRO (``AloneSchedules``).

Accelerate's DeepSpeed path wraps a scheduler only when it is prepared in the same call as the
model; ``scheduler = accelerator.prepare(scheduler)`` after it came back bare: it stepped on every
micro-batch (LR 0.08, 0.06 after two steps of 4 where DDP's is 0.09, 0.08) and was never saved,
so a resume restarted the schedule. The hook wraps and registers it as Accelerate does on DDP
(``prepare_scheduler``: once a process per optimizer step, none on an accumulating micro-batch;
``save_state`` / ``load_state`` carry it). One prepared with the model stays Accelerate's.
"""

from __future__ import annotations

from typing import Any


class AloneSchedules:
    """The hook's ``prepare`` under ZeRO: an LR scheduler in a call without the model, wrapped and
    registered as on DDP; a base of its ``Accelerator`` subclass, before ``Accelerator``."""

    stratagem: tuple[str, str]

    def prepare(self, *args: Any, **kw: Any) -> Any:
        out = super().prepare(*args, **kw)  # (Accelerator's, next in the bases)
        import torch
        from torch.optim.lr_scheduler import LRScheduler

        if self.stratagem[1] != "deepspeed" or any(isinstance(a, torch.nn.Module) for a in args):
            return out
        one = (out,) if len(args) == 1 else out  # (Accelerate returns one object bare)
        one = tuple(self.prepare_scheduler(o) if isinstance(o, LRScheduler) else o for o in one)
        return one[0] if len(args) == 1 else one
