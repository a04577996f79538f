"""The training recipe as plain functions of the config: the model, its loss, the optimizer and
the learning-rate schedule. No engine here: each backend calls these (the Lightning backend
from its LightningModule adapter, the Accelerate backend from its loop), so every engine trains
exactly the same recipe.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from recipes.data import IGNORE  # a target the loss does not count (data=chat's masked ones)

if TYPE_CHECKING:
    from core.mesh import Mesh
    from recipes.model_config import ModelConfig
    from recipes.trainer_config import TrainerConfig

def model_class(shape: ModelConfig) -> type[torch.nn.Module]:
    """The class ``build_model`` builds (its ``block_cls`` tells strategies what to wrap):
    recipes/gpt.py's GPT, or a transformers model for ``model=hf`` (recipes/hf.py)."""
    if shape.is_hf:
        from recipes.hf import model_class as hf_class

        return hf_class(shape.path)
    from recipes.gpt import GPT

    return GPT


def build_model(shape: ModelConfig, seed: int, *, meta: bool = False,
                gather: Callable[[list[torch.Tensor]], Any] | None = None) -> torch.nn.Module:
    """The plain single-device model, initialised from ``seed`` alone: every rank, and the
    single-process reference, start from identical weights whatever RNG state they are in.
    ``meta``: the parameters stay on the meta device (a pretrained HF model's; a random-init
    HF model is built whole), for a strategy that shards them first and then materializes them
    (parallel/parallelize.py ``materialize``: a GPT draws the same values, one part at a time);
    ``gather``: the engine's context that makes partitioned parameters whole (ZeRO-3), which a
    model that writes its own weights (recipes/hf.py) uses."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if shape.is_hf:
            return model_class(shape)(shape, meta=meta and shape.pretrained, seed=seed, gather=gather)
        if not meta:
            return model_class(shape)(shape)
        with torch.device("meta"):
            model = model_class(shape)(shape)
        model.pending_init = seed  # (recipes/gpt.py GPT.init_shards, once sharded)
        return model


def seed_training(seed: int, mesh: Mesh, rank: int) -> int:
    """Seed this rank's training RNG (torch's, every device's, and Python's and numpy's: what a
    checkpoint's ``rng/rank<r>.pt`` restores) from ``trainer.seed``, after the model's build
    (drawn in a forked RNG of its own) and before the first step, so a config and seed give the
    same run, dropout masks included; each rank's seed is ``core.mesh.training_seed``'s (ranks
    holding different tokens draw different masks, tensor-parallel peers the same). Returns it."""
    import random

    import numpy as np

    from core.mesh import training_seed

    own = training_seed(seed, mesh, rank)
    torch.manual_seed(own)
    random.seed(own)
    np.random.seed(own % 2**32)
    return own


def loss(model: torch.nn.Module, batch: tuple[torch.Tensor, ...], chunk: int = 0,
         share: float = 1.0, objective: Any = None, step: int = 0) -> torch.Tensor:
    """Next-token cross entropy of one micro-batch, computed in fp32: its sum of token losses
    over ``token_weight`` (``share``: recipes/data.py ``CountedShare`` of this step, which makes
    the step's loss the mean over every counted token of the global batch, whatever the layout);
    a mixture-of-experts model adds its load-balancing loss (``aux_loss``). ``chunk``
    (trainer.loss_chunk > 0): the model computes the loss itself, that many tokens' logits at a
    time (recipes/head.py), and returns [sum, count]: the same loss, without the whole logits.
    ``objective``: objective=dpo's ``recipes.dpo.Dpo`` (the batch holds pairs), at optimizer
    step ``step``; None: next-token cross entropy."""
    if objective is not None:
        out = objective.loss(model, batch, step)
    elif chunk > 0:
        tokens, targets = batch
        total, _ = model(tokens, targets=targets, loss_chunk=chunk)
        out = total / token_weight(targets, share)
    else:
        tokens, targets = batch
        out = token_loss(model(tokens), targets, share)
    aux = aux_loss(model)
    return out if aux is None else out + aux


def aux_loss(model: torch.nn.Module) -> torch.Tensor | None:
    """The forward's load-balancing loss, summed over the MoE layers, each times its
    model.aux_loss_coef; None for a dense model."""
    from recipes.gpt import MoE

    terms = [m.aux_loss_coef * m.aux_loss for m in model.modules()
             if isinstance(m, MoE) and m.aux_loss is not None]
    return torch.stack(terms).sum() if terms else None


def token_loss(logits: torch.Tensor, targets: torch.Tensor, share: float = 1.0) -> torch.Tensor:
    """Next-token cross entropy of logits, in fp32, summed over the targets that are not
    ``IGNORE`` (data=chat's masked ones) and divided by ``token_weight``; also each pipeline
    micro-batch's loss on the last stage. Every engine averages these over micro-batches and
    ranks: with this step's ``share`` that is the token mean of the global batch."""
    total = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE,
                            reduction="sum")
    return total / token_weight(targets, share)


def token_weight(targets: torch.Tensor, share: float) -> torch.Tensor | float:
    """What a micro-batch's loss sum is divided by: its targets times the share of the step's
    global batch the loss counts. Where every target counts (share 1.0: unmasked data) that is
    the micro-batch's count, as a plain mean divides: today's numbers, bit for bit, on any
    device."""
    if share == 1.0:
        return (targets != IGNORE).sum().clamp(min=1)
    return targets.numel() * share


def no_decay_names(model: torch.nn.Module) -> frozenset[str]:
    """Names (in the plain model) of the parameters ``trainer.no_decay`` exempts from weight
    decay: every parameter with fewer than two dimensions (norm scales, biases) and every
    embedding table. Read from the plain model, before an engine flattens or partitions it."""
    embeddings = {f"{m_name}.{p_name}".lstrip(".")
                  for m_name, m in model.named_modules() if isinstance(m, torch.nn.Embedding)
                  for p_name, _ in m.named_parameters(recurse=False)}
    # ZeRO-3 partitions parameters as it builds them: its ds_shape is the full shape
    return frozenset(n for n, p in model.named_parameters()
                     if len(getattr(p, "ds_shape", p.shape)) < 2 or n in embeddings)


def param_groups(named: Iterable[tuple[str, torch.nn.Parameter]], t: TrainerConfig,
                 plain: Iterable[str], no_decay: frozenset[str]) -> list[dict[str, Any]]:
    """The optimizer's parameter groups: one, or (``trainer.no_decay`` with weight decay) the
    decayed and the exempt ones. ``named``: the parameters as the engine names them (wrappers
    add prefixes: ``module.``, ``_fsdp_wrapped_module.``, a LightningModule's attribute); each is
    matched to the longest plain-model name it ends with. A parameter that matches none (a flat
    parameter mixing several) is an error, never silently decayed."""
    named = list(named)
    if not (t.no_decay and t.weight_decay > 0):
        return [{"params": [p for _, p in named], "weight_decay": t.weight_decay}]
    plain = sorted(set(plain), key=len, reverse=True)
    groups: dict[bool, list[torch.nn.Parameter]] = {True: [], False: []}
    for name, p in named:
        bare = ".".join(x for x in name.split(".") if x not in WRAPPER_SEGMENTS)
        match = next((q for q in plain if bare == q or bare.endswith("." + q)), None)
        if match is None:
            raise ValueError(f"parameter {name!r} is none of the model's own (a flat parameter?): "
                             "trainer.no_decay cannot tell its weight decay; set trainer.no_decay=false")
        groups[match in no_decay].append(p)
    return [{"params": groups[False], "weight_decay": t.weight_decay},
            {"params": groups[True], "weight_decay": 0.0}]


WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_forward_module",
                              "_orig_mod", "module"})
