"""A regular install (``pip install .``, not editable) carries everything the library reads: from
another directory, a plain Lightning script that does ``import strategies`` trains with
``Trainer(strategy="fsdp2")``, and the planner answers (presets, schemas and the activation
calibration are package data)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib

import pytest

from tests.conftest import ROOT, typed

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(600)]

SCRIPT = """
import sys
from pathlib import Path
import strategies, planner
here = Path(sys.argv[1])
for module in (strategies, planner):
    assert here in Path(module.__file__).parents, (module.__file__, here)

import lightning as L
import torch

class Tiny(L.LightningModule):
    def configure_model(self):
        if not hasattr(self, "net"):
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
    def train_dataloader(self):
        x = torch.randn(16, 8)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)

trainer = L.Trainer(strategy="fsdp2", accelerator="cpu", devices=1, max_steps=2, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Tiny())
assert type(trainer.strategy).__name__ == "PresetModelParallelStrategy", trainer.strategy
print("trained", trainer.global_step)

from recipes.config import compose
from recipes.job import CONFIG, validate
cfg = compose(["model=llama_7b", "cluster=node_8x_h100"])
report = planner.plan_all(validate(cfg, depth=CONFIG))
print("recommended", report.recommendation.strategy)
"""


def test_a_regular_install_trains_and_plans_from_elsewhere(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, source / part)
    # every directory pyproject's packages come from (a package added there is copied too)
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    tops = {tool["package-dir"].get(p, p.replace(".", "/")).split("/")[0] for p in tool["packages"]}
    for part in sorted(tops):
        shutil.copytree(ROOT / part, source / part, ignore=shutil.ignore_patterns("__pycache__"))
    # the wheel `pip install .` would build, installed into a fresh environment that sees the
    # dependencies (torch, Lightning, ...) but not the checkout
    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            str(source), "-w", str(wheels)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True,
                   timeout=120)
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps",
                          *map(str, wheels.glob("*.whl"))], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr[-3000:]
    site = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # (without the caller's PYTHONPATH: a checkout on it would be imported instead of the install)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", SCRIPT, site], cwd=elsewhere,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    from planner import plan_all
    from recipes.config import compose

    cfg = compose(["model=llama_7b", "cluster=node_8x_h100"])
    expected = plan_all(typed(cfg)).recommendation.strategy
    assert "trained 2" in proc.stdout
    assert f"recommended {expected}" in proc.stdout, proc.stdout
