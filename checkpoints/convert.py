"""A checkpoint -> a plain full state dict in safetensors, loadable without stratagem:

    model = GPT(shape); model.load_state_dict(safetensors.torch.load_file("model.safetensors"))

The parameters come out of the library that wrote them (DCP read whole, or DeepSpeed's
zero_to_fp32), fp32, keyed as the plain model. No process group is needed.
"""

from __future__ import annotations

from pathlib import Path

from checkpoints.state import full_model, verify
from checkpoints.store import read


def to_full(checkpoint: str | Path, out: str | Path | None = None) -> Path:
    """Write ``<checkpoint>/model.safetensors`` (or ``out``); returns the path written."""
    from safetensors.torch import save_file

    from observers.files import atomic_write

    ckpt = read(checkpoint)
    verify(ckpt)
    state = full_model(ckpt)
    path = Path(out) if out is not None else ckpt.path.parent / f"{ckpt.path.name}.safetensors"
    metadata = {"step": str(ckpt.step), "strategy": str(ckpt.meta.get("strategy")),
                "format": "pt"}
    atomic_write(path, lambda tmp: save_file(state, tmp, metadata=metadata))
    return path