"""Name segments that engines' wrappers insert (FSDP1, activation checkpointing, Lightning's
forward redirection, torch.compile, DDP / DeepSpeed)."""


def build_optimizer(groups: list[dict[str, Any]], t: TrainerConfig, device: str | None = None
                    ) -> torch.optim.Optimizer:
    """``trainer.optimizer`` over ``param_groups``: AdamW (``trainer.betas``, ``trainer.eps``), or
    plain SGD (momentum ``trainer.momentum``), stepping as ``trainer.optimizer_impl`` says (fused,
    foreach or one parameter at a time). ``auto`` is decided here, for these parameters
    (``resolve_impl``): ``device`` is where the optimizer will step (cuda | cpu; None: where the
    parameters are now). SGD keeps every gradient-scale error visible: AdamW divides a constant
    scale out of its update."""
    kwargs = IMPLS[resolve_impl(groups, t, device)]
    if t.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=t.lr, momentum=t.momentum, **kwargs)
    return torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas), eps=t.eps, **kwargs)


def resolve_impl(groups: list[dict[str, Any]], t: TrainerConfig, device: str | None = None) -> str:
    """``trainer.optimizer_impl`` for these parameter groups: ``auto`` is fused / foreach by the
    device (``auto_impl``), and one parameter at a time where a group mixes DTensors with plain
    tensors (tensor parallelism's unsharded norms) or DTensors of different meshes, which
    torch's foreach and fused kernels refuse; an explicit fused or foreach there is an error
    naming the fix."""
    params = [p for g in groups for p in g["params"]]
    impl = t.optimizer_impl
    if impl == "auto":
        impl = auto_impl(t.optimizer, device or (params[0].device.type if params else "cpu"))
    if impl == "for-loop" or not any(_mixed(g["params"]) for g in groups):
        return impl
    if t.optimizer_impl == "auto":
        return "for-loop"
    raise ValueError(f"trainer.optimizer_impl={impl}: a parameter group mixes DTensors with plain "
                     "tensors or with DTensors of another mesh, which torch's foreach and fused "
                     "kernels refuse; set trainer.optimizer_impl=auto or for-loop")


