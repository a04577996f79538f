"""Submit a training job to a cluster that needs a submission step of its own: SageMaker, or
Kubernetes (a Kubeflow PyTorchJob).

    python launch.py cluster=sagemaker_p5_2node strategy=fsdp model=llama_7b --dry-run
    python launch.py cluster=sagemaker_p5_2node strategy=fsdp model=llama_7b \\
        cluster.sagemaker.role=arn:aws:iam::<account>:role/<role> \\
        cluster.sagemaker.output_path=s3://<bucket>/stratagem \\
        +cluster.sagemaker.inputs.train=s3://<bucket>/data data=jsonl data.path=/opt/ml/input/data/train/corpus.jsonl \\
        data.tokenizer=/opt/ml/input/data/train/tokenizer

Takes train.py's overrides, checks the run they describe as train.py would (not this machine),
asks the planner whether it fits, then builds the SageMaker training job (launchers/sagemaker.py)
and submits it with the SageMaker Python SDK (``pip install -e ".[sagemaker]"``). ``--dry-run``
prints the job's arguments (JSON, alone on stdout) and the exact command every host will run (on
stderr); it needs neither the SDK nor AWS.

    python launch.py cluster=k8s cluster.k8s.image=<registry>/stratagem:<tag> \\
        cluster.k8s.volume_claim=<ReadWriteMany PVC> cluster.nodes=2 strategy=fsdp [--dry-run]

writes the PyTorchJob manifest (launchers/k8s.py) and applies it with the kubernetes client
(``pip install -e ".[k8s]"``); ``--dry-run`` prints it alone on stdout (``... --dry-run | kubectl
apply -f -``), what it says of it on stderr. Each launcher says whether it has this step
(``@launcher(..., submit=...)``, launchers/registry.py). Other clusters need no launch step: ``python train.py`` (local, torchrun) or
``python train.py -m hydra/launcher=submitit_slurm cluster=slurm_...`` (Slurm).
"""

from __future__ import annotations

import sys

from recipes import cli

NO_LAUNCH_STEP = ("cluster={name} (cluster.launcher={launcher}) needs no launch step: run python train.py ... "
                  "(Slurm: python train.py -m hydra/launcher=submitit_slurm ...); launch.py submits "
                  "cluster.launcher=sagemaker and k8s clusters, e.g. cluster=sagemaker_p5_2node or cluster=k8s")


def main(argv: list[str]) -> None:
    if {"-h", "--help"} & set(argv):
        from recipes.cli_help import groups_help
        from recipes.key_help import option_keys

        print("\n".join([__doc__, groups_help(argv), "", *option_keys(argv, "launch.py")]))
        return
    import planner
    from launchers import registry
    from recipes.config import compose_chosen
    from recipes.job import RUN, validate
    from core.errors import ConfigError
    from core.knobs import paths_elsewhere

    dry = "--dry-run" in argv
    if (sweep := cli.one_point([a for a in argv if a != "--dry-run"], "launch.py")) is not None:
        print(sweep, file=sys.stderr)
        sys.exit(cli.CONFIG_ERROR)
    overrides = cli.normalize([a for a in argv if a != "--dry-run"])
    cfg, _, origin = cli.or_exit(lambda: compose_chosen(overrides), overrides)

    def _problems(job) -> list[str]:
        chosen = registry.get(job.cluster.launcher)  # (launchers/registry.py: its submission step)
        out = []
        if not chosen.submits:
            out.append(NO_LAUNCH_STEP.format(name=job.cluster.name, launcher=job.cluster.launcher))
        else:
            out += chosen.submission_problems(job, overrides)
        try:
            planner.check(job, to="submit")
        except planner.WillNotFit as e:
            out.append(str(e))
        except ConfigError as e:  # (a preset the backend cannot run: beside the other problems)
            out += e.problems
        if chosen.submits and not dry:
            out += chosen.client_problems(job)
        return out

    def _elsewhere(path: str) -> bool:  # (a SageMaker channel: checked in the container)
        return any(c.elsewhere(path) for c in registry.every() if c.elsewhere is not None)

    with paths_elsewhere(_elsewhere):
        job = cli.or_exit(lambda: validate(cfg, depth=RUN, extra=[_problems], auto=planner.choose, origin=origin))
    chosen = registry.get(job.cluster.launcher)
    if not dry:
        print(chosen.submit(job, overrides))
        for line in _configs_there(overrides):
            print(line, file=sys.stderr)
        return
    document, notes = chosen.dry_run(job, overrides)
    for line in notes + _configs_there(overrides):  # (stderr: stdout is the document alone, for the tool)
        print(line, file=sys.stderr)
    print(document)


def _configs_there(overrides: list[str]) -> list[str]:
    """The job's hosts run train.py with the user's own config directory as given here (its
    absolute path on this machine): say that it must be at that path there."""
    from recipes.compose import search_args

    search, rest = search_args(overrides)
    if not search:
        return []
    typed = " ".join(a for a in overrides if a not in rest)  # (as the hosts' command has them)
    return [f"the job's hosts compose with your own config directory as typed here ({typed}): it must be "
            "at that path there too (in the image, or on storage they mount), or their train.py stops "
            "with 'no such ...'"]


if __name__ == "__main__":
    main(sys.argv[1:])
