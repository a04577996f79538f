"""Calibrate the planner's activation model on the model actually trained.

    python -m recipes.calibrate        # rewrites planner/activations.json (a test keeps it current)

Textbook formulas (Korthikanti et al. 2022) count a GPT layer's saved activations; our model
saves more (RMSNorm's fp32 upcast, RoPE's fp32 copies, SwiGLU's three inner tensors, fp32
logits for the loss) and by precision regime differently. So: trace the real modules at tiny
shapes on CPU with the memory observer's counter (``parallel.memory.SavedTensors``), once,
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
- ``embedding``: the token embedding (its indices);
- ``moe_block``: a mixture-of-experts block (``MOE_FEATURES``).

Regimes: ``32`` (fp32 parameters), ``autocast`` (fp32 parameters under torch autocast bf16:
torch AMP families' bf16-mixed), ``bf16`` (bf16 parameters: DeepSpeed's bf16-mixed).

Variants, each traced on its own (``VARIANTS``): the plain model above; ``dropout`` (dropout > 0:
the dropout masks, and the attention kernel that keeps its s x s probabilities -- feature
``heads_seq`` = heads x seq_len, per token); ``tp`` / ``tp_sp`` (tensor parallelism as
parallel.parallelize applies it, without and with sequence parallelism; traced at tp = 2 and 4
over a fake process group, so one process and no communication: every feature ``f`` then has a
part kept whole on each rank and a part split over the tp ranks, ``f/tp``) and the same two
with dropout. A pipeline stage saves what its blocks save: the planner combines these per stage.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from core.precision import REGIMES
from recipes.model_config import ModelConfig
from parallel.memory import SavedTensors

OUT = Path(__file__).resolve().parents[1] / "planner" / "activations.json"
BLOCK_FEATURES = ("one", "dim", "ffn", "kv_dim", "heads")
TAIL_FEATURES = ("one", "dim", "vocab")
SEQ, BATCH, DROPOUT = 16, 2, 0.1
TP = (2, 4)
# Shapes that make the features independent: (dim, heads, kv_heads, ffn, vocab)
SHAPES = [(32, 4, 4, 64, 64), (64, 4, 4, 64, 64), (32, 4, 2, 64, 64), (32, 8, 8, 64, 64),
          (32, 4, 4, 96, 128), (64, 8, 2, 160, 96)]
# ... under tensor parallelism: every count divisible by the largest degree traced, and at least
# two query and two key/value heads per rank there (with one, the attention output's reshape is
# a view of what attention saved, not a copy: one b x s x h/tp tensor less than the fit says)
TP_SHAPES = [(32, 8, 8, 64, 64), (64, 8, 8, 64, 64), (64, 16, 8, 64, 64), (32, 16, 16, 64, 64),
             (32, 8, 8, 96, 128), (64, 16, 8, 160, 96)]
# A mixture-of-experts block (recipes/gpt.py's MoE; ``moe_block``): the attention half's
# features and the router's (experts), the top-k assignments' (k, k_dim), the capacity slots'
# (``slots`` = n_experts x capacity / seq_len per token: slots_dim, slots_ffn), the shared
# experts' and a per-sequence term (experts/seq). Traced without dropped assignments
# (capacity_factor >= n_experts / top_k): the planner counts every assignment, an upper bound.
MOE_FEATURES = ("one", "dim", "kv_dim", "heads", "experts", "k", "k_dim", "slots_dim", "slots_ffn",
                "shared_ffn", "experts/seq")
# (dim, heads, kv_heads, expert ffn, experts, top_k, capacity_factor, shared experts)
MOE_SHAPES = [(32, 4, 4, 48, 4, 2, 2.0, 0), (64, 4, 4, 48, 4, 2, 2.0, 0), (32, 4, 2, 48, 4, 2, 2.0, 0),
              (32, 8, 8, 48, 4, 2, 2.0, 0), (32, 4, 4, 96, 4, 2, 2.0, 0), (32, 4, 4, 48, 8, 2, 4.0, 0),
              (32, 4, 4, 48, 4, 1, 4.0, 0), (32, 4, 4, 48, 4, 2, 4.0, 0), (32, 4, 4, 48, 4, 2, 2.0, 1),
              (64, 8, 2, 80, 8, 3, 4.0, 2), (32, 4, 4, 48, 6, 2, 3.0, 0), (48, 4, 4, 64, 4, 3, 2.0, 1),
              (32, 4, 4, 48, 8, 4, 2.0, 0), (64, 4, 4, 32, 4, 1, 8.0, 0)]
# autocast's MoE block is not exactly linear in these features (max residual 0.13% of a block,
# measured): least squares within this bound; every other table is exact
MOE_AUTOCAST_RESIDUAL = 0.005

# name -> (dropout, tensor parallel, sequence parallel)
VARIANTS = {"dropout": (True, False, False), "tp": (False, True, False), "tp_sp": (False, True, True),
            "tp_dropout": (True, True, False), "tp_sp_dropout": (True, True, True)}


def _shape(dim: int, heads: int, kv: int, ffn: int, vocab: int, *, seq: int = SEQ,
           dropout: float = 0.0) -> ModelConfig:
    return ModelConfig(name="calibration", dim=dim, n_layers=1, n_heads=heads, n_kv_heads=kv,
                       vocab_size=vocab, seq_len=seq, ffn_dim=ffn, dropout=dropout)


def _context(regime: str):
    if regime == "autocast":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _dtype(regime: str) -> torch.dtype:
    return torch.bfloat16 if regime == "bf16" else torch.float32


@contextlib.contextmanager
def fake_group(world: int):
    """A process group of ``world`` ranks in this one process whose collectives move nothing
    (torch's fake backend): DTensor tensor parallelism runs with the right local shapes."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("recipes.calibrate traces tensor parallelism in a process of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def trace(shape: ModelConfig, regime: str, tp: int = 1, sp: bool = False) -> dict[str, float]:
    """Bytes per token each part saves for backward, at this shape and regime (``tp`` > 1: on
    one rank of that tensor-parallel degree, inside ``fake_group``)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from recipes.gpt import GPT

    torch.manual_seed(0)
    model = GPT(shape).to(_dtype(regime))
    if tp > 1:
        from torch.distributed.device_mesh import DeviceMesh

        from parallel.parallelize import apply_tp

        apply_tp(model, DeviceMesh("cpu", list(range(tp))), sequence_parallel=sp)
    tokens = torch.randint(shape.vocab_size, (BATCH, shape.seq_len))
    out = {}
    with _context(regime), SavedTensors(buffers=model.buffers()) as saved:
        x = model.drop(model.tok_embeddings(tokens))  # a non-leaf input, as in the model
    out["embedding"] = saved.bytes
    for part, block in (("block", model.layers["0"]), ("checkpointed", checkpoint_wrapper(model.layers["0"]))):
        with _context(regime), SavedTensors(buffers=model.buffers()) as saved:
            y = block(x, model.rope)
        out[part] = saved.bytes
    with _context(regime), SavedTensors(buffers=model.buffers()) as saved:
        logits = model.output(model.norm(y))
        F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
    out["tail"] = saved.bytes
    return {k: v / (BATCH * shape.seq_len) for k, v in out.items()}


def _features(shape: ModelConfig, names: tuple[str, ...], tp: int = 1) -> list[float]:
    from strategies.footprint import moe_features

    values = {"one": 1, "dim": shape.dim, "ffn": shape.hidden, "kv_dim": shape.n_kv_heads * shape.head_dim,
              "heads": shape.n_heads, "vocab": shape.vocab_size, "heads_seq": shape.n_heads * shape.seq_len}
    values |= moe_features(shape) if shape.is_moe else {}
    return [float(values[n.removesuffix("/tp")]) / (tp if n.endswith("/tp") else 1) for n in names]


def _fit(rows: list[list[float]], targets: list[float], tolerance: float = 1e-6) -> list[float]:
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(targets, dtype=torch.float64).unsqueeze(1)
    coef = torch.linalg.lstsq(a, b).solution.squeeze(1)
    residual = (a @ coef.unsqueeze(1) - b).abs().max().item()
    if residual > tolerance * max(targets):
        raise RuntimeError(f"activations are not linear in {rows}: residual {residual}")
    return [round(c, 6) + 0.0 for c in coef.tolist()]


def _calibrate(regime: str, dropout: bool = False, tp: bool = False, sp: bool = False) -> dict:
    """part -> {feature: bytes per token per unit} for one regime and variant."""
    p = DROPOUT if dropout else 0.0
    table = TP_SHAPES if tp else SHAPES
    shapes = [_shape(*s, dropout=p) for s in table]
    if dropout:  # the attention probabilities grow with the sequence: trace two lengths
        shapes += [_shape(*s, seq=2 * SEQ, dropout=p) for s in table[:2]]
    degrees = TP if tp else (1,)
    traces = [(s, t, trace(s, regime, t, sp)) for t in degrees for s in shapes]
    out = {}
    for part, names in (("embedding", ("one", "dim")), ("block", BLOCK_FEATURES), ("checkpointed", BLOCK_FEATURES),
                        ("tail", TAIL_FEATURES)):
        if dropout and part == "block":
            names += ("heads_seq",)
        if tp:  # a part kept whole on every rank, a part split over the tp ranks
            names = tuple(itertools.chain.from_iterable((n, f"{n}/tp") for n in names))
        rows = [(s, t, tr) for s, t, tr in traces if part == "block" or s.seq_len == SEQ]
        coef = _fit([_features(s, names, t) for s, t, _ in rows], [tr[part] for _, _, tr in rows])
        out[part] = {n: c for n, c in zip(names, coef) if c or not tp}
    return out


def _calibrate_moe(regime: str) -> dict[str, float]:
    """{feature: bytes per token per unit} of a mixture-of-experts block in one regime."""
    shapes = [ModelConfig(name="calibration", dim=d, n_layers=1, n_heads=h, n_kv_heads=kv, vocab_size=64,
                          seq_len=seq, ffn_dim=64, n_experts=e, top_k=k, capacity_factor=cf,
                          moe_ffn_dim=eh, n_shared_experts=shared)
              for seq, table in ((SEQ, MOE_SHAPES), (2 * SEQ, MOE_SHAPES[:6]))
              for d, h, kv, eh, e, k, cf, shared in table]
    coef = _fit([_features(s, MOE_FEATURES) for s in shapes], [trace(s, regime)["block"] for s in shapes],
                tolerance=MOE_AUTOCAST_RESIDUAL if regime == "autocast" else 1e-6)
    return dict(zip(MOE_FEATURES, coef))


def calibrate(regimes: tuple[str, ...] = REGIMES) -> dict[str, dict]:
    """regime -> part -> {feature: bytes per token per unit}, and regime -> "variants" ->
    variant -> part -> the same."""
    out: dict = {}
    with fake_group(max(TP)):
        for regime in regimes:
            out[regime] = _calibrate(regime)
            out[regime]["moe_block"] = _calibrate_moe(regime)
            out[regime]["variants"] = {name: _calibrate(regime, *flags) for name, flags in VARIANTS.items()}
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
