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
        cfg, chosen, _, _ = query([*search, "strategy=my_zero3", "model=my_gpt", "cluster=my_cpu2"], "", "plan.py")
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
    cfg, chosen, _, _ = query(argv, "", "plan.py")
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


# ------------------------------------------------------- the userconf audit: a user's options, named and found
USER = {  # (written with `defaults: [<built-in>, _self_]` as the README shows, no `name:`; and one named as a built-in)
    "mine/strategy/my_fsdp.yaml": "defaults: [fsdp2, _self_]\nreshard_after_forward: false\n",
    "mine/strategy/my_topk.yaml": "defaults: [ddp, _self_]\ncomm_hook: topk\nstart_step: 1\n",
    "mine/strategy/hand_fsdp2.yaml": "defaults: [/fsdp2_schema@_here_, _self_]\nreduce_fp32: false\n",
    "coll/strategy/fsdp2.yaml": "defaults: [/fsdp2_schema@_here_, _self_]\nname: fsdp2\nreshard_after_forward: false\n",
}
NANO2 = ["model=gpt_nano", "cluster.devices=2", "cluster.accelerator=cpu"]


@pytest.fixture
def user(tmp_path) -> Path:
    for name, text in USER.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def _job(argv: list[str], **kw):
    """plan.py's composition and validation of ``argv``, with what Hydra recorded of it."""
    from recipes.cli import query
    from recipes.job import CONFIG, validate

    cfg, _, _, origin = query(argv, "", "plan.py")
    return validate(cfg, depth=kw.pop("depth", CONFIG), origin=origin, **kw)


@pytest.mark.unit
def test_a_users_file_named_as_a_built_in_loses_to_conf_in_every_composition_and_is_refused(user, caplog):
    """F2: Hydra searches its --config-dir AFTER conf/, so train.py trained conf/'s fsdp2 while
    plan.py, --dry-run, export.py and a sweep's preflight (which put the directory first) planned
    the user's file (comm 0.1 MiB/step against the run's 0.2), without a word. Every composition
    now takes conf/'s, and the user's file is refused by name where it is the option chosen, a
    warning where it is not."""
    from launchers import dry_run
    from strategies import ConfigError

    coll = user / "coll"
    for search in (["--config-dir", str(coll)], [f"hydra.searchpath=[file://{coll}]"]):
        from recipes.compose import compose

        cfg = compose([*search, "strategy=fsdp2", *NANO2])
        assert cfg.strategy.reshard_after_forward is True, search  # (conf/strategy/fsdp2.yaml's)
        with pytest.raises(ConfigError) as e:
            _job([*search, "strategy=fsdp2", *NANO2])
        said = [p for p in e.value.problems if str(coll) in p]
        assert said == [f"{coll}/strategy/fsdp2.yaml: strategy=fsdp2 is conf/strategy/fsdp2.yaml, a built-in "
                        "option Hydra finds before your config directory, so this file is never composed; "
                        "rename it (e.g. strategy/my_fsdp2.yaml starting `defaults: [fsdp2, _self_]`) and "
                        "choose strategy=my_fsdp2"], e.value.problems
    assert dry_run.main(["--config-dir", str(coll), "strategy=fsdp2", *NANO2, "--dry-run"]) == 2
    caplog.clear()
    job = _job(["--config-dir", str(coll), "strategy=ddp", *NANO2])  # (not chosen: a warning, the run goes on)
    assert job.strategy.name == "ddp"
    assert [r.getMessage() for r in caplog.records if str(coll) in r.getMessage()] == [
        f"{coll}/strategy/fsdp2.yaml: strategy=fsdp2 is conf/strategy/fsdp2.yaml, a built-in option Hydra finds "
        "before your config directory, so this file is never composed; rename it (e.g. strategy/my_fsdp2.yaml "
        "starting `defaults: [fsdp2, _self_]`) and choose strategy=my_fsdp2"]


@pytest.mark.unit
def test_a_users_train_yaml_is_refused_as_the_top_config(tmp_path):
    """F2: a copy of conf/train.yaml edited in the user's directory (model: gpt_nano): the dry run
    planned gpt_nano, the run trained conf/train.yaml's gpt_small."""
    from recipes.compose import compose
    from strategies import ConfigError

    (tmp_path / "top").mkdir()
    (tmp_path / "top" / "train.yaml").write_text(
        (ROOT / "conf" / "train.yaml").read_text().replace("model: gpt_small", "model: gpt_nano"))
    assert compose(["--config-dir", str(tmp_path / "top")]).model.name == "gpt_small"  # (as train.py composes)
    with pytest.raises(ConfigError) as e:
        _job(["--config-dir", str(tmp_path / "top")])
    assert [p for p in e.value.problems if "train.yaml" in p] == [
        f"{tmp_path}/top/train.yaml: the top config train is conf/train.yaml, a built-in Hydra finds before "
        "your config directory, so this file is never composed; rename it (e.g. my_train.yaml starting "
        "`defaults: [train, _self_]`) and pass --config-name my_train"], e.value.problems


