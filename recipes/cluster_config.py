"""``cluster``'s schema: hardware as data (``ClusterConfig``) and each launcher's keys beside it
(``SlurmConfig``, ``SageMakerConfig``, ``RayConfig``, ``K8sConfig``). Torch-free: ``accelerator=auto``
finds this machine's GPUs through recipes/hardware.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from core.discover import package_folder, registered
from core.knobs import free, knob

CHECKED_AS = "checked as the trainer value it becomes (trainer.<key>), told as this key"

LAUNCHERS = tuple(registered(package_folder("launchers"), "launcher"))
"""cluster.launcher's choices: the names launchers/ registers (``@launcher``), read from the modules'
source (recipes imports no launcher)."""


@dataclass
class SlurmConfig:
    """``cluster.launcher=slurm``: what every Slurm job of the run asks for. The launch callback
    (launchers/slurm.py) hands these to hydra-submitit-launcher, with one task per device."""

    partition: str | None = free(None, "a partition name; checked against sinfo before submission")
    """The Slurm partition the jobs go to (sbatch --partition); None: Slurm's default partition."""
    time_min: int = knob(60, min=1)
    """Time limit of each job, minutes (sbatch --time)."""
    account: str | None = free(None, "an account name, checked by Slurm")
    """The account the jobs are charged to (sbatch --account); None: the user's default."""
    qos: str | None = free(None, "a QOS name, checked by Slurm")
    """The quality of service the jobs ask for (sbatch --qos); None: the default."""
    constraint: str | None = free(None, "a feature expression, checked by Slurm")
    """Node features the jobs need (sbatch --constraint, e.g. a100); None: any node."""
    cpus_per_task: int = knob(1, min=1)
    """CPUs per rank (sbatch --cpus-per-task)."""
    mem_gb: int | None = knob(None, min=0)
    """Memory per node, GB (sbatch --mem); 0: all of each node's; None: the partition's default,
    which the planner reads from Slurm where Slurm counts memory (scontrol's DefMemPerNode or
    DefMemPerCPU; in a job, its allocation)."""
    requeue_signal_s: int = knob(90, min=0)
    """Seconds before the time limit Slurm sends SIGUSR1: Lightning saves a checkpoint and
    requeues the job, which resumes from it (0: no signal)."""
    array_parallelism: int = knob(256, min=1)
    """At most this many jobs of a sweep's array run at once."""


@dataclass
class SageMakerConfig:
    """``cluster.launcher=sagemaker``: the training job launch.py builds (the SageMaker SDK)."""

    instance_type: str = free("ml.p5.48xlarge", "a SageMaker training instance type")
    """The instance every host of the job runs on (cluster.nodes of them)."""
    role: str | None = free(None, "an IAM role ARN; None: the SDK's default execution role")
    """The IAM role the job runs as; None: the SDK's default execution role."""
    image_uri: str | None = free(None, "a training image; None: the SDK's PyTorch image")
    """The container image the job runs; None: the SDK's PyTorch image (framework_version)."""
    framework_version: str = free("2.11.0", "a PyTorch image version the SDK knows, at least "
                                            "pyproject.toml's torch minimum (checked before submission)")
    """The SDK's PyTorch image (no image_uri); each host's ``pip install -e .`` keeps its torch
    only when it meets pyproject.toml's minimum (launchers/sagemaker.py ``image_problems``)."""
    py_version: str = free("py312", "the PyTorch image's Python")
    """The Python of the SDK's PyTorch image (no image_uri)."""
    region: str | None = free(None, "an AWS region; None: the SDK's default")
    """The AWS region the image is looked up in; None: the SDK's default."""
    output_path: str | None = free(None, "s3://bucket/prefix for the job's output")
    """Where the job's output goes (/opt/ml/model, /opt/ml/output), s3://bucket/prefix."""
    checkpoint_s3_uri: str | None = free(None, "s3://bucket/prefix synced with /opt/ml/checkpoints")
    """Where checkpoints and the report go; None: <output_path>/checkpoints (one of the two must
    be set, or they vanish with the job)."""
    inputs: dict[str, str] = field(default_factory=dict)
    """Input channels: name -> s3:// URI, mounted at /opt/ml/input/data/<name> on every host
    (point data.path there: /opt/ml/input/data/<name>/<file>)."""
    max_run_s: int = knob(86400, min=1)
    """The job's time limit, seconds."""
    volume_gb: int = knob(100, min=1)
    """EBS volume per instance, GB."""
    base_job_name: str = free("stratagem", "the job name's prefix")
    """The training job's name prefix (the SDK makes each job's name unique from it)."""


