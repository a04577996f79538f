"""A decoder-only transformer as plain single-device PyTorch (Llama-style).

RMSNorm, rotary position embeddings, causal attention through ``scaled_dot_product_attention``,
SwiGLU MLP, optional grouped-query attention and tied embeddings; with ``model.n_experts`` a
top-k mixture of experts (``MoE``) in place of the MLP. No parallelism code: the model declares,
as data, its repeated block (``GPT.block_cls``), which linear layers are column- or
row-parallel (``GPT.tp_plan``) and where its experts are (``GPT.ep_plan``); strategies apply
themselves from outside.

The shape is ``recipes.model_config.ModelConfig`` (the same object the planner reads). Weights are
initialised inside each module's constructor (never by a pass over the built
model), so construction under DeepSpeed's ``zero.Init`` or on the meta device stays correct; a
meta-built model that was sharded draws the same values into its shards (``GPT.init_shards``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from recipes.head import Head

if TYPE_CHECKING:
    from recipes.model_config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_table(head_dim: int, seq_len: int, theta: float) -> torch.Tensor:
    """cos/sin of rotary angles, shape (seq_len, head_dim // 2, 2)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, heads, seq, head_dim) pairs of channels by the table's angles."""
    x2 = x.float().unflatten(-1, (-1, 2))
    if table.dim() == 4:  # per row (batch, seq, head_dim // 2, 2): documents' own positions
        cos, sin = table[:, None, :, :, 0], table[:, None, :, :, 1]
    else:
        cos, sin = table[: x.shape[-2], :, 0], table[: x.shape[-2], :, 1]
    out = torch.stack([x2[..., 0] * cos - x2[..., 1] * sin, x2[..., 0] * sin + x2[..., 1] * cos], -1)
    return out.flatten(-2).type_as(x)


def document_layout(tokens: torch.Tensor, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotary position of each token, attention mask (batch, 1, seq, seq), True where a query
    may attend) of windows of packed documents: a document starts at each EOS (and at the
    window's first token); a token attends to the earlier tokens of its own document."""
    t = tokens.shape[1]
    at = torch.arange(t, device=tokens.device)
    starts = tokens == eos
    doc = starts.long().cumsum(1)
    first = torch.where(starts, at, torch.zeros_like(at)).cummax(1).values
    causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()
    mask = (doc[:, :, None] == doc[:, None, :]) & causal
    return at - first, mask[:, None]


class CoreAttention(nn.Module):
    """Causal attention over (batch, seq, heads, head_dim) queries, keys and values: the part a
    sequence-parallel strategy wraps (Ulysses' all-to-all around it; ring attention replaces
    the SDPA call under torch's context_parallel). ``GPT.attention_core`` names it."""

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = dropout
        self.kernel: str | None = None
        """The SDPA kernel of the first eager training forward (``sdpa_kernel``); a compiled
        block's forward leaves it None (report.json's ``attention`` asks torch with the run's
        shapes instead: observers/kernels.py)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        dropout, gqa = self.dropout if self.training else 0.0, q.shape[1] != k.shape[1]
        if self.kernel is None and self.training and not torch.compiler.is_compiling():
            self.kernel = sdpa_kernel(q, k, v, dropout=dropout, enable_gqa=gqa, mask=mask)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           dropout_p=dropout, enable_gqa=gqa)
        return y.transpose(1, 2)


def sdpa_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout: float = 0.0,
                enable_gqa: bool = False, mask: torch.Tensor | None = None) -> str:
    """The kernel ``F.scaled_dot_product_attention(q, k, v, is_causal=True, ...)`` runs: torch's
    own choice (``torch._fused_sdp_choice``, the dispatch SDPA itself calls, per device: on CUDA
    its priority order over the backends enabled, each backend's constraints on these shapes,
    dtypes and dropout; on CPU the CPU flash kernel or math) -- flash | efficient | cudnn | math,
    or ``unknown (why)`` where torch cannot say (DTensor inputs, an older signature)."""
    from torch.nn.attention import SDPBackend

    try:
        choice = torch._fused_sdp_choice(q, k, v, mask, dropout, mask is None,
                                         scale=None, enable_gqa=enable_gqa)
        name = SDPBackend(choice).name
    except Exception as e:  # noqa: BLE001  (the report says why instead)
        return f"unknown ({type(e).__name__}: {str(e)[:120]})"
    return {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient",
            "CUDNN_ATTENTION": "cudnn", "MATH": "math"}.get(name, name.lower())


class Attention(nn.Module):
    def __init__(self, s: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = s.n_heads, s.n_kv_heads, s.head_dim
        self.wq = nn.Linear(s.dim, s.n_heads * s.head_dim, bias=False)
        self.wk = nn.Linear(s.dim, s.n_kv_heads * s.head_dim, bias=False)
        self.wv = nn.Linear(s.dim, s.n_kv_heads * s.head_dim, bias=False)
        self.wo = nn.Linear(s.n_heads * s.head_dim, s.dim, bias=False)
        self.core = CoreAttention(s.dropout)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism the projections hold a slice of the heads.
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        q = apply_rope(q.transpose(1, 2), rope).transpose(1, 2)
        k = apply_rope(k.transpose(1, 2), rope).transpose(1, 2)
        y = self.core(q, k, v) if mask is None else self.core(q, k, v, mask)
        return self.wo(y.reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, s: ModelConfig, hidden: int | None = None):
        super().__init__()
        hidden = hidden or s.hidden
        self.w1 = nn.Linear(s.dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(s.dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, s.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Experts(nn.Module):
    """The routed experts' SwiGLU weights, stacked: (experts, in, out). Its input is one buffer
    of slots per expert, (experts, slots, dim); under expert parallelism this module holds only
    its rank's experts and the strategy's hooks exchange the slots around it (all-to-all)."""

    def __init__(self, n: int, dim: int, hidden: int):
        super().__init__()
        # each expert initialised as nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        self.w1 = nn.Parameter((torch.rand(n, dim, hidden) * 2 - 1) * dim**-0.5)  # gate
        self.w3 = nn.Parameter((torch.rand(n, dim, hidden) * 2 - 1) * dim**-0.5)  # up
        self.w2 = nn.Parameter((torch.rand(n, hidden, dim) * 2 - 1) * hidden**-0.5)  # down

    def forward(self, slots: torch.Tensor) -> torch.Tensor:
        # DTensor weights (experts sharded over an expert-parallel mesh): this rank's experts
        w1, w3, w2 = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w3, self.w2))
        return torch.bmm(F.silu(torch.bmm(slots, w1)) * torch.bmm(slots, w3), w2)


class MoE(nn.Module):
    """Top-k mixture of experts (Mixtral's routing, Switch/GShard's capacity and balancing loss),
    each sequence one routing group: a softmax gate, each token's top_k experts with their
    weights renormalized to sum to 1; each expert takes at most ``capacity`` assignments per
    sequence (first the top-1 choices in token order, then the top-2, ...), the rest are dropped
    (counted; the token keeps its residual). The load-balancing loss of a sequence is
    n_experts x sum_e f_e x P_e (f_e: the share of its assignments routed to e, before
    dropping; P_e: its mean gate probability), averaged over the sequences: a per-sequence
    quantity, so a data-parallel split of the batch computes exactly what one process does."""

    def __init__(self, s: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k, self.capacity_factor = s.n_experts, s.top_k, s.capacity_factor
        self.aux_loss_coef = s.aux_loss_coef
        self.router = nn.Linear(s.dim, s.n_experts, bias=False)
        self.experts = Experts(s.n_experts, s.dim, s.expert_hidden)
        self.shared = (MLP(s, s.n_shared_experts * s.expert_hidden) if s.n_shared_experts else None)
        self.aux_loss: torch.Tensor | None = None
        self.stats: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        e, k = self.n_experts, self.top_k
        cap = math.ceil(self.capacity_factor * t * k / e)  # ModelConfig.capacity
        probs = F.softmax(self.router(x).float(), dim=-1)  # (b, t, e)
        top_p, top_i = probs.topk(k, dim=-1)
        weights = (top_p / top_p.sum(-1, keepdim=True)).type_as(x)
        # slot-major priority: every token's first choice before any second choice
        choice = top_i.transpose(1, 2).reshape(b, k * t)  # (b, k*t)
        onehot = F.one_hot(choice, e)  # (b, k*t, e)
        position = (onehot.cumsum(1) - 1).gather(2, choice.unsqueeze(-1)).squeeze(-1)
        kept = position < cap
        f = onehot.float().mean(1)  # (b, e): share of the assignments, before dropping
        self.aux_loss = (e * (f * probs.mean(1)).sum(-1)).mean()
        self.stats = {"tokens": (onehot * kept.unsqueeze(-1)).sum((0, 1)).detach(),
                      "dropped": (~kept).sum().detach(), "assignments": torch.tensor(b * k * t)}
        seq = torch.arange(b, device=x.device).unsqueeze(1).expand(b, k * t)[kept]
        tok = torch.arange(t, device=x.device).repeat(k).unsqueeze(0).expand(b, k * t)[kept]
        exp, pos = choice[kept], position[kept]
        w = weights.transpose(1, 2).reshape(b, k * t)[kept]
        slots = x.new_zeros(e, b, cap, d).index_put((exp, seq, pos), x[seq, tok])
        out = self.experts(slots.view(e, b * cap, d)).view(e, b, cap, d)
        y = x.new_zeros(b * t, d).index_add(0, seq * t + tok, out[exp, seq, pos] * w.unsqueeze(-1))
        y = y.view(b, t, d)
        return y + self.shared(x) if self.shared is not None else y


class Block(nn.Module):
    """One transformer layer: the unit of FSDP wrapping and activation checkpointing."""

    def __init__(self, s: ModelConfig, moe: bool = False):
        super().__init__()
        self.attn_norm = RMSNorm(s.dim, s.norm_eps)
        self.attn = Attention(s)
        self.mlp_norm = RMSNorm(s.dim, s.norm_eps)
        self.mlp = MoE(s) if moe else MLP(s)
        self.drop = nn.Dropout(s.dropout)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x), rope, mask=mask))  # (TP hooks see x, rope)
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class Embedding(nn.Embedding):
    """nn.Embedding, N(0, 1). ``tied`` (the head shares the table): N(0, 1/(3 dim)), the spread
    of an untied head's rows (nn.Linear's U(-1/sqrt(dim), 1/sqrt(dim))): N(0, 1) rows as the head
    would give logits of std sqrt(dim) after the final norm (a first loss of ~32 for gpt_nano,
    not ~ln(vocab)). Scaled in the constructor, so a
    ZeRO-3 build (``zero.Init`` partitions when it returns) and ``GPT.init_shards`` see it."""

    def __init__(self, vocab: int, dim: int, *, tied: bool = False):
        super().__init__(vocab, dim)
        if tied:
            with torch.no_grad():
                self.weight.mul_((3 * dim) ** -0.5)


def parts(shape: ModelConfig) -> dict[str, Any]:
    """GPT's parts with parameters, by name, each a constructor, in the order ``GPT.__init__``
    makes them (the order of their random draws; ``GPT.init_shards`` replays it)."""
    moe = lambda i: shape.is_moe and i >= shape.first_dense_layers  # noqa: E731
    return {"tok_embeddings": lambda: Embedding(shape.vocab_size, shape.dim, tied=shape.tie_embeddings),
            **{f"layers.{i}": (lambda i=i: Block(shape, moe=moe(i))) for i in range(shape.n_layers)},
            "norm": lambda: RMSNorm(shape.dim, shape.norm_eps),
            "output": lambda: Head(shape.dim, shape.vocab_size, bias=False)}


class GPT(nn.Module):
    block_cls = Block
    # Megatron-style tensor-parallel plan, relative to each block: column-parallel layers split
    # their output features, row-parallel layers their input features (then all-reduce).
    tp_plan = {
        "attn.wq": "column", "attn.wk": "column", "attn.wv": "column", "attn.wo": "row",
        "mlp.w1": "column", "mlp.w3": "column", "mlp.w2": "row",
    }

    # Where tensor parallelism finds the blocks, the embedding (row-parallel over the vocab), the
    # head (column-parallel) and, under sequence parallelism, the final norm.
    tp_layout = {"blocks": "layers", "embedding": "tok_embeddings", "head": "output", "norm": "norm"}

    # How a pipeline splits the model at block boundaries: ``blocks`` is the ModuleDict of
    # layers, ``first`` runs only on the first stage, ``last`` only on the last.
    pp_plan = {"blocks": "layers", "first": ("tok_embeddings",), "last": ("norm", "output")}

    # The attention core, relative to each block, that sequence parallelism wraps (Ulysses).
    attention_core = "attn.core"
    # (rank, degree[, balanced]) of this rank's sequence shard (Ulysses: contiguous; context
    # parallelism: torch's head-tail load balancing): the tokens it is handed are those
    # positions (recipes.data.shard_index), so are its rotary angles. None: the whole sequence.
    seq_shard: tuple[int, ...] | None = None

    # Mixture of experts, relative to each MoE block: the module holding the routed experts'
    # stacked weights (dim 0: the expert), which expert parallelism splits over its ranks.
    ep_plan = {"experts": "mlp.experts", "moe": "mlp"}

    def __init__(self, shape: ModelConfig):
        super().__init__()
        self.shape = shape
        part = parts(shape)
        self.tok_embeddings = part["tok_embeddings"]()
        self.drop = nn.Dropout(shape.dropout)
        # A dict keyed by the layer's index: a pipeline stage deletes the layers it does not run
        # and the others keep their names (and state-dict keys).
        self.layers = nn.ModuleDict({str(i): part[f"layers.{i}"]() for i in range(shape.n_layers)})
        self.norm = part["norm"]()
        self.output = part["output"]()  # nn.Linear, or the chunked loss
        if shape.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", rope_table(shape.head_dim, shape.seq_len, shape.rope_theta),
                             persistent=False)
        self.pending_init: int | None = None
        """A meta build's seed (recipes/training.py ``build_model``): ``init_shards`` gives the
        sharded parameters the values this constructor would have drawn from it."""

    def init_shards(self) -> None:
        """After a meta build was sharded and given storage (parallel/parallelize.py
        ``materialize``): each parameter's local shard gets exactly the values a whole build
        from the same seed holds, the parts made again one at a time in the constructor's order
        (the same random draws), so a rank never holds more than one whole block (or the
        embedding) beyond its shards. Parts this rank does not hold (pipeline stages) are made
        too, for their draws."""
        import logging
        import os

        from torch.distributed.tensor import distribute_tensor

        seed, self.pending_init = self.pending_init, None
        if os.environ.get("RANK", "0") == "0":  # (minutes at 70B: every rank draws every part)
            logging.getLogger(__name__).info(
                "initial values: %s parameters drawn from trainer.seed=%d a part at a time, "
                "each rank keeping its shards", f"{self.shape.num_params():,}", seed)
        filled: set[int] = set()
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            for name, make in parts(self.shape).items():
                for key, whole in make().named_parameters():
                    try:
                        target = self.get_parameter(f"{name}.{key}")
                    except AttributeError:  # not on this pipeline stage
                        continue
                    if id(target) in filled:  # tied: the embedding's values, not the head's
                        continue
                    filled.add(id(target))
                    if hasattr(target, "device_mesh"):
                        whole = distribute_tensor(whole, target.device_mesh, target.placements,
                                                  src_data_rank=None).to_local()
                        target = target.to_local()
                    target.copy_(whole)
        unfilled = [n for n, p in self.named_parameters() if id(p) not in filled]
        if unfilled:  # (a wrapper that renamed them: they would train uninitialised memory)
            raise RuntimeError(f"GPT.init_shards: no initial values for {', '.join(unfilled[:3])}"
                               f"{' ...' if len(unfilled) > 3 else ''}: a wrapper changed their names")
        s = self.shape
        self.rope.copy_(rope_table(s.head_dim, s.seq_len, s.rope_theta))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                loss_chunk: int = 0) -> torch.Tensor:
        # A pipeline stage has some of these set to None (see ``pp_plan``): the first stage
        # takes tokens, the others hidden states; only the last one returns logits.
        # With ``targets`` (trainer.loss_chunk > 0): [sum of token cross entropies, count of
        # counted targets] instead of the logits, ``loss_chunk`` tokens' logits at a time
        # (recipes/head.py), inside the head's own call so every engine gathers it for it.
        h = self.drop(self.tok_embeddings(tokens)) if self.tok_embeddings is not None else tokens
        rope, mask, eos = self.rope, None, self.shape.document_eos
        if eos is not None and self.tok_embeddings is not None:  # data.packing=document
            positions, mask = document_layout(tokens, eos)
            rope = rope[positions]
        if self.seq_shard is not None:
            from recipes.data import shard_index

            rank, degree, *balanced = self.seq_shard
            rope = rope[shard_index(h.shape[1] * degree, rank, degree, *balanced)]
        for layer in self.layers.values():
            h = layer(h, rope) if mask is None else layer(h, rope, mask)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        return self.output(h) if targets is None else self.output(h, targets, loss_chunk)

