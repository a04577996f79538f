"""The house: the import arrows docs/ARCHITECTURE.md draws, answers before imports (plan.py and
``--cfg job`` load no engine), Lightning registration in either import order, and one strategy
whichever way it is reached (train.py or Lightning's registry)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.unit

OURS = ("strategies", "planner", "recipes", "observers", "checkpoints", "backends", "launchers")
ENGINES = ("torch", "lightning", "accelerate", "deepspeed", "transformers", "wandb")


def _rules() -> dict[str, set[str]]:
    """package -> the packages of ours it may import, from ARCHITECTURE.md's import table."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    table = text.split("<!-- import-rules -->")[1].split("<!-- /import-rules -->")[0]
    rules = {}
    for line in table.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        package = re.fullmatch(r"`(\w+)/`", cells[0])
        if package:
            rules[package.group(1)] = set(re.findall(r"`(\w+)`", cells[-1]))
    return rules


def _imports(path) -> set[str]:
    """Top-level names of every module ``path`` imports, anywhere in the file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_the_table_covers_every_package():
    assert set(_rules()) == set(OURS)


@pytest.mark.parametrize("package", OURS)
def test_imports_follow_the_architecture(package):
    allowed = _rules()[package] | {package}
    for path in sorted((ROOT / package).rglob("*.py")):
        wrong = (_imports(path) & set(OURS)) - allowed
        assert not wrong, (f"{path.relative_to(ROOT)} imports {sorted(wrong)}; docs/ARCHITECTURE.md "
                           f"allows {package}/ only {sorted(allowed - {package})}")


def test_the_rule_test_sees_a_wrong_arrow(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from recipes.gpt import GPT\n")
    assert "recipes" in _imports(bad) and "recipes" not in _rules()["strategies"]


# --------------------------------------------------------------------- answers before imports
_PROBE = """
import atexit, runpy, sys
def _report():
    loaded = sorted({m.split('.')[0] for m in sys.modules} & set(%r))
    sys.stderr.write('ENGINES=' + ','.join(loaded) + '\\n')
atexit.register(_report)
sys.argv = %r
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def _engines_loaded(*argv: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    proc = subprocess.run([sys.executable, "-c", _PROBE % (ENGINES, list(argv))], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    line = next(x for x in proc.stderr.splitlines() if x.startswith("ENGINES="))
    return proc, [m for m in line.removeprefix("ENGINES=").split(",") if m]


@pytest.mark.parametrize("argv", [
    ("plan.py", "model=llama_70b", "cluster=slurm_8x8_h100"),
    ("plan.py", "model=llama_7b", "cluster=node_8x_a100_80g", "strategy=zero3", "planner.format=json"),
    ("train.py", "--cfg", "job", "strategy=zero3", "model=llama_1b"),
    ("train.py", "--help"),
], ids=["plan-all", "plan-one", "cfg-job", "help"])
def test_no_engine_is_imported_to_answer(argv, tmp_path):
    proc, loaded = _engines_loaded(*argv, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert loaded == [], f"{' '.join(argv)} imported {loaded}"


def test_help_lists_only_real_options():
    proc = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    groups = proc.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    assert "_schema" not in groups, groups
    assert "strategy: 3d, auto, ddp," in groups and "logger: csv, tensorboard, wandb" in groups


def test_the_lightning_backend_defers_the_transformers_torchmetrics_imports():
    """torchmetrics imports transformers when installed (~2 s a process): the Lightning backend
    defers those names (backends/lightning/torchmetrics_imports.py); used, they are the real ones."""
    pytest.importorskip("transformers")
    code = ("import sys\n"
            "import backends.lightning\n"
            "assert 'lightning' in sys.modules and 'transformers' not in sys.modules\n"
            "from torchmetrics.functional.text import bert\n"
            "import transformers\n"
            "assert transformers.AutoModel.__module__.startswith('transformers.')\n"
            "assert bert.AutoTokenizer.from_pretrained == transformers.AutoTokenizer.from_pretrained\n"
            "from backends.lightning.torchmetrics_imports import _Deferred\n"
            "assert isinstance(transformers.PretrainedConfig(), _Deferred('PretrainedConfig'))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]


# --------------------------------------------------------------------- Lightning's registry
@pytest.mark.parametrize("order", ["strategies first", "lightning first"])
def test_presets_register_in_either_import_order(order):
    first, second = (("strategies", "lightning") if order == "strategies first"
                     else ("lightning", "strategies"))
    code = (f"import {first}, {second}\n"
            "from lightning.pytorch.strategies import StrategyRegistry\n"
            "import strategies as s\n"
            "missing = [n for n in s.names() if n not in StrategyRegistry "
            "or 'stratagem preset' not in StrategyRegistry[n]['description']]\n"
            "assert not missing, missing\n"
            "print(type(StrategyRegistry.get('zero3')).__name__)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "CPUCapableDeepSpeedStrategy"


def _describe_both(name: str, devices: int = 2) -> tuple[dict, dict]:
    """The strategy Lightning's registry builds for ``name`` and the one train.py builds, each
    inside a Trainer for the same world (no process is started), described as data."""
    from lightning.pytorch import Trainer

    import backends.lightning as backend
    from recipes.config import compose
    from recipes.job import CONFIG, validate

    # (gpt_small: no conf/strategy_model/ tweak applies, which only train.py, knowing the model, can)
    cfg = compose([f"strategy={name}", f"cluster.devices={devices}", "cluster.accelerator=cpu",
                   "cluster.oversubscribe=true", "model=gpt_small", "trainer.global_batch_size=8",
                   "trainer.micro_batch_size=1", "logger=null"])
    job = validate(cfg, depth=CONFIG)  # presets that refuse CPU are compared all the same
    ours = backend.trainer_for(job, ROOT / "outputs", []).strategy
    theirs = Trainer(strategy=name, accelerator="cpu", devices=devices, logger=False,
                     enable_progress_bar=False, enable_checkpointing=False).strategy
    return ours.describe(), theirs.describe()


@pytest.mark.parametrize("name", __import__("strategies").names())
def test_registry_builds_what_train_py_builds(name):
    """Wrap policy (from the model's block class at setup, on both paths), mesh, buckets, hooks,
    the DeepSpeed config (micro batch and clipping are the Trainer's on both paths)."""
    ours, theirs = _describe_both(name, devices=4 if name in ("fsdp_hybrid", "hsdp2") else 2)
    assert ours == theirs
    assert ours["preset"]["name"] == name


def test_registry_describes_the_world_lightning_sets_up():
    ours, theirs = _describe_both("hsdp2", devices=4)
    assert theirs["mesh_shape"] == (1, 4) == ours["mesh_shape"]  # shard group: devices per node