@dataclass
class RayConfig:
    """``cluster.launcher=ray``: the Ray cluster whose Ray Train workers run the ranks
    (launchers/ray.py, ``pip install -e ".[ray]"``)."""

    address: str | None = free(None, "auto, host:port or ray://host:port; checked before launch "
                                     "(launchers/ray.py problems)")
    """None: start a Ray instance on this machine for the job (stopped after it) | auto: the
    cluster ``ray start`` runs here | host:port (the head's GCS) | ray://host:port (Ray Client)."""
    cpus_per_worker: float = knob(1.0, above=0.0)
    """CPUs Ray reserves for each rank (its worker process)."""


@dataclass
class K8sConfig:
    """``cluster.launcher=k8s``: the Kubeflow PyTorchJob launch.py writes and applies
    (launchers/k8s.py, ``pip install -e ".[k8s]"``)."""

    image: str = free("stratagem:latest", "a container image holding this repository, installed; "
                                          "pulled by the cluster")
    """The image every pod runs (the repository in ``workdir``, ``pip install -e .`` done)."""
    namespace: str = free("default", "a Kubernetes namespace, checked by the cluster")
    """The Kubernetes namespace the PyTorchJob is created in."""
    job_name: str | None = free(None, "the PyTorchJob's name: lowercase letters, digits and '-' "
                                      "(checked before launch)")
    """None: a name new to each launch (stratagem-<UTC date>-<time>-<4 hex>), so every job gets a
    run directory of its own; name one to run (or resume) in <mount_path>/<job_name>."""
    workdir: str = free("/workspace/stratagem", "the repository's path inside the image")
    """Where the repository is inside the image: each pod runs train.py there."""
    volume_claim: str | None = free(None, "a ReadWriteMany PersistentVolumeClaim's name")
    """Mounted at ``mount_path`` on every pod: the run directory (report, checkpoints) every node
    must see; None is refused (they would vanish with the pods)."""
    mount_path: str = free("/mnt/stratagem", "an absolute path inside the pods")
    """Where ``volume_claim`` is mounted; the run directory is <mount_path>/<job_name>."""
    cpus: float = knob(8.0, above=0.0)
    """CPUs each pod requests (and is limited to); accelerator cpu: at least cluster.devices, one
    per rank, unless cluster.oversubscribe (checked before submission)."""
    memory_GB: float = knob(64.0, above=0.0)
    """Memory each pod requests (and is limited to), GB."""
    gpu_resource: str = free("nvidia.com/gpu", "the cluster's GPU resource name")
    """The extended resource a pod asks cluster.devices of (accelerator gpu)."""


@dataclass
class ClusterTrainer:
    """``cluster.trainer``: what the cluster implies for the trainer (a GPU cluster: bf16-mixed,
    one sequence per micro-batch, a global batch that divides its world), taken where the trainer
    option leaves conf/trainer/default.yaml's ``${implied:<key>,<its own default>}`` in place --
    a value of the user's (the chosen trainer option's file, an experiment, the command line)
    wins. A cluster derived from another keeps its parent's; None: implies nothing."""

    precision: str | None = free(None, CHECKED_AS)
    """The trainer.precision this cluster implies (a GPU cluster: bf16-mixed); None: none."""
    micro_batch_size: int | None = free(None, CHECKED_AS)
    """The trainer.micro_batch_size this cluster implies (a GPU cluster: 1); None: none."""
    global_batch_size: int | None = free(None, CHECKED_AS)
    """The trainer.global_batch_size this cluster implies (one its world divides); None: none."""


