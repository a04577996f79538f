"""The client matrix (issue 39): a Lightning module as Lightning's documentation writes one
(tests/lightning_client_script.py: layers in ``__init__``, plain DataLoaders, no stratagem import
beyond ``import strategies``), each training preset by name through every Trainer entry -- fit,
validate, test, predict, fit again on the same Trainer, validate -- on 2 CPU ranks, with
``Trainer(gradient_clip_val=0.05)`` (norm clipping that binds at every step).

Every call's result equals the reference: the same training computed here on one process with
plain torch, as Lightning's data-parallel run defines it (its DistributedSampler's shuffled split
of each epoch over the 2 ranks, the ranks' mean gradient, clipping by the global 2-norm, SGD;
evaluation and prediction over every sample once). CI: FSDP1 (``stratagem_fsdp``), the family no
other default-tier test takes through every entry; the rest in the slow tier."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import GLOO_ABORT, ROOT
from tests.test_lightning_user import CPU_PRESETS, registry_name

SCRIPT = ROOT / "tests" / "lightning_client_script.py"
CLIP = 0.05
# measured: every CPU preset in TRAINING within 1e-5 of it (DDP and FSDP1: 6.6e-8, fp32 summation
# order; compression, local SGD and DiLoCo start after these 6 steps)
RTOL = 1e-5
LOOSE = {"ddp_fp16_compress": 1e-3}  # fp16-rounded gradients (11 bits)
CI = {"fsdp"}
TRAINING = list(CPU_PRESETS)  # every one (zero2_ep too: tests/test_zero2_ep.py)


def reference(clip: float | None, optimizer: str = "sgd") -> list:
    """The script's calls as Lightning's 2-rank data-parallel run computes them, on one process
    (each fit a fresh optimizer, as each ``Trainer.fit`` calls ``configure_optimizers``)."""
    from tests.lightning_client_script import GLOBAL_BATCH, OPTIMIZERS, STEPS, Regression

    model, ranks, calls = Regression(), 2, []

    def data(samples: int, seed: int):
        x = torch.randn(samples, 16, generator=torch.Generator().manual_seed(seed))
        return x, torch.sin(x.sum(dim=1, keepdim=True))

    def fit(epoch: int) -> list[float]:
        from torch.utils.data import DistributedSampler

        x, y = data(STEPS * GLOBAL_BATCH, 1)
        samplers = []
        for r in range(ranks):  # what Lightning puts under a training DataLoader: shuffled, seed 0
            s = DistributedSampler(range(len(x)), ranks, r, shuffle=True, seed=0)
            s.set_epoch(epoch)
            samplers.append(list(s))
        opt, losses, per = OPTIMIZERS[optimizer](model.parameters()), [], GLOBAL_BATCH // ranks
        for step in range(STEPS):
            opt.zero_grad()
            rank_losses = [torch.nn.functional.mse_loss(model(x[i]), y[i]) for i in
                           (samplers[r][step * per:(step + 1) * per] for r in range(ranks))]
            loss = sum(rank_losses) / ranks
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            losses.append(float(loss.detach()))
        return losses

    def evaluate() -> dict:
        with torch.no_grad():
            x, y = data(2 * GLOBAL_BATCH, 2)
            return {"loss": float(torch.nn.functional.mse_loss(model(x), y))}

    calls.append(["fit", {"losses": fit(0)}])
    calls += [["validate", evaluate()], ["test", evaluate()]]
    with torch.no_grad():
        predicted = model(data(GLOBAL_BATCH, 3)[0])
    calls.append(["predict", {"sum": float(predicted.sum()), "count": len(predicted)}])
    calls += [["fit", {"losses": fit(1)}], ["validate", evaluate()]]
    return calls


def client_run(preset: str, out, clip: float | None = CLIP, optimizer: str = "sgd") -> dict:
    assert clip or optimizer == "sgd", "the script takes its optimizer after a clip value"
    proc = subprocess.run([sys.executable, str(SCRIPT), registry_name(preset), "2", str(out),
                           *([str(clip)] if clip else []), *([optimizer] if optimizer != "sgd" else [])],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and GLOO_ABORT not in log, log[-4000:]
    return json.loads(out.read_text())


def assert_calls_equal(got: list, want: list, rtol: float) -> None:
    assert [c for c, _ in got] == [c for c, _ in want]
    for (call, g), (_, w) in zip(got, want):
        assert g.keys() == w.keys(), call
        for key in g:
            assert g[key] == pytest.approx(w[key], rel=rtol, abs=rtol * 1e-2), (call, key, got, want)


@pytest.mark.unit
def test_the_reference_clips_at_every_step():
    """CLIP binds: without it the same training ends elsewhere (so an engine that ignored
    ``gradient_clip_val`` fails the matrix)."""
    clipped, free = reference(CLIP), reference(None)
    assert clipped[-1][1]["loss"] != pytest.approx(free[-1][1]["loss"], rel=1e-3)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize("preset", [p if p in CI else pytest.param(p, marks=pytest.mark.slow)
                                    for p in TRAINING])
def test_a_documented_lightning_client_gets_its_preset_through_every_entry(preset, tmp_path):
    run = client_run(preset, tmp_path / "calls.json")
    assert_calls_equal(run["calls"], reference(CLIP), LOOSE.get(preset, RTOL))


@pytest.mark.unit
@pytest.mark.timeout(300)
def test_a_model_the_preset_cannot_parallelize_is_refused_before_any_process_group():
    """tp, pp, cp, Ulysses (issue 39: refused only after the ranks started; Ulysses built a
    DeepSpeed op for minutes first): a user's module that declares none of what the preset needs
    is one ConfigError from the strategy's ``setup_environment`` -- the first thing a Trainer call
    does on each rank -- before the process group exists, naming the key, what to declare and the
    fix. A module that builds its layers in ``configure_model`` is checked once they exist (the
    families' ``setup``, before they parallelize)."""
    import lightning as L
    import torch.distributed as dist

    import strategies
    from strategies import ConfigError
    from tests.lightning_client_script import Regression
    from tests.test_lightning_user import PARALLEL

    for name in sorted(PARALLEL):
        preset = strategies.load(name)
        devices = next(d for d in (2, 4, 8) if not preset.mesh(1, d).problems())
        trainer = L.Trainer(strategy=name, accelerator="cpu", devices=devices, logger=False)
        trainer.strategy._lightning_module = Regression()  # what Trainer.fit does first
        with pytest.raises(ConfigError) as refused:
            trainer.strategy.setup_environment()
        said = str(refused.value)
        assert f"strategy={name} (strategy." in said and "Regression declares no" in said, said
        assert "to the model class, or use a preset without" in said, said
        assert not dist.is_initialized()

    class Later(Regression):
        def configure_model(self):
            pass

    strategy = L.Trainer(strategy="tp", accelerator="cpu", devices=2, logger=False).strategy
    later = Later()
    later.net = None  # layers not built yet: nothing to read, nothing refused
    strategy._lightning_module = later
    strategy.check()
    later.net = Regression().net
    with pytest.raises(ConfigError, match="declares no tp_plan or tp_layout"):
        strategy.check_model()
