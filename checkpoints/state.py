"""What a checkpoint holds and how it is written and read back, for any engine.

The model and optimizer are written by the library that shards them -- torch's distributed
checkpoint (DCP) for single, DDP, FSDP1 and FSDP2; DeepSpeed's own ``save_checkpoint`` for ZeRO --
from the objects the backend hands over (``Handles``). Everything else is engine-neutral and the
same for every backend: the step (which is also the data position: ``GlobalBatchSampler``
resumes the sample stream at it), the LR scheduler, each rank's RNG states and the resolved
config.

Keys are the plain model's (``Handles.prefix``, where the backend keeps the plain model, is
removed on save and added on load), so a checkpoint is not tied to a backend. Loading picks the
most faithful path the two sides allow:

- DCP -> any torch strategy, any world size: ``dcp.load`` into the engine's own state dict
  (``torch.distributed.checkpoint.state_dict.get_state_dict`` / ``set_state_dict``); DCP
  reshards. Model and optimizer come back.
- DeepSpeed -> DeepSpeed on the same world size, keys and precision: the engine's ``load_checkpoint``.
- zero_ep (DeepSpeed's ZeRO-2 with the experts split, zero2_ep: its ``save_checkpoint`` keys a MoE
  layer's experts only as its own MoE layer names them) -> zero2_ep on the same world size: each
  rank's module (its own experts, plain keys) and ZeRO optimizer state, written and read through
  the engine's ``state_dict`` / ``load_state_dict``; ``model.pt`` beside them holds the full
  model (experts gathered over the ep group), for convert.py and the other presets.
- anything else (ZeRO -> FSDP/DDP/single, DCP -> ZeRO, or another world size, backend or precision
  under ZeRO): the full fp32 parameters (DeepSpeed's ``zero_to_fp32``, or DCP read whole) loaded into
  the engine -- a DeepSpeed engine's module set (under ZeRO-3 gathered and partitioned again)
  and its fp32 masters refreshed from it; the optimizer starts fresh, and the log says so.
"""

from __future__ import annotations

import logging
import pickle
import random
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from checkpoints import resume_settings
from checkpoints.store import RANK_STATE, Checkpoint, CheckpointError
from core.keys import plain_key

log = logging.getLogger(__name__)


@contextmanager
def _dcp_quietly() -> Iterator[None]:
    """DCP without a process group (one process, or convert.py) is what we mean: its warning
    that it assumes a single process says nothing a user must act on. Scoped to our DCP calls."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")
        yield

# DeepSpeed's zero_to_fp32 tells its progress with print() and tqdm bars (no logger, no switch):
# each piece of output that starts so is dropped; anything else it prints or warns passes.
ZERO_TO_FP32_CHATTER = (
    r"\r?(Processing zero checkpoint |Parsing checkpoint created by deepspeed==|Detected checkpoint "
    r"of type zero stage |Reconstructed (Frozen |Trainable )?fp32 state dict with |(Loading checkpoint "
    r"shards|Gathering sharded weights): |\r$)")


@contextmanager
def _zero_to_fp32_quietly() -> Iterator[None]:
    """DeepSpeed's conversion of a ZeRO checkpoint to full parameters (``full_model``: save_hf,
    export, resuming on another layout) without its progress lines, which say nothing a user acts
    on: this process's stdout and stderr are held around the call and written back without them."""
    import io
    import re
    import sys
    from contextlib import redirect_stderr, redirect_stdout

    chatter = re.compile(ZERO_TO_FP32_CHATTER)
    held = {"stdout": io.StringIO(), "stderr": io.StringIO()}
    try:
        with redirect_stdout(held["stdout"]), redirect_stderr(held["stderr"]):
            yield
    finally:
        for name, text in held.items():
            pieces = re.split(r"(?<=[\n\r])", text.getvalue())
            getattr(sys, name).write("".join(x for x in pieces if x and not chatter.match(x)))


DCP, DEEPSPEED, ZERO_EP = "dcp", "deepspeed", "zero_ep"
TAG = "state"  # DeepSpeed's tag (sub-directory) inside <checkpoint>/deepspeed


