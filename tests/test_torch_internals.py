"""Where we lean on torch's internals (docs/ARCHITECTURE.md's table): each probe asks the running
torch, and a torch without the private name gets one clear message naming the feature, the name,
the torch version and the fix (or, where the feature can degrade, one warning and an unknown
value, never a wrong one). The missing name is simulated by handing the probe a stand-in object,
or by ``monkeypatch.delattr`` on torch's attribute; each probe also passes on the real torch (CI
runs this file on both torch legs)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.unit

VERSION = f"torch {torch.__version__}"


class _Bare:
    """A stand-in for a torch module or class that has none of the names asked."""


# --------------------------------------------------------------------- checkpoints/state.py
def test_a_dcp_loader_without_its_key_reader_is_a_checkpoint_error(monkeypatch, tmp_path):
    import torch.distributed.checkpoint.state_dict_loader as loader

    from checkpoints.state import dcp_key_reader, full_model
    from checkpoints.store import Checkpoint, CheckpointError

    assert dcp_key_reader(loader) is loader._load_state_dict_from_keys
    with pytest.raises(CheckpointError) as e:
        dcp_key_reader(_Bare())
    assert "state_dict_loader._load_state_dict_from_keys" in str(e.value) and VERSION in str(e.value)
    assert "convert.py --to full" in str(e.value) and "2.11 to 2.13" in str(e.value)
    # full_model (convert.py, a model-only resume): the same error, not an ImportError
    monkeypatch.delattr(loader, "_load_state_dict_from_keys")
    with pytest.raises(CheckpointError, match="_load_state_dict_from_keys"):
        full_model(Checkpoint(Path(tmp_path), {"payload": "dcp", "prefix": ""}))


# --------------------------------------------------------------------- backends/common/ddp_comm.py
def test_ddp_int8_asks_for_its_quantization_kernels_when_the_hook_is_made(monkeypatch):
    from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks

    from backends.common.ddp_comm import comm_hook, int8_hook, int8_kernels
    from core.internals import TorchLacks
    from strategies.families.ddp import DDPConfig

    assert int8_kernels() is quantization_hooks
    with pytest.raises(TorchLacks) as e:
        int8_kernels(_Bare())
    text = str(e.value)
    assert "strategy.comm_hook=int8" in text and VERSION in text and "comm_hook=topk" in text
    assert "quantization_hooks._quantize_per_tensor_backend" in text and "_dequantize_per_tensor_backend" in text
    preset = DDPConfig(comm_hook="int8")
    assert comm_hook(preset)[0] is int8_hook
    # at setup (the hook made), not after start_step steps at the first compressed bucket
    monkeypatch.delattr(quantization_hooks, "_quantize_per_tensor_backend")
    with pytest.raises(TorchLacks, match="_quantize_per_tensor_backend"):
        comm_hook(preset)


# --------------------------------------------------------------------- parallel/context_parallel.py
def test_context_parallelism_asks_for_device_mesh_flatten(monkeypatch):
    from torch.distributed.device_mesh import DeviceMesh

    from core.internals import TorchLacks, lacking
    from parallel.context_parallel import flattened

    assert not lacking(DeviceMesh, ["_flatten"])
    monkeypatch.delattr(DeviceMesh, "_flatten")
    with pytest.raises(TorchLacks) as e:
        flattened(object.__new__(DeviceMesh), "dp_cp")
    text = str(e.value)
    assert "DeviceMesh._flatten" in text and VERSION in text and "strategy.cp=1" in text


# --------------------------------------------------------------------- parallel/checkpointing.py
def _selective_block_bytes() -> int | None:
    """The saved bytes of one selectively checkpointed matmul block, counted as the memory
    observer counts them."""
    from torch.utils.checkpoint import checkpoint

    from parallel.checkpointing import selective_context
    from parallel.memory import SavedTensors

    w = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(32, 64, requires_grad=True)
    with SavedTensors() as saved:
        y = checkpoint(lambda t: torch.relu(t @ w) @ w, x, use_reentrant=False, context_fn=selective_context)
    y.sum().backward()
    return saved.bytes


class _Context:
    """A stand-in for SAC's forward context: ``storage`` as given (absent when None)."""

    def __init__(self, storage=None):
        if storage is not None:
            self.storage = storage

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_selective_checkpointing_counts_its_cache_or_says_it_cannot(caplog):
    import parallel.checkpointing as sac
    from core import internals
    from parallel.memory import SavedTensors

    # this torch's layout (2.11's list or 2.13's dict with _RECOMPUTE): the kept matmul outputs count
    with caplog.at_level(logging.WARNING):
        kept = _selective_block_bytes()
    assert kept is not None and kept >= 2 * 32 * 64 * 4 and not caplog.records, caplog.text
    t = torch.ones(3)
    assert sac.sac_kept(_Context({"mm": [(t,)]})) == [t]  # 2.11's layout, a tensor in place of a wrapper
    recompute = getattr(torch.utils.checkpoint, "_RECOMPUTE", None)  # (2.13's sentinel; 2.11 has none)
    layout_213 = {0: t, 1: recompute} if recompute is not None else {0: t}
    assert sac.sac_kept(_Context({("mm", 0): layout_213})) == [t]  # 2.13's
    internals._WARNED.discard("sac-storage")
    for storage in (None, {"mm": 5}, {"mm": [{"a": t}]}, [t]):  # no storage; three unknown layouts
        assert sac.sac_kept(_Context(storage)) is None, storage
        with SavedTensors() as saved:
            held: list = []
            with sac._Counted(_Context(storage), held, count=True):
                pass
        assert saved.bytes is None and held == [], storage  # unknown, not 0
    warned = [r for r in caplog.records if "selective checkpoint context" in r.getMessage()]
    assert len(warned) == 1 and VERSION in warned[0].getMessage() and "unknown" in warned[0].getMessage()


