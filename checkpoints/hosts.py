"""Run directories that are one per host, not one for the job: a multi-instance SageMaker job,
whose every host writes ``/opt/ml/checkpoints`` on its own disk; SageMaker uploads each host's
files to one S3 prefix, and a restarted job gets their union back on every host. The launcher
says so in the ranks' environment (``STRATAGEM_RUN_DIR_PER_HOST=1``: launchers/sagemaker.py puts
it in every host's command); elsewhere a run directory the ranks do not share is refused.

``layout`` (every rank, at start) finds which ranks share a directory: each writes a marker
there and lists the markers it sees. With per-host directories declared and found, a save is
committed per directory: every rank writes its files into its own directory; rank 0 writes the
config, the history and ``meta.json`` into its own; the lowest rank of each directory lists what
is there; rank 0 checks that the union holds every rank's files and hands every directory the one
manifest (``COMPLETE``, the union), which each writes before renaming its part. So every host's
part carries the same marker, and a union that lacks a host's upload fails ``store.read``: a
restarted run resumes from the newest checkpoint that reads whole (``store.latest_whole``).
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path
from typing import Any

PER_HOST = "STRATAGEM_RUN_DIR_PER_HOST"

_LEADERS: dict[str, frozenset[int]] = {}
"""run directory -> the lowest rank of each rank's directory (only where they are per host)."""


def declared() -> bool:
    """The launcher declared the run directory one per host (synced elsewhere)."""
    return os.environ.get(PER_HOST) == "1"


def leaders(run_dir: str | Path) -> frozenset[int] | None:
    """The ranks that commit a save in their directory; None: rank 0 alone (one directory)."""
    return _LEADERS.get(str(Path(run_dir).resolve()))


def layout(run_dir: Path, rank: int, world_size: int, share: Any) -> list[tuple[tuple[int, ...], str]]:
    """Every rank: (the ranks whose marker it sees in ``run_dir`` -- rank 0's alone unless the
    directories are declared per host -- its host name), per rank.
    ``share(value)`` is rank 0's value on every rank. Remembers the leaders where the directories
    are per host and declared so."""
    import torch.distributed as dist

    token = share(uuid.uuid4().hex if rank == 0 else None)
    # Undeclared, only rank 0's marker is asked about (one file, a stat per rank on a shared
    # filesystem); declared per host, every rank's (a host's local disk), to find the groups.
    writers = range(world_size) if declared() else (0,)
    run_dir.mkdir(parents=True, exist_ok=True)
    mine = run_dir / f".shared-{token}-{rank}"
    if rank in writers:
        mine.write_text(token)
    dist.barrier()
    here = tuple(r for r in writers if (run_dir / f".shared-{token}-{r}").is_file())
    seen: list[Any] = [None] * world_size
    dist.all_gather_object(seen, (here, socket.gethostname()))
    dist.barrier()
    mine.unlink(missing_ok=True)
    groups = {group for group, _ in seen}
    partition = sorted(r for group in groups for r in group) == list(range(world_size))
    if declared() and len(groups) > 1 and partition:
        _LEADERS[str(run_dir.resolve())] = frozenset(min(group) for group in groups)
    return seen


def union(files: dict[str, int] | None, rank: int, world_size: int) -> tuple[dict[str, int], list[int]]:
    """Every rank: the union of the leaders' listings (``files``; None elsewhere), and the ranks
    whose own file is in none of them."""
    import torch.distributed as dist

    from checkpoints.store import missing_ranks

    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, files)
    merged: dict[str, int] = {}
    for listing in gathered:
        merged.update(listing or {})
    return merged, missing_ranks(set(merged), world_size)