@dataclass
class Handles:
    """What a backend hands the checkpoint code: its engine's objects, and where the plain model
    sits among the model's parameter names."""

    model: Any
    """The model as the engine wrapped it (DDP, FSDP, a DeepSpeedEngine, or the module itself)."""
    optimizer: Any
    """The torch optimizer (under DeepSpeed: unused, the engine saves its own)."""
    scheduler: Any
    rank: int
    world_size: int
    format: str = DCP
    """How the engine writes model and optimizer (the run's ``checkpoint``): dcp | deepspeed."""
    prefix: str = ""
    """The plain model's name prefix in ``model`` ("model." under Lightning)."""
    full_model: Any = None
    """zero_ep: a callable returning the full model on every rank, keyed as the plain model
    (the strategy's ``full_state_dict``: the experts gathered over the ep group, collectively)."""
    rank_state: Any = None
    """What each rank holds beyond model and optimizer (``state_dict`` / ``load_state_dict``;
    backends/common/ddp_comm.py's ``RankState`` for the compressing and relaxed ddp presets),
    written as ``rank_state/rank<r>.pt``; None: nothing."""


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


# ------------------------------------------------------------------ save
def save(h: Handles, temp: Path) -> None:
    """Every rank: write this rank's part of the model, optimizer and RNG into ``temp``."""
    temp.mkdir(parents=True, exist_ok=True)
    if h.format == DEEPSPEED:
        # DeepSpeed writes its own layout (model states + one optimizer shard per rank).
        h.model.save_checkpoint(str(temp / DEEPSPEED), tag=TAG, client_state={}, save_latest=False)
    elif h.format == ZERO_EP:
        _save_zero_ep(h, temp / ZERO_EP)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(h.model, h.optimizer, options=_options())
        # A tensor every rank holds is written by one: by default the rank with the least to
        # write so far, tensor by tensor. Under local_sgd and diloco the replicas differ between
        # averagings, and the checkpoint was a mix of them; rank 0 writes every such tensor there,
        # so the checkpoint holds rank 0's replica and its optimizer state, the model its
        # validation scored (backends/common/replica.py).
        planner = dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=getattr(h.rank_state, "replicas_differ", False))
        with _dcp_quietly():
            dcp.save({"model": _strip(model_sd, h.prefix), "optim": _strip_optim(optim_sd, h.prefix)},
                     checkpoint_id=str(temp / DCP), planner=planner)
    (temp / "rng").mkdir(exist_ok=True)
    torch.save(rng_state(), temp / "rng" / f"rank{h.rank}.pt")
    if h.rank_state is not None:
        (temp / RANK_STATE).mkdir(exist_ok=True)
        torch.save(h.rank_state.state_dict(), temp / RANK_STATE / f"rank{h.rank}.pt")
    _barrier()


def _save_zero_ep(h: Handles, d: Path) -> None:
    """Each rank: its module (own experts) and the ZeRO optimizer's state; rank 0 also the full
    model, the experts gathered over the ep group (collective)."""
    if h.full_model is None:
        raise CheckpointError("a zero_ep checkpoint needs the backend's full_model (the experts "
                              "gathered), which it did not hand over")
    d.mkdir(exist_ok=True)
    local = {k: v.detach().cpu() for k, v in _strip(h.model.module.state_dict(), h.prefix).items()}
    torch.save({"module": local, "optim": h.model.optimizer.state_dict()}, d / f"rank{h.rank}.pt")
    full = h.full_model()
    if h.rank == 0:
        torch.save({k: v.float() for k, v in full.items()}, d / "model.pt")


def _load_zero_ep(h: Handles, d: Path) -> None:
    """Each rank: its module, then ZeRO's optimizer from every rank's state (as the engine's
    ``load_checkpoint`` hands it: one per data-parallel rank), fp32 masters included."""
    _check_pickles(d)
    with torch.serialization.safe_globals(_deepspeed_safe_globals()):
        parts = [torch.load(d / f"rank{r}.pt", map_location="cpu", weights_only=True)
                 for r in range(h.world_size)]
    h.model.module.load_state_dict(_add(parts[h.rank]["module"], h.prefix), strict=True)
    h.model.optimizer.load_state_dict([p["optim"] for p in parts], load_optimizer_states=True,
                                      load_from_fp32_weights=True)


def scheduler_state(h: Handles) -> dict[str, Any]:
    return h.scheduler.state_dict() if h.scheduler is not None else {}


