"""Activations per device; docs/PLANNER.md. (The transient buffers beside the model states are
each footprint's own: strategies/footprint.py.)

Activations come from the calibration of the model actually trained (``activations.json``:
bytes saved per token by a block, a checkpointed block, the loss tail and the embedding, linear
in the shape, traced by recipes/calibrate.py per precision regime) when its architecture is
calibrated and no tensor parallelism splits it; otherwise from Korthikanti et al. 2022's closed
forms, generalised to our shapes (the documented reference, and the fallback).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

from planner.inputs import ModelDescription


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False) -> float:
    """Korthikanti et al. 2022, eq. 1-3: one GPT layer's 16-bit activations (4h MLP, dropout)."""
    if sp:
        return s * b * h / t * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def layer_activation_bytes(s: int, b: int, h: int, a: int, *, ffn: int | None = None,
                           kv: int | None = None, t: int = 1, sp: bool = False,
                           dropout: bool = True, flash: bool = False, mlp_tensors: int = 2,
                           elem: float = 2) -> float:
    """Korthikanti's per-layer count, term by term, generalised to GQA (``kv`` < h), SwiGLU
    (``mlp_tensors=4``: gate, up, silu, product), no dropout, flash attention and element size.
    With the defaults it equals ``korthikanti_layer_bytes``."""
    ffn, kv = ffn or 4 * h, kv or h
    mask = 1 if dropout else 0                   # one byte per element
    # kept whole on every TP rank unless sequence parallel: 2 norm inputs, attention and MLP
    # inputs (4 elements) plus 2 dropout masks -- Korthikanti's "10"
    replicated = 4 * elem + 2 * mask
    # split over TP ranks: Q, K, V, projection input; the MLP's inner tensors -- his "24"
    split = (2 + 2 * kv / h) * elem + mlp_tensors * ffn / h * elem
    scores = 0.0 if flash else a * s / h * ((1 + mask) * elem + mask)  # softmax (+dropout) "5as/h"
    per_sbh = replicated / (t if sp else 1) + (split + scores) / t
    return s * b * h * per_sbh


def boundary_activation_bytes(micro: int, seq: int, hidden: int, elem: float = 2) -> int:
    """One pipeline-stage boundary activation: micro x seq x hidden x bytes per element."""
    return int(micro * seq * hidden * elem)


@functools.cache
def calibration() -> dict[str, Any]:
    return json.loads((Path(__file__).with_name("activations.json")).read_text())


def _per_token(coefficients: dict[str, float], shape: ModelDescription) -> float:
    head_dim = shape.dim // shape.n_heads
    values = {"one": 1, "dim": shape.dim, "ffn": shape.hidden, "vocab": shape.vocab_size,
              "kv_dim": shape.n_kv_heads * head_dim, "heads": shape.n_heads}
    return sum(c * values[f] for f, c in coefficients.items())


def activation_bytes(shape: ModelDescription, *, micro: int, tp: int = 1, pp: int = 1,
                     inflight: int = 1, sp: bool = False, ckpt: bool = False,
                     flash: bool = True, elem: float = 2, regime: str | None = None) -> int:
    """Activations of the busiest device for one micro-batch (``inflight`` under 1F1B):
    calibrated when ``regime`` names a traced precision regime of this architecture and no
    tensor parallelism splits the layers, else the closed forms with ``elem`` bytes."""
    s, b, h = shape.seq_len, micro, shape.dim
    table = calibration().get(getattr(shape, "architecture", ""), {}).get(regime or "")
    if table and tp == 1:
        tokens = s * b
        layer, block_input, head, embed = (tokens * _per_token(table[p], shape)
                                           for p in ("block", "checkpointed", "tail", "embedding"))
    else:
        layer = layer_activation_bytes(s, b, h, shape.n_heads, ffn=shape.hidden,
                                       kv=shape.n_kv_heads * (h // shape.n_heads), t=tp, sp=sp,
                                       dropout=shape.dropout > 0, flash=flash, mlp_tensors=4,
                                       elem=elem)
        block_input = s * b * h * elem / (tp if sp else 1)  # all a checkpointed block keeps
        head = 4 * s * b * shape.vocab_size / tp + s * b * h * elem / (tp if sp else 1)  # fp32 logits, norm
        embed = 0.0
    layers = math.ceil(shape.n_layers / pp)
    kept = (block_input if ckpt else layer) * layers
    recompute = layer if ckpt else 0.0                   # one block re-run in backward
    first, last = embed + kept * inflight + recompute, kept + recompute + head
    return int(max(first, last))


def estimated_unit(params: float) -> float:
    """The largest FSDP/ZeRO-3 unit of a ``params``-parameter transformer whose shape is not
    given (``planner.params``): GPT-3 and Llama keep hidden ~ 128 x layers, so with ~12 h^2
    parameters a block, P ~ 12 x 128^2 x L^3 and a block is P / L (7B: 213M vs Llama's 202M;
    70B: 0.99B vs 0.86B)."""
    layers = max(1.0, (params / (12 * 128**2)) ** (1 / 3))
    return params / layers
