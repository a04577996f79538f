"""Mixture of experts: what the router did, per optimizer step, over every rank.

Read after each micro-batch's forward from the model's MoE layers (the modules that carry
``aux_loss`` and ``stats``, as recipes/gpt.py's ``MoE`` does): the load-balancing loss (each
layer's, unweighted, the mean of its sequences), the assignments each expert took and the ones
dropped over its capacity.

Report key ``moe``: ``aux_loss`` (mean over micro-batches and ranks of the sum over MoE layers,
before model.aux_loss_coef), ``tokens_per_expert`` (per MoE layer, the assignments each expert
took per optimizer step, summed over every rank), ``dropped_tokens`` (assignments dropped per
step, all layers and ranks), ``dropped_fraction`` (of all assignments), ``layers``. Over the
whole run: each checkpoint's history carries the totals so far (gathered over the ranks as it
is saved), which a resumed run continues, on any number of ranks.
"""

from __future__ import annotations

import math
from typing import Any

from observers.base import Engine, Observer, Selection, observer


def moe_layers(model: Any) -> list[Any]:
    return [m for m in model.modules() if hasattr(m, "aux_loss_coef") and hasattr(m, "stats")]


class MoEStats(Observer):
    """This attempt's counts on this rank, plus the run's totals before it (a resume's
    ``history``): the report covers the whole run, as the losses do."""

    def __init__(self) -> None:
        self.aux: list[float] = []
        self.tokens: list[list[float]] | None = None
        self.dropped = 0.0
        self.assignments = 0.0
        self.steps = 0
        self.before: dict[str, Any] = {}
        """The run's totals up to the checkpoint resumed from (``totals``' form; empty: none)."""
        self.merged: dict[str, Any] = {}

    def on_resume(self, engine: Engine, step: int, history: dict[str, Any]) -> None:
        before = history.get("moe") or {}
        # (a checkpoint's record ends at its step; one that says otherwise is not continued)
        self.before = dict(before) if before.get("steps") == step else {}

    def history(self) -> dict[str, Any]:
        """The run's totals so far, over every rank: a collective (every rank saves a checkpoint
        together); sums, so a resume on another number of ranks continues them."""
        return {"moe": self.totals()}

    def on_forward_end(self, engine: Engine, step: int) -> None:
        layers = [m for m in moe_layers(engine.model) if m.stats]
        if not layers:
            return
        self.aux.append(float(sum(float(m.aux_loss.detach()) for m in layers)))
        counts = [m.stats["tokens"].double().cpu().tolist() for m in layers]
        if self.tokens is None:
            self.tokens = [[0.0] * len(c) for c in counts]
        for acc, c in zip(self.tokens, counts):
            for i, x in enumerate(c):
                acc[i] += x
        self.dropped += sum(float(m.stats["dropped"]) for m in layers)
        self.assignments += sum(float(m.stats["assignments"]) for m in layers)

    def on_step_end(self, engine: Engine, step: int, loss: float) -> None:
        self.steps += 1

    def totals(self) -> dict[str, Any]:
        """The run's sums so far (``before`` and this attempt on every rank; collective):
        ``aux_sum`` over ``aux_count`` micro-batches, ``tokens`` per layer and expert,
        ``dropped``, ``assignments``, ``steps``."""
        from observers.memory import all_gather

        mine = {"aux_sum": math.fsum(self.aux), "aux_count": len(self.aux), "tokens": self.tokens,
                "dropped": self.dropped, "assignments": self.assignments}
        ranks = all_gather(mine) + ([self.before] if self.before else [])
        tokens = None
        for r in ranks:
            if r.get("tokens") is None:
                continue
            tokens = [list(t) for t in r["tokens"]] if tokens is None else [
                [a + b for a, b in zip(x, y)] for x, y in zip(tokens, r["tokens"])]
        return {"aux_sum": math.fsum(r["aux_sum"] for r in ranks),
                "aux_count": sum(r["aux_count"] for r in ranks), "tokens": tokens,
                "dropped": sum(r["dropped"] for r in ranks),
                "assignments": sum(r["assignments"] for r in ranks),
                "steps": self.steps + int(self.before.get("steps", 0))}

    def on_train_end(self, engine: Engine) -> None:
        t = self.totals()
        steps, tokens, total = max(1, t["steps"]), t["tokens"], t["assignments"]
        self.merged = {
            "aux_loss": t["aux_sum"] / t["aux_count"] if t["aux_count"] else None,
            "tokens_per_expert": [[x / steps for x in layer] for layer in tokens] if tokens else [],
            "dropped_tokens": t["dropped"] / steps,
            "dropped_fraction": t["dropped"] / total if total else 0.0,
            "layers": len(tokens or []),
        }

    def report(self) -> dict[str, Any]:
        return {"moe": self.merged} if self.merged else {}


@observer("moe", order=60)
def _selected(s: Selection) -> Observer | None:
    """A MoE model's routing, whenever the model is one."""
    return MoEStats() if getattr(s.job.model, "is_moe", False) else None
