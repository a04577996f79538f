"""Mixture of experts: what the router did, per optimizer step, over every rank.

Read after each micro-batch's forward from the model's MoE layers (the modules that carry
``aux_loss`` and ``stats``, as recipes/gpt.py's ``MoE`` does): the load-balancing loss (each
layer's, unweighted, the mean of its sequences), the assignments each expert took and the ones
dropped over its capacity.

Report key ``moe``: ``aux_loss`` (mean over micro-batches and ranks of the sum over MoE layers,
before model.aux_loss_coef), ``tokens_per_expert`` (per MoE layer, the assignments each expert
took per optimizer step, summed over every rank), ``dropped_tokens`` (assignments dropped per
step, all layers and ranks), ``dropped_fraction`` (of all assignments), ``layers``.
"""

from __future__ import annotations

from typing import Any

from observers.base import Engine, Observer, Selection, observer


def moe_layers(model: Any) -> list[Any]:
    return [m for m in model.modules() if hasattr(m, "aux_loss_coef") and hasattr(m, "stats")]


class MoEStats(Observer):
    def __init__(self) -> None:
        self.aux: list[float] = []
        self.tokens: list[list[float]] | None = None
        self.dropped = 0.0
        self.assignments = 0.0
        self.steps = 0
        self.merged: dict[str, Any] = {}

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

    def on_train_end(self, engine: Engine) -> None:
        from observers.memory import all_gather

        ranks = all_gather({"aux": self.aux, "tokens": self.tokens, "dropped": self.dropped,
                            "assignments": self.assignments})
        steps = max(1, self.steps)
        aux = [a for r in ranks for a in r["aux"]]
        tokens = None
        for r in ranks:
            if r["tokens"] is None:
                continue
            tokens = [list(t) for t in r["tokens"]] if tokens is None else [
                [a + b for a, b in zip(x, y)] for x, y in zip(tokens, r["tokens"])]
        dropped = sum(r["dropped"] for r in ranks)
        total = sum(r["assignments"] for r in ranks)
        self.merged = {
            "aux_loss": sum(aux) / len(aux) if aux else None,
            "tokens_per_expert": [[x / steps for x in layer] for layer in tokens] if tokens else [],
            "dropped_tokens": dropped / steps,
            "dropped_fraction": dropped / total if total else 0.0,
            "layers": len(tokens or []),
        }

    def report(self) -> dict[str, Any]:
        return {"moe": self.merged} if self.merged else {}


@observer("moe", order=60)
def _selected(s: Selection) -> Observer | None:
    """A MoE model's routing, whenever the model is one."""
    return MoEStats() if getattr(s.job.model, "is_moe", False) else None
