"""Where checkpoints live and when one counts: naming, atomic commit, discovery, pruning and the
integrity check. Engine-free and torch-free (plan-time code may import it).

A run directory holds ``checkpoints/step<N>/``. A save writes everything under
``checkpoints/.tmp-step<N>/``; once every rank has written its part, rank 0 writes
``COMPLETE`` (the manifest: every file with its size) and renames the directory to
``step<N>``. So a directory named ``step<N>`` is complete by construction, and a kill during a
save leaves only a ``.tmp-`` directory, which discovery ignores and ``clean`` removes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from observers.files import atomic_write_text

DIRNAME = "checkpoints"
MARKER = "COMPLETE"
META = "meta.json"
HISTORY = "history.json"
RANK_STATE = "rank_state"  # <checkpoint>/rank_state/rank<r>.pt: Handles.rank_state's (checkpoints/state.py)
TMP = ".tmp-"
_STEP = re.compile(r"step(\d+)")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, with the file and the reason."""


def directory(run_dir: str | Path) -> Path:
    return Path(run_dir) / DIRNAME


def path_for(run_dir: str | Path, step: int) -> Path:
    return directory(run_dir) / f"step{step}"


def temp_for(run_dir: str | Path, step: int) -> Path:
    return directory(run_dir) / f"{TMP}step{step}"


