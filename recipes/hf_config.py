"""A Hugging Face model's shape, read from its ``config.json`` without importing torch or
transformers: what ``model=hf`` resolves its shape fields from (the ``${hf:...}`` resolver in
conf/model/hf.yaml), so plan.py and ``--cfg job`` see the real model at no import cost.

``model.path`` is a local directory holding ``config.json`` (and safetensors weights), or a model
id (``org/name``) already in the local Hugging Face cache; never a network call.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

# model_type -> which attention projections carry a bias (the families whose modules match the
# built-in GPT's: RMSNorm, rotary attention, SwiGLU MLP, no other parameters).
FAMILIES = {"llama": None, "mistral": "none", "qwen2": "qkv"}
"""None: the config's ``attention_bias`` decides (Llama: on q, k, v and o together)."""


def hub_cache() -> Path:
    """Where huggingface_hub keeps downloaded repositories (its own environment variables)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface"
    return Path(home) / "hub"


FIX = ("point model.path at a directory written by save_pretrained (config.json + safetensors), or "
       "a model id already downloaded (hf download <id>)")


def _snapshot(path: str) -> Path | None:
    """The cached snapshot directory of model id ``path`` (``refs/main`` of huggingface_hub's
    cache layout), None when the cache has none."""
    repo = hub_cache() / ("models--" + path.replace("/", "--"))
    ref = repo / "refs" / "main"
    if "/" not in path or not ref.is_file():
        return None
    snap = repo / "snapshots" / ref.read_text().strip()
    return snap if snap.is_dir() else None


def locate(path: str) -> Path:
    """The local directory of ``model.path``: the directory itself, or the cached snapshot of a
    model id; a ValueError naming the key, the value and the fix when it is neither."""
    p = Path(path).expanduser()
    if (p / "config.json").is_file():
        return p
    snap = _snapshot(path)
    if snap is not None and (snap / "config.json").is_file():
        return snap
    if p.is_dir():
        raise ValueError(f"model.path={path}: the directory holds no model (no config.json there); {FIX}")
    if p.exists():
        raise ValueError(f"model.path={path} is a file, not a model directory; {FIX}")
    raise ValueError(f"model.path={path}: no such directory, and no such model id in the local Hugging "
                     f"Face cache ({hub_cache()}); {FIX}")


def weights_problems(path: str) -> list[str]:
    """``model.pretrained=true`` loads the safetensors weights beside config.json (recipes/hf.py):
    their absence, found before launch rather than by every rank after it."""
    where = locate(path)
    if any(where.glob("*.safetensors")):
        return []
    other = sorted(f.name for f in where.iterdir() if f.suffix in (".bin", ".pt", ".pth", ".ckpt", ".h5"))
    found = f"only {', '.join(other[:3])}" if other else "no weights at all"
    return [f"model.path={path}: no *.safetensors weights there ({found}) and model.pretrained=true loads "
            "them; save the model with save_pretrained (safetensors, transformers' default), or set "
            "model.pretrained=false to start from random weights"]


# The fields a named shape (conf/model/llama3_8b.yaml ...) states and the weights' config.json must give.
SHAPE_KEYS = ("architecture", "dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim",
              "tie_embeddings", "norm_eps", "rope_theta", "attention_bias")


def launch_problems(model: Any, here: bool = True) -> list[str]:
    """Before launch, a transformers model (``model=hf`` or a named shape such as
    ``model=llama3_8b``, planned from its stated shape with no weights): ``model.path`` is set
    and, ``here`` (on the machine that runs it), a named shape's numbers are those of the
    config.json there and the weights are there."""
    if model.path is None:
        return [f"model={model.name} (architecture {model.architecture}) plans without weights, "
                "but training builds the model from them: set model.path to a directory written "
                "by save_pretrained or a model id in the local Hugging Face cache "
                f"(model.path=/models/<the {model.name} checkpoint>)"]
    if not here:
        return []
    try:
        differ = _differ(model)
    except ValueError as e:
        return [str(e)]
    if differ and model.name != "hf":
        return [f"model={model.name} with model.path={model.path}: the checkpoint is not this "
                f"shape: {', '.join(f'{k} {v} (config.json: {c})' for k, v, c in differ)}; point "
                f"model.path at the {model.name} checkpoint, or use model=hf model.path={model.path} "
                "(the shape read from its config.json)"]
    return weights_problems(str(model.path)) if model.pretrained else []


def _differ(model: Any) -> list[tuple[str, Any, Any]]:
    """(key, the model's value, config.json's value) of each shape field that differs."""
    real = shape(str(model.path))
    return [(k, getattr(model, k), real[k]) for k in SHAPE_KEYS if getattr(model, k) != real[k]]


def override_problems(model: Any) -> list[str]:
    """``model=hf`` builds the model from config.json: a shape key set to another value (on the
    command line) would be planned and reported, not built; so would ``model.dropout`` on any
    transformers model (``dropout_problems``). Checked at every depth (plan.py reads config.json
    too); an unreadable path is ``launch_problems``' to report."""
    if model.path is None:
        return []
    out = dropout_problems(model)
    if model.name != "hf":
        return out
    try:
        differ = _differ(model)
    except ValueError:
        return out
    if not differ:
        return out
    said = ", ".join(f"model.{k}={v} (config.json: {c})" for k, v, c in differ)
    what, it = ("these overrides", "them") if len(differ) > 1 else ("this override", "it")
    return [*out, f"{said}: model=hf builds the model from model.path={model.path}'s config.json and "
            f"ignores {what}: remove {it}, or edit config.json (or point model.path at a model of that shape)"]


