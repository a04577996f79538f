"""Activations per device; docs/PLANNER.md. (The transient buffers beside the model states are
each footprint's own: strategies/footprint.py.)

Activations come from the calibration of the model actually trained (``activations.json``:
bytes saved per token by a block, a checkpointed block, the loss tail and the embedding, linear
in the shape, traced by recipes/calibrate.py per precision regime, with and without dropout,
and under tensor parallelism with and without sequence parallelism) when its architecture is
calibrated; otherwise from Korthikanti et al. 2022's closed forms, generalised to our shapes
(the documented reference, the fallback, and what planned-only Megatron layouts use). A
pipeline rank holds, at its peak, the micro-batch chunks its schedule keeps in flight
(parallel.pipeline.peak_live), each the blocks of its stage.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from planner.inputs import ModelDescription
from strategies.footprint import moe_features
from parallel.pipeline import balanced_split, peak_live, stage_owner


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


def _per_token(coefficients: dict[str, float], shape: ModelDescription, tp: int = 1) -> float:
    """Bytes per token: sum of coefficient x feature; a feature ``f/tp`` is split over ``tp``."""
    head_dim = shape.dim // shape.n_heads
    values = {"one": 1, "dim": shape.dim, "ffn": shape.hidden, "vocab": shape.vocab_size,
              "kv_dim": shape.n_kv_heads * head_dim, "heads": shape.n_heads,
              "heads_seq": shape.n_heads * shape.seq_len}
    if getattr(shape, "is_moe", False):
        values |= moe_features(shape)
    return sum(c * values[f.removesuffix("/tp")] / (tp if f.endswith("/tp") else 1)
               for f, c in coefficients.items())


def calibrated(shape: ModelDescription, regime: str | None, tp: int = 1, sp: bool = False) -> dict | None:
    """The traced table for this model, regime and layout (tensor parallel, sequence parallel,
    dropout), or None: not calibrated."""
    table = calibration().get(getattr(shape, "architecture", ""), {}).get(regime or "")
    if not table:
        return None
    variant = "_".join(v for v, on in (("tp", tp > 1), ("sp", tp > 1 and sp),
                                      ("dropout", shape.dropout > 0)) if on)
    return table.get("variants", {}).get(variant) if variant else table


def loss_chunk(trainer: Any, *, tp: int = 1, pp: int = 1, planned_only: bool = False) -> int:
    """``trainer.loss_chunk`` where it runs (validation refuses it under tensor and pipeline
    parallelism; a planned-only layout computes its loss its own way); 0 elsewhere."""
    chunk = getattr(trainer, "loss_chunk", 0) or 0
    return chunk if tp == 1 and pp == 1 and not planned_only else 0


def loss_chunk_problems(trainer: Any, *, tp: int = 1, pp: int = 1) -> list[str]:
    """A tensor- or pipeline-parallel layout cannot run ``trainer.loss_chunk`` (recipes/job.py
    refuses a named preset so; here ``strategy=auto`` and plan.py's table skip it)."""
    chunk = getattr(trainer, "loss_chunk", 0) or 0
    if chunk and (tp > 1 or pp > 1):
        return [f"trainer.loss_chunk={chunk} runs without tensor or pipeline parallelism: "
                "set trainer.loss_chunk=0 for this layout"]
    return []


def logit_tokens(tokens: int, chunk: int = 0) -> int:
    """Tokens whose fp32 logits exist at once: all ``tokens`` of the micro-batch, or one
    ``trainer.loss_chunk`` of them (recipes/head.py)."""
    return min(chunk, tokens) if chunk > 0 else tokens


def chunked_head_bytes(tokens: int, shape: ModelDescription, chunk: int = 0) -> int:
    """What the chunked loss (``trainer.loss_chunk`` > 0) keeps from forward to backward: the
    fp32 gradients it computed in forward, of the head's input (tokens x dim) and of its
    weight (vocab x dim); 0 without it."""
    return 4 * (tokens + shape.vocab_size) * shape.dim if chunk > 0 else 0


def activation_parts(shape: ModelDescription, *, micro: int, tp: int = 1, sp: bool = False,
                     flash: bool = True, elem: float = 2, regime: str | None = None,
                     seq: int = 1, chunk: int = 0,
                     vocab_tp: int | None = None) -> tuple[float, float, float, float]:
    """One micro-batch's bytes on one rank: a block's saved tensors, a checkpointed block's,
    the loss tail's (final norm, head, fp32 cross entropy) and the embedding's -- calibrated
    when ``regime`` names a traced precision regime of this architecture, else the closed
    forms with ``elem`` bytes per element. ``seq``: the sequence degree (context parallel or
    Ulysses): each rank keeps its 1/seq of the tokens (Ulysses' attention sees the whole sequence
    but 1/seq of the heads: the same bytes). ``chunk`` (trainer.loss_chunk): the tail's logits
    terms are one chunk's, plus the gradients the chunked loss holds (``chunked_head_bytes``).
    ``vocab_tp``: the ranks the closed form's fp32 logits are split over (default ``tp``; the
    runnable TP presets keep the whole vocabulary's on every rank: 1)."""
    s, b, h = shape.seq_len // max(1, seq), micro, shape.dim
    logits, held = logit_tokens(s * b, chunk), chunked_head_bytes(s * b, shape, chunk)
    table = calibrated(shape, regime, tp, sp)
    if table:
        layer, block_input, head, embed = (s * b * _per_token(table[p], shape, tp)
                                           for p in ("block", "checkpointed", "tail", "embedding"))
        if chunk > 0:
            tail = dict(table["tail"])
            vocab = {f: tail.pop(f) for f in list(tail) if f.startswith("vocab")}  # the logits' terms
            head = s * b * _per_token(tail, shape, tp) + logits * _per_token(vocab, shape, tp) + held
        moe = calibration().get(getattr(shape, "architecture", ""), {}).get(regime or "", {}).get("moe_block")
        if getattr(shape, "is_moe", False) and moe and tp == 1:
            # a mixture-of-experts model: its MoE blocks save their own; the mean block here
            # (a pipeline stage is planned with it too, whichever of its blocks are MoE)
            m = shape.moe_layers
            layer = ((shape.n_layers - m) * layer + m * s * b * _per_token(moe, shape)) / shape.n_layers
        return layer, block_input, head, embed
    layer = layer_activation_bytes(s, b, h, shape.n_heads, ffn=shape.hidden,
                                   kv=shape.n_kv_heads * (h // shape.n_heads), t=tp, sp=sp,
                                   dropout=shape.dropout > 0, flash=flash, mlp_tensors=4, elem=elem)
    block_input = s * b * h * elem / (tp if sp else 1)  # all a checkpointed block keeps
    head = (4 * logits * shape.vocab_size / (tp if vocab_tp is None else vocab_tp)  # fp32 logits
            + s * b * h * elem / (tp if sp else 1)  # the final norm's output
            + held)
    return layer, block_input, head, 0.0


def selective_block_bytes(shape: ModelDescription, *, micro: int, tp: int = 1, sp: bool = False,
                          elem: float = 2, seq: int = 1) -> float:
    """A block under ``strategy.activation_checkpointing=selective`` (parallel/checkpointing.py):
    its input and the outputs of its matmuls and attention, counted per op -- Q (h), K and V
    (2 kv), the attention output (h) and its fp32 log-sum-exp (one per head and token), the
    output projection (h), the MLP's gate and up (2 ffn; each expert's under MoE: top_k of them)
    and down (h). The column-parallel outputs split over TP ranks; the row-parallel ones are
    whole before their reduction, and the reduced copy is kept too (split under sequence
    parallelism). Norms, rotary, SwiGLU's product, dropout masks: recomputed."""
    s, b, h = shape.seq_len // max(1, seq), micro, shape.dim
    kv = shape.n_kv_heads * (h // shape.n_heads)
    k = getattr(shape, "top_k", 1) if getattr(shape, "is_moe", False) else 1
    split = (h + 2 * kv + h + 2 * k * shape.hidden) * elem + shape.n_heads * 4
    rows = 2 * h * elem + (2 * h * elem / (tp if sp else 1) if tp > 1 else 0.0)
    block_input = h * elem / (tp if sp else 1)
    return s * b * (block_input + split / tp + rows)


def kept_per_block(shape: ModelDescription, layer: float, block_input: float, selective: float,
                   ckpt: bool | str, every: int) -> tuple[float, float]:
    """(bytes a block keeps on average, bytes alive while one checkpointed block is recomputed)
    under ``ckpt`` (false | true | selective) on every ``every``-th block: the checkpointed
    blocks keep their input (true) or their matmul and attention outputs (selective, at most a
    plain block's), the others everything."""
    if not ckpt:
        return layer, 0.0
    sel = ckpt == "selective"
    kept = min(selective, layer) if sel else block_input
    n = shape.n_layers
    chosen = n // max(1, every)
    return (chosen * kept + (n - chosen) * layer) / n, (layer - kept if sel else layer) if chosen else 0.0


def recomputed_share(ckpt: bool | str, every: int, n_layers: int) -> float:
    """The share of the blocks' forward FLOPs run again in backward: the whole of each
    checkpointed block under true, none under selective (it keeps every matmul's output)."""
    if not ckpt or ckpt == "selective":
        return 0.0
    return (n_layers // max(1, every)) / max(1, n_layers)


def stage_layers(shape: ModelDescription, stages: int, split: list[int] | None = None) -> list[int]:
    """Blocks per pipeline stage: ``split``, or balanced by parameter count as the runner cuts
    the model (the first stage also holds the embedding, the last the norm and head)."""
    if split:
        return list(split)
    if stages > shape.n_layers:  # (a problem of the layout; plan one block a stage)
        return [1] * stages
    emb = shape.embedding_params()
    return _balanced(shape.n_layers, shape.block_params(), emb, emb + shape.dim, stages)


@functools.lru_cache(maxsize=256)
def _balanced(n: int, block: int, first: int, last: int, stages: int) -> list[int]:
    return balanced_split([float(block)] * n, first, last, stages)


def activation_bytes(shape: ModelDescription, *, micro: int, tp: int = 1, pp: int = 1,
                     sp: bool = False, ckpt: bool | str = False, flash: bool = True, elem: float = 2,
                     regime: str | None = None, schedule: str = "1f1b", virtual: int = 1,
                     microbatches: int = 1, split: list[int] | None = None, seq: int = 1,
                     loss: float = 0.0, every: int = 1, chunk: int = 0, vocab_tp: int | None = None) -> int:
    """Activations of the busiest device: without a pipeline, one micro-batch through the
    whole model; with ``pp`` stages (``virtual`` per rank), the most its ``schedule`` keeps
    alive at once over ``microbatches`` micro-batches, each chunk its stage's blocks (and the
    embedding on the first stage, the loss tail on the last). Checkpointing (``ckpt`` true) keeps
    each block's input and re-runs one block in backward; ``selective`` keeps its matmul and
    attention outputs and rebuilds the rest of one block; ``every``: only blocks n, 2n, ... are
    checkpointed (``kept_per_block``). ``loss``: bytes alive beside the activations of the
    rank holding the head at backward's start (the loss backward, ``loss_backward_bytes``).
    ``chunk``, ``vocab_tp``: as ``activation_parts`` takes them."""
    layer, block_input, head, embed = activation_parts(shape, micro=micro, tp=tp, sp=sp, flash=flash,
                                                       elem=elem, regime=regime, seq=seq, chunk=chunk,
                                                       vocab_tp=vocab_tp)
    embed += document_mask_bytes(shape, micro=micro, seq=seq)
    selective = (selective_block_bytes(shape, micro=micro, tp=tp, sp=sp, elem=elem, seq=seq)
                 if ckpt == "selective" else 0.0)
    kept, recompute = kept_per_block(shape, layer, block_input, selective, ckpt, every)
    if pp <= 1:
        return int(embed + kept * shape.n_layers + recompute + head + loss)
    n = pp * virtual
    layers = stage_layers(shape, n, split)

    def chunk(stage: int) -> float:
        return layers[stage] * kept + (embed if stage == 0 else 0.0) + (head if stage == n - 1 else 0.0)

    live = peak_live(schedule, pp, virtual, max(1, microbatches), chunk)
    last = stage_owner(schedule, n - 1, pp, virtual)  # the rank whose stage runs the loss
    return int(max(max(live), live[last] + loss) + recompute)


def document_mask_bytes(shape: ModelDescription, *, micro: int, seq: int = 1) -> int:
    """data.packing=document: the boolean block-diagonal mask (micro x seq x seq bytes) every
    block's attention reads and keeps for backward -- one tensor, saved once; 0 otherwise (the
    rotary table it indexes is per token, small beside it)."""
    if getattr(shape, "document_eos", None) is None:
        return 0
    s = shape.seq_len
    return micro * (s // max(1, seq)) * s


def loss_backward_bytes(shape: ModelDescription, *, micro: int, tp: int = 1, chunk: int = 0) -> int:
    """The loss's backward, on the stage holding the head: the gradient of the fp32 log-softmax
    output and the fp32 logits' gradient, ``2 x 4 x s x b x V`` bytes (``/ tp`` with the
    vocabulary split), alive at once while every saved tensor still is -- the start of backward,
    the step's peak. Measured as the peak minus the saved tensors: exactly this in fp32, autocast
    and bf16 (the loss is computed in fp32 in each). ``chunk`` (trainer.loss_chunk): one chunk's
    tokens instead of s x b (the chunked loss runs this backward per chunk, at forward's end)."""
    return int(8 * logit_tokens(shape.seq_len * micro, chunk) * shape.vocab_size / tp)


def estimated_unit(params: float) -> float:
    """The largest FSDP/ZeRO-3 unit of a ``params``-parameter transformer whose shape is not
    given (``planner.params``): GPT-3 and Llama keep hidden ~ 128 x layers, so with ~12 h^2
    parameters a block, P ~ 12 x 128^2 x L^3 and a block is P / L (7B: 213M vs Llama's 202M;
    70B: 0.99B vs 0.86B)."""
    layers = max(1.0, (params / (12 * 128**2)) ** (1 / 3))
    return params / layers
