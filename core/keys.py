"""State-dict keys as the plain model names them: the path pieces engines' wrappers insert
(FSDP1's flat-parameter wrapper, activation checkpointing's wrapper, torch.compile), removed.
DCP's ``get_state_dict`` removes them itself; a DeepSpeed checkpoint keeps its module's names, and
the export, the converter and a Hugging Face save read them through here. Standard library only.
"""

from __future__ import annotations

WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def plain_key(key: str) -> str:
    """A state-dict key as the plain model names it (wrappers' path pieces removed)."""
    for piece in WRAPPER_PREFIXES:
        key = key.replace(piece, "")
    return key
