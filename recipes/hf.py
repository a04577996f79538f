"""Hugging Face causal LMs (``model=hf``) behind the recipe's interface: tokens -> logits.

``HFCausalLM`` holds a transformers model (``self.hf``) and declares what strategies read off
the built-in GPT: its repeated block (``block_cls``, the architecture's decoder layer, for wrap
policies and activation checkpointing) and its tensor-parallel plan. LoRA adapters come from
``peft``, injected into ``self.hf`` in place; the base is frozen.

Weights: ``model.pretrained=false`` initialises from the config under the run's seed (identical
on every rank). Pretrained weights are read tensor by tensor from the safetensors files
(memory-mapped), into whatever each rank holds:
- a plain parameter: the whole tensor (single, DDP, ZeRO-1/2, FSDP1 before wrapping);
- a ZeRO-3 partition (built under ``zero.Init``, transformers' own init skipped:
  ``_partitioned_build``): gathered one tensor at a time through the engine's ``gather`` (the
  backend hands it in), rank 0 writes;
- an FSDP2 shard (``meta=True`` build, sharded, then parallel.parallelize.materialize): only this
  rank's rows.
So the sharded presets never hold the full model on one rank.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from recipes.hf_config import export_dtype, locate

if TYPE_CHECKING:
    from recipes.model_config import ModelConfig

log = logging.getLogger(__name__)

# Megatron-style plan relative to each decoder layer (transformers' own names).
TP_PLAN = {
    "self_attn.q_proj": "column", "self_attn.k_proj": "column", "self_attn.v_proj": "column",
    "self_attn.o_proj": "row", "mlp.gate_proj": "column", "mlp.up_proj": "column",
    "mlp.down_proj": "row",
}


ATTENTION = "sdpa"  # the attention implementation every model=hf build asks transformers for
# data.packing=document: the implementations whose mask transformers builds from position_ids
# that restart at each document (masking_utils.create_causal_mask: find_packed_sequence_indices,
# then packed_sequence_mask_function and-ed into the causal mask; sdpa_mask / eager_mask
# materialise it, is_causal skip off). flash_attention_* find documents another way
# (cu_seqlens from position_ids inside the kernel call) and flex_attention builds a BlockMask:
# neither is built here nor tested, so refused by name.
PACKED_ATTENTION = ("sdpa", "eager")


def _auto_config(path: str) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(locate(path), local_files_only=True)
    config.use_cache = False
    return config


class HFCausalLM(nn.Module):
    """A transformers causal LM as a recipe model (see the module docstring)."""

    block_cls: type | None = None  # set per architecture by ``model_class``
    tp_plan = TP_PLAN
    tp_layout = {"blocks": "hf.model.layers", "embedding": "hf.model.embed_tokens", "head": "hf.lm_head"}

    def __init__(self, shape: ModelConfig, *, meta: bool = False, seed: int = 0,
                 gather: Callable[[list[torch.Tensor]], Any] | None = None):
        """``meta``: parameters without storage (a strategy shards them, then ``load_pretrained``
        fills each rank's part); ``gather``: the engine's context that makes partitioned
        parameters whole for writing, rank 0's writes kept (ZeRO-3; None: parameters are whole)."""
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.shape, self.gather = shape, gather
        self._rss0 = _anon_rss()  # host memory before the model: loading is measured from here
        config = _auto_config(shape.path)
        partitioned = gather is not None and not meta  # (built under the engine's zero.Init)
        plain = _partitioned_build() if partitioned else contextlib.nullcontext()
        with torch.device("meta") if meta else plain:
            self.hf = AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION,
                                                       dtype=torch.float32)
        if partitioned:
            self.hf.tie_weights()  # (what the skipped init_weights also does)
        if shape.document_eos is not None and self.hf.config._attn_implementation not in PACKED_ATTENTION:
            raise ValueError(f"data.packing=document with model=hf: attention "
                             f"{self.hf.config._attn_implementation!r} does not build the document "
                             f"mask from position_ids here (it does: {', '.join(PACKED_ATTENTION)}); "
                             "use data.packing=pad")
        if meta:
            _real_buffers(self.hf)
        self.pending_weights = shape.pretrained
        """True until the pretrained weights are in (``load_pretrained``)."""
        if shape.pretrained and not meta:
            self.load_pretrained()
        elif not shape.pretrained:
            self._init_random(seed)
        if shape.lora.rank:
            self._add_lora(shape, meta, seed)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        eos = self.shape.document_eos
        if eos is None:
            return self.hf(input_ids=tokens, use_cache=False).logits
        # data.packing=document: rotary positions restart at each document (its EOS first, as
        # recipes/gpt.py's document_layout places them) and no attention mask, so transformers'
        # create_causal_mask finds the packed documents in the positions
        # (masking_utils.find_packed_sequence_indices) and builds the block-causal mask itself.
        positions = document_positions(tokens, eos)
        return self.hf(input_ids=tokens, position_ids=positions, use_cache=False).logits

    @torch.no_grad()
    def _init_random(self, seed: int) -> None:
        """transformers' own initialisation, redone from ``seed`` module by module (children
        first, as ``initialize_weights`` goes): the same values whether the parameters are whole
        or ZeRO-3 partitions (built under ``zero.Init``, where the constructor's pass is skipped:
        ``_partitioned_build``) -- each module's parameters are gathered while it is initialised."""
        torch.manual_seed(seed)
        for m in _children_first(self.hf):
            own = list(m.parameters(recurse=False))
            for t in (m, *own):
                if hasattr(t, "_is_hf_initialized"):
                    t._is_hf_initialized = False
            with self._gathered(own):
                self.hf._init_weights(m)
        self.hf.tie_weights()

    def _gathered(self, params: list[torch.Tensor]) -> Any:
        """Partitioned parameters made whole (rank 0's writes kept); whole ones as they are."""
        return self.gather(params) if self.gather is not None and params else contextlib.nullcontext()

    # ------------------------------------------------------------------ LoRA
    def _add_lora(self, shape: ModelConfig, meta: bool, seed: int) -> None:
        from peft import LoraConfig, get_peft_model

        lora = shape.lora
        peft_model = get_peft_model(self.hf, LoraConfig(
            r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules)))
        # peft wrapped self.hf in place; keep its wrapper (merge_and_unload) off the module tree.
        object.__setattr__(self, "_peft", peft_model)
        # The adapters' initial values from the seed alone (a meta build consumed no random
        # numbers); they are tiny, so a meta build makes them real here, before sharding.
        torch.manual_seed(seed + 1)
        for m in self.hf.modules():
            if hasattr(m, "reset_lora_parameters"):
                if meta:
                    for name in ("lora_A", "lora_B"):
                        getattr(m, name).to_empty(device="cpu")
                m.reset_lora_parameters("default", True)

    # ------------------------------------------------------------------ pretrained weights
    @torch.no_grad()
    def load_pretrained(self) -> dict[str, int]:
        """Copy the safetensors weights into this rank's parameters (see the module docstring);
        returns (and logs) the bytes this rank read, and its peak anonymous host memory since
        the model's build began (the file's mapped pages are page cache, not counted)."""
        import gc

        from safetensors import safe_open

        # The build can leave cyclic garbage holding whole tensors (under zero.Init, ones already
        # partitioned), released only when the collector next runs: free it before loading, so
        # neither the load nor its measurement carries it.
        gc.collect()
        peak = _anon_rss()
        where = {}
        files = sorted(locate(self.shape.path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"model.path={self.shape.path}: no *.safetensors weights; set "
                                    "model.pretrained=false to start from random weights")
        handles = [safe_open(str(f), framework="pt") for f in files]
        for h in handles:
            where.update(dict.fromkeys(h.keys(), h))
        read = 0
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        for name, p in self.hf.named_parameters():
            key = hf_key(name)
            if "lora_" in key:
                continue
            if key not in where:
                if key == "lm_head.weight" and self.shape.tie_embeddings:
                    continue
                raise KeyError(f"model.path={self.shape.path}: the weights have no {key!r}")
            read += _copy_into(p, where[key].get_slice(key), rank, self.gather)
            peak = max(peak, _anon_rss())
        self.pending_weights = False
        self.load_report = {"rank": rank, "bytes_read": read, "host_peak_bytes": peak - self._rss0}
        log.info("rank %d loaded pretrained weights from %s: %d bytes read; host memory peak "
                 "+%d bytes over the model's build (parameters + loading)", rank, self.shape.path,
                 read, self.load_report["host_peak_bytes"])
        return self.load_report


def document_positions(tokens: torch.Tensor, eos: int) -> torch.Tensor:
    """Each token's position in its document (0 at each EOS and at the window's first token):
    a position that does not follow its predecessor by 1 starts a document for transformers."""
    t = tokens.shape[1]
    at = torch.arange(t, device=tokens.device)
    first = torch.where(tokens == eos, at, torch.zeros_like(at)).cummax(1).values
    return at - first


def hf_key(name: str) -> str:
    """A parameter's name in ``HFCausalLM.hf`` as the checkpoint names it (peft's and
    strategies' wrapper pieces removed)."""
    from core.keys import plain_key

    return plain_key(name).replace(".base_layer", "")  # (peft's wrapped layer)


def _copy_into(p: torch.Tensor, source: Any, rank: int, gather: Callable[[list], Any] | None) -> int:
    """One tensor of the file into ``p``, however this rank holds it; returns bytes read."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):  # FSDP2: read only this rank's rows
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        target = p.to_local()
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        if not target.numel():
            return 0
        piece = source[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
    elif gather is not None:  # a partition (ZeRO-3): gathered for this tensor, rank 0 writes
        with gather([p]):
            if rank != 0:
                return 0
            piece = source[:]
            p.data.copy_(piece)
        return piece.numel() * piece.element_size()
    else:
        target, piece = p.data, source[:]
    target.copy_(piece)
    return piece.numel() * piece.element_size()


def _partitioned_build() -> Any:
    """The one workaround for transformers under ZeRO-3 here: the constructor's weight init,
    skipped, when the model is built under the engine's ``zero.Init`` (``gather`` given).

    ``zero.Init`` partitions each module's parameters as its ``__init__`` returns, so the
    ``post_init`` -> ``init_weights`` of ``LlamaModel`` and ``LlamaForCausalLM`` runs on empty
    partitions; transformers' ``_init_weights`` (modeling_utils.py) then does
    ``init.zeros_(module.weight[module.padding_idx])`` for an embedding with a padding index (a
    config with ``pad_token_id``): an IndexError on a size-0 tensor. transformers builds the same
    way when it runs ``zero.Init`` itself (``PreTrainedModel._from_config`` under
    ``is_deepspeed_zero3_enabled()``): inside ``initialization.no_init_weights()``, then
    ``integrations.deepspeed.initialize_weights_zero3`` gathers one module at a time for rank 0
    to initialise, then ``tie_weights()``. Here the backend owns ``zero.Init`` (transformers'
    HfDeepSpeedConfig hook stays off: backends/accelerate/families/deepspeed.py), so the same
    context is entered here, and the rest is this class's: ``_init_random`` (per module,
    gathered, rank 0 writes) or ``load_pretrained`` (per tensor, gathered); never a whole-model
    gather. ``no_init_weights`` swaps torch's init functions for no-ops while the model is built
    (transformers' own context; restored on exit)."""
    from transformers.initialization import no_init_weights

    return no_init_weights()


def _children_first(m: nn.Module):
    for c in m.children():
        yield from _children_first(c)
    yield m


def _real_buffers(hf: nn.Module) -> None:
    """After a meta build: the non-persistent buffers (rotary tables) get storage and their values
    from transformers' own initialisation of the modules that own them."""
    for m in hf.modules():
        meta = [n for n, b in m.named_buffers(recurse=False) if b is not None and b.is_meta]
        if meta:
            with torch.device("cpu"):
                for n in meta:
                    m._buffers[n] = torch.empty_like(m._buffers[n], device="cpu")
                hf._init_weights(m)


def _anon_rss() -> int:
    """This process's anonymous resident memory, bytes (Linux; 0 elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@functools.cache
def model_class(path: str) -> type[HFCausalLM]:
    """``HFCausalLM`` with ``block_cls`` set to the architecture's decoder layer (from the
    transformers class's ``_no_split_modules``), without building the model."""
    from transformers import AutoModelForCausalLM

    config = _auto_config(path)
    arch = AutoModelForCausalLM._model_mapping[type(config)]
    names = sorted(getattr(arch, "_no_split_modules", None) or ())
    module = sys.modules[arch.__module__]
    block = next((getattr(module, n) for n in names if hasattr(module, n)), None)
    cls = type(f"HF{arch.__name__}", (HFCausalLM,), {"block_cls": block, "__module__": __name__})
    setattr(sys.modules[__name__], cls.__name__, cls)  # picklable by name
    return cls


def _restore_generation(model: Any, path: str) -> None:
    """Training builds the model with ``use_cache=False`` (no KV cache to keep); the export gets
    the source model's own setting back (True unless its config says otherwise), and its
    generation_config.json when it has one, so ``generate()`` on the export uses the cache."""
    from transformers import AutoConfig, GenerationConfig

    source = locate(path)
    use_cache = getattr(AutoConfig.from_pretrained(source, local_files_only=True), "use_cache", True)
    model.config.use_cache = use_cache
    if (source / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(source, local_files_only=True)
    elif model.generation_config is not None:
        model.generation_config.use_cache = use_cache


def save_hf(state: dict[str, torch.Tensor], shape: ModelConfig, out: Path, *, merge_lora: bool) -> Path:
    """Write ``state`` (the plain model's full state dict, keys ``hf.…``) as a directory that
    ``AutoModelForCausalLM.from_pretrained`` loads: config, safetensors weights, and the
    tokenizer files found next to the source model. LoRA adapters are merged into the base
    weights (``merge_lora``: in fp32, then cast) or saved as a peft adapter directory beside them
    (fp32, peft's default). The weights are in the source checkpoint's dtype
    (``hf_config.export_dtype``: a bf16 model exports bf16, not twice its size). Written beside
    ``out`` and renamed into place: an interrupted export leaves no half directory."""
    import dataclasses
    import shutil

    # Parameters on the meta device, then the state's tensors assigned: no weights read twice.
    model = model_class(shape.path)(dataclasses.replace(shape, pretrained=True), meta=True)
    model.load_state_dict(state, strict=True, assign=True)
    model.hf.tie_weights()
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    peft_model = getattr(model, "_peft", None)
    if peft_model is None:
        base = model.hf
    elif merge_lora:
        base = peft_model.merge_and_unload()  # in place: this model is the export's own
    else:  # (the adapter names the base beside it, and the task AutoPeftModelForCausalLM expects)
        config = next(iter(peft_model.peft_config.values()))
        config.task_type, config.base_model_name_or_path = "CAUSAL_LM", str(out.absolute())
        peft_model.save_pretrained(str(tmp / "adapter"))
        base = peft_model.unload()
    _restore_generation(base, shape.path)
    base.to(getattr(torch, export_dtype(shape.path, shape.pretrained)))  # (config.json's dtype follows)
    base.save_pretrained(str(tmp))
    for f in locate(shape.path).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens_map", "vocab", "merges", "added_tokens",
                              "chat_template")) and f.is_file():
            shutil.copy2(f, tmp / f.name)
    tmp.rename(out)  # (onto nothing, or an empty directory)
    return out
