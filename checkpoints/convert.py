"""A checkpoint -> a plain full state dict in safetensors, loadable without stratagem:

    model = GPT(shape); model.load_state_dict(safetensors.torch.load_file("model.safetensors"))

or, for ``model=hf``, a Hugging Face model directory (``to_hf``) that
``AutoModelForCausalLM.from_pretrained`` loads, LoRA adapters merged or saved beside it.

The parameters come out of the library that wrote them (DCP read whole, or DeepSpeed's
zero_to_fp32), fp32, keyed as the plain model. No process group is needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from checkpoints.state import full_model, verify
from checkpoints.store import full_out, read


def to_full(checkpoint: str | Path, out: str | Path | None = None) -> Path:
    """Write ``<checkpoint>.safetensors`` beside it (``full_out``; or ``out``); returns the path
    written."""
    from safetensors.torch import save_file

    from observers.files import atomic_write

    ckpt = read(checkpoint)
    verify(ckpt)
    state = full_model(ckpt)
    path = Path(out) if out is not None else full_out(ckpt.path)
    metadata = {"step": str(ckpt.step), "strategy": str(ckpt.meta.get("strategy")),
                "format": "pt"}
    atomic_write(path, lambda tmp: save_file(state, tmp, metadata=metadata))
    return path


def to_hf(checkpoint: str | Path, out: str | Path, *, merge_lora: bool = True,
          model_path: str | None = None) -> Path:
    """Write the checkpoint of a ``model=hf`` run as a Hugging Face model directory ``out``
    (config, safetensors, the source model's tokenizer files). ``merge_lora``: fold LoRA
    adapters into the base weights; false: the base model plus a peft adapter in
    ``out/adapter``. ``model_path``: where the run's ``model.path`` (its config.json and
    tokenizer) is now, when it moved."""
    from omegaconf import OmegaConf

    from checkpoints.store import CheckpointError
    from recipes.config import ModelConfig

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"--out {out} exists and is not an empty directory: choose a new "
                              "directory (an export never overwrites one)")
    ckpt = read(checkpoint)
    verify(ckpt)
    model = ckpt.meta.get("config", {}).get("model", {})
    if model.get("name") != "hf":
        raise CheckpointError(f"{ckpt.path}: a checkpoint of model={model.get('name')}; --to hf "
                              "converts model=hf runs (use --to full for the built-in models)")
    model = {**model, "path": model_path or model.get("path")}
    shape = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), model))
    from observers.files import plain_modes
    from recipes.hf import save_hf
    from recipes.hf_config import locate

    try:
        locate(shape.path)
    except ValueError as e:
        raise CheckpointError(f"{ckpt.path}: the run's model (its config.json and tokenizer files) is "
                              f"not there: {e}; or, if it moved, pass --model-path <its directory now>") from None

    path = save_hf(full_model(ckpt), shape, out, merge_lora=merge_lora)
    plain_modes(path)  # (safetensors' own temp file leaves the weights 0600)
    return path


def hf_step(trainer: Any, report: dict[str, Any]) -> int:
    """The step whose checkpoint ``trainer.save_hf`` exports: the best (``trainer.save_hf_from=
    best``, the report's ``best``), else the run's last (``trainer.max_steps``, or where an early
    stop ended it)."""
    best, stopped = report.get("best"), report.get("stopped") or {}
    if trainer.save_hf_from == "best" and best:
        return int(best["step"])
    return int(stopped["step"]) if stopped.get("reason") == "early_stopping" else trainer.max_steps


def final_hf(run_dir: str | Path, step: int) -> Path:
    """``trainer.save_hf``: the run's final checkpoint as ``<run_dir>/hf`` (rank 0, after the
    last save). A longer re-run replaces it whole: the new directory is written beside it and
    swapped in."""
    import shutil

    from checkpoints.store import path_for

    run_dir = Path(run_dir)
    dest, fresh, old = run_dir / "hf", run_dir / f".hf-step{step}", run_dir / ".hf-old"
    for p in (fresh, old):
        shutil.rmtree(p, ignore_errors=True)
    to_hf(path_for(run_dir, step), fresh)
    if dest.exists():
        dest.rename(old)
    fresh.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest
