"""trainer.loss_chunk: the loss computed inside the GPT's head one chunk of tokens at a time
(recipes/head.py), so the whole (tokens, vocab) logits never exist; equal to today's loss.

Tolerance: in fp32 the chunked path runs the same ops per chunk; only summation order differs
(the loss sum over chunks, the weight gradient over chunks) and the upstream gradient scales the
chunk's gradients after the matmul instead of before it. Measured on one process: loss within
1e-7 relative, gradients within 6e-8 of their largest magnitude; through train.py (gpt_nano,
6 steps): losses within 1e-7 relative, parameters within 2e-7 of their largest magnitude, SGD
and AdamW, single, ddp, fsdp, fsdp2, zero2, zero3 on both backends. Asserted: 1e-6 for the
one-process comparison, the equivalence tests' 1e-5 for the runs (AdamW parameters 1e-3, as
tests/test_compile.py: its sqrt(v) amplifies last-bit gradient differences).
"""

from __future__ import annotations

import functools
import json

import pytest

from tests.cases import CASES
from tests.conftest import EQUIV, OPTIMIZERS, assert_losses_close, assert_params_close

pytestmark = pytest.mark.timeout(900)
RTOL = {"sgd": (1e-5, 1e-5), "adamw": (1e-5, 1e-3)}
CHUNK = "trainer.loss_chunk=40"  # gpt_nano: micro 8 x 32 tokens = 256, not a multiple of 40


@functools.cache
def _nano(name: str = "gpt_nano"):
    from recipes.config import compose, describe

    return describe(compose([f"model={name}", "model.dropout=0"]).model)


def _batch(shape, b: int = 3, seed: int = 0):
    """Tokens and targets with some IGNORE targets (a masked span and a lone one)."""
    import torch

    from recipes.data import IGNORE

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, shape.vocab_size, (b, shape.seq_len), generator=g)
    targets = torch.randint(0, shape.vocab_size, (b, shape.seq_len), generator=g)
    targets[0, :9] = IGNORE
    targets[2, 17] = IGNORE
    return tokens, targets


def _grads(model, loss):
    import torch

    names = [n for n, p in model.named_parameters()]
    return dict(zip(names, torch.autograd.grad(loss, [p for _, p in model.named_parameters()])))