IMPLIED = "${implied:"


def implied(key: str, default: Any, *, _root_: Any) -> Any:
    """The ``${implied:<key>,<default>}`` resolver (conf/trainer/default.yaml): what the composed
    config's cluster implies for ``trainer.<key>`` (``cluster.trainer.<key>``), else ``default``."""
    from omegaconf import OmegaConf

    value = OmegaConf.select(_root_, f"cluster.trainer.{key}", default=None)
    return default if value is None else value


def implied_keys(cfg: Any) -> list[str]:
    """The trainer keys a composed config takes from its cluster: an ``${implied:...}`` no value of
    the user's replaced, whose cluster implies something."""
    from omegaconf import OmegaConf

    trainer = cfg.get("trainer")
    raw = OmegaConf.to_container(trainer, resolve=False) if trainer is not None else {}
    return [key for key, value in raw.items() if isinstance(value, str) and value.startswith(IMPLIED)
            and OmegaConf.select(cfg, f"cluster.trainer.{value[len(IMPLIED):].split(',')[0]}",
                                 default=None) is not None]


def implied_note(cfg: Any) -> str | None:
    """The trainer values a composed config takes from its cluster, in a sentence; None: none."""
    if not (keys := implied_keys(cfg)):
        return None
    taken = " ".join(f"trainer.{key}={cfg.trainer[key]}" for key in keys)
    return (f"cluster={cfg.cluster.name} implies {taken} (its cluster.trainer; a value of yours -- "
            "your trainer preset, an experiment, the command line -- wins)")


def implied_problems(problems: list[str], cfg: Any) -> list[str]:
    """The trainer's problems, a value the cluster implied told as the cluster's key: the one to fix."""
    keys = implied_keys(cfg)
    return [next((p.replace(f"trainer.{k}", f"cluster.trainer.{k}") for k in keys
                  if p.startswith(f"trainer.{k}=")), p) for p in problems]


