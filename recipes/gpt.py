"""A decoder-only transformer as plain single-device PyTorch (Llama-style).

RMSNorm, rotary position embeddings, causal attention through ``scaled_dot_product_attention``,
SwiGLU MLP, optional grouped-query attention and tied embeddings. No parallelism code: the
model declares, as data, its repeated block (``GPT.block_cls``) and which linear layers are
column- or row-parallel (``GPT.tp_plan``); strategies apply themselves from outside.

The shape is ``recipes.config.ModelConfig`` (the same object the planner reads). Weights are
initialised inside each module's constructor (never by a pass over the built
model), so construction under DeepSpeed's ``zero.Init`` or on the meta device stays correct.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from recipes.config import ModelConfig


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
    cos, sin = table[: x.shape[-2], :, 0], table[: x.shape[-2], :, 1]
    out = torch.stack([x2[..., 0] * cos - x2[..., 1] * sin, x2[..., 0] * sin + x2[..., 1] * cos], -1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, s: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = s.n_heads, s.n_kv_heads, s.head_dim
        self.wq = nn.Linear(s.dim, s.n_heads * s.head_dim, bias=False)
        self.wk = nn.Linear(s.dim, s.n_kv_heads * s.head_dim, bias=False)
        self.wv = nn.Linear(s.dim, s.n_kv_heads * s.head_dim, bias=False)
        self.wo = nn.Linear(s.n_heads * s.head_dim, s.dim, bias=False)
        self.dropout = s.dropout

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism the projections hold a slice of the heads.
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, s: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(s.dim, s.hidden, bias=False)  # gate
        self.w3 = nn.Linear(s.dim, s.hidden, bias=False)  # up
        self.w2 = nn.Linear(s.hidden, s.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """One transformer layer: the unit of FSDP wrapping and activation checkpointing."""

    def __init__(self, s: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(s.dim, s.norm_eps)
        self.attn = Attention(s)
        self.mlp_norm = RMSNorm(s.dim, s.norm_eps)
        self.mlp = MLP(s)
        self.drop = nn.Dropout(s.dropout)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x), rope))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


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

    def __init__(self, shape: ModelConfig):
        super().__init__()
        self.shape = shape
        self.tok_embeddings = nn.Embedding(shape.vocab_size, shape.dim)
        self.drop = nn.Dropout(shape.dropout)
        # A dict keyed by the layer's index: a pipeline stage deletes the layers it does not run
        # and the others keep their names (and state-dict keys).
        self.layers = nn.ModuleDict({str(i): Block(shape) for i in range(shape.n_layers)})
        self.norm = RMSNorm(shape.dim, shape.norm_eps)
        self.output = nn.Linear(shape.dim, shape.vocab_size, bias=False)
        if shape.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", rope_table(shape.head_dim, shape.seq_len, shape.rope_theta),
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # A pipeline stage has some of these set to None (see ``pp_plan``): the first stage
        # takes tokens, the others hidden states; only the last one returns logits.
        h = self.drop(self.tok_embeddings(tokens)) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

