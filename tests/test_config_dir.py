"""A user's own config directory (``hydra.searchpath=[file://...]``, ``--config-dir``/``-cd``) is
seen wherever train.py sees it: plan.py, export.py and launch.py's composition, ``--dry-run`` and a
sweep's preflight; and an error inside (or on top of) a user's YAML says what is wrong there --
"no such <group>" only when no directory searched holds the option."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.timeout(300)]

FILES = {  # (the audit's user project: presets over built-in ones, a model, a cluster, an experiment)
    "myconf/strategy/my_zero3.yaml": "defaults: [zero3, _self_]\nname: my_zero3\nreduce_bucket_size: 1000000\n",
    "myconf/strategy/my_fsdp2.yaml": "defaults: [fsdp2, _self_]\nname: my_fsdp2\nactivation_checkpointing: true\n",
    "myconf/model/my_gpt.yaml": "name: my_gpt\ndim: 32\nn_layers: 2\nn_heads: 4\nn_kv_heads: 2\nvocab_size: 256\n"
                                "seq_len: 32\ndropout: 0.0\nffn_dim: 64\n",
    "myconf/cluster/my_cpu2.yaml": "defaults: [local, _self_]\nname: my_cpu2\ndevices: 2\naccelerator: cpu\n",
    "myconf/experiment/my_exp.yaml": "# @package _global_\ndefaults:\n  - override /strategy: my_fsdp2\n"
                                     "  - override /model: my_gpt\ntrainer:\n  max_steps: 4\n",
    "myconf/my_train.yaml": "defaults:\n  - train\n  - override model: my_gpt\n  - override cluster: my_cpu2\n"
                            "  - _self_\ntrainer:\n  max_steps: 4\n",
    "bad/strategy/typo_zero3.yaml": "defaults: [zero3, _self_]\nname: typo_zero3\nreduce_bucket_sise: 1000000\n",
    "bad/strategy/type_zero3.yaml": "defaults: [zero3, _self_]\nname: type_zero3\nreduce_bucket_size: lots\n",
    "bad/model/strint.yaml": "name: strint\ndim: 32\nn_layers: two\nn_heads: 4\nvocab_size: 256\nseq_len: 32\n",
}


@pytest.fixture
def project(tmp_path) -> Path:
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def _spellings(project: Path) -> list[list[str]]:
    mine = project / "myconf"
    return [[f"hydra.searchpath=[file://{mine}]"], ["--config-dir", str(mine)], [f"-cd={mine}"]]


@pytest.mark.unit
def test_compose_searches_the_users_config_dir_every_way_it_is_spelled(project):
    """plan.py and export.py (``cli.query``) and launch.py compose through ``compose_chosen``,
    which refused ``--config-dir`` and said "no such strategy" of the user's presets."""
    from recipes.cli import query

    for search in _spellings(project):
        cfg, chosen, _ = query([*search, "strategy=my_zero3", "model=my_gpt", "cluster=my_cpu2"], "", "plan.py")
        assert (cfg.strategy.name, cfg.strategy.reduce_bucket_size, cfg.model.name, cfg.cluster.devices) == \
            ("my_zero3", 1000000, "my_gpt", 2), search
        assert {"strategy", "model", "cluster"} <= chosen


@pytest.mark.unit
@pytest.mark.parametrize("name", [["--config-name", "my_train"], ["-cn", "my_train"], ["--config-name=my_train"]])
def test_a_users_top_config_is_composed_as_train_py_composes_it(project, name, capsys):
    """``train.py --config-dir D --config-name my_train`` trains the user's top config; plan.py,
    export.py, launch.py and ``--dry-run`` composed conf/train.yaml ("LexerNoViableAltException:
    --config-name" from plan.py; "missing EQUAL" from --dry-run)."""
    from launchers import dry_run
    from recipes.cli import query
    from recipes.compose import search_args

    argv = ["--config-dir", str(project / "myconf"), *name, "strategy=ddp"]
    assert search_args(argv) == ([f"--config-dir={project / 'myconf'}", "--config-name=my_train"], ["strategy=ddp"])
    cfg, chosen, _ = query(argv, "", "plan.py")
    assert (cfg.model.name, cfg.cluster.devices, cfg.trainer.max_steps) == ("my_gpt", 2, 4)
    assert {"model", "cluster", "strategy"} <= chosen
    assert dry_run.main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "1 node(s) x 2 rank(s)" in out and "--config-name=my_train" in out.split("Hydra's overrides")[1], out


@pytest.mark.unit
def test_a_missing_config_dir_is_hydras_one_line(tmp_path, capsys):
    from recipes.cli import query

    with pytest.raises(SystemExit) as e:
        query(["--config-dir", str(tmp_path / "nowhere"), "strategy=ddp"], "", "plan.py")
    assert e.value.code == 2
    assert f"Additional config directory '{tmp_path / 'nowhere'}' not found" in capsys.readouterr().err


@pytest.mark.unit
def test_dry_run_composes_with_the_users_config_dir(project, capsys):
    """``--dry-run`` put hydra.searchpath among Hydra's overrides, composed without it, and took
    --config-dir's value for an override of the job: "cannot run" of a job that trains."""
    from launchers import dry_run

    for search in _spellings(project):
        code = dry_run.main([*search, "strategy=my_zero3", "model=my_gpt", "cluster=my_cpu2", "--dry-run"])
        out = capsys.readouterr().out
        assert code == 0 and "composes, validates and plans" in out, out
        assert str(project / "myconf") not in out.split("Hydra's overrides")[0], out  # (not a job override)