# ----------------------------------------------------------------------------- one process
@pytest.mark.unit
@pytest.mark.parametrize("chunk", [7, 40, 96, 1000])
def test_chunked_head_equals_the_whole_logits(chunk):
    """Loss and gradients of the head weight and of the hidden input, fp32, IGNORE targets,
    chunks that do not divide the 96 tokens (and one larger than all of them)."""
    import torch
    import torch.nn.functional as F

    from recipes.head import Head
    from recipes.training import token_loss

    torch.manual_seed(0)
    head = Head(32, 256, bias=False)
    tokens, targets = _batch(_nano())
    h = (torch.randn(3, 32, 32) * 0.5).requires_grad_()
    ref = token_loss(F.linear(h, head.weight), targets)
    rx, rw = torch.autograd.grad(ref, [h, head.weight])
    total, count = head(h, targets, chunk)
    assert count == (targets != -100).sum()
    out = total / count
    ox, ow = torch.autograd.grad(out, [h, head.weight])
    assert abs(out.item() - ref.item()) <= 1e-6 * abs(ref.item())
    for a, b in ((rx, ox), (rw, ow)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert (a - b).abs().max() <= 1e-6 * a.abs().max()


@pytest.mark.unit
@pytest.mark.parametrize("name", ["gpt_nano", "gpt_moe_nano"])
def test_the_model_and_the_recipe_equal_todays_loss_with_every_gradient(name):
    """Through GPT.forward(tokens, targets, loss_chunk) and recipes/training.py's loss, every
    parameter's gradient (a mixture of experts' load-balancing loss still added); a micro-batch
    with no counted target adds 0 and no head gradient, as today; validation's sums (no
    grad) equal today's."""
    import torch

    from recipes import evaluation, training
    from recipes.data import IGNORE

    shape = _nano(name)
    model = training.build_model(shape, 0)
    batch = _batch(shape)
    ref, out = training.loss(model, batch), training.loss(model, batch, chunk=40)
    assert abs(out.item() - ref.item()) <= 1e-6 * ref.item()
    g_ref, g_out = _grads(model, training.loss(model, batch)), _grads(model, out)
    for k in g_ref:
        assert (g_ref[k] - g_out[k]).abs().max() <= 1e-6 * g_ref[k].abs().max(), k
    masked = (batch[0], torch.full_like(batch[1], IGNORE))
    none = training.loss(model, masked, chunk=40)  # (the MoE's aux loss alone)
    assert none.item() == training.loss(model, masked).item()
    assert _grads(model, none)["output.weight"].abs().max() == 0
    with torch.no_grad():
        a, b = evaluation.batch_sums(model, batch), evaluation.batch_sums(model, batch, chunk=40)
    assert a[1] == b[1] and abs(a[0] - b[0]) <= 1e-6 * a[0]


@pytest.mark.unit
def test_under_autocast_the_head_runs_in_the_autocast_dtype():
    """bf16 autocast: the chunk's matmuls in bf16 as today's head (the loss in fp32); equal to
    today's within bf16 rounding (measured: 5e-3 of the largest gradient; asserted 2e-2), the
    gradients in the parameters' and input's dtypes."""
    import torch
    import torch.nn.functional as F

    from recipes.head import Head
    from recipes.training import token_loss

    torch.manual_seed(0)
    head = Head(32, 256, bias=False)
    _, targets = _batch(_nano())
    h = (torch.randn(3, 32, 32) * 0.5).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = token_loss(F.linear(h, head.weight), targets)
        total, count = head(h, targets, 40)
    rx, rw = torch.autograd.grad(ref, [h, head.weight])
    ox, ow = torch.autograd.grad(total / count, [h, head.weight])
    assert abs((total / count).item() - ref.item()) <= 1e-2 * ref.item()
    for a, b in ((rx, ox), (rw, ow)):
        assert a.dtype == b.dtype == torch.float32
        assert (a - b).abs().max() <= 2e-2 * a.abs().max()


@pytest.mark.unit
def test_no_tensor_holds_the_whole_logits():
    """Every tensor an op makes in forward and backward, seen by a dispatch mode: the chunked
    loss's largest has one chunk's logits (chunk x vocab elements) or the weight's gradient
    (vocab x dim), never tokens x vocab; today's path does make one (the test sees it)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from recipes import training

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.numel = max(self.numel, t.numel())
            return out

    shape = _nano()
    model = training.build_model(shape, 0)
    batch = _batch(shape)
    tokens = batch[0].numel()  # 96
    seen = {}
    for chunk in (0, 16):
        with Largest() as mode:
            training.loss(model, batch, chunk=chunk).backward()
        seen[chunk] = mode.numel
    assert seen[0] == tokens * shape.vocab_size
    assert seen[16] == max(16 * shape.vocab_size, shape.vocab_size * shape.dim) < tokens * shape.vocab_size


# ----------------------------------------------------------------------------- refusals
@pytest.mark.unit
@pytest.mark.parametrize("overrides, says", [
    (("strategy=tp", "cluster.devices=2"), "tensor parallel 2"),
    (("strategy=pipeline", "cluster.devices=2"), "2 pipeline stages"),
])
def test_refused_where_the_head_is_not_the_models_own(overrides, says):
    from recipes.config import compose
    from recipes.job import RUN, validate
    from strategies import ConfigError

    with pytest.raises(ConfigError) as e:
        validate(compose(["model=gpt_nano", "cluster.accelerator=cpu", "trainer.loss_chunk=64",
                          *overrides]), depth=RUN)
    text = str(e.value)
    assert "trainer.loss_chunk=64" in text and says in text and "set trainer.loss_chunk=0" in text


@pytest.mark.unit
def test_refused_for_a_transformers_model(tmp_path):
    from recipes.config import compose
    from recipes.job import RUN, validate
    from strategies import ConfigError

    path = tmp_path / "llama"  # a config.json is all validation reads (recipes/hf_config.py)
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64}))
    with pytest.raises(ConfigError, match=r"trainer.loss_chunk=64: .*model=hf .* set trainer.loss_chunk=0"):
        validate(compose(["model=hf", f"model.path={path}", "model.seq_len=32", "data.tokenizer=null",
                          "cluster.accelerator=cpu", "trainer.loss_chunk=64"]), depth=RUN)


# ----------------------------------------------------------------------------- the planner
@pytest.mark.unit
def test_the_planner_shrinks_the_logits_to_the_chunk():
    """llama_1b x micro 4 x 2048, bf16-mixed on one H200: the loss backward's 8 x s x b x V
    becomes 8 x chunk x V, the head's saved 4 x s x b x V becomes 4 x chunk x V plus the
    gradients the chunked loss holds (4 x (s x b + V) x dim); tensor- and pipeline-parallel
    layouts (refused at validate) are planned as today; the report says so."""
    from planner import plan_all
    from planner.render import report_dict
    from recipes.config import compose, describe
    from tests.conftest import typed

    def plans(*extra):
        cfg = compose(["model=llama_1b", "cluster=h200_1x", "trainer.precision=bf16-mixed",
                       "trainer.micro_batch_size=4", "trainer.global_batch_size=4", "callbacks=none", *extra])
        report = plan_all(typed(cfg), describe(cfg.model))
        return {p.strategy: p.memory for p in report.plans}, report

    (whole, _), (chunked, report) = plans(), plans("trainer.loss_chunk=1024")
    runnable = {p.strategy: p.runnable for p in report.plans}
    assert runnable["single"] and not runnable["pipeline"] and not runnable["fsdp_tp"]  # auto skips them
    m = describe(compose(["model=llama_1b"]).model)
    tokens, chunk, vocab = 4 * m.seq_len, 1024, m.vocab_size
    for name in ("single", "ddp", "fsdp2", "zero3"):
        assert whole[name].loss == 8 * tokens * vocab  # 8.4 GB
        assert chunked[name].loss == 8 * chunk * vocab  # 1.05 GB
        held = 4 * (tokens + vocab) * m.dim
        assert whole[name].activations - chunked[name].activations == 4 * (tokens - chunk) * vocab - held
        assert chunked[name].total < whole[name].total - 9e9, name
    for name in ("pipeline", "fsdp_tp"):
        assert chunked[name].loss == whole[name].loss and chunked[name].total == whole[name].total
    text = " ".join(report_dict(report)["assumptions"])
    assert "trainer.loss_chunk=1024" in text


# ----------------------------------------------------------------------------- through train.py
@pytest.mark.subprocess
# (SGD shows any gradient-scale error; its AdamW twin, which divides one out, in the slow tier)
@pytest.mark.parametrize("optimizer", [o if o == "sgd" else pytest.param(o, marks=pytest.mark.slow)
                                       for o in OPTIMIZERS])
def test_chunked_single_equals_the_whole_logits(cached, optimizer):
    """The default run (the equivalence tests' single-process reference, from the session
    cache) and the same run with the chunked loss: losses and final parameters."""
    single = (*EQUIV, *OPTIMIZERS[optimizer], *CASES["single"].overrides)
    ref, chunked = cached(*single), cached(*single, CHUNK)
    loss_tol, param_tol = RTOL[optimizer]
    assert_losses_close(ref.losses, chunked.losses, rtol=loss_tol)
    assert_params_close(ref.params(), chunked.params(), rtol=param_tol)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name, backend", [("ddp", "accelerate"), ("fsdp", "lightning"), ("fsdp2", "lightning"),
                                           ("fsdp2", "accelerate"), ("zero3", "lightning"),
                                           ("zero3", "accelerate")])
def test_chunked_sharded_presets_equal_the_single_process(cached, name, backend):
    """The head's weight gathered for the chunked loss (FSDP1, FSDP2, ZeRO-3) and its gradient
    reduced (DDP): each preset with the chunked loss equals the single-process run (SGD)."""
    overrides = (*EQUIV, *OPTIMIZERS["sgd"], *CASES[name].overrides, f"backend={backend}", CHUNK)
    ref = cached(*EQUIV, *OPTIMIZERS["sgd"], *CASES["single"].overrides)
    chunked = cached(*overrides)
    assert_losses_close(ref.losses, chunked.losses, rtol=RTOL["sgd"][0])
    assert_params_close(ref.params(), chunked.params(), rtol=RTOL["sgd"][1])


# ----------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@pytest.mark.unit
def test_on_gpu_the_chunked_head_at_llama_1b_shapes_saves_the_logits():
    """llama_1b's head, micro 4 x 2048 tokens (dim 2048, vocab 128,256), bf16 autocast over
    fp32 weights, forward + backward: the chunked loss's CUDA peak is below today's by most
    of the 4 x 4 GB logits terms, equal within bf16 rounding, and its time is printed."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import time

    import torch.nn.functional as F

    from recipes.head import Head
    from recipes.training import token_loss

    torch.manual_seed(0)
    dev, n, dim, vocab = "cuda", 4 * 2048, 2048, 128256
    head = Head(dim, vocab, bias=False, device=dev)
    h = torch.randn(4, 2048, dim, device=dev).requires_grad_()
    targets = torch.randint(0, vocab, (4, 2048), device=dev)
    seen = {}
    for chunk in (0, 1024, 4096):
        for _ in range(2):  # (the second one timed)
            head.weight.grad = h.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base, start = torch.cuda.memory_allocated(), time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if chunk:
                    total, count = head(h, targets, chunk)
                    loss = total / count
                else:
                    loss = token_loss(F.linear(h, head.weight), targets)
            loss.backward()
            torch.cuda.synchronize()
        seen[chunk] = (loss.item(), torch.cuda.max_memory_allocated() - base, time.perf_counter() - start,
                       head.weight.grad.clone())
        print(f"chunk {chunk}: loss {seen[chunk][0]:.6f} peak over inputs {seen[chunk][1] / 2**30:.2f} GiB "
              f"forward+backward {1e3 * seen[chunk][2]:.1f} ms")
    for chunk in (1024, 4096):
        assert abs(seen[chunk][0] - seen[0][0]) <= 1e-3 * seen[0][0]
        g, ref = seen[chunk][3], seen[0][3]
        assert (g - ref).abs().max() <= 2e-2 * ref.abs().max()
    assert seen[1024][1] < seen[0][1] - 8 * 2**30  # today's: ~4 x 4.2 GB of logits and gradients
