"""SageMaker: ``python launch.py cluster=sagemaker_p5_2node strategy=fsdp ...`` builds a training
job with the SageMaker Python SDK (v3, ``ModelTrainer``) and submits it; ``--dry-run`` prints the
job's arguments (JSON alone on stdout) and the exact command every host runs (stderr), and needs
neither the SDK nor AWS.

Every host runs the same command, ``python train.py <your overrides> <the paths below>``, in the
source directory SageMaker unpacks (the repository, uploaded by the SDK). Inside the container
train.py reads SageMaker's environment (``in_container``, ``environment``): one node per
instance, ``cluster.devices`` ranks per node started by launchers/local.py, the c10d rendezvous
at SageMaker's master host. The run directory is ``/opt/ml/checkpoints/run``, on each host's own
disk (several hosts: the command declares it per host, checkpoints/hosts.py), which SageMaker
syncs with ``cluster.sagemaker.checkpoint_s3_uri`` (default ``<output_path>/checkpoints``; a
job with neither is refused: its checkpoints and report would vanish with it), so a restarted
job finds them; ``/opt/ml/model`` and ``/opt/ml/output`` go to ``output_path``. Data comes in
through input channels (``cluster.sagemaker.inputs``, name -> S3 URI, mounted at
``/opt/ml/input/data/<name>``): a ``data.path`` there is checked against the declared channels on
the submitting machine, and for existence in the container.

The SDK is an optional extra (``pip install -e ".[sagemaker]"``), imported by ``submit`` only.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from checkpoints.hosts import PER_HOST
from launchers.registry import launcher

if TYPE_CHECKING:
    from recipes.job import Job

CHANNELS_DIR = "/opt/ml/input/data"
"""Where SageMaker mounts each input channel (``cluster.sagemaker.inputs``): <here>/<channel>."""
CODE_DIR = "/opt/ml/input/data/code"
"""Where SageMaker unpacks the source directory (the command runs there)."""
RUN_DIR = "/opt/ml/checkpoints/run"
CHECKPOINT_DIR = "/opt/ml/checkpoints"
SOURCE_DIR = str(Path(__file__).resolve().parent.parent)
"""What the SDK uploads: the repository (launch.py's directory)."""
IGNORE = [".git", "__pycache__", "outputs", "multirun", ".venv", "*.egg-info", "wandb", "lightning_logs"]


# --------------------------------------------------------------------------- inside the container
def in_container() -> bool:
    """This process runs in a SageMaker training job (the environment SageMaker sets up)."""
    return "SM_CURRENT_HOST" in os.environ and "SM_HOSTS" in os.environ


@dataclass(frozen=True)
class Environment:
    hosts: int
    host_rank: int
    master_addr: str
    master_port: int
    gpus: int
    job_name: str


def _list(text: str) -> list[str]:
    try:
        return list(json.loads(text))
    except ValueError:
        return list(ast.literal_eval(text))


def environment() -> Environment:
    """The job's shape as SageMaker describes it to this host."""
    e = os.environ
    hosts = _list(e["SM_HOSTS"])
    return Environment(hosts=int(e.get("SM_HOST_COUNT", len(hosts))),
                       host_rank=int(e.get("SM_CURRENT_HOST_RANK", hosts.index(e["SM_CURRENT_HOST"]))),
                       master_addr=e.get("SM_MASTER_ADDR", min(hosts)),
                       master_port=int(e.get("SM_MASTER_PORT", "29500")),
                       gpus=int(e.get("SM_NUM_GPUS", "0")),
                       job_name=e.get("TRAINING_JOB_NAME", "job"))


def problems(nodes: int, devices: int, accelerator: str) -> list[str]:
    """The cluster config against the job SageMaker really started (inside the container)."""
    env, out = environment(), []
    if nodes != env.hosts:
        out.append(f"cluster.nodes={nodes} but this SageMaker job has {env.hosts} instance(s): "
                   f"set cluster.nodes={env.hosts} (launch.py sets the instance count from it)")
    if accelerator == "gpu" and devices > env.gpus:
        out.append(f"cluster.devices={devices} but this instance has {env.gpus} GPU(s): "
                   f"set cluster.devices<={env.gpus}")
    return out


# --------------------------------------------------------------------------- before submission
def channel_of(path: Any) -> str | None:
    """The input channel a container path is in (/opt/ml/input/data/<channel>/...), or None."""
    parts = str(path).split("/")
    root = CHANNELS_DIR.split("/")
    if path is None or parts[:len(root)] != root or len(parts) <= len(root):
        return None
    return parts[len(root)]


def checkpoint_destination(s: Any) -> str | None:
    """Where the run directory is synced: checkpoint_s3_uri, else <output_path>/checkpoints."""
    if s.checkpoint_s3_uri:
        return s.checkpoint_s3_uri
    return f"{s.output_path.rstrip('/')}/checkpoints" if s.output_path else None


def torch_minimum(source_dir: str = SOURCE_DIR) -> str | None:
    """The torch minimum the uploaded pyproject.toml declares (``"torch>=X.Y"``): what each
    host's ``pip install -e .`` installs over an older image's torch. None: none declared."""
    path = Path(source_dir) / "pyproject.toml"
    found = re.search(r'^\s*"torch>=([0-9.]+)', path.read_text(), re.M) if path.is_file() else None
    return found.group(1) if found else None


def _release(version: str) -> tuple[int, ...] | None:
    parts = version.split(".")
    return tuple(int(p) for p in parts) + (0,) * (3 - len(parts)) if all(p.isdigit() for p in parts) else None


def image_problems(s: Any, source_dir: str = SOURCE_DIR) -> list[str]:
    """The SDK's PyTorch image (no image_uri) older than the torch pyproject.toml requires: each
    host's ``pip install -e .`` would replace the image's torch."""
    minimum = torch_minimum(source_dir)
    have, need = _release(str(s.framework_version)), _release(minimum or "")
    if s.image_uri is not None or have is None or need is None or have >= need:
        return []
    return [f"cluster.sagemaker.framework_version={s.framework_version}: the PyTorch image's torch is "
            f"older than pyproject.toml's torch>={minimum}, which each host's `pip install -e .` would "
            f"install over it; set cluster.sagemaker.framework_version=<a version >= {minimum}> "
            f"(e.g. {'.'.join(map(str, need))}), or cluster.sagemaker.image_uri=<an image with "
            f"torch>={minimum}>"]


def submission_problems(cluster: Any, data: Any) -> list[str]:
    """What would make the job lose its results, miss its data or replace its image's torch,
    checked on the submitting machine: a checkpoint destination on S3, every container data path
    in a declared channel, the image's torch version."""
    s, out = cluster.sagemaker, []
    if checkpoint_destination(s) is None:
        out.append("cluster.sagemaker.checkpoint_s3_uri=null and cluster.sagemaker.output_path=null: "
                   "the run directory (checkpoints, report.json) would vanish with the job; set "
                   "cluster.sagemaker.output_path=s3://<bucket>/<prefix> (checkpoints go to its "
                   "checkpoints/) or cluster.sagemaker.checkpoint_s3_uri=s3://<bucket>/<prefix>")
    for key in ("output_path", "checkpoint_s3_uri"):
        value = getattr(s, key)
        if value is not None and not str(value).startswith("s3://"):
            out.append(f"cluster.sagemaker.{key}={value} is not an S3 URI: set "
                       f"cluster.sagemaker.{key}=s3://<bucket>/<prefix>")
    out += image_problems(s)
    for key in ("path", "val_path", "tokenizer"):
        value = getattr(data, key, None)
        channel = channel_of(value)
        if value is not None and str(value).startswith(CHANNELS_DIR) and channel not in s.inputs:
            out.append(f"data.{key}={value} is in channel {channel!r}, which cluster.sagemaker.inputs "
                       f"does not declare (declared: {', '.join(s.inputs) or 'none'}): add "
                       f"+cluster.sagemaker.inputs.{channel}=s3://<bucket>/<prefix>")
    return out


def container_path(path: str) -> bool:
    """A path of the container's input channels: checked there, not on the submitting machine
    (``core.knobs.paths_elsewhere``; ``submission_problems`` checks its channel)."""
    return channel_of(path) is not None


# --------------------------------------------------------------------------- building the job
def host_command(overrides: list[str], hosts: int = 1) -> str:
    """What every host runs, in CODE_DIR: our dependencies (the PyTorch image has torch), then
    train.py with the user's overrides and SageMaker's paths. Several hosts: each one's run
    directory is its own disk, synced to one S3 prefix, which the command declares
    (checkpoints/hosts.py: a save is committed per host, a restart resumes from the union)."""
    args = [*overrides, f"hydra.run.dir={RUN_DIR}"]
    env = f"{PER_HOST}=1 " if hosts > 1 else ""
    return f"pip install -q -e . && {env}python train.py " + " ".join(shlex.quote(a) for a in args)


def job_arguments(cluster: Any, overrides: list[str], source_dir: str) -> dict[str, Any]:
    """``ModelTrainer``'s arguments as plain data (``submit`` turns them into the SDK's objects)."""
    s = cluster.sagemaker
    image = s.image_uri or {"framework": "pytorch", "version": s.framework_version,
                            "py_version": s.py_version, "instance_type": s.instance_type,
                            "image_scope": "training", "region": s.region}
    return {
        "base_job_name": s.base_job_name,
        "role": s.role,
        "training_image": image,
        "source_code": {"source_dir": source_dir, "command": host_command(overrides, cluster.nodes),
                        "ignore_patterns": IGNORE},
        "compute": {"instance_type": s.instance_type, "instance_count": cluster.nodes,
                    "volume_size_in_gb": s.volume_gb},
        "stopping_condition": {"max_runtime_in_seconds": s.max_run_s},
        "output_data_config": {"s3_output_path": s.output_path} if s.output_path else None,
        "checkpoint_config": ({"s3_uri": checkpoint_destination(s), "local_path": CHECKPOINT_DIR}
                              if checkpoint_destination(s) else None),
        "input_data_config": [{"channel_name": name, "data_source": uri}
                              for name, uri in sorted(s.inputs.items())] or None,
        "environment": {"OMP_NUM_THREADS": "1"},
    }


def dry_run(args: dict[str, Any], hosts: int) -> tuple[str, list[str]]:
    """The job's arguments alone (JSON, as ``launch.py --dry-run`` prints them on stdout) and what
    is said of them (stderr): each host's command, where its checkpoints go."""
    lines = ["SageMaker training job: its ModelTrainer arguments on stdout (JSON)",
             f"each host runs, in {CODE_DIR}:"]
    lines += [f"  algo-{i + 1} (SM_CURRENT_HOST_RANK={i}): {args['source_code']['command']}"
              for i in range(hosts)]
    if hosts > 1 and args["checkpoint_config"]:
        lines.append(f"each host writes its ranks' checkpoint files into its own {CHECKPOINT_DIR}, which "
                     f"SageMaker uploads to {args['checkpoint_config']['s3_uri']}; a restarted job gets "
                     "their union back on every host and resumes from the newest checkpoint every host "
                     "uploaded whole")
    return json.dumps(args, indent=1), lines


def build(args: dict[str, Any]) -> Any:
    """The SDK's ``ModelTrainer`` for ``args`` (no AWS call but the image lookup)."""
    from sagemaker.core import image_uris
    from sagemaker.train import ModelTrainer
    from sagemaker.train.configs import (
        CheckpointConfig,
        Compute,
        InputData,
        OutputDataConfig,
        SourceCode,
        StoppingCondition,
    )

    image = args["training_image"]
    if isinstance(image, dict):
        image = image_uris.retrieve(**{k: v for k, v in image.items() if v is not None})
    built = {
        "training_image": image,
        "source_code": SourceCode(**args["source_code"]),
        "compute": Compute(**args["compute"]),
        "stopping_condition": StoppingCondition(**args["stopping_condition"]),
        "output_data_config": (OutputDataConfig(**args["output_data_config"])
                               if args["output_data_config"] else None),
        "checkpoint_config": (CheckpointConfig(**args["checkpoint_config"])
                              if args["checkpoint_config"] else None),
        "input_data_config": ([InputData(**c) for c in args["input_data_config"]]
                              if args["input_data_config"] else None),
    }
    rest = {k: v for k, v in args.items() if k not in built and v is not None}
    return ModelTrainer(**{k: v for k, v in built.items() if v is not None}, **rest)


def submit(args: dict[str, Any]) -> str:
    """Start the job (not waiting for it); its name."""
    trainer = build(args)
    trainer.train(wait=False)
    return str(getattr(trainer, "_latest_training_job", None) or args["base_job_name"])


# --------------------------------------------------------------------------- launch.py's step
def _submission_problems(job: Job, overrides: list[str]) -> list[str]:
    return submission_problems(job.cluster, job.data)


def _client_problems(job: Job) -> list[str]:
    import importlib.util

    if importlib.util.find_spec("sagemaker") is None:
        return ["submitting needs the SageMaker Python SDK, which is not installed: "
                "pip install -e '.[sagemaker]' (or add --dry-run to see the job without it)"]
    return []


def _dry_run(job: Job, overrides: list[str]) -> tuple[str, list[str]]:
    return dry_run(job_arguments(job.cluster, overrides, SOURCE_DIR), job.cluster.nodes)


def _submit(job: Job, overrides: list[str]) -> str:
    return f"submitted SageMaker training job {submit(job_arguments(job.cluster, overrides, SOURCE_DIR))}"


@launcher("sagemaker", submission_problems=_submission_problems, client_problems=_client_problems,
          dry_run=_dry_run, submit=_submit, elsewhere=container_path)
def launch_problems(job: Job) -> list[str]:
    """Outside a SageMaker container (inside it, ``problems``): launch.py submits the job."""
    return [f"cluster.launcher=sagemaker: the ranks start inside a SageMaker training job; "
            f"submit it with python launch.py cluster={job.cluster.name} ... (--dry-run to see it first)"]
