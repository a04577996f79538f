"""On resume, this run's trainer settings govern, not the checkpoint's run's: the optimizer's
param-group settings (lr, betas, weight decay, eps; and how it steps: foreach, fused) as this
run's config built them are put back over what a loaded optimizer state carries, and the
schedule continues from the checkpoint's step count on this run's schedule. What differed is
returned for one warning (checkpoints/state.py ``load``). The model's settings that are no
parameter's shape (``model_changes``: LoRA's alpha and dropout, dropout) pass the resume's shape
check, and apply from the resume on: said before launch (checkpoints ``for_launch``)."""

from __future__ import annotations

import math
from typing import Any


def of(optimizer: Any) -> list[dict[str, Any]]:
    """The optimizer's param-group settings as this run's config made them (the learning rate
    aside: the schedule sets it)."""
    return [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in optimizer.param_groups]


def govern(optimizer: Any, settings: list[dict[str, Any]]) -> list[str]:
    """Put this run's settings back over the loaded groups (a loaded state dict carries the
    old run's: a resume with a new trainer.lr or weight decay ran the old ones, silently; and
    how this run steps -- foreach, fused, chosen for this layout -- is not the checkpoint's to
    say: an fsdp2 run's foreach=True in tp's mixed groups crashed the first step). Returns what
    differed, as ``key old -> new`` (``initial_lr``: trainer.lr)."""
    changed = set()
    for group, mine in zip(optimizer.param_groups, settings):
        for k, v in mine.items():
            if k not in _STEPPING and k in group and _differs(group[k], v):
                changed.add(f"{'lr' if k == 'initial_lr' else k} {_shown(group[k])} -> {_shown(v)}")
        group.update(mine)
    return sorted(changed)


_STEPPING = ("foreach", "fused", "capturable", "differentiable")
"""torch optimizers' param-group flags that choose the kernel, not training state."""


def continue_schedule(scheduler: Any, optimizer: Any, saved: dict[str, Any]) -> list[str]:
    """The checkpoint's step count with this run's schedule (trainer.lr, scheduler, warm-up,
    decay steps): the learning rate of the next step is this config's at that step (restoring
    the old state's base and last rates ran the old lr on; a cosine run extended by raising
    max_steps took one step at the old schedule's end, 0.0, then jumped)."""
    steps = int(saved["last_epoch"])
    lrs = [base * f(steps) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    scheduler.load_state_dict({**saved, "base_lrs": list(scheduler.base_lrs), "_last_lr": lrs})
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    old = saved.get("_last_lr") or []
    if old and any(_differs(a, b) for a, b in zip(old, lrs)):
        return [f"the schedule's lr at step {steps + 1} {_shown(old[0])} -> {_shown(lrs[0])}"]
    return []


MODEL_SETTINGS = ("lora.alpha", "lora.dropout", "dropout")
"""model.* settings a checkpoint's parameter shapes do not pin (the rank and target modules do)."""


def model_changes(saved: dict[str, Any], model: Any) -> list[str]:
    """``MODEL_SETTINGS`` that differ between the checkpoint's run (``saved``: its resolved
    ``model`` config) and this one, as ``model.<key> old -> new``. alpha scales the adapters'
    update (alpha / rank x B A), so a new one changes the model the run continues from, and says so."""
    changed = []
    for key in MODEL_SETTINGS:
        if key.startswith("lora.") and not model.lora.rank:
            continue  # (no adapters: nothing to scale or drop)
        old, new = saved, model
        for part in key.split("."):
            old, new = (old or {}).get(part), getattr(new, part)
        if old is not None and _differs(old, new):
            changed.append(f"model.{key} {_shown(old)} -> {_shown(new)}" + (
                " (the adapters' scale, alpha / rank: the run continues from other effective weights)"
                if key == "lora.alpha" else ""))
    return changed


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b))
    return a != b


def _shown(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(tuple(v) if isinstance(v, list) else v)