def complete(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    return _complete_in(directory(run_dir))


def full_out(checkpoint: str | Path) -> Path:
    """Where ``convert.py --to full`` writes without ``--out``: ``<checkpoint>.safetensors``
    beside the checkpoint directory."""
    ckpt = Path(checkpoint)
    return ckpt.parent / f"{ckpt.name}.safetensors"


def _complete_in(root: Path) -> list[Path]:
    """The complete ``step<N>`` checkpoints directly in ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP.fullmatch(p.name)) and (p / MARKER).is_file()]
    return [p for _, p in sorted(found)]


def latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run (``trainer.resume_from=auto``), or None."""
    found = complete(run_dir)
    return found[-1] if found else None


def clean(run_dir: str | Path) -> list[Path]:
    """Remove what interrupted saves left (``.tmp-`` directories, and any ``step<N>`` without its
    marker, which no version of this code writes); returns what was removed."""
    root = directory(run_dir)
    if not root.is_dir():
        return []
    gone = [p for p in root.iterdir() if p.is_dir() and (
        p.name.startswith(TMP) or (_STEP.fullmatch(p.name) and not (p / MARKER).is_file()))]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def commit(temp: Path, final: Path, meta: dict[str, Any]) -> None:
    """Rank 0, after every rank has written its part into ``temp``: write the manifest, then
    rename ``temp`` to ``final``. A crash before the rename leaves ``final`` absent."""
    write_meta(temp, meta)
    finish(temp, final, manifest(listing(temp)))


def write_meta(temp: Path, meta: dict[str, Any]) -> None:
    atomic_write_text(temp / META, json.dumps(meta, indent=1, sort_keys=True))


def listing(temp: Path) -> dict[str, int]:
    """Every file under ``temp`` (relative name -> size)."""
    return {str(p.relative_to(temp)): p.stat().st_size for p in sorted(temp.rglob("*")) if p.is_file()}


def manifest(files: dict[str, int]) -> str:
    """The marker's text for ``files``."""
    return json.dumps({"files": dict(sorted(files.items()))}, indent=1)


def finish(temp: Path, final: Path, marker: str) -> None:
    """Write the marker ``temp`` is complete by, then rename it to ``final``."""
    atomic_write_text(temp / MARKER, marker)
    _fsync_dir(temp)
    if final.exists():  # a re-run of the same step (resumed before it): the new save wins
        shutil.rmtree(final)
    os.replace(temp, final)
    _fsync_dir(final.parent)


def latest_whole(run_dir: str | Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that reads whole (``read``), and why each newer one did not: where
    a run directory is one per host and a sync assembles their union (SageMaker's checkpoint
    upload), the newest may lack a host's files that never reached the store."""
    skipped = []
    for path in reversed(complete(run_dir)):
        try:
            read(path)
            return path, skipped
        except CheckpointError as e:
            skipped.append(str(e))
    return None, skipped


def prune(run_dir: str | Path, keep_last: int, spare: Iterable[int | None] = ()) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints (0 keeps all), and never those
    of the steps in ``spare`` (the one just saved or resumed; trainer.keep_best's, kept beside the
    rotation)."""
    if keep_last <= 0:
        return []
    kept = {f"step{s}" for s in spare if s is not None}
    old = [p for p in complete(run_dir)[:-keep_last] if p.name not in kept]
    for p in old:
        # Rename first: a kill mid-delete leaves a .tmp- directory, never a half step<N>.
        doomed = p.with_name(f"{TMP}pruned-{p.name}")
        os.replace(p, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return old


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint as read back: its directory and what ``meta.json`` says."""

    path: Path
    meta: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    def history(self) -> dict[str, Any]:
        """The run's record up to this step (``history.json``: the losses, validations, ... the
        observers carry across a resume); empty for a checkpoint written without one."""
        f = self.path / HISTORY
        return json.loads(f.read_text()) if f.is_file() else {}


def read(path: str | Path) -> Checkpoint:
    """Open a checkpoint directory and check that it is whole: the marker, every file of the
    manifest present with its recorded size, ``meta.json`` readable. Raises ``CheckpointError``
    naming the file."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint directory (a checkpoint is a "
                              f"directory written by trainer.checkpoint_every, named step<N>)")
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointError(_not_one(path))
    try:
        files = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{marker} is corrupt ({e})") from None
    for rel, size in files.items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"{f} is missing from checkpoint {path}")
        have = f.stat().st_size
        if have != size:
            raise CheckpointError(f"{f} is truncated or altered: {have} bytes, the save wrote {size}")
    try:
        meta = json.loads((path / META).read_text())
        int(meta["step"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path / META} is corrupt ({e})") from None
    absent = missing_ranks(set(files), int(meta["world_size"])) if "world_size" in meta else []
    if absent:
        raise CheckpointError(f"{path} lacks the files of rank(s) {', '.join(map(str, absent))} of "
                              f"{meta.get('world_size')} (rng/rank<r>.pt): they were written into "
                              "another directory, not shared with rank 0's; resume from a "
                              "checkpoint every rank wrote")
    return Checkpoint(path, meta)


def _not_one(path: Path) -> str:
    """Why ``path``, a directory without the marker, is not a checkpoint: a run directory or its
    checkpoints folder (named as one) names the newest checkpoint in it, or says it holds none."""
    if directory(path).is_dir():
        folder, what = directory(path), "a run directory"
    elif path.name == DIRNAME or any(_STEP.fullmatch(p.name) or p.name.startswith(f"{TMP}step")
                                     for p in path.iterdir()):
        folder, what = path, "a run's checkpoints folder"
    elif (tool := _lightnings(path)) is not None:
        return (f"{path} is a checkpoint a Lightning Trainer wrote (your own script's: ModelCheckpoint or "
                f"trainer.save_checkpoint), not one of a train.py run, which convert.py reads; its full "
                f"weights: {tool}")
    else:
        return (f"{path} has no {MARKER} marker: the save did not finish (or this is not a stratagem "
                "checkpoint); use an older checkpoint")
    found = _complete_in(folder)
    if found:
        return (f"{path} is {what}, not one of its checkpoints: name one, {found[-1]} (the newest), "
                f"or another {folder}/step<N>")
    return (f"{path} holds no complete checkpoint ({what}; an interrupted save leaves only "
            f"{TMP}step<N>, which does not count): name a complete one, <run>/{DIRNAME}/step<N>")


def _lightnings(path: Path) -> str | None:
    """How to get the full weights out of ``path`` when a user's Lightning Trainer wrote it under
    a preset (README's Lightning users' paragraph): torch DCP shards (fsdp, fsdp2) or a DeepSpeed
    directory (ZeRO); None when it is neither."""
    if (path / "meta.pt").is_file() and any(path.glob("*.distcp")):
        return ("torch.distributed.checkpoint.format_utils.dcp_to_torch_save(path, 'model.pt') (one "
                "torch.save file; your module's weights under 'state_dict' or 'model')")
    if (path / "latest").is_file() and (path / "checkpoint").is_dir():
        return ("lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict(path, "
                "'model.pt')")
    return None


def missing_ranks(files: set[str], world_size: int) -> list[int]:
    """Ranks whose own file (``rng/rank<r>.pt``, every rank writes one) is not among ``files``."""
    return [r for r in range(world_size) if f"rng/rank{r}.pt" not in files]