@pytest.mark.unit
def test_one_point_reads_past_config_dir(project):
    from recipes.cli import one_point

    line = one_point(["--config-dir", str(project), "strategy=my_zero3,zero3"], "plan.py")
    assert line and line.startswith("strategy=my_zero3,zero3: plan.py plans one point"), line
    assert f"python plan.py --config-dir={project} strategy=my_zero3 " in line


@pytest.mark.unit
@pytest.mark.parametrize("where, argv, expected", [
    ("bad", ["strategy=typo_zero3"], "{dir}/strategy/typo_zero3.yaml: reduce_bucket_sise is not a key of the "
     "deepspeed family (ZeroConfig); did you mean reduce_bucket_size?"),
    ("bad", ["strategy=type_zero3"], "{dir}/strategy/type_zero3.yaml: reduce_bucket_size: lots -- "
     "strategy.reduce_bucket_size takes an integer"),
    ("bad", ["model=strint"], "{dir}/model/strint.yaml: n_layers: two -- model.n_layers takes an integer"),
    ("myconf", ["strategy=my_zero3", "strategy.reduce_bucket_sise=5"],
     "strategy.reduce_bucket_sise=5: no such key; did you mean strategy.reduce_bucket_size? "
     "(strategy.reduce_bucket_size=5)"),
    ("myconf", ["strategy=my_zero3", "strategy.reduce_bucket_size=lots"],
     "strategy.reduce_bucket_size=lots: strategy.reduce_bucket_size takes an integer"),
    ("myconf", ["strategy=my_zero33"], "strategy=my_zero33: no such strategy; did you mean my_zero3? "
     "(strategy=my_zero3); the options: 3d, auto, ddp,"),
    ("myconf", ["+experiment=my_exp"], "+experiment=my_exp: experiment is already in the defaults list "
     "(conf/train.yaml); write experiment=my_exp (no +)"),
    (None, ["+logger=csv"], "+logger=csv: logger is already in the defaults list (conf/train.yaml); "
     "write logger=csv (no +)"),
], ids=["key-in-file", "type-in-file", "model-type-in-file", "key-on-top", "type-on-top", "near-user-option",
        "plus-experiment", "plus-logger"])
def test_an_error_in_or_on_a_users_yaml_is_said_as_it_is(project, where, argv, expected):
    """Every one of these said "<group>=<option>: no such <group>; did you mean <a built-in>?" (or
    Hydra's "Multiple values for experiment"), though the option exists."""
    from recipes.cli_help import composition_problems
    from recipes.compose import compose

    search = [f"hydra.searchpath=[file://{project / where}]"] if where else []
    with pytest.raises(Exception) as e:
        compose([*search, *argv])
    lines = composition_problems(e.value, [*search, *argv])
    assert len(lines) == 1 and lines[0].startswith(expected.format(dir=project / (where or ""))), lines
    if "no such strategy" in expected:
        assert "my_fsdp2, my_zero3" in lines[0]  # (the user's options are listed too)


@pytest.mark.unit
def test_help_lists_the_users_options(project):
    from recipes.cli_help import groups_help

    page = groups_help(["--config-dir", str(project / "myconf")])
    assert "my_zero3" in page and "my_gpt" in page and "my_zero3" not in groups_help()


@pytest.mark.subprocess
def test_a_sweeps_preflight_sees_the_users_config_dir(project, tmp_path):
    """``train.py -m`` refused every point of a user's presets as "no such strategy" before any job
    ran. One point here is a real typo, so preflight refuses the sweep and nothing trains."""
    cmd = [sys.executable, "train.py", "-m", "--config-dir", str(project / "myconf"), "strategy=my_fsdp2,my_zero33",
           "model=my_gpt", "cluster=my_cpu2", "trainer.max_steps=1", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "1 of the sweep's 2 jobs cannot run" in proc.stderr, proc.stderr
    assert "0  ok            strategy=my_fsdp2" in proc.stderr, proc.stderr
    assert "strategy=my_zero33: no such strategy; did you mean my_zero3?" in proc.stderr, proc.stderr


@pytest.mark.subprocess
def test_a_sweeps_preflight_composes_the_users_top_config(project, tmp_path):
    """The preflight composed conf/train.yaml whatever ``--config-name`` said: a point valid
    there but not in the user's config (strategy=single on its 2-device cluster) was started."""
    cmd = [sys.executable, "train.py", "-m", "--config-dir", str(project / "myconf"), "--config-name", "my_train",
           "strategy=single,ddp", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "strategy=single runs one process, but cluster.nodes=1 x cluster.devices=2" in proc.stderr, proc.stderr


@pytest.mark.unit
def test_launch_py_says_the_hosts_need_the_users_config_dir(project, monkeypatch, capsys):
    """A k8s / SageMaker job's hosts run train.py with the user's ``--config-dir`` as typed here:
    launch.py composed with it and said nothing, so the pods stopped with 'no such strategy'."""
    import launch

    monkeypatch.chdir(project)
    base = ["cluster=k8s", "cluster.k8s.image=r/s:1", "cluster.k8s.volume_claim=runs", "strategy=my_zero3",
            "model=my_gpt", "--dry-run"]
    launch.main(["-cd", "myconf", *base])
    out, err = capsys.readouterr()
    pod = json.loads(out)["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert pod["command"][2:4] == ["-cd", "myconf"], pod["command"]
    assert "your own config directory as typed here (-cd myconf): it must be at that path there" in err, err
    launch.main([*base[:3], "strategy=zero3", "model=gpt_nano", "--dry-run"])
    assert "config directory" not in capsys.readouterr().err