# ------------------------------------------------------------------ load
def load(h: Handles, ckpt: Checkpoint) -> None:
    """Every rank: restore model, optimizer, scheduler and this rank's RNG from ``ckpt``. (Which
    branch loads the optimizer is told before launch by resume_settings.py ``model_only``.)"""
    meta, path = ckpt.meta, ckpt.path
    saved = meta["payload"]
    same_world = int(meta["world_size"]) == h.world_size
    settings = resume_settings.of(h.optimizer)  # (this run's config: what the loaded groups carry is the old run's)
    if saved == DCP and h.format == DCP:
        _load_dcp(h, path)
        how = "model and optimizer (DCP" + (")" if same_world else
                                            f", resharded from {meta['world_size']} ranks)")
    elif (saved == DEEPSPEED and h.format == DEEPSPEED and same_world and meta["prefix"] == h.prefix
          and _zero3_files(path) == (h.model.zero_optimization_stage() >= 3)  # (ZeRO-3's own layout)
          and _same_precision(meta, h.model)):
        _check_pickles(path / DEEPSPEED)
        done, _ = h.model.load_checkpoint(str(path / DEEPSPEED), tag=TAG, load_optimizer_states=True,
                                          load_lr_scheduler_states=False, load_module_strict=True)
        if done is None:
            raise CheckpointError(f"DeepSpeed could not load {path / DEEPSPEED / TAG}")
        how = "model and optimizer (DeepSpeed)"
    elif saved == ZERO_EP and h.format == ZERO_EP and same_world and meta["prefix"] == h.prefix:
        _load_zero_ep(h, path / ZERO_EP)
        how = "model and optimizer (DeepSpeed ZeRO-2, experts split)"
    else:
        _load_full_model(h, full_model(ckpt))
        how = (f"model only, from a {saved} checkpoint of {meta['strategy']} on {meta['world_size']} "
               "rank(s); the optimizer state does not carry over and starts fresh")
    changed = resume_settings.govern(h.optimizer, settings)
    if h.scheduler is not None and meta.get("scheduler"):
        changed += resume_settings.continue_schedule(h.scheduler, h.optimizer, meta["scheduler"])
    if changed and h.rank == 0:
        log.warning("resume: this run's trainer settings govern, not the checkpoint's run's: %s",
                    "; ".join(changed))
    own = path / RANK_STATE / f"rank{h.rank}.pt"  # (a checkpoint of this preset and world:
    if h.rank_state is not None and own.is_file():  # checkpoints.refusal said so before launch)
        h.rank_state.load_state_dict(_torch_load(own))
        how += ", and this rank's own state (its preset's)"
    rng = path / "rng" / f"rank{h.rank}.pt"
    if rng.is_file():
        set_rng_state(_torch_load(rng))
    _barrier()
    if h.rank == 0:
        log.info("resumed from %s at step %d: %s", path, ckpt.step, how)


