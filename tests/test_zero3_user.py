"""A Lightning user's module under ZeRO-3 (backends/common/partitioned.py): a write into an
already-partitioned parameter in ``configure_model`` (lost without a word before: the run started
from the constructors' values) is refused, naming the parameter and the fix, and the fix trains
as plain torch does; a parameter used outside any module's forward fails its backward with a
message that says so instead of autograd's shape error. One 2-rank launch (tests/zero3_user_script.py)
and unit tests of the pieces."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from backends.common.partitioned import (outside_forward_message, transformers_write, unreached_name,
                                        write_message, written)
from tests.conftest import GLOO_ABORT, ROOT

SCRIPT = ROOT / "tests" / "zero3_user_script.py"
CASES = ("init", "xavier", "writes", "penalty_forward", "penalty_gathered", "penalty_threshold", "penalty")
REFUSED = "PartitionedWriteError: configure_model wrote into parameter "
FIX = "`with deepspeed.zero.GatheredParameters([param, ...], modifier_rank=0):`"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("zero3_user") / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), *CASES], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and out.exists() and GLOO_ABORT not in log, log[-4000:]
    return json.loads(out.read_text())


def _equal(run: dict) -> None:
    assert "error" not in run, run["error"]
    assert run["losses"] == pytest.approx(run["plain"], rel=1e-5), run


@pytest.mark.multiprocess
def test_zero3_refuses_a_write_into_a_partitioned_parameter_and_its_fix_trains_as_torch(runs):
    assert "error" in runs["init"], ("the initialisation was lost without a word: losses "
                                     f"{runs['init']['losses']} against torch's {runs['init']['plain']}")
    init = runs["init"]["error"]
    assert init.startswith(REFUSED + "block.0.weight (shape [16, 8]) with torch.nn.init.normal_ after "
                           "DeepSpeed partitioned it"), init
    assert "holds 0 of its 128 values and the write is lost" in init and FIX in init, init
    assert "torch.nn.init.xavier_uniform_" in runs["xavier"]["error"], runs["xavier"]
    writes = runs["writes"]["writes"]
    said = {k: v.split(" after ")[0] for k, v in writes.items() if k != "reads"}
    assert said == {
        "data.normal_": REFUSED + "block.0.weight (shape [16, 8]) with Tensor.normal_",
        "copy_": REFUSED + "block.0.weight (shape [16, 8]) with Tensor.copy_",
        "setitem": REFUSED + "block.0.weight (shape [16, 8]) with Tensor.__setitem__",
        "iadd": REFUSED + "block.0.weight (shape [16, 8]) with Tensor.add_",
        "detach.zero_": REFUSED + "block.0.weight (shape [16, 8]) with Tensor.zero_",
        "data=": REFUSED + "block.0.weight (shape [16, 8]) with an assignment to .data",
        "bias.fill_": REFUSED + "block.2.bias (shape [1]) with Tensor.fill_"}, said
    assert writes["reads"] == [[0], 0.0, 5]  # (reads pass: the partitioned, empty tensor)
    _equal(runs["writes"])  # the same initialisation under GatheredParameters(modifier_rank=0)
    # README's Lightning users: a callback sees the partition (0 values here), whole when gathered;
    # after fit the module's state_dict is empty, the strategy's full_state_dict and Lightning's
    # converted checkpoint hold torch's final weights
    assert [seen[:2] for seen in runs["writes"]["callback_saw"]] == [[0, 128]] * 3, runs["writes"]
    after = runs["writes"]["after_fit"]
    assert set(after["state_dict_numel"].values()) == {0}, after
    assert after["full_state_dict"] <= 1e-6 and after["checkpoint"] <= 1e-6, after


@pytest.mark.multiprocess
def test_zero3_says_what_a_parameter_used_outside_forward_means_and_its_fixes_train_as_torch(runs):
    for case in ("penalty", "penalty_threshold"):  # (a threshold above W's 64 elements does not help)
        error = runs[case]["error"]
        assert error.startswith("RuntimeError: a parameter was used outside the forward of a module that "
                                "owns it"), error
        assert "w = param.clone()" in error and error.endswith(
            "(The error: The size of tensor a (0) must match the size of tensor b (8) at non-singleton "
            "dimension 1)"), error
    _equal(runs["penalty_forward"])
    _equal(runs["penalty_gathered"])


@pytest.mark.unit
def test_the_writes_refused_are_writes_and_reads_pass():
    from torch.overrides import TorchFunctionMode

    seen = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            w = written(func, args, kwargs)
            seen.append(None if w is None else w[1])
            return func(*args, **kwargs)

    p = torch.nn.Parameter(torch.zeros(2, 3))
    writes = {"torch.nn.init.normal_": lambda: torch.nn.init.normal_(p),
              "Tensor.uniform_": lambda: p.data.uniform_(),
              "Tensor.copy_": lambda: p.copy_(torch.ones(2, 3)),
              "Tensor.__setitem__": lambda: p.__setitem__(0, 1.0),
              "Tensor.add_": lambda: p.__iadd__(1.0),
              "an assignment to .data": lambda: setattr(p, "data", torch.ones(2, 3)),
              "add(out=...)": lambda: torch.add(torch.ones(2, 3), 1, out=p)}
    for how, write in writes.items():
        seen.clear()
        with torch.no_grad(), Record():
            write()
        assert how in seen, (how, seen)
    seen.clear()
    with Record():
        p.shape, p.dim(), p.sum(), p.clone(), p.detach(), p.data, p.requires_grad_(True)
        torch.ones(2).add_(1)  # (a write, but into another tensor: the mode checks its target)
    assert seen.count("Tensor.add_") == 1 and set(seen) == {None, "Tensor.add_"}, seen


@pytest.mark.unit
@pytest.mark.parametrize("error, names", [
    ("The size of tensor a (0) must match the size of tensor b (400) at non-singleton dimension 1", "a parameter"),
    ("The size of tensor a (400) must match the size of tensor b (0) at non-singleton dimension 1", "a parameter"),
    ("Function PowBackward0 returned an invalid gradient at index 0 - got [0] but expected shape compatible "
     "with [256, 400]", "parameter W or block.2.weight"),
])
def test_a_backward_on_a_partitioned_parameter_is_said_plainly(error, names):
    named = [("W", (256, 400)), ("embed.weight", (400, 256)), ("block.2.weight", (256, 400))]
    said = outside_forward_message("zero3", error, named)
    assert said.startswith(f"{names} was used outside the forward of a module that owns it"), said
    assert "under strategy=zero3" in said and said.endswith(f"(The error: {error})"), said
    assert outside_forward_message("zero3", said, named) is None  # (not twice)
    assert outside_forward_message("zero3", "The size of tensor a (3) must match the size of tensor b (4)") is None


@pytest.mark.unit
def test_the_lightning_strategy_rewrites_that_backward_under_zero3_only():
    from backends.lightning import stratagem_strategy

    err = RuntimeError("The size of tensor a (0) must match the size of tensor b (8) at non-singleton dimension 1")
    stratagem_strategy("zero3").on_exception(err)
    assert str(err).startswith("a parameter was used outside the forward"), str(err)
    other = RuntimeError("The size of tensor a (0) must match the size of tensor b (8) at non-singleton dimension 1")
    stratagem_strategy("zero2").on_exception(other)
    assert str(other).startswith("The size of tensor a (0)")


@pytest.mark.unit
def test_the_accelerate_hooks_backward_rewrites_that_error_under_zero3_only():
    from backends.accelerate.user import _Zero3Backward

    error = "Function PowBackward0 returned an invalid gradient at index 0 - got [0] but expected shape compatible with [4]"

    class Fails:  # (what Accelerator.backward raises when autograd fails)
        def backward(self, loss, **kw):
            raise RuntimeError(error)

    class Hook(_Zero3Backward, Fails):
        stratagem = ("zero3", "deepspeed")

    for zero3, starts in ((True, "a parameter was used outside the forward"), (False, "Function PowBackward0")):
        Hook.zero3 = zero3
        with pytest.raises(RuntimeError) as e:
            Hook().backward(None)
        assert str(e.value).startswith(starts), str(e.value)


# A write from a constructor that is still running (a library's own, transformers' post_init): the
# parameter is not yet an attribute of the LightningModule, so the error names it from the stack.
SKIP = (os.path.dirname(torch.__file__) + os.sep,)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.said = unreached_name(self.lin.weight, sys._getframe(), SKIP)  # (as at a write here)
        self.stray = unreached_name(torch.nn.Parameter(torch.zeros(1)), sys._getframe(), SKIP)


class _Outer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Block()


@pytest.mark.unit
def test_a_write_inside_a_constructor_names_the_parameter_its_module_and_the_call_site():
    block = _Outer().block
    line = _Block.__init__.__code__.co_firstlineno
    assert block.said == (f"lin.weight of the _Block being constructed (inside _Outer's constructor), written at "
                          f"{__file__}:{line + 3} (__init__)")
    assert block.stray == (f"<not yet an attribute of the module while _Block's constructor ran, written at "
                           f"{__file__}:{line + 4} (__init__)>")
    said = write_message("zero3", block.said, (2, 3), "torch.nn.init.normal_", "configure_model")
    assert said.startswith(f"configure_model wrote into parameter {block.said} (shape [2, 3])"), said
    assert "not from this initialisation" in said and "Fix: initialise it in the constructor" in said, said


@pytest.mark.unit
def test_a_write_by_transformers_says_which_weights_are_lost_and_the_fixes_a_hf_user_can_apply(tmp_path):
    """A real tiny Llama, built and loaded with every write recorded as the guard would see it
    (the guard itself needs DeepSpeed's partitioning; the audit ran it: two ranks, same text)."""
    transformers = pytest.importorskip("transformers")
    from torch.overrides import TorchFunctionMode

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            w = written(func, args, kwargs)
            if w is not None and not seen and (everything or getattr(w[0], "shape", None) == (128, 64)
                                               and built(w[0])):
                seen.append((transformers_write(sys._getframe()), unreached_name(w[0], sys._getframe(), SKIP)))
            return func(*args, **kwargs)

    def built(p) -> bool:
        """The constructor of the module that holds ``p`` has returned: zero.Init would have
        partitioned it (the embedding's own reset_parameters writes it before)."""
        f = sys._getframe()
        while f is not None:
            me = f.f_locals.get("self") if f.f_code.co_name == "__init__" else None
            if isinstance(me, torch.nn.Module) and any(q is p for q in me.parameters(recurse=False)):
                return False
            f = f.f_back
        return True

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    seen: list = []
    everything = False
    with Record():
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert seen[0][0] == "init" and seen[0][1].startswith(
        "embed_tokens.weight of the LlamaModel being constructed (inside LlamaForCausalLM's constructor)"), seen
    model.save_pretrained(tmp_path)
    seen.clear()
    everything = True  # (from_pretrained builds on the meta device here: no initialisation is written
    with Record():     # after a constructor returns; its own writes are from_pretrained's all the same)
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert seen[0][0] == "from_pretrained", seen
    for how, lost in (("init", "transformers' initialisation"), ("from_pretrained", "the pretrained weights")):
        said = write_message("zero3", "embed_tokens.weight", (128, 64), "Tensor.normal_", "configure_model", how)
        assert f"not from {lost}" in said and "The write is transformers' own" in said, said
        assert "in the LightningModule's __init__ instead of configure_model" in said, said
        assert "`transformers.integrations.HfDeepSpeedConfig(self.trainer.strategy.config)` alive" in said, said
        assert "Fix: initialise it in the constructor" not in said, said
    assert transformers_write(sys._getframe()) is None
