"""Submit a training job to a cluster that needs a submission step of its own: SageMaker, or
Kubernetes (a Kubeflow PyTorchJob).

    python launch.py cluster=sagemaker_p5_2node strategy=fsdp model=llama_7b --dry-run
    python launch.py cluster=sagemaker_p5_2node strategy=fsdp model=llama_7b \\
        cluster.sagemaker.role=arn:aws:iam::<account>:role/<role> \\
        cluster.sagemaker.output_path=s3://<bucket>/stratagem \\
        +cluster.sagemaker.inputs.train=s3://<bucket>/data data=jsonl data.path=/opt/ml/input/data/train/corpus.jsonl

Takes train.py's overrides, checks the run they describe as train.py would (not this machine),
asks the planner whether it fits, then builds the SageMaker training job (launchers/sagemaker.py)
and submits it with the SageMaker Python SDK (``pip install -e ".[sagemaker]"``). ``--dry-run``
prints the job's arguments and the exact command every host will run; it needs neither the SDK
nor AWS.

    python launch.py cluster=k8s cluster.k8s.image=<registry>/stratagem:<tag> \\
        cluster.k8s.volume_claim=<ReadWriteMany PVC> cluster.nodes=2 strategy=fsdp [--dry-run]

writes the PyTorchJob manifest (launchers/k8s.py) and applies it with the kubernetes client
(``pip install -e ".[k8s]"``); ``--dry-run`` prints it. Other clusters need no launch step: ``python train.py`` (local, torchrun) or
``python train.py -m hydra/launcher=submitit_slurm cluster=slurm_...`` (Slurm).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from recipes import cli

ROOT = Path(__file__).resolve().parent


def main(argv: list[str]) -> None:
    if {"-h", "--help"} & set(argv):
        print(__doc__ + "\n" + cli.groups_help())
        return
    from launchers import k8s, sagemaker
    import planner
    from recipes.config import compose
    from recipes.job import RUN, validate

    dry = "--dry-run" in argv
    overrides = cli.normalize([a for a in argv if a != "--dry-run"])
    cfg = cli.or_exit(lambda: compose(overrides))

    def _problems(job) -> list[str]:
        out = []
        if job.cluster.launcher not in ("sagemaker", "k8s"):
            out.append(f"cluster={job.cluster.name} (cluster.launcher={job.cluster.launcher}) needs no "
                       "launch step: run python train.py ... (Slurm: python train.py -m "
                       "hydra/launcher=submitit_slurm ...); launch.py submits cluster.launcher=sagemaker "
                       "and k8s clusters, e.g. cluster=sagemaker_p5_2node or cluster=k8s")
        if job.cluster.launcher == "sagemaker":
            out += sagemaker.submission_problems(job.cluster, job.data)
        if job.cluster.launcher == "k8s":
            out += k8s.submission_problems(job.cluster, overrides)
        try:
            planner.check(job, to="submit")
        except planner.WillNotFit as e:
            out.append(str(e))
        if job.cluster.launcher == "k8s" and not dry:
            if importlib.util.find_spec("kubernetes") is None:
                out.append("applying the PyTorchJob needs the kubernetes client, which is not "
                           "installed: pip install -e '.[k8s]' (or add --dry-run to print it)")
            elif k8s.reachable():
                out.append(k8s.reachable())
        if job.cluster.launcher == "sagemaker" and not dry and importlib.util.find_spec("sagemaker") is None:
            out.append("submitting needs the SageMaker Python SDK, which is not installed: "
                       "pip install -e '.[sagemaker]' (or add --dry-run to see the job without it)")
        return out

    from strategies.checks import paths_elsewhere

    with paths_elsewhere(sagemaker.container_path):
        job = cli.or_exit(lambda: validate(cfg, depth=RUN, extra=[_problems], auto=planner.choose))
    if job.cluster.launcher == "k8s":
        manifest = k8s.manifest(job.cluster, overrides, job.run.accelerator)
        if dry:
            print(k8s.dry_run(manifest))
            return
        print(f"created Kubeflow PyTorchJob {k8s.apply(manifest)}")
        return
    args = sagemaker.job_arguments(job.cluster, overrides, str(ROOT))
    if dry:
        print(sagemaker.dry_run(args, job.cluster.nodes))
        return
    print(f"submitted SageMaker training job {sagemaker.submit(args)}")


if __name__ == "__main__":
    main(sys.argv[1:])