def dropout_problems(model: Any) -> list[str]:
    """``model.dropout`` is the built-in GPT's dropout of the attention probabilities, each
    block's two residual branches and the embeddings; transformers' Llama, Mistral and Qwen2
    have only the first, from config.json's ``attention_dropout``. Applying ``model.dropout``
    there would be half of it, and ignoring it (as it was) trains without any: refused, with
    config.json's field as the way to attention dropout."""
    if not model.dropout:
        return []
    return [f"model.dropout={model.dropout} with model={model.name}: transformers builds the "
            f"{model.architecture} model from model.path={model.path}'s config.json, and its only dropout "
            "is attention's (config.json's attention_dropout), not the residual and embedding dropout "
            "model.dropout also means; it would not be applied: set model.dropout=0, and for attention "
            f'dropout set "attention_dropout": {model.dropout} in config.json']


EXPORT_DTYPES = ("float32", "bfloat16", "float16")


def export_dtype(path: str, pretrained: bool) -> str:
    """The dtype a Hugging Face export (recipes/hf.py ``save_hf``) writes: the source checkpoint's,
    config.json's ``dtype`` (``torch_dtype`` before transformers 5), as ``save_pretrained`` keeps a
    model's; float32 for random weights (``model.pretrained=false``) or a config naming none of
    ``EXPORT_DTYPES``."""
    if not pretrained:
        return "float32"
    config = _read(path)
    named = config.get("dtype") or config.get("torch_dtype")
    return named if named in EXPORT_DTYPES else "float32"


def tokenizer_default(path: Any) -> Any:
    """The ``${hf_dir:...}`` resolver: data.tokenizer's default from ``model.path``, resolved as
    ``locate`` resolves it (a model id: its cached snapshot); any other value as it is."""
    if path is None:
        return None
    try:
        where = locate(str(path))
    except ValueError:  # (said once, as model.path's problem)
        return path
    return path if where == Path(str(path)).expanduser() else str(where)


@functools.cache
def _read(path: str) -> dict[str, Any]:
    return json.loads((locate(path) / "config.json").read_text())


@functools.cache
def shape(path: str) -> dict[str, Any]:
    """The ``ModelConfig`` shape fields of the model at ``path``."""
    c = _read(path)
    kind = c.get("model_type")
    if kind not in FAMILIES:
        raise ValueError(f"model.path={path}: model_type {kind!r} is not supported; supported: "
                         f"{', '.join(FAMILIES)} (decoder-only, RMSNorm, rotary attention, SwiGLU)")
    dim, heads = c["hidden_size"], c["num_attention_heads"]
    if c.get("head_dim") not in (None, dim // heads):
        raise ValueError(f"model.path={path}: head_dim {c['head_dim']} != hidden_size / "
                         f"num_attention_heads = {dim // heads}; such models are not supported yet")
    if c.get("mlp_bias"):
        raise ValueError(f"model.path={path}: mlp_bias=true is not supported")
    rope = c.get("rope_parameters") or {}
    bias = FAMILIES[kind] or ("all" if c.get("attention_bias") else "none")
    return {
        "dim": dim, "n_layers": c["num_hidden_layers"], "n_heads": heads,
        "n_kv_heads": c.get("num_key_value_heads") or heads, "vocab_size": c["vocab_size"],
        "ffn_dim": c["intermediate_size"], "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
        "norm_eps": float(c.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(rope.get("rope_theta") or c.get("rope_theta") or 10000.0),
        "attention_bias": bias, "max_seq_len": c.get("max_position_embeddings"),
        "seq_len": min(c.get("max_position_embeddings") or SEQ_LEN_CAP, SEQ_LEN_CAP),
        "architecture": kind,
    }


SEQ_LEN_CAP = 2048
"""model=hf's default ``model.seq_len``: the model's ``max_position_embeddings``, at most this
(Axolotl's default sequence length; a 128k-context model fine-tunes on 2k-token samples unless
``model.seq_len`` asks for more)."""


def resolve(path: Any, key: str) -> Any:
    """The ``${hf:<path>,<key>}`` resolver."""
    if path is None or str(path) in ("", "???"):
        raise ValueError("model=hf needs model.path, which is null: set it to a directory written by "
                         "save_pretrained or a model id in the local Hugging Face cache "
                         "(model.path=/models/Llama-3.2-1B)")
    return shape(str(path))[key]
