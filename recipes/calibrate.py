"""Calibrate the planner's activation model on the model actually trained.

    python -m recipes.calibrate        # rewrites planner/activations.json (a test keeps it current)

Textbook formulas (Korthikanti et al. 2022) count a GPT layer's saved activations; our model
saves more (RMSNorm's fp32 upcast, RoPE's fp32 copies, SwiGLU's three inner tensors, fp32
logits for the loss) and by precision regime differently. So: trace the real modules at tiny
shapes on CPU with the memory observer's counter (``strategies.memory.SavedTensors``), once,
and fit bytes per token as a linear function of the shape -- exact, because every tensor a
block saves is one of those widths. The planner then scales the fitted coefficients to any
shape without torch (it reads the JSON).

Parts, bytes saved per token (per sequence position of one micro-batch):
- ``block``: one transformer block: ``c_one + c_dim * dim + c_ffn * ffn + c_kv * kv_dim
  + c_heads * heads`` (``one``: per-token statistics such as RMSNorm's reciprocal norm;
  ``heads``: the attention kernel's log-sum-exp);
- ``checkpointed``: the same block under activation checkpointing (only its input remains);
- ``tail``: final norm, output projection and the fp32 cross entropy: ``c_one + c_dim * dim +
  c_vocab * vocab``;
- ``embedding``: the token embedding (its indices).

Regimes: ``32`` (fp32 parameters), ``autocast`` (fp32 parameters under torch autocast bf16:
torch AMP families' bf16-mixed), ``bf16`` (bf16 parameters: DeepSpeed's bf16-mixed).
"""

from __future__ import annotations

import contextlib
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from recipes.config import ModelConfig
from strategies.memory import SavedTensors

OUT = Path(__file__).resolve().parents[1] / "planner" / "activations.json"
REGIMES = ("32", "autocast", "bf16")
BLOCK_FEATURES = ("one", "dim", "ffn", "kv_dim", "heads")
TAIL_FEATURES = ("one", "dim", "vocab")
SEQ, BATCH = 16, 2
# Shapes that make the features independent: (dim, heads, kv_heads, ffn, vocab)
SHAPES = [(32, 4, 4, 64, 64), (64, 4, 4, 64, 64), (32, 4, 2, 64, 64), (32, 8, 8, 64, 64),
          (32, 4, 4, 96, 128), (64, 8, 2, 160, 96)]


def _shape(dim: int, heads: int, kv: int, ffn: int, vocab: int) -> ModelConfig:
    return ModelConfig(name="calibration", dim=dim, n_layers=1, n_heads=heads, n_kv_heads=kv,
                       vocab_size=vocab, seq_len=SEQ, ffn_dim=ffn)


def _context(regime: str):
    if regime == "autocast":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _dtype(regime: str) -> torch.dtype:
    return torch.bfloat16 if regime == "bf16" else torch.float32


def trace(shape: ModelConfig, regime: str) -> dict[str, float]:
    """Bytes per token each part saves for backward, at this shape and regime."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from recipes.gpt import GPT

    torch.manual_seed(0)
    model = GPT(shape).to(_dtype(regime))
    tokens = torch.randint(shape.vocab_size, (BATCH, SEQ))
    x = model.tok_embeddings(tokens)  # a non-leaf input, as in the model
    out = {}
    for part, block in (("block", model.layers["0"]), ("checkpointed", checkpoint_wrapper(model.layers["0"]))):
        with _context(regime), SavedTensors(buffers=model.buffers()) as saved:
            block(x, model.rope)
        out[part] = saved.bytes / (BATCH * SEQ)
    h = model.tok_embeddings(tokens)
    with _context(regime), SavedTensors(buffers=model.buffers()) as saved:
        logits = model.output(model.norm(h))
        F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
    out["tail"] = saved.bytes / (BATCH * SEQ)
    with _context(regime), SavedTensors(buffers=model.buffers()) as saved:
        model.tok_embeddings(tokens)
    out["embedding"] = saved.bytes / (BATCH * SEQ)
    return out


def _features(shape: ModelConfig, names: tuple[str, ...]) -> list[float]:
    values = {"one": 1, "dim": shape.dim, "ffn": shape.hidden, "kv_dim": shape.n_kv_heads * shape.head_dim,
              "heads": shape.n_heads, "vocab": shape.vocab_size}
    return [float(values[n]) for n in names]


def _fit(rows: list[list[float]], targets: list[float]) -> list[float]:
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(targets, dtype=torch.float64).unsqueeze(1)
    coef = torch.linalg.lstsq(a, b).solution.squeeze(1)
    residual = (a @ coef.unsqueeze(1) - b).abs().max().item()
    if residual > 1e-6 * max(targets):
        raise RuntimeError(f"activations are not linear in {rows}: residual {residual}")
    return [round(c, 6) + 0.0 for c in coef.tolist()]


def calibrate() -> dict[str, dict[str, dict[str, float]]]:
    """regime -> part -> {feature: bytes per token per unit}."""
    out: dict = {}
    for regime in REGIMES:
        shapes = [_shape(*s) for s in SHAPES]
        traces = [trace(s, regime) for s in shapes]
        out[regime] = {}
        for part, names in itertools.chain(((p, BLOCK_FEATURES) for p in ("block", "checkpointed")),
                                           [("tail", TAIL_FEATURES), ("embedding", ("one",))]):
            coef = _fit([_features(s, names) for s in shapes], [t[part] for t in traces])
            out[regime][part] = dict(zip(names, coef))
    return out


ARCHITECTURE = "gpt"  # ModelConfig.architecture: the model these numbers were traced on


def main() -> None:
    table = {"_about": "bytes saved per token by each part of each model, linear in the shape; "
                       "regenerate with python -m recipes.calibrate (recipes/calibrate.py)",
             ARCHITECTURE: calibrate()}
    OUT.write_text(json.dumps(table, indent=2) + "\n")
    print(OUT)


if __name__ == "__main__":
    main()