@pytest.mark.subprocess
def test_train_py_composes_what_the_dry_run_planned_and_refuses_the_shadowed_file(user, tmp_path):
    """The one answer for every tool is train.py's: its composed config (``--cfg job``) is the
    dry run's, and its run is refused before launch as the dry run is."""
    import yaml

    from recipes.compose import compose
    from tests.conftest import run_cli

    argv = ["--config-dir", str(user / "coll"), "strategy=fsdp2", *NANO2]
    shown = run_cli("train.py", "--cfg", "job", *argv, out=tmp_path / "cfg", timeout=120)
    assert yaml.safe_load(shown.proc.stdout)["strategy"] == dict(compose(argv).strategy)
    run = run_cli("train.py", *argv, "trainer.max_steps=1", out=tmp_path / "run", check=False, timeout=120)
    assert run.proc.returncode == 2, run.log
    assert f"{user}/coll/strategy/fsdp2.yaml: strategy=fsdp2 is conf/strategy/fsdp2.yaml" in run.proc.stderr


@pytest.mark.unit
def test_a_users_preset_is_named_by_its_option(user):
    """F1/F6: a user's preset over a built-in one (`defaults: [fsdp2, _self_]` + a key) was planned,
    logged, reported and exported under the built-in's name (`plan: fsdp2 on local`,
    `fsdp2-local.accelerate.yaml`, which a stock export overwrote), and one from a schema without
    `name:` as `?`. The option names it; ``strategy.name`` stays the built-in it derives from."""
    import planner
    from export import _default_name
    from recipes.job import RUN

    mine = ["--config-dir", str(user / "mine")]
    job = _job([*mine, "strategy=my_fsdp", *NANO2, "export=accelerate", "backend=accelerate"], depth=RUN)
    assert (job.strategy.name, job.strategy_option) == ("fsdp2", "my_fsdp")
    assert job.label == "my_fsdp (fsdp2 + reshard_after_forward=false)"
    assert planner.preflight(job).summary().startswith(
        "plan: my_fsdp (fsdp2 + reshard_after_forward=false) on local (2 devices): "), planner.preflight(job).summary()
    meta = job.meta()
    assert (meta["strategy"], meta["strategy_option"], meta["model_option"], meta["cluster_option"],
            meta["experiment_option"]) == ("fsdp2", "my_fsdp", "gpt_nano", "local", None)
    assert _default_name(job) == "my_fsdp-local.accelerate.yaml"
    hand = _job([*mine, "strategy=hand_fsdp2", *NANO2, "export=accelerate", "backend=accelerate"], depth=RUN)
    assert (hand.strategy.name, hand.label, _default_name(hand)) == (
        "hand_fsdp2", "hand_fsdp2", "hand_fsdp2-local.accelerate.yaml")
    assert planner.preflight(hand).summary().startswith("plan: hand_fsdp2 on local (2 devices): ")
    stock = _job(["strategy=fsdp2", "strategy.reshard_after_forward=false", *NANO2])
    assert (stock.label, stock.meta()["strategy_option"]) == ("fsdp2", "fsdp2")


@pytest.mark.unit
@pytest.mark.parametrize("argv, said", [
    (["strategy=ddp", "strategy.name=ddp_powersgd"],
     "strategy.name='ddp_powersgd': set by the preset's file (strategy=ddp), not a knob; remove the override"),
    (["strategy=my_topk", "strategy.name=ddp_topk"],
     "strategy.name='ddp_topk': set by the preset's file (strategy=my_topk), not a knob; remove the override"),
    (["strategy=my_topk", "strategy.name=ddp"], None),  # (the file's own: nothing changes)
], ids=["stock", "user", "the-files-own"])
def test_strategy_name_set_to_another_preset_of_the_family_is_refused(user, argv, said):
    """F4: `strategy=ddp strategy.name=ddp_powersgd` trained plain DDP under a plan line, log and
    report saying ddp_powersgd; only a name of another family was refused."""
    from strategies import ConfigError

    full = ["--config-dir", str(user / "mine"), *argv, *NANO2]
    if said is None:
        assert _job(full).strategy.name == "ddp"
        return
    with pytest.raises(ConfigError) as e:
        _job(full)
    assert [p for p in e.value.problems if p.startswith("strategy.name=")] == [said]
