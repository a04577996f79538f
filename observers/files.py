"""Atomic writes: a temp file in the same directory, then a rename, so a reader (or a resumed
run) never sees half a file and a failed run leaves nothing behind. The file gets the mode a
plain ``open`` would give it (0666 less the umask), not the temp file's private 0600: a report or
a converted model copied to a shared directory stays readable by the team."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _atomic(path: str | Path, write: Callable[[str], None]) -> None:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        if (named := named_error(e, path)) is e:
            raise
        raise named from e
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if not isinstance(e, OSError) or (named := named_error(e, path)) is e:
            raise
        raise named from e


def named_error(error: OSError, path: Path, doing: str = "writing") -> OSError:
    """A full disk (or quota) or a read-only one as one OSError with its errno, the file and the
    fix: the run's summary line (train.py) is this, where Python's says only "[Errno 28] No space
    left on device" (a write's error names no file). ``doing``: what wrote it ("logger=csv
    writing"). Any other OSError is left as it is."""
    import errno

    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free space there, or point hydra.run.dir at a disk with room"
    elif error.errno == errno.EROFS:
        fix = "point hydra.run.dir at a directory this user can write"
    else:
        return error
    return OSError(error.errno, f"{os.strerror(error.errno)}: {doing} {path}; {fix}")


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


def plain_modes(directory: str | Path) -> None:
    """Give every file under ``directory`` the mode a plain ``open`` would (a library that
    writes through its own temp files -- safetensors under transformers' save_pretrained --
    leaves them 0600)."""
    mode = 0o666 & ~_umask()
    for p in Path(directory).rglob("*"):
        if p.is_file():
            os.chmod(p, mode)


def atomic_write(path: str | Path, write: Callable[[str], None]) -> None:
    """``write(tmp)`` writes the file at a temporary name; it then replaces ``path`` at once."""
    _atomic(path, write)


def atomic_write_text(path: str | Path, text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    _atomic(path, write)


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    import torch

    _atomic(path, lambda tmp: torch.save(obj, tmp))
