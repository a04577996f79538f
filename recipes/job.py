"""Validate a composed config into a ``Job``: every problem collected into one ``ConfigError``,
before any process starts. Downstream code holds the Job's objects, never raw strings."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from recipes.gpt import GPT, GPTShape
from strategies import Batch, ConfigError, Run, StrategyConfig, World, as_config

ACCELERATORS = ("auto", "cpu", "gpu")
PRECISIONS = ("32", "bf16-mixed", "16-mixed")
BACKENDS = ("lightning",)
DATASETS = ("text", "synthetic")


@dataclass(frozen=True)
class Job:
    cfg: DictConfig
    shape: GPTShape
    strategy: StrategyConfig
    world: World
    batch: Batch
    run: Run

    @property
    def tokens_per_step(self) -> int:
        return self.batch.global_size * self.shape.seq_len

    def meta(self) -> dict[str, Any]:
        """The report's identifying keys."""
        return {
            "strategy": self.strategy.name,
            "backend": self.cfg.backend.name,
            "world_size": self.world.size,
            "global_batch_size": self.batch.global_size,
            "micro_batch_size": self.batch.micro_size,
            "accumulation": self.batch.accumulation,
            "config": OmegaConf.to_container(self.cfg, resolve=True),
        }


def resolve_accelerator(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def _device_problems(accelerator: str, world: World, oversubscribe: bool) -> list[str]:
    import torch

    if accelerator == "gpu":
        have = torch.cuda.device_count()
        if have == 0:
            return ["cluster.accelerator=gpu but no CUDA device is visible: "
                    "use cluster.accelerator=cpu (gloo) or auto"]
        if world.devices > have:
            return [f"cluster.devices={world.devices} but this node has {have} GPU(s): "
                    f"set cluster.devices<={have}"]
        return []
    have = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if world.devices > have and not oversubscribe:
        return [f"cluster.devices={world.devices} CPU processes but this machine has {have} core(s) "
                f"available: set cluster.devices<={have}, or cluster.oversubscribe=true to run "
                "more processes than cores (slower, but correct)"]
    return []


def validate(cfg: DictConfig) -> Job:
    """Check everything that can be checked without starting a process; raise one ConfigError."""
    problems: list[str] = []
    c, t = cfg.cluster, cfg.trainer
    shape = GPTShape.of(cfg.model)
    problems += shape.problems()
    if c.accelerator not in ACCELERATORS:
        problems.append(f"cluster.accelerator={c.accelerator!r}: allowed {', '.join(ACCELERATORS)}")
    if str(t.precision) not in PRECISIONS:
        problems.append(f"trainer.precision={t.precision!r}: allowed {', '.join(PRECISIONS)}")
    if cfg.backend.name not in BACKENDS:
        problems.append(f"backend.name={cfg.backend.name!r}: allowed {', '.join(BACKENDS)}")
    if cfg.data.name not in DATASETS:
        problems.append(f"data.name={cfg.data.name!r}: allowed {', '.join(DATASETS)}")
    if t.max_steps < 1:
        problems.append(f"trainer.max_steps={t.max_steps}: must be >= 1")
    if cfg.data.name == "text" and shape.vocab_size < 256:
        problems.append(f"model.vocab_size={shape.vocab_size}: byte tokens of data=text need >= 256")

    strategy = as_config(cfg.strategy)
    world = World(nodes=c.nodes, devices=c.devices, tp=getattr(strategy, "tp", 1),
                  pp=getattr(strategy, "pp", 1))
    problems += world.problems()
    batch = Batch(t.global_batch_size, t.micro_batch_size, max(world.dp, 1))
    problems += batch.problems()
    accelerator = resolve_accelerator(c.accelerator) if c.accelerator in ACCELERATORS else "cpu"
    if not world.problems():
        problems += _device_problems(accelerator, world, c.oversubscribe)
    run = Run(accelerator=accelerator, precision=str(t.precision), block_cls=GPT.block_cls,
              micro_batch_size=t.micro_batch_size,
              accumulation=batch.accumulation if not batch.problems() else 1,
              grad_clip=float(t.grad_clip))
    problems += strategy.problems(world, run)
    if problems:
        raise ConfigError(problems)
    return Job(cfg=cfg, shape=shape, strategy=strategy, world=world, batch=batch, run=run)
