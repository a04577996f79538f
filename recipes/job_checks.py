"""The checks of ``recipes.job.validate`` that read one group or two -- the optimizer and schedule,
the logger's package and W&B's credentials, save_hf, the chunked loss, LoRA -- each a list of
problems (one line each: the key, the value, the fix), nothing raised."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from recipes.config import LoggerConfig
from recipes.model_config import ModelConfig
from recipes.trainer_config import TrainerConfig
from strategies import Run, StrategyConfig
from strategies.presets import load, names

# logger name -> (module it needs, the extra that installs it)
LOGGER_PACKAGES = {"wandb": ("wandb", "wandb"), "tensorboard": ("tensorboard", "tensorboard")}


def trainer_problems(t: TrainerConfig, strategy: StrategyConfig) -> list[str]:
    """The optimizer and schedule settings that only make sense together."""
    out = []
    betas = list(t.betas)
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
        out.append(f"trainer.betas={betas}: AdamW takes two numbers, each >= 0 and < 1; set "
                   "trainer.betas=[0.9,0.95] (the default) or e.g. [0.9,0.999]")
    end = t.decay_steps or t.max_steps
    if t.scheduler != "constant" and end <= t.warmup_steps:
        key = f"trainer.decay_steps={t.decay_steps}" if t.decay_steps else f"trainer.max_steps={t.max_steps}"
        out.append(f"trainer.scheduler={t.scheduler} decays between trainer.warmup_steps={t.warmup_steps} "
                   f"and {key}, which leaves no steps to decay over: set trainer.decay_steps (or "
                   f"trainer.max_steps) above {t.warmup_steps}, or trainer.scheduler=constant")
    if t.decay_steps is not None and t.scheduler == "constant":
        out.append(f"trainer.decay_steps={t.decay_steps} with trainer.scheduler=constant does nothing: "
                   "set trainer.scheduler=cosine or linear, or remove trainer.decay_steps")
    if t.no_decay and t.weight_decay > 0 and not strategy.capabilities.param_groups:
        out.append(f"trainer.no_decay=true (no weight decay for norms, biases, embeddings) needs "
                   f"per-parameter optimizer groups, and strategy={strategy.name} hands the optimizer "
                   "flat parameters (strategy.use_orig_params=false): set trainer.no_decay=false, "
                   "or trainer.weight_decay=0")
    return out


def unread_keys(cfg: Any, group: str) -> list[str]:
    """``cfg``'s keys that one choice of its ``group`` alone reads (its class's ``READ_BY``: key ->
    that choice), set away from their defaults under another choice: one line each, the key, its
    value, what reads it and the fix (logger=csv with logger.project, objective=lm with
    objective.beta)."""
    default = type(cfg)()
    return [f"{group}.{key}={_shown(getattr(cfg, key))} applies to {group}={owner} only; "
            f"{group}={cfg.name} does not read it: remove it, or set {group}={owner}"
            for key, owner in type(cfg).READ_BY.items()
            if cfg.name != owner and getattr(cfg, key) != getattr(default, key)]


def _shown(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def logger_problems(logger: LoggerConfig | None) -> list[str]:
    if logger is None:
        return []
    out = unread_keys(logger, "logger")
    if logger.name in LOGGER_PACKAGES:
        module, extra = LOGGER_PACKAGES[logger.name]
        if importlib.util.find_spec(module) is None:
            out.append(f"logger={logger.name} needs the {module!r} package, which is not installed: "
                       f"pip install -e '.[{extra}]' (or pip install {module}), or logger=null")
    return out


def save_hf_problems(t: TrainerConfig, model: ModelConfig) -> list[str]:
    if not t.save_hf:
        return []
    if not model.is_hf:
        return [f"trainer.save_hf=true writes a Hugging Face directory of a model=hf run (model="
                f"{model.name} now): remove it (convert.py --to full exports the built-in models)"]
    if not t.save_last:
        return ["trainer.save_hf=true exports the final checkpoint, and trainer.save_last=false "
                "saves none: set trainer.save_last=true"]
    return []


def loss_chunk_problems(t: TrainerConfig, model: ModelConfig, run: Run, preset: str) -> list[str]:
    """Where the chunked loss (recipes/head.py: the built-in GPT's head) cannot run."""
    c = t.loss_chunk
    if c == 0:
        return []
    key, fix = f"trainer.loss_chunk={c}", "set trainer.loss_chunk=0 (the whole logits at once)"
    if model.is_hf:
        return [f"{key}: the chunked loss is the built-in GPT's head (recipes/head.py), and model=hf "
                f"runs a transformers model that returns its whole logits: {fix}"]
    out = []
    if run.mesh.tp > 1:
        out.append(f"{key} with strategy={preset} (tensor parallel {run.mesh.tp}): its head is "
                   "column-parallel over the vocabulary and hands its logits to the parallel plan, "
                   f"which the chunked loss does not compute: {fix}, or a preset without tensor "
                   "parallelism")
    if run.mesh.pp > 1:
        out.append(f"{key} with strategy={preset} ({run.mesh.pp} pipeline stages): the last stage's "
                   f"loss runs inside the pipeline schedule on the whole logits: {fix}, or a preset "
                   "without a pipeline")
    return out


def wandb_online_problems(env: dict[str, str] | None = None, *, timeout: float = 3.0) -> list[str]:
    """What ``logger.mode=online`` needs before any rank starts (else wandb.init fails in every
    rank with a traceback, or waits on the network): credentials where wandb looks for them
    (WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, a netrc entry for the server), and the server
    reachable (a TCP connect, ``timeout`` seconds)."""
    import socket
    from urllib.parse import urlsplit

    env = os.environ if env is None else env
    base = env.get("WANDB_BASE_URL", "https://api.wandb.ai")
    url = urlsplit(base if "://" in base else f"https://{base}")
    host, port = url.hostname or "api.wandb.ai", url.port or (80 if url.scheme == "http" else 443)
    fix = "run `wandb login` (or set WANDB_API_KEY), or use logger.mode=offline and `wandb sync` later"
    if not (env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE") or _netrc_has(host, env)):
        return [f"logger.mode=online: no W&B credentials for {host} (no WANDB_API_KEY, no netrc "
                f"entry); {fix}"]
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return [f"logger.mode=online: cannot reach the W&B server {host}:{port} ({e}); "
                f"use logger.mode=offline and `wandb sync <run dir>/wandb` when online"]
    return []


def _netrc_has(host: str, env: dict[str, str]) -> bool:
    paths = [env["NETRC"]] if env.get("NETRC") else [os.path.expanduser(f"~/{n}") for n in (".netrc", "_netrc")]
    import netrc

    for path in paths:
        try:
            if netrc.netrc(path).authenticators(host):
                return True
        except (OSError, netrc.NetrcParseError):
            continue
    return False


def lora_problems(strategy: StrategyConfig, model: ModelConfig) -> list[str]:
    """LoRA (frozen base weights next to trainable adapters) on a preset whose engine keeps
    per-parameter requires_grad (``capabilities.lora``)."""
    if not model.lora.rank or strategy.capabilities.lora:
        return []
    able = ", ".join(n for n in names() if (c := load(n).capabilities).lora and not c.cuts_model)  # (model=hf)
    return [f"model.lora.rank={model.lora.rank} with strategy={strategy.name}: LoRA runs with "
            f"{able}; choose one of them, or model.lora.rank=0 for a full fine-tune"]
