"""What an offline W&B run recorded, read from its ``run-<id>.wandb`` file: the LevelDB log
framing W&B writes its ``Record`` protobufs in (32 KiB blocks, each record a 7-byte header --
crc32, length, type: full, first, middle, last), parsed with W&B's own protobuf classes. wandb
0.31 has no Python reader of its own (its Go core reads and writes the file)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Iterator

BLOCK = 32768
HEADER = 7


def _records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, pending = 7, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # (a block's tail too short for a header is padding)
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
            pending = b""


def run_file(run_dir: Path) -> Path:
    """The ``.wandb`` file of one ``offline-run-*`` directory."""
    (found,) = run_dir.glob("run-*.wandb")
    return found


def history(run_dir: Path) -> list[dict[str, Any]]:
    """Every history row the run logged, in order: ``{"_step": n, key: value, ...}`` (values as
    W&B's JSON, a table as its reference)."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for chunk in _records(run_file(run_dir)):
        record = pb.Record()
        record.ParseFromString(chunk)
        if record.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def run_record(run_dir: Path) -> Any:
    """The run's ``RunRecord`` (its id, display name, group, config)."""
    from wandb.proto import wandb_internal_pb2 as pb

    for chunk in _records(run_file(run_dir)):
        record = pb.Record()
        record.ParseFromString(chunk)
        if record.WhichOneof("record_type") == "run":
            return record.run
    raise AssertionError(f"no run record in {run_file(run_dir)}")
