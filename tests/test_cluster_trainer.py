"""What a cluster implies for the trainer (``cluster.trainer``: a GPU cluster's precision and
batch) follows the cluster -- a cluster derived from a stock one keeps its parent's, a cluster file
may carry its own -- and yields to the user's own values: the command line, an experiment and the
chosen trainer option's file (a user's trainer preset) all win over it; the plan and the dry run
say which values came from the cluster."""

from __future__ import annotations

import pytest

from tests.test_config_dir import project  # noqa: F401  (the user's config directory, under tmp_path)

H100 = "defaults: [node_8x_h100, _self_]\n"
MINE = {  # (the audit's: a trainer preset of the user's, clusters derived from a stock GPU cluster)
    "trainer/my_tr.yaml": "defaults: [default, _self_]\nmax_steps: 3\nglobal_batch_size: 8\n"
                          "micro_batch_size: 4\n",
    "trainer/my_tr32.yaml": "defaults: [default, _self_]\nprecision: '32'\n",
    "cluster/my_h100.yaml": H100 + "name: my_h100\ndevices: 4\n",
    "cluster/my_h100_noname.yaml": H100 + "devices: 4\n",
    "cluster/my_h100_big.yaml": H100 + "name: my_h100_big\ntrainer:\n  global_batch_size: 32\n",
    "cluster/my_h100_fp32.yaml": H100 + "name: my_h100_fp32\ntrainer:\n  precision: null\n",
    "cluster/my_cpu_bf16.yaml": "defaults: [local, _self_]\nname: my_cpu_bf16\ndevices: 2\naccelerator: cpu\n"
                                "trainer:\n  precision: bf16-mixed\n  micro_batch_size: 2\n"
                                "  global_batch_size: 4\n",
}


@pytest.fixture
def mine(project) -> list[str]:  # noqa: F811
    """The config directory, as the command line names it."""
    for name, text in MINE.items():
        (project / "myconf" / name).parent.mkdir(parents=True, exist_ok=True)
        (project / "myconf" / name).write_text(text)
    return ["--config-dir", str(project / "myconf")]


def _trainer(*overrides: str) -> tuple:
    from recipes.compose import compose

    t = compose(list(overrides)).trainer
    return t.precision, t.micro_batch_size, t.global_batch_size


STOCK = {  # (what conf/cluster_trainer/ implied before cluster.trainer, by cluster)
    "local": ("32", 8, 16), "torchrun": ("32", 8, 16), "ray": ("32", 8, 16), "slurm_local": ("32", 8, 16),
    "h200_1x": ("bf16-mixed", 1, 8), "k8s": ("bf16-mixed", 1, 128), "node_8x_a100_80g": ("bf16-mixed", 1, 64),
    "node_8x_h100": ("bf16-mixed", 1, 64), "sagemaker_p5_2node": ("bf16-mixed", 1, 128),
    "slurm_64x8_a100": ("bf16-mixed", 1, 1024), "slurm_8x8_h100": ("bf16-mixed", 1, 512),
}


@pytest.mark.unit
def test_the_stock_clusters_imply_what_they_did_and_yours_still_win():
    for cluster, implied in STOCK.items():
        assert _trainer(f"cluster={cluster}") == implied, cluster
    assert _trainer("cluster=node_8x_h100", "trainer.global_batch_size=8") == ("bf16-mixed", 1, 8)
    assert _trainer("cluster=node_8x_h100", "trainer.precision=32") == ("32", 1, 64)
    assert _trainer("experiment=llama3_8b_lora") == ("bf16-mixed", 2, 128)  # (its own, on node_8x_h100)


