"""Where ``conf/`` is: the one place that locates it (presets, schemas, the command line and the
backends' YAML all read it through ``CONF_DIR``); where our caches are (``cache_dir``); and the
helpers that turn its Hydra/OmegaConf containers into the plain dicts the engines take
(``plain``, ``merge``, ``has``).

In a checkout (and an editable install) it is the ``conf/`` beside the packages; a regular
install ships the same files as the package data ``stratagem_conf`` (pyproject.toml maps it).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any


def _locate() -> Path:
    beside = Path(__file__).resolve().parents[1] / "conf"
    if (beside / "train.yaml").is_file():
        return beside
    spec = importlib.util.find_spec("stratagem_conf")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    raise FileNotFoundError("conf/ not found beside the packages nor installed as stratagem_conf: "
                            "install the project (pip install -e . from the checkout)")


CONF_DIR = _locate()


def cache_dir(name: str) -> Path:
    """Our cache ``name`` (``machine``: the calibrations, ``tokens``: tokenized data):
    ``$XDG_CACHE_HOME/stratagem/<name>``, ``~/.cache`` where it is unset -- the rule torch's and
    Hugging Face's caches follow, so a cluster that moves caches off a small home moves ours too."""
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "stratagem" / name


def plain(node: Any) -> Any:
    """Hydra/OmegaConf containers -> plain dicts/lists (DeepSpeed and Lightning mutate and JSON them)."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(node):
        return OmegaConf.to_container(node, resolve=True)
    if isinstance(node, dict):
        return {str(k): plain(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [plain(v) for v in node]
    return node


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Deep merge: mappings merge key by key, anything else in ``over`` replaces ``base``."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out


def has(cfg: Any, dotted: str) -> bool:
    """Whether the dotted key is set in a (Hydra/OmegaConf or plain) mapping."""
    node = plain(cfg)
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True
