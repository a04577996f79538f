"""Names a package's modules register, read from their source without importing them: what
``@<decorator>("<name>"`` says at the start of a line (a top-level function or class). A config's
choices can then list a registry's names while the modules behind them (and what they import)
load only when chosen."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path


def package_folder(package: str) -> Path:
    """Where a top-level package's modules are, found and not imported."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"no package {package!r}")
    return Path(next(iter(spec.submodule_search_locations)))


def registered(folder: Path, decorator: str) -> dict[str, str]:
    """name -> module stem, for every ``@decorator("<name>"`` in ``folder/*.py``; a name
    registered twice is an error naming both modules."""
    found = re.compile(rf"""^@{re.escape(decorator)}\(\s*["']([^"']+)["']""", re.MULTILINE)
    out: dict[str, str] = {}
    for path in sorted(folder.glob("*.py")):
        for name in found.findall(path.read_text()):
            if name in out:
                raise ValueError(f"{decorator} {name!r} is registered by both {folder.name}/{out[name]}.py "
                                 f"and {folder.name}/{path.name}")
            out[name] = path.stem
    return out
