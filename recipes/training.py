"""The training recipe as plain functions of the config: the model, its loss, the optimizer and
the learning-rate schedule. No engine here: each backend calls these (the Lightning backend
from its LightningModule adapter, the Accelerate backend from its loop), so every engine trains
exactly the same recipe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from recipes.config import ModelConfig, TrainerConfig

ADAMW_BETAS, ADAMW_EPS = (0.9, 0.95), 1e-8


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
    ``meta``: a pretrained HF model's parameters stay on the meta device, for a strategy that
    shards them first and then materializes them (strategies/parallelize.py ``materialize``);
    ``gather``: the engine's context that makes partitioned parameters whole (ZeRO-3), which a
    model that writes its own weights (recipes/hf.py) uses."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if shape.is_hf:
            return model_class(shape)(shape, meta=meta and shape.pretrained, seed=seed, gather=gather)
        return model_class(shape)(shape)


def loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross entropy of one micro-batch, computed in fp32."""
    tokens, targets = batch
    return token_loss(model(tokens), targets)


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of logits, in fp32 (also a pipeline's last stage's loss)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build_optimizer(params: Any, t: TrainerConfig) -> torch.optim.Optimizer:
    """``trainer.optimizer``: AdamW, or plain SGD (momentum ``trainer.momentum``). SGD keeps every
    gradient-scale error visible: AdamW divides a constant scale out of its update."""
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
    return torch.optim.AdamW(params, lr=t.lr, betas=ADAMW_BETAS, eps=ADAMW_EPS,
                             weight_decay=t.weight_decay)


def lr_factor(t: TrainerConfig):
    """Multiplier of the base learning rate at optimizer step ``s``: linear warm-up over
    ``trainer.warmup_steps`` steps, then constant."""
    warm = t.warmup_steps

    def factor(s: int) -> float:
        return min(1.0, (s + 1) / (warm + 1))

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, t: TrainerConfig) -> Any:
    """Stepped once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(t))
