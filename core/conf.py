"""Where ``conf/`` is: the one place that locates it (presets, schemas, the command line and the
backends' YAML all read it through ``CONF_DIR``).

In a checkout (and an editable install) it is the ``conf/`` beside the packages; a regular
install ships the same files as the package data ``stratagem_conf`` (pyproject.toml maps it).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


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