def _load_dcp(h: Handles, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    _check_dcp_metadata(path / DCP)
    model_sd, optim_sd = get_state_dict(h.model, h.optimizer, options=_options())
    state = {"model": _strip(model_sd, h.prefix), "optim": _strip_optim(optim_sd, h.prefix)}
    try:
        with _dcp_quietly():
            dcp.load(state, checkpoint_id=str(path / DCP))
    except Exception as e:  # noqa: BLE001  (DCP reports a missing key or a bad file in its own words)
        raise CheckpointError(f"cannot load {path / DCP}: {_first_line(e)}") from e
    set_state_dict(h.model, h.optimizer, model_state_dict=_add(state["model"], h.prefix),
                   optim_state_dict=_add_optim(state["optim"], h.prefix), options=_options())


def _same_precision(meta: dict[str, Any], engine: Any) -> bool:
    """The checkpoint's run had the precision ``engine`` runs (DeepSpeed's bf16 or fp16 section, or
    neither): its ZeRO optimizer state is per precision -- bf16's files are
    ``bf16_zero_pp_rank_*``, which another engine's loader does not find (FileNotFoundError on
    every rank), fp16's carry its loss scaler."""
    was = ((meta.get("config") or {}).get("trainer") or {}).get("precision", "32")
    runs = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else None
    return resume_settings.deepspeed_precision(was) == runs


def _zero3_files(path: Path) -> bool:
    """A DeepSpeed checkpoint in ZeRO-3's layout (each rank's ``zero_pp_rank_*_model_states``;
    ZeRO-1/2 write one ``mp_rank_00_model_states``): DeepSpeed's loader reads only its own."""
    return any((path / DEEPSPEED / TAG).glob("zero_pp_rank_*_model_states.pt"))


def full_model(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """The full parameters of a checkpoint, fp32 on CPU, keyed as the plain model: DCP read whole,
    or DeepSpeed's zero_to_fp32. Needs no process group (convert.py); under one, every rank reads."""
    path, meta = ckpt.path, ckpt.meta
    if meta["payload"] == DCP:
        import torch.distributed.checkpoint.state_dict_loader as loader

        read_keys = dcp_key_reader(loader)
        _check_dcp_metadata(path / DCP)
        try:
            with _dcp_quietly():
                sd = read_keys({"model"}, checkpoint_id=str(path / DCP))["model"]
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"cannot read {path / DCP}: {_first_line(e)}") from e
    elif meta["payload"] == ZERO_EP:
        sd = _torch_load(path / ZERO_EP / "model.pt")
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        _check_pickles(path / DEEPSPEED)
        with _zero_to_fp32_quietly():
            sd = get_fp32_state_dict_from_zero_checkpoint(str(path / DEEPSPEED), tag=TAG)
        sd |= _zero1_frozen(path / DEEPSPEED / TAG, sd)
        # (DeepSpeed saves its module's own names: activation checkpointing's wrapper in them)
        sd = _strip({plain_key(k): v for k, v in sd.items()}, meta["prefix"])
    return {k: v.detach().float().cpu().contiguous() for k, v in sd.items()}


def dcp_key_reader(loader: Any) -> Any:
    """torch's private ``_load_state_dict_from_keys`` of ``loader`` (DCP's state_dict_loader): a
    DCP checkpoint's model read whole, without a model to load into. A torch without it is a
    ``CheckpointError`` naming it, not an ImportError."""
    from core.internals import PROVEN, require

    found = require(loader, ["_load_state_dict_from_keys"], error=CheckpointError,
                    feature="reading a DCP checkpoint's full model (convert.py --to full, a resume that "
                            "takes the model only)",
                    where="torch.distributed.checkpoint.state_dict_loader",
                    fix=f"read it with torch {PROVEN} (the versions CI runs)")
    return found._load_state_dict_from_keys


def _zero1_frozen(state_dir: Path, have: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The frozen parameters (LoRA's base weights) of a ZeRO-1 checkpoint. DeepSpeed records
    frozen parameters for zero_to_fp32 only when it partitions gradients (stage 2 and 3), so at
    stage 1 the conversion returns the trained ones alone; their only copy is the module state
    the engine saves whole. (Frozen means never updated: that copy is exact, in the module's
    dtype.)"""
    files = sorted(state_dir.glob("mp_rank_*_model_states.pt"))
    if not files:
        return {}
    with torch.serialization.safe_globals(_deepspeed_safe_globals()):
        module = torch.load(files[0], map_location="cpu", weights_only=True, mmap=True).get("module") or {}
    return {k: v for k, v in module.items() if k not in have and v.numel() > 0}


def _load_full_model(h: Handles, full: dict[str, torch.Tensor]) -> None:
    if h.format == DEEPSPEED:
        return _load_into_deepspeed(h.model, _add(full, h.prefix))
    if h.format != DCP:
        raise CheckpointError(
            "resuming strategy=zero2_ep from a checkpoint of another strategy, world size or backend "
            "is not supported (each rank's experts would not follow); resume with the preset and "
            "world size that wrote it, or with a torch strategy (single, ddp, fsdp, fsdp2)")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(h.model, _add(full, h.prefix),
                         options=StateDictOptions(full_state_dict=True, strict=True))


def _load_into_deepspeed(engine: Any, full: dict[str, torch.Tensor]) -> None:
    """Every parameter and buffer of ``full`` (the plain model's keys plus the backend's prefix)
    into a DeepSpeed engine's module -- under ZeRO-3 each gathered, set, and partitioned again
    (``GatheredParameters``) -- then the optimizer's fp32 masters from them
    (``refresh_fp32_params``): the engine steps on the loaded weights with a fresh optimizer."""
    import deepspeed

    module = engine.module
    params = {plain_key(n): t for n, t in module.named_parameters()}
    buffers = {plain_key(n): t for n, t in module.named_buffers() if plain_key(n) in full}
    differ = sorted(set(params) ^ (set(full) - set(buffers)))
    if differ:
        raise CheckpointError(f"the checkpoint's parameters are not the model's: {', '.join(differ[:5])}")
    stage3 = engine.zero_optimization_stage() == 3
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0, enabled=stage3), \
            torch.no_grad():
        for key, t in (params | buffers).items():
            t.copy_(full[key].to(t.device, t.dtype))
    engine.optimizer.refresh_fp32_params()


# ------------------------------------------------------------------ keys
def _strip(sd: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


def _add(sd: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {prefix + k: v for k, v in sd.items()}


def _options() -> Any:
    """Optimizer state flattened to one key per parameter name and value
    (``state.<name>.exp_avg``, ``param_groups.<name>.lr``): ranks that hold different parameters
    (pipeline stages) write disjoint keys, where the nested form's per-rank ``param_groups``
    lists would collide in DCP."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _strip_optim(osd: dict[str, Any], prefix: str) -> dict[str, Any]:
    out = {}
    for k, v in osd.items():  # "<state|param_groups>.<prefix><name>.<key>"
        head, rest = k.split(".", 1)
        if rest.startswith(prefix):
            out[f"{head}.{rest[len(prefix):]}"] = v
    return out


def _add_optim(osd: dict[str, Any], prefix: str) -> dict[str, Any]:
    out = {}
    for k, v in osd.items():
        head, rest = k.split(".", 1)
        out[f"{head}.{prefix}{rest}"] = v
    return out


# ------------------------------------------------------------------ RNG
def rng_state() -> dict[str, Any]:
    import numpy as np

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    py = random.getstate()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python": [py[0], list(py[1]), py[2]],
            "numpy": [kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]}


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))