@pytest.mark.unit
def test_a_users_trainer_preset_keeps_its_batch_on_a_gpu_cluster(mine):
    """``trainer=my_tr`` (``defaults: [default, _self_]``, global 8, micro 4) on node_8x_h100
    composed global 64, micro 1: the cluster's implications merged after the chosen trainer
    option. What the preset does not set (precision) the cluster still implies; the command line
    beats the preset."""
    assert _trainer(*mine, "trainer=my_tr", "cluster=node_8x_h100") == ("bf16-mixed", 4, 8)
    assert _trainer(*mine, "trainer=my_tr32", "cluster=node_8x_h100") == ("32", 1, 64)
    assert _trainer(*mine, "trainer=my_tr", "cluster=node_8x_h100", "trainer.global_batch_size=16") == \
        ("bf16-mixed", 4, 16)
    assert _trainer(*mine, "trainer=my_tr", "cluster=my_h100") == ("bf16-mixed", 4, 8)


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_train_py_composes_a_users_trainer_preset_and_cluster_alike(mine):
    """train.py's own composition (``@hydra.main``, ``--cfg job --resolve``) agrees with compose's."""
    import subprocess
    import sys

    import yaml

    from tests.conftest import ROOT

    proc = subprocess.run([sys.executable, "train.py", *mine, "trainer=my_tr", "cluster=my_h100", "--cfg", "job",
                           "--resolve"], cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    t = yaml.safe_load(proc.stdout)["trainer"]
    assert (t["precision"], t["micro_batch_size"], t["global_batch_size"]) == ("bf16-mixed", 4, 8), t


@pytest.mark.unit
def test_a_cluster_derived_from_a_gpu_cluster_keeps_its_trainer_implications(mine):
    """``cluster/my_h100.yaml: defaults: [node_8x_h100, _self_]`` planned at precision 32, global
    16, micro 8: the implications were keyed on the option's name. A cluster file carries its own
    (``trainer:``), changes one of its parent's, or drops it (null)."""
    assert _trainer(*mine, "cluster=my_h100") == STOCK["node_8x_h100"]
    assert _trainer(*mine, "cluster=my_h100_noname") == STOCK["node_8x_h100"]
    assert _trainer(*mine, "cluster=my_h100_big") == ("bf16-mixed", 1, 32)
    assert _trainer(*mine, "cluster=my_h100_fp32") == ("32", 1, 64)
    assert _trainer(*mine, "cluster=my_cpu_bf16") == ("bf16-mixed", 2, 4)
    assert _trainer(*mine, "cluster=my_h100", "cluster.trainer.global_batch_size=16") == ("bf16-mixed", 1, 16)


@pytest.mark.unit
def test_the_plan_says_which_trainer_values_the_cluster_implied(mine, capsys):
    import plan

    base = [*mine, "model=llama_1b", "strategy=fsdp2"]
    plan.main([*base, "cluster=my_h100"])
    out = capsys.readouterr().out
    assert ("note: cluster=my_h100 implies trainer.global_batch_size=64 trainer.micro_batch_size=1 "
            "trainer.precision=bf16-mixed (its cluster.trainer; a value of yours -- your trainer preset, "
            "an experiment, the command line -- wins)") in out, out
    assert "plan: fsdp2 on my_h100 (4 devices)" in out, out
    plan.main([*base, "cluster=my_h100", "cluster.devices=2", "trainer=my_tr", "planner.format=json"])
    out, err = capsys.readouterr()
    assert "note: cluster=my_h100 implies trainer.precision=bf16-mixed (its cluster.trainer;" in err, err
    assert "note:" not in out  # (stdout: the JSON alone)
    plan.main([*base, "cluster=my_h100", "trainer.precision=bf16-mixed", "trainer.micro_batch_size=1",
               "trainer.global_batch_size=64"])
    assert "cluster.trainer" not in capsys.readouterr().out  # (all yours)


@pytest.mark.unit
def test_the_dry_run_says_which_trainer_values_the_cluster_implied(mine, capsys):
    from launchers import dry_run

    assert dry_run.main([*mine, "cluster=my_cpu_bf16", "model=gpt_nano", "strategy=ddp", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert ("note: cluster=my_cpu_bf16 implies trainer.global_batch_size=4 trainer.micro_batch_size=2 "
            "trainer.precision=bf16-mixed (its cluster.trainer;") in out, out


@pytest.mark.unit
def test_a_wrong_implication_is_one_line_naming_the_cluster_key(mine):
    from recipes.compose import compose
    from recipes.job import CONFIG, validate
    from strategies import ConfigError

    with pytest.raises(ConfigError) as e:
        validate(compose([*mine, "cluster=my_h100", "cluster.trainer.precision=fp17"]), depth=CONFIG)
    assert any(p.startswith("cluster.trainer.precision='fp17' is not one of 32, bf16-mixed, 16-mixed")
               for p in e.value.problems), e.value.problems