@dataclass
class ClusterConfig:
    """Hardware as data: the launcher reads nodes, devices, accelerator and the launch keys, the
    planner the hardware."""

    name: str = "local"
    """The cluster's name: the YAML file's stem under conf/cluster/."""
    nodes: int = knob(1, min=1)
    """Machines the job runs on (the launcher starts cluster.devices processes on each)."""
    devices: int = knob(1, min=1)
    """Processes per node (one per GPU; on CPU, per core at most unless oversubscribe)."""
    accelerator: str = knob("auto", choices=("auto", "cpu", "gpu"))
    """auto (this machine's GPUs if it has any, found without torch, else CPU) | cpu | gpu."""
    device_memory_GB: float = knob(24.0, above=0.0)
    """Memory per device, GB = 1e9 bytes (for CPU: the host memory shared by its processes)."""
    peak_tflops: float = knob(0.2, above=0.0)
    """Dense bf16 peak per device, TFLOP/s."""
    intra_node_GBps: float = knob(0.0, min=0.0)
    """Per-device bandwidth to devices on the same node, GB/s (0: no peers)."""
    inter_node_GBps: float = knob(0.0, min=0.0)
    """Per-device bandwidth to other nodes, GB/s (0: one node)."""
    host_memory_GB: float = knob(0.0, min=0.0)
    """Host (CPU) memory per node, GB: what the planner checks CPU offload and each rank's
    build against (a launcher's lower limit wins: cluster.k8s.memory_GB, cluster.slurm.mem_gb)."""
    nvme_GB: float = knob(0.0, min=0.0)
    """NVMe space per node, GB, that the planner checks NVMe offload against."""
    oversubscribe: bool = False
    """Allow more CPU processes than cores (tests of 4-rank meshes on a 2-core machine)."""
    launcher: str = knob("local", choices=LAUNCHERS)
    """How the ranks start: local (this machine), torchrun (one command per node, c10d
    rendezvous), slurm (srun, through hydra/launcher=submitit_slurm), sagemaker (launch.py),
    ray (Ray Train workers on cluster.ray.address), k8s (a Kubeflow PyTorchJob, launch.py)."""
    rdzv_endpoint: str | None = free(None, "host:port every node reaches (checked before launch)")
    """torchrun: the c10d rendezvous, host:port (needed with nodes > 1; node 0's address)."""
    max_restarts: int = knob(0, min=0)
    """torchrun, ray, k8s: restarts of the ranks after one fails (each resumes from
    trainer.resume_from=auto), before the job fails."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    sagemaker: SageMakerConfig = field(default_factory=SageMakerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    k8s: K8sConfig = field(default_factory=K8sConfig)
    collective_timeout: float = knob(1800.0, above=0.0)
    """Seconds a collective waits for a lost peer before the job fails (gloo and NCCL)."""
    trainer: ClusterTrainer = field(default_factory=ClusterTrainer)
    """What this cluster implies for the trainer unless a value of the user's is set."""

    @property
    def size(self) -> int:
        return self.nodes * self.devices

    def planned(self) -> ClusterConfig:
        """This cluster as the planner sees it: ``accelerator=auto`` resolved to what this
        machine has -- its GPUs, found without torch (recipes/hardware.py), or CPU processes."""
        if self.accelerator != "auto":
            return self
        from recipes.hardware import local_gpus

        return dataclasses.replace(self, accelerator="gpu" if local_gpus() else "cpu")

    def host_limit(self) -> tuple[float, str]:
        """The memory a node's processes may use, GB, and the key that sets it: host_memory_GB,
        or the launcher's per-node limit when lower -- what the kernel's OOM killer enforces (a
        pod's cluster.k8s.memory_GB; under Slurm sbatch --mem as cluster.slurm.mem_gb, and what
        Slurm itself says: its nodes' memory, the default a job asking for none gets)."""
        limits = [(self.host_memory_GB, "cluster.host_memory_GB")]
        if self.launcher == "k8s":
            limits.append((self.k8s.memory_GB, "cluster.k8s.memory_GB: each pod's memory limit"))
        if self.launcher == "slurm" and self.slurm.mem_gb:
            limits.append((float(self.slurm.mem_gb), "cluster.slurm.mem_gb: sbatch --mem"))
        if self.launcher == "slurm":  # (the nodes and the memory Slurm grants)
            from recipes.allocation import slurm_memory

            limits += slurm_memory(self.slurm.partition, self.devices * self.slurm.cpus_per_task,
                                   self.slurm.mem_gb)
        return min(limits, key=lambda x: x[0])

    def hardware(self) -> str | None:
        """What this machine was found to have, for the plan's assumptions: the GPUs
        ``accelerator=auto`` found, and ``cluster=local``'s host memory and where it was read;
        None for a cluster that names them."""
        from recipes.hardware import describe_gpus, host_bytes, local_gpus

        gpus = local_gpus() if self.accelerator == "auto" else ()
        said = [f"cluster.accelerator=auto: this machine's {describe_gpus(gpus)}"] if gpus else []
        if self.name == "local":
            host, source = host_bytes()
            said.append(f"cluster=local: host memory {host / 1e9:.1f} GB ({source}), "
                        f"used as {self.host_memory_GB:g} GB")
        return "; ".join(said) or None

    def device_name(self) -> str | None:
        """This machine's first GPU's name (recipes/hardware.py), None without one: what a
        calibration on a GPU machine is cached under (planner/machine.py)."""
        from recipes.hardware import local_gpus

        gpus = local_gpus()
        return gpus[0].name if gpus else None

    def device_bytes(self) -> int:
        """Memory one process may use: a GPU's own, or a CPU node's share."""
        shared = self.accelerator != "gpu"
        return int(self.device_memory_GB * 1e9 / (self.devices if shared else 1))