# ------------------------------------------------------------------ untrusted files
def verify(ckpt: Checkpoint) -> None:
    """Read every file of ``ckpt`` the way loading will, safely, without loading it into an
    engine: a truncated or garbage file raises ``CheckpointError`` naming it."""
    if ckpt.meta["payload"] == DCP:
        _check_dcp_metadata(ckpt.path / DCP)
    else:
        _check_pickles(ckpt.path / ckpt.meta["payload"])
    for f in sorted([*(ckpt.path / "rng").glob("*.pt"), *(ckpt.path / RANK_STATE).glob("*.pt")]):
        _torch_load(f)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def _torch_load(path: Path) -> Any:
    """``torch.load`` with safe deserialization: tensors and plain data only."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path} is not a readable checkpoint file ({_first_line(e)})") from None


class _MetadataUnpickler(pickle.Unpickler):
    """DCP reads its ``.metadata`` with plain pickle; this reads it first, allowing only DCP's own
    metadata classes, torch sizes and dtypes, and builtins."""

    ALLOWED = ("torch.distributed.checkpoint.", "torch.distributed._shard.", "collections")
    NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
             ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("builtins", "set"),
             ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex")}

    def find_class(self, module: str, name: str) -> Any:
        if (module.startswith(self.ALLOWED) or (module, name) in self.NAMES
                or (module == "torch" and isinstance(getattr(torch, name, None),
                                                     (torch.dtype, torch.memory_format, torch.layout)))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def _check_dcp_metadata(dcp_dir: Path) -> None:
    """DCP's metadata, read safely; every storage range inside the files it names."""
    meta_file = dcp_dir / ".metadata"
    try:
        with open(meta_file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{meta_file} is not DCP metadata ({_first_line(e)})") from None
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        f = dcp_dir / info.relative_path
        if not f.is_file() or f.stat().st_size < info.offset + info.length:
            raise CheckpointError(f"{f} is truncated: the metadata places data up to byte "
                                  f"{info.offset + info.length}")


def _check_pickles(ds_dir: Path) -> None:
    """DeepSpeed loads its files with full pickle (``weights_only=False``); read each first
    with torch's safe loader, allowing the few DeepSpeed and Python types its files contain."""
    allowed = _deepspeed_safe_globals()
    for f in sorted(ds_dir.rglob("*.pt")):
        try:
            with torch.serialization.safe_globals(allowed):
                torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{f} is not a readable DeepSpeed checkpoint file "
                                  f"({_first_line(e)})") from None


def _deepspeed_safe_globals() -> list[Any]:
    import argparse
    import collections

    out: list[Any] = [argparse.Namespace, collections.OrderedDict, set]
    try:
        from deepspeed.runtime.fp16.loss_scaler import LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        out += [ZeroStageEnum, LossScaler, fragment_address]
    except ImportError:
        pass
    return out
