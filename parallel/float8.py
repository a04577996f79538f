"""FP8 training (``trainer.float8``): torchao's float8 Linear in place of each ``nn.Linear`` of the
model's blocks, the first step of the parallelize plan (torchtitan's model converters run before
TP, checkpointing, compile and FSDP2). The output head stays in bf16 (its logits feed the loss),
and so do a MoE router and any Linear whose in or out features are not divisible by 16 (what
``torch._scaled_mm`` takes).

``tensorwise``: one dynamic scale per tensor; under FSDP2 the weights are all-gathered in float8
(half of bf16's bytes), and their scales are computed for all weights at once after each
optimizer step (torchao's ``precompute_float8_dynamic_scale_for_fsdp``, one all-reduce of the
amaxes), as torchtitan does. ``rowwise``: one scale per row, more accurate, gathered in bf16.
torchao is imported only here, when a run converts. Its autograd function saves each Linear's
input and weight in their high precision for backward and re-casts them there: activations are
those of bf16.
"""

from __future__ import annotations

import sys
from typing import Any

RECIPES = ("tensorwise", "rowwise")
CHOICES = ("none", *RECIPES)
TORCHAO = "0.17.0"
"""The torchao release to install (the first ABI-stable one, built against torch 2.11)."""
MIN_CAPABILITY = (8, 9)
"""float8 matmuls (``torch._scaled_mm``) need compute capability 8.9: Ada (L4, L40S), Hopper
(H100, H200), Blackwell."""
PRESETS = ("single", "fsdp2")
"""The strategy families float8 is built for (the single device, FSDP2)."""
DIVISOR = 16


def convertible(name: str, module: Any) -> bool:
    """Whether the Linear ``module`` at ``name`` (inside a block) is converted: not a router,
    both dimensions divisible by 16."""
    if name.split(".")[-1] in ("router", "gate"):
        return False
    return module.in_features % DIVISOR == 0 and module.out_features % DIVISOR == 0


def config(recipe: str, *, fsdp: bool) -> Any:
    """torchao's ``Float8LinearConfig`` for ``recipe``; tensorwise under FSDP2 gathers the weights
    in float8 (rowwise has no float8 all-gather in torchao)."""
    from torchao.float8 import Float8LinearConfig

    if recipe == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp)
    if recipe == "rowwise":
        return Float8LinearConfig.from_recipe_name("rowwise")
    raise ValueError(f"trainer.float8={recipe!r}: allowed {', '.join(CHOICES)}")


def convert(model: Any, recipe: str, *, fsdp: bool = False, block: type | None = None) -> list[str]:
    """Swap the convertible Linears inside the blocks of ``model`` (every instance of ``block``;
    all of ``model`` but its ``head`` when it declares none) for torchao's ``Float8Linear``, in
    place; the converted modules' names (relative to ``model``)."""
    import torch
    from torchao.float8 import convert_to_float8_training

    head = getattr(type(model), "tp_layout", {}).get("head", "output")
    roots = [(n, m) for n, m in model.named_modules() if block is not None and isinstance(m, block)]
    if block is None:
        roots = [("", model)]
    done: list[str] = []
    for prefix, root in roots:
        def keep(m: torch.nn.Module, fqn: str, prefix: str = prefix) -> bool:
            full = f"{prefix}.{fqn}" if prefix else fqn
            ok = isinstance(m, torch.nn.Linear) and full != head and convertible(full, m)
            if ok:
                done.append(full)
            return ok

        convert_to_float8_training(root, module_filter_fn=keep, config=config(recipe, fsdp=fsdp))
    return done


def gathers_float8(model: Any) -> bool:
    """Whether ``model`` holds float8 Linears whose FSDP2 all-gather is in float8 (their scales
    are then precomputed after each optimizer step)."""
    if "torchao.float8" not in sys.modules:  # (nothing was converted in this process)
        return False
    from torchao.float8.float8_linear import Float8Linear

    return any(isinstance(m, Float8Linear) and m.config.enable_fsdp_float8_all_gather
               for m in model.modules())


def precompute_after_step(model: Any, optimizer: Any) -> bool:
    """After each step of ``optimizer``, compute the float8 scales of ``model``'s FSDP2-gathered
    weights in one all-reduce (torchtitan's post-optimizer hook), so the next forward's
    all-gather casts with them; nothing when ``model`` gathers none in float8. Whether a hook
    was registered."""
    if not gathers_float8(model):
        return False
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))
    return True


def missing() -> str | None:
    """What float8 lacks on this machine's Python: the fix when torchao is not installed, else
    None (found without importing it)."""
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        return (f"torchao is not installed: pip install torchao=={TORCHAO} (or pip install "
                "'stratagem[fp8]')")
    return None


def capability_problem() -> str | None:
    """Why this machine's first CUDA device cannot run float8 matmuls, or None. Asks torch, which
    initialises CUDA's runtime in this process (no memory on the device): validation's process is
    the rank itself, or our launcher's parent, which spawns (not forks) GPU ranks."""
    import torch

    if not torch.cuda.is_available():
        return None  # (validation's device check says so)
    cap = tuple(torch.cuda.get_device_capability(0))
    if cap < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(0)
        return (f"{name} has compute capability {cap[0]}.{cap[1]}, and float8 matmuls need "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (Ada, Hopper: L4, L40S, H100, H200)")
    return None


__all__ = ["CHOICES", "MIN_CAPABILITY", "PRESETS", "RECIPES", "TORCHAO", "capability_problem",
           "config", "convert", "convertible", "gathers_float8", "missing", "precompute_after_step"]