def _mixed(params: list[torch.Tensor]) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    # plain tensors beside DTensors, or DTensors of different meshes (experts on their own)
    return len({id(p.device_mesh) if isinstance(p, DTensor) else None for p in params}) > 1


IMPLS: dict[str, dict[str, bool]] = {"fused": {"fused": True}, "foreach": {"foreach": True},
                                     "for-loop": {"foreach": False, "fused": False}}
"""``trainer.optimizer_impl`` -> torch's optimizer arguments."""


def fused_missing(optimizer: str, device: str) -> str | None:
    """Why the running torch has no fused ``optimizer`` (adamw | sgd) stepping on ``device``
    (cuda | cpu), or None when it has one: its constructor takes ``fused`` and its fused kernels
    run on that device type (torch's own list, checked against each parameter at the first step:
    floating-point parameters, DTensors by their local device)."""
    import inspect

    cls = torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW
    if "fused" not in inspect.signature(cls.__init__).parameters:
        return f"torch {torch.__version__}'s {cls.__name__} has no fused implementation"
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        devices = list(_get_fused_kernels_supported_devices())
    except ImportError:  # (before torch listed them: CUDA only)
        devices = ["cuda"]
    if device not in devices:
        return (f"torch {torch.__version__}'s fused {cls.__name__} runs on {', '.join(devices)}, "
                f"and this run's optimizer steps on {device}")
    return None


def auto_impl(optimizer: str, device: str) -> str:
    """``trainer.optimizer_impl=auto``: fused where the optimizer steps on CUDA and torch has the
    fused kernels there, foreach elsewhere (CPU included)."""
    return "fused" if device == "cuda" and fused_missing(optimizer, device) is None else "foreach"


def optimizer_impl(t: TrainerConfig, device: str) -> tuple[str, list[str]]:
    """``trainer.optimizer_impl`` resolved for an optimizer stepping on ``device`` (cuda | cpu),
    with the problem when the running torch cannot do the explicit choice."""
    if t.optimizer_impl == "auto":
        return auto_impl(t.optimizer, device), []
    why = fused_missing(t.optimizer, device) if t.optimizer_impl == "fused" else None
    if why is None:
        return t.optimizer_impl, []
    return t.optimizer_impl, [f"trainer.optimizer_impl=fused: {why}; set trainer.optimizer_impl=auto "
                              "(fused where it exists, foreach elsewhere), foreach or for-loop"]


def lr_factor(t: TrainerConfig) -> Callable[[int], float]:
    """Multiplier of ``trainer.lr`` for the optimizer step after ``s`` steps: linear warm-up over
    ``trainer.warmup_steps`` steps, then ``trainer.scheduler``: constant, or a cosine / linear
    decay to ``trainer.min_lr_ratio`` reached at ``trainer.decay_steps`` (default max_steps) and
    held after it."""
    warm, floor = t.warmup_steps, t.min_lr_ratio
    end = t.decay_steps or t.max_steps

    def factor(s: int) -> float:
        if s < warm or t.scheduler == "constant":
            return min(1.0, (s + 1) / (warm + 1))
        progress = min(1.0, (s - warm) / max(1, end - warm))
        if t.scheduler == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1 - (1 - floor) * progress

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, t: TrainerConfig) -> Any:
    """Stepped once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(t))
