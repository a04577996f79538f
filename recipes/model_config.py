"""``model``'s schema: a decoder-only transformer's shape (``ModelConfig``, with its LoRA
adapters) and the exact parameter and FLOP counts the planner reads from it. Torch-free."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from omegaconf import MISSING

from core.knobs import free, knob

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ARCHITECTURES = ("gpt", "llama", "mistral", "qwen2")


@dataclass
class LoraConfig:
    """``model.lora``: low-rank adapters through ``peft`` (model=hf). The base model is frozen;
    only the adapters train (and hold gradients and optimizer state)."""

    rank: int = knob(0, min=0)
    """Adapter rank r; 0: no LoRA, every parameter trains."""
    alpha: float = knob(16.0, above=0.0)
    """Scaling numerator: the update is (alpha / rank) x B A."""
    dropout: float = knob(0.0, min=0.0, below=1.0)
    """Dropout on the adapters' input (peft's lora_dropout), in [0, 1)."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Linear layers, by their name inside a decoder layer, that get adapters (LORA_TARGETS)."""


@dataclass
class ModelConfig:
    """A decoder-only transformer's shape (recipes/gpt.py builds it, or transformers for
    ``model=hf``). Also the torch-free model description the planner reads: shape fields plus
    the exact parameter counts below."""

    name: str = MISSING
    """The model's name: the YAML file's stem under conf/model/."""
    path: str | None = free(None, "a directory written by save_pretrained (config.json + "
                            "safetensors), or a model id in the local Hugging Face cache")
    """model=hf: where the model is. Its shape fields are read from its config.json."""
    pretrained: bool = True
    """model=hf: load the weights from ``path``; false: random weights from the config and seed."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    architecture: str = knob("gpt", choices=ARCHITECTURES)
    """gpt: recipes/gpt.py; llama | mistral | qwen2: a transformers model (model=hf). The
    planner's activation calibration is per architecture."""
    attention_bias: str = knob("none", choices=("none", "qkv", "all"))
    """Which attention projections have a bias (Qwen2: qkv; Llama's attention_bias: all)."""
    max_seq_len: int | None = knob(None, min=1)
    """The longest sequence the model supports (an HF config's max_position_embeddings)."""
    dim: int = knob(MISSING, min=1)
    """Hidden size."""
    n_layers: int = knob(MISSING, min=1)
    """Transformer blocks."""
    n_heads: int = knob(MISSING, min=1)
    """Attention (query) heads; dim / n_heads is the head size."""
    n_kv_heads: int = knob(MISSING, min=1)
    """Key/value heads; fewer than n_heads is grouped-query attention."""
    vocab_size: int = knob(MISSING, min=1)
    """Token ids the embedding and the output layer cover."""
    seq_len: int = knob(MISSING, min=1)
    """Tokens per sample (and the RoPE table length)."""
    dropout: float = knob(0.0, min=0.0, below=1.0)
    """Dropout in training (gpt: on the embeddings, the attention weights and each block's
    outputs), in [0, 1); 0: none."""
    ffn_dim: int | None = knob(None, min=1)
    """SwiGLU hidden size; None: 8/3 x dim rounded up to a multiple of 64."""
    tie_embeddings: bool = False
    """Share the input embedding with the output projection."""
    norm_eps: float = knob(1e-5, above=0.0)
    """The epsilon of RMSNorm's denominator."""
    rope_theta: float = knob(10000.0, above=0.0)
    """The base of the rotary position embedding's frequencies."""
    n_experts: int = knob(0, min=0)
    """Mixture of experts: routed experts per MoE layer (recipes/gpt.py's MoE); 0: a dense MLP."""
    top_k: int = knob(2, min=1)
    """Experts each token is routed to (softmax gate, the top-k weights renormalized, as Mixtral)."""
    capacity_factor: float = knob(1.25, above=0.0, fix="set model.capacity_factor > 0 (1.0: exactly the "
                                  "balanced share; 1.25 is Switch's default)")
    """Slots per expert and sequence = ceil(capacity_factor x seq_len x top_k / n_experts); the
    assignments over it are dropped (the token keeps its residual) and counted."""
    aux_loss_coef: float = knob(0.01, min=0.0)
    """Weight of the load-balancing loss (Switch/GShard: n_experts x sum_e f_e x P_e per sequence)
    added to the training loss."""
    moe_ffn_dim: int | None = knob(None, min=1)
    """Each expert's SwiGLU hidden size; None: model.ffn_dim (the dense MLP's)."""
    n_shared_experts: int = knob(0, min=0)
    """Experts every token goes through (DeepSeek-MoE), one MLP of n x moe_ffn_dim."""
    first_dense_layers: int = knob(0, min=0)
    """The first layers keep a dense MLP (DeepSeek-MoE: 1)."""
    document_eos: int | None = knob(None, min=0)
    """The token id at which attention and rotary positions restart (recipes/packing.py): set
    at validation from ``data.packing=document`` (the tokenizer's EOS); None: causal over the
    whole window."""

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts."""
        return max(0, self.n_layers - self.first_dense_layers) if self.is_moe else 0

    @property
    def expert_hidden(self) -> int:
        return self.moe_ffn_dim or self.hidden

    def expert_params(self) -> int:
        """Parameters of the routed experts, all layers (what expert parallelism splits)."""
        return self.moe_layers * self.n_experts * 3 * self.dim * self.expert_hidden

    def capacity(self, seq_len: int | None = None) -> int:
        """Expert slots per sequence (recipes/gpt.py's MoE)."""
        t = seq_len or self.seq_len
        return math.ceil(self.capacity_factor * t * self.top_k / max(1, self.n_experts))

    @property
    def is_hf(self) -> bool:
        return self.architecture != "gpt"
    @property
    def hidden(self) -> int:
        """The MLP's inner size."""
        return self.ffn_dim or 64 * math.ceil(8 * self.dim / 3 / 64)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def block_params(self, moe: bool | None = None) -> int:
        """Parameters of one transformer block (attention, SwiGLU MLP, two norms); of a MoE
        model, a MoE block (router, routed and shared experts) unless ``moe=False``."""
        return sum(self._block_tensors(self.is_moe and moe is not False))

    def stack_params(self) -> int:
        """Parameters of all the blocks together: the dense first layers' (first_dense_layers)
        and the MoE layers' each at their own size."""
        dense = self.n_layers - self.moe_layers
        return dense * self.block_params(moe=False) + self.moe_layers * self.block_params()

    def largest_block_params(self) -> int:
        """Parameters of the largest block: a MoE block, or a dense first one where it is larger."""
        dense = self.block_params(moe=False) if self.n_layers > self.moe_layers else 0
        return max(dense, self.block_params() if self.moe_layers else 0)

    def _block_tensors(self, moe: bool) -> list[int]:
        """Elements of each of a block's tensors: q, k, v, o, the two norms, the attention's
        biases, then the MLP's three (a MoE block: the router and the stacked experts' three,
        and the shared experts' three)."""
        d, kv = self.dim, self.n_kv_heads * self.head_dim
        out = [d * d, d * kv, d * kv, d * d, d, d]
        out += {"none": [], "qkv": [d, kv, kv], "all": [d, kv, kv, d]}[self.attention_bias]
        if not moe:
            return out + [d * self.hidden] * 3
        e = self.expert_hidden
        out += [d * self.n_experts] + [self.n_experts * d * e] * 3
        return out + ([d * self.n_shared_experts * e] * 3 if self.n_shared_experts else [])

    def lora_matrices(self) -> list[tuple[int, int]]:
        """Each LoRA adapter matrix as (rows, columns): A (rank x in) and B (out x rank) per
        targeted linear layer of every block; none without LoRA."""
        r, d, kv, f = self.lora.rank, self.dim, self.n_kv_heads * self.head_dim, self.hidden
        io = {"q_proj": (d, d), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (d, d),
              "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}
        targets = [io[m] for m in self.lora.target_modules if m in io] if r else []
        return [pair for i, o in targets for pair in ((r, i), (o, r))] * self.n_layers

    def _lora_tensors(self) -> list[int]:
        return [n * m for n, m in self.lora_matrices()]

    def lora_params(self) -> int:
        """Parameters of the LoRA adapters (rank x (in + out) per targeted linear layer); 0
        without LoRA."""
        return sum(self._lora_tensors())

    def tensor_sizes(self, *, adapters: bool = False) -> dict[int, int]:
        """Elements of each parameter tensor -> how many tensors have that size (LoRA's adapters
        included): what DeepSpeed's ZeRO-3 persistence threshold sorts. Sums to
        ``num_params() + lora_params()``. ``adapters``: LoRA's adapters alone."""
        tensors = [] if adapters else (
            self._block_tensors(False) * (self.n_layers - self.moe_layers)
            + self._block_tensors(True) * self.moe_layers
            + [self.embedding_params()] * (1 if self.tie_embeddings else 2) + [self.dim])
        tensors += self._lora_tensors()
        out: dict[int, int] = {}
        for t in tensors:
            out[t] = out.get(t, 0) + 1
        return out

    def embedding_params(self) -> int:
        """Parameters of one vocab x dim matrix (the input embedding; the output head is
        another unless ``tie_embeddings``)."""
        return self.vocab_size * self.dim

    def num_params(self) -> int:
        """Exact parameter count of ``GPT(self)``, without building it."""
        embeddings = self.embedding_params() * (1 if self.tie_embeddings else 2)
        return self.stack_params() + embeddings + self.dim

    def buffer_bytes(self) -> int:
        """Bytes of the model's buffers (what DDP broadcasts from rank 0 before a forward): the
        built-in GPT's rope table, seq_len x head_dim fp32 (recipes/gpt.py; no precision we
        offer casts it); model=hf: transformers 5's rotary module, inv_freq and
        original_inv_freq, head_dim / 2 fp32 each."""
        return self.head_dim * 4 * (1 if self.is_hf else self.seq_len)

    def moe_problems(self) -> list[str]:
        """The mixture-of-experts keys together (a dense model: none)."""
        if not self.is_moe:
            return []
        out = []
        if self.is_hf:
            out.append(f"model.n_experts={self.n_experts} applies to the built-in GPT (recipes/gpt.py), "
                       "not model=hf: set model.n_experts=0")
        if self.top_k > self.n_experts:
            out.append(f"model.top_k={self.top_k} > model.n_experts={self.n_experts}: a token is "
                       f"routed to top_k distinct experts; allowed: 1..{self.n_experts}. Set "
                       f"model.top_k<={self.n_experts} or raise model.n_experts")
        if self.first_dense_layers > self.n_layers:
            out.append(f"model.first_dense_layers={self.first_dense_layers} > model.n_layers="
                       f"{self.n_layers}: set it to at most n_layers")
        return out

    def tp_collectives(self) -> tuple[int, int]:
        """All-reduces per block under tensor parallelism (forward, backward): recipes/gpt.py's
        tp_plan has 2 row-parallel layers (attention output, MLP down) and 5 column-parallel
        ones (q, k, v, gate, up), each all-reducing its input's gradient."""
        return (2, 5)

    def flops_per_token(self) -> float:
        """Model FLOPs to train on one token (forward + backward), the convention MFU uses
        (PaLM, Chowdhery et al. 2022, app. B): 6 per parameter of every matmul (all but the input
        embedding, a lookup) plus 12 x layers x seq x dim for attention's scores and mixing."""
        matmul = self.num_params() - (0 if self.tie_embeddings else self.embedding_params())
        if self.is_moe:  # a token runs through top_k of the routed experts (and the shared ones)
            matmul -= self.expert_params() * (1 - self.top_k / self.n_experts)
        return 6 * matmul + 12 * self.n_layers * self.seq_len * self.dim

    def problems(self) -> list[str]:
        """Shape rules that involve more than one field (single fields declare their own)."""
        out = []
        if self.dim % self.n_heads:
            out.append(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}: "
                       "choose n_heads dividing dim")
        elif self.head_dim % 2:
            out.append(f"head dim model.dim / model.n_heads = {self.dim}/{self.n_heads} = "
                       f"{self.head_dim} must be even for rotary embeddings")
        if self.n_heads % self.n_kv_heads:
            out.append(f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}")
        out += self.moe_problems()
        if self.max_seq_len is not None and self.seq_len > self.max_seq_len:
            out.append(f"model.seq_len={self.seq_len} exceeds the model's max_position_embeddings "
                       f"{self.max_seq_len}: set model.seq_len<={self.max_seq_len}")
        if not self.is_hf:
            for key, value in (("path", self.path), ("lora.rank", self.lora.rank)):
                if value:
                    out.append(f"model.{key}={value} applies to model=hf only (this is the built-in "
                               f"{self.name}): remove it, or use model=hf model.path=...")
        if not self.lora.rank:
            default = LoraConfig()
            out += [f"model.lora.{k}={getattr(self.lora, k)} does nothing with model.lora.rank=0 (no "
                    "adapters: every parameter trains): set model.lora.rank (e.g. 16, model=hf) to "
                    "fine-tune with LoRA, or remove it"
                    for k in ("alpha", "dropout", "target_modules")
                    if getattr(self.lora, k) != getattr(default, k)]
        bad = sorted(set(self.lora.target_modules) - set(LORA_TARGETS))
        if self.lora.rank and not self.lora.target_modules:
            out.append(f"model.lora.target_modules=[] with model.lora.rank={self.lora.rank}: no layer "
                       f"gets an adapter; allowed: {', '.join(LORA_TARGETS)}; set e.g. "
                       "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj], or model.lora.rank=0")
        if bad:
            out.append(f"model.lora.target_modules: {', '.join(bad)} not a decoder layer's linear "
                       f"layer; allowed: {', '.join(LORA_TARGETS)}")
        return out