# --------------------------------------------------------------------- observers/startup.py
def test_the_compile_phase_is_unmeasured_and_said_once_without_dynamos_callbacks(monkeypatch, caplog):
    import torch._dynamo.callback as callback

    from core import internals
    from observers.startup import _compile_callbacks, compile_callback_handler

    assert compile_callback_handler() is callback.callback_handler
    hooks = _compile_callbacks()
    assert hooks is not None and _compile_callbacks(remove=hooks) is None
    internals._WARNED.discard("compile-callbacks")
    monkeypatch.delattr(type(callback.callback_handler), "register_start_callback")  # a renamed method
    with caplog.at_level(logging.WARNING):
        assert _compile_callbacks() is None and compile_callback_handler(_Bare()) is None
    [warned] = [r.getMessage() for r in caplog.records]
    assert "callback_handler.register_start_callback" in warned and VERSION in warned
    assert "unmeasured" in warned


# --------------------------------------------------------------------- observers/comm.py
def test_the_communication_observer_is_unavailable_not_a_crash_without_its_dispatch_internals(
        monkeypatch, caplog):
    import observers.comm as comm
    from core import internals

    assert comm.dispatch_problem() is None  # this torch has them all
    problem = comm.dispatch_problem(_Bare(), torch.ops.c10d.allreduce_.default)
    assert "torch._C._after_autograd_keyset" in problem and VERSION in problem
    assert "callbacks.communication=false" in problem and "training goes on" in problem
    assert "OpOverload._op_dk, torch._ops.OpOverload.redispatch" in comm.dispatch_problem(torch._C, _Bare())
    # registration: asked once, one warning, no kernels installed, a report that says why
    monkeypatch.setattr(comm, "_recorder", None)
    monkeypatch.setattr(comm, "_unavailable", None)
    monkeypatch.delattr(torch._C, "_after_autograd_keyset")
    internals._WARNED.discard("comm-dispatch")
    profile = comm.CommunicationProfile("data-replicate")
    with caplog.at_level(logging.WARNING):
        profile.on_train_start(None, 0)
        profile.on_step_start(None, 0)
        profile.on_step_work_end(None, 0)
        assert comm.recorder("data-replicate") is None
    [warned] = [r.getMessage() for r in caplog.records]
    assert "_after_autograd_keyset" in warned and VERSION in warned
    report = profile.report()["communication"]
    assert report["unavailable"] == warned and report["steps"] == 0 and report["per_step"] == {}


# --------------------------------------------------------------------- backends/common/torch.py
def test_every_group_made_after_the_default_one_waits_the_collective_timeout(monkeypatch, caplog):
    """cluster.collective_timeout reached the default group only: DeepSpeed's ZeRO groups (and
    DeviceMesh's sub-groups) are made without a timeout, so torch gave them its 30 minutes, and a
    zero2 rank waited 4 min for a stalled peer under a 40 s timeout. The module default every
    such group reads is set now; a torch without it warns once and sets nothing."""
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d

    from backends.common.torch import bound_new_groups
    from core import internals

    monkeypatch.setattr(c10d, "default_pg_timeout", c10d.default_pg_timeout)  # (put back after)
    monkeypatch.setattr(c10d, "default_pg_nccl_timeout", c10d.default_pg_nccl_timeout)
    assert bound_new_groups(7.0)
    assert c10d._get_default_timeout(c10d.Backend.GLOO) == timedelta(seconds=7)
    assert c10d._get_default_timeout(c10d.Backend.NCCL) == timedelta(seconds=7)
    assert not bound_new_groups(None) and c10d.default_pg_timeout == timedelta(seconds=7)
    internals._WARNED.discard("bound_new_groups")
    with caplog.at_level(logging.WARNING):
        assert not bound_new_groups(7.0, _Bare()) and not bound_new_groups(7.0, _Bare())
    [warned] = [r.getMessage() for r in caplog.records]
    assert "cluster.collective_timeout=7" in warned and "distributed_c10d.default_pg_timeout" in warned
    assert VERSION in warned and "30 min" in warned


# --------------------------------------------------------------------- backends/common/partitioned.py
def test_a_partitioned_parameters_aliases_share_its_storage_identity():
    """ZeRO-3's write refusal follows ``p.data`` / ``p.detach()`` / a view back to the parameter by
    its storage (``UntypedStorage._cdata``); an empty tensor of its own is another storage."""
    from backends.common.partitioned import _storage

    p = torch.nn.Parameter(torch.empty(0))  # (as ZeRO-3 leaves a partitioned parameter's data)
    assert _storage(p) is not None
    assert _storage(p) == _storage(p.data) == _storage(p.detach()) == _storage(p.data.view(-1))
    assert _storage(p) != _storage(torch.empty(0))
    assert _storage(_Bare()) is None
