"""Which kernels the run's hot paths run, read from the running engine (report keys, through the
always-on ``StartupTimes`` observer):

- ``optimizer``: ``{"name", "impl", "class", "device"}`` -- the torch optimizer the engine
  steps (unwrapped from Accelerate's and DeepSpeed's wrappers: under ZeRO the torch optimizer
  steps DeepSpeed's fp32 partitions, on the host under an offloaded optimizer), how it steps
  (fused | foreach | for-loop, from its own ``defaults``), its class and where its first
  parameter lives (ZeRO-3: its first fp32 partition, which DeepSpeed hands it only inside the
  step); ``wrapper``: the engine's class around it, when there is one.
- ``attention``: ``{"kernel", "planner_assumes", "how"}`` -- the SDPA kernel (flash | efficient |
  cudnn | math) as torch's own dispatch chose it (``recipes.gpt.sdpa_kernel``): recorded by
  ``CoreAttention`` at its first eager training forward from the real tensors, or, where the
  blocks are compiled (the traced forward records nothing), asked of torch at the end of the run
  with tensors of the first forward's per-rank shape, dtype, device and dropout; and the
  planner's assumption for the attention scores (``planner.flash_attention``: flash = no
  seq x seq term, math = the seq x seq term of Korthikanti's closed forms; a calibrated
  architecture's activations are traced from SDPA on CPU instead).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recipes.job import Job

FLASH_LIKE = ("flash", "efficient", "cudnn")
"""Kernels that never hold the (seq x seq) scores: what ``planner.flash_attention=true`` plans."""


def torch_optimizer(opt: Any) -> tuple[Any, Any]:
    """(the torch optimizer inside ``opt``, the outermost wrapper or None): Accelerate's
    AcceleratedOptimizer and DeepSpeed's ZeRO optimizers hold theirs as ``.optimizer``."""
    import torch

    inner, wrapper = opt, None
    while type(inner).__module__.split(".")[0] != "torch" and hasattr(inner, "optimizer"):
        wrapper = wrapper or inner
        inner = inner.optimizer
    return (inner, wrapper) if isinstance(inner, torch.optim.Optimizer) else (opt, None)


def optimizer_facts(optimizers: list[Any], name: str) -> dict[str, Any]:
    """report.json's ``optimizer``: ``name`` (trainer.optimizer) and what the engine's first
    optimizer really is and how it steps."""
    if not optimizers:
        return {"name": name, "impl": None}
    opt, wrapper = torch_optimizer(optimizers[0])
    defaults = getattr(opt, "defaults", {})
    impl = ("fused" if defaults.get("fused") else "foreach" if defaults.get("foreach")
            else "for-loop" if defaults.get("foreach") is False else "torch default")
    first = next(iter(_stepped(optimizers[0], opt)), None)
    out = {"name": name, "impl": impl, "class": type(opt).__name__,
           "device": None if first is None else first.device.type}
    if wrapper is not None:
        out["wrapper"] = type(wrapper).__name__
    return out


def _stepped(outer: Any, opt: Any) -> list[Any]:
    """The tensors the torch optimizer ``opt`` steps: its param_groups' -- or, where the engine
    hands them to it only inside its step (DeepSpeed's ZeRO-3 empties the groups after each
    step), the fp32 partitions of the wrapper around it (``outer``: the engine's optimizer)."""
    params = [p for g in getattr(opt, "param_groups", []) for p in g["params"]]
    layer = outer
    while not params and layer is not None and layer is not opt:
        params = list(getattr(layer, "fp32_partitioned_groups_flat", None) or [])
        layer = getattr(layer, "optimizer", None)
    return params


def attention_facts(model: Any, job: Job) -> dict[str, Any]:
    """report.json's ``attention`` (see the module)."""
    assumes = "flash" if job.planner.flash_attention else "math"
    out: dict[str, Any] = {"kernel": None, "planner_assumes": assumes}
    cores = [m for m in model.modules() if type(m).__name__ == "CoreAttention"] if model is not None else []
    if not cores:
        return out | {"how": "not our CoreAttention (model=hf: transformers' attention)"}
    seen = next((m.kernel for m in cores if getattr(m, "kernel", None)), None)
    if seen is not None:
        out |= {"kernel": seen, "how": "torch's SDPA dispatch asked at the first forward, real tensors"}
    else:
        out |= {"kernel": _probe(model, job), "how": "torch's SDPA dispatch asked with the run's "
                "per-rank shapes (compiled blocks: the traced forward records nothing)"}
    kernel = str(out["kernel"])
    out["matches_planner"] = (kernel in FLASH_LIKE) == (assumes == "flash") if kernel in (*FLASH_LIKE, "math") else None
    return out


def _probe(model: Any, job: Job) -> str:
    """``sdpa_kernel`` for tensors shaped as one rank's first forward: micro x heads/tp x
    seq/seq-degree x head_dim, in the dtype the run computes in, on the model's device."""
    import torch

    from core.precision import low_dtype
    from recipes.gpt import sdpa_kernel

    m, mesh = job.model, job.mesh
    param = next(model.parameters(), None)
    device = param.device if param is not None and param.device.type != "meta" else torch.device("cpu")
    dtype = low_dtype(job.trainer.precision) or (param.dtype if param is not None else torch.float32)
    tp, seq = max(1, mesh.tp), max(1, mesh.seq)
    heads, kv = max(1, m.n_heads // tp), max(1, m.n_kv_heads // tp)
    shape = (job.batch.micro_size, heads, max(1, m.seq_len // seq), m.head_dim)
    q = torch.zeros(shape, dtype=dtype, device=device, requires_grad=True)
    k = torch.zeros((shape[0], kv, *shape[2:]), dtype=dtype, device=device, requires_grad=True)
    return sdpa_kernel(q, k, k, dropout=m.dropout, enable_gqa=heads != kv)


__all__ = ["FLASH_LIKE", "attention_facts", "optimizer_facts", "torch_optimizer"]
