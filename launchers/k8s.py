"""Kubernetes: ``python launch.py cluster=k8s ...`` writes a Kubeflow ``PyTorchJob`` manifest and
applies it with the ``kubernetes`` client (``pip install -e ".[k8s]"``); ``--dry-run`` prints it
alone on stdout (what it says of it on stderr) and needs neither the client nor a cluster.

The job is one ``Master`` pod and ``cluster.nodes - 1`` ``Worker`` pods (the training operator
accepts exactly one master and at least one worker when there are workers), each the container
``pytorch`` of ``cluster.k8s.image`` running ``torchrun train.py <your overrides>
hydra.run.dir=<run dir>`` in ``cluster.k8s.workdir``. ``spec.nprocPerNode`` is
``cluster.devices``; the operator hands torchrun the rest through its ``PET_*`` variables (nodes,
node rank, the master's address), so in a pod train.py is a rank torchrun started
(``launchers.launched``). Each pod asks for ``cluster.devices`` of ``cluster.k8s.gpu_resource``
(accelerator gpu), ``cluster.k8s.cpus`` and ``cluster.k8s.memory_GB``, and mounts
``cluster.k8s.volume_claim`` (a ReadWriteMany claim every node sees) at ``mount_path``: the run
directory <mount_path>/<job_name> (report.json, checkpoints) is on it, so it outlives the pods
and a restarted pod resumes from it (``trainer.resume_from=auto``). With
``cluster.max_restarts`` the job gets an ``elasticPolicy`` (c10d rendezvous, min = max = nodes,
``maxRestarts``) and pods restart ``OnFailure``. Its rendezvous store is hosted on the Master pod,
reached through the Master's service (``rdzvHost: <job>-master-0``): the operator's default is the
first Worker's, so losing a Worker would end the job with the store; a Master lost ends the job
anyway. A multi-node job's claim must be ReadWriteMany: launch.py reads its access modes through
the client before it creates the job (``claim_problems``); ``--dry-run`` states the requirement.

The manifest is plain data (``manifest``); the ``kubernetes`` client is imported by ``apply``
only.
"""

from __future__ import annotations

import functools
import json
import re
from typing import TYPE_CHECKING, Any

from launchers.registry import launcher

if TYPE_CHECKING:
    from recipes.job import Job

GROUP, VERSION, PLURAL, KIND = "kubeflow.org", "v1", "pytorchjobs", "PyTorchJob"
CONTAINER = "pytorch"  # the container name the training operator looks for
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
RDZV_PORT = 29400  # torchrun's own c10d default; the operator's services are headless (any port)
RWX = "ReadWriteMany"


def job_name(k: Any) -> str:
    """``cluster.k8s.job_name``, or (null, the default) a name new to this launch, so no two jobs
    share a run directory: ``stratagem-<UTC date>-<time>-<4 hex digits>``, the same everywhere in
    one launch.py."""
    return k.job_name or _new_name()


@functools.cache
def _new_name() -> str:
    import secrets
    import time

    return f"stratagem-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(2)}"


def run_dir(k: Any) -> str:
    """The run directory inside every pod (on the mounted claim)."""
    return f"{k.mount_path.rstrip('/')}/{job_name(k)}"


def submission_problems(cluster: Any, overrides: list[str]) -> list[str]:
    """What would make the job unacceptable to the operator or lose its results, before it is
    written: the job's name, a claim for the run directory, absolute paths, a run directory of
    the user's own."""
    k, out = cluster.k8s, []
    if k.job_name is not None and not DNS1035.match(k.job_name):
        out.append(f"cluster.k8s.job_name={k.job_name!r} is not a DNS-1035 label (the PyTorchJob's "
                   "name: lowercase letters, digits and '-', starting with a letter, at most 63): "
                   "set e.g. cluster.k8s.job_name=stratagem-run1")
    if k.volume_claim is None:
        out.append("cluster.k8s.volume_claim=null: the run directory (checkpoints, report.json) would "
                   "vanish with the pods, and the nodes of a multi-node job must share it; set "
                   "cluster.k8s.volume_claim=<a ReadWriteMany PersistentVolumeClaim in "
                   f"namespace {k.namespace}>")
    for key in ("mount_path", "workdir"):
        if not str(getattr(k, key)).startswith("/"):
            out.append(f"cluster.k8s.{key}={getattr(k, key)!r} is not an absolute path inside the "
                       f"pods: set cluster.k8s.{key}=/<path>")
    mine = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] == "hydra.run.dir"]
    if mine:
        out.append(f"{mine[0]}: in the pods the run directory is <cluster.k8s.mount_path>/"
                   f"<cluster.k8s.job_name> ({run_dir(k)}); remove the override and set "
                   "cluster.k8s.job_name instead")
    return out


def cpu_problems(cluster: Any, accelerator: str) -> list[str]:
    """CPU ranks in a pod limited to fewer CPUs than ranks (cluster.k8s.cpus is its limit), unless
    cluster.oversubscribe allows more processes than cores, as on this machine."""
    k, ranks = cluster.k8s, cluster.devices
    if accelerator != "cpu" or k.cpus >= ranks or cluster.oversubscribe:
        return []
    fewer = f"cluster.devices<={int(k.cpus)}, or " if k.cpus >= 1 else ""
    return [f"cluster.k8s.cpus={k.cpus:g} but each pod runs cluster.devices={ranks} CPU ranks "
            f"(cluster.accelerator=cpu), one CPU each at least: set cluster.k8s.cpus>={ranks}, or "
            f"{fewer}cluster.oversubscribe=true to run more ranks than CPUs (slower, but correct)"]


def command(overrides: list[str], k: Any) -> list[str]:
    """What every pod runs: torchrun (the operator's PET_* variables give it the nodes, this
    node's rank and the master's address) over train.py with the overrides, each once."""
    return ["torchrun", "train.py", *overrides, f"hydra.run.dir={run_dir(k)}"]


def _pod(cluster: Any, overrides: list[str], gpu: bool) -> dict[str, Any]:
    k = cluster.k8s
    amounts = {"cpu": f"{k.cpus:g}", "memory": f"{k.memory_GB:g}G",
               **({k.gpu_resource: str(cluster.devices)} if gpu else {})}
    env = [{"name": "OMP_NUM_THREADS", "value": "1"},  # the job's id for its run directory's lock
           {"name": "STRATAGEM_JOB_ID", "value": f"k8s:{k.namespace}/{job_name(k)}"}]
    if cluster.max_restarts:  # restarted workers must not read the attempt before's peers (pytorch#135712)
        env.append({"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"})
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if k.volume_claim is not None:
        volumes.append({"name": "run", "persistentVolumeClaim": {"claimName": k.volume_claim}})
        mounts.append({"name": "run", "mountPath": k.mount_path})
    return {"spec": {"containers": [{
        "name": CONTAINER,
        "image": k.image,
        "workingDir": k.workdir,
        "command": command(overrides, k),
        "env": env,
        "resources": {"requests": dict(amounts), "limits": dict(amounts)},
        "volumeMounts": mounts,
    }], "volumes": volumes}}


def manifest(cluster: Any, overrides: list[str], accelerator: str) -> dict[str, Any]:
    """The PyTorchJob as plain data (what ``--dry-run`` prints and ``apply`` creates)."""
    k, restarts = cluster.k8s, cluster.max_restarts
    policy = "OnFailure" if restarts else "Never"
    pod = _pod(cluster, overrides, accelerator == "gpu")
    replicas = {"Master": {"replicas": 1, "restartPolicy": policy, "template": pod}}
    if cluster.nodes > 1:
        replicas["Worker"] = {"replicas": cluster.nodes - 1, "restartPolicy": policy, "template": pod}
    spec: dict[str, Any] = {"nprocPerNode": str(cluster.devices), "pytorchReplicaSpecs": replicas,
                            "runPolicy": {"cleanPodPolicy": "None",
                                          **({"backoffLimit": restarts} if restarts else {})}}
    if restarts and cluster.nodes > 1:  # (the operator wants a Worker replica with an elasticPolicy)
        spec["elasticPolicy"] = {"rdzvBackend": "c10d", "minReplicas": cluster.nodes,
                                 "maxReplicas": cluster.nodes, "maxRestarts": restarts,
                                 "rdzvHost": f"{job_name(k)}-master-0", "rdzvPort": RDZV_PORT}
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
            "metadata": {"name": job_name(k), "namespace": k.namespace,
                         "labels": {"app.kubernetes.io/created-by": "stratagem"}},
            "spec": spec}


def dry_run(job: dict[str, Any]) -> tuple[str, list[str]]:
    """The manifest alone (JSON is YAML: ``kubectl apply -f`` takes it as printed, ``--dry-run |
    kubectl apply -f -`` too) and what is said of it: each pod's command, the job's name, the claim."""
    cmd = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    lines = [f"Kubeflow {KIND} manifest on stdout (kubectl apply -f <it>, or pipe it: ... --dry-run | "
             "kubectl apply -f -)",
             f"every pod runs ({job['spec']['nprocPerNode']} ranks each): {' '.join(cmd)}"]
    meta = job["metadata"]
    lines.append(f"job {meta['namespace']}/{meta['name']} (cluster.k8s.job_name; unset, each launch gets a new "
                 "name and run directory: name it to run or resume in the same one)")
    claims = [v["persistentVolumeClaim"]["claimName"] for v in
              job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["volumes"]
              if "persistentVolumeClaim" in v]
    if claims and "Worker" in job["spec"]["pytorchReplicaSpecs"]:
        lines.append(f"the claim {claims[0]} must be {RWX} (every node writes the run directory): "
                     "checked when submitting, not by --dry-run")
    return json.dumps(job, indent=1), lines


def apply(job: dict[str, Any]) -> str:
    """Create the PyTorchJob in the cluster the kubeconfig (or the pod's service account) names;
    its namespace/name."""
    from kubernetes import client

    _load_config()
    ns = job["metadata"]["namespace"]
    client.CustomObjectsApi().create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, job)
    return f"{ns}/{job['metadata']['name']}"


def claim_problems(modes: list[str] | None, k: Any, nodes: int) -> list[str]:
    """What the run directory's claim lacks, from its access modes (None: no such claim)."""
    where = f"namespace {k.namespace}"
    if modes is None:
        return [f"cluster.k8s.volume_claim={k.volume_claim}: no such PersistentVolumeClaim in {where}; "
                f"create it ({RWX}) or name an existing one"]
    if nodes > 1 and RWX not in modes:
        return [f"cluster.k8s.volume_claim={k.volume_claim} is {', '.join(modes) or 'without access modes'}, "
                f"not {RWX}: the {nodes} nodes' pods cannot all mount it (checkpoints, report.json); "
                f"name a {RWX} claim in {where} (e.g. on NFS, CephFS, EFS or Filestore)"]
    return []


def claim_modes(k: Any) -> list[str] | None:
    """The claim's access modes as the cluster has them (None: no such claim)."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    try:
        claim = client.CoreV1Api().read_namespaced_persistent_volume_claim(k.volume_claim, k.namespace)
    except ApiException as e:
        if e.status == 404:
            return None
        raise
    return list(claim.spec.access_modes or [])


def _load_config() -> None:
    from kubernetes import config

    try:
        config.load_kube_config()
    except Exception:  # noqa: BLE001  (inside a cluster: the service account)
        config.load_incluster_config()


def reachable() -> str | None:
    """Why no cluster can be reached (None: a kubeconfig or an in-cluster service account)."""
    import os

    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return None
    path = os.environ.get("KUBECONFIG", os.path.expanduser("~/.kube/config"))
    if not any(os.path.isfile(p) for p in path.split(os.pathsep)):
        return (f"no Kubernetes cluster configured (no kubeconfig at {path}, not in a pod): point "
                "KUBECONFIG at one, or add --dry-run to print the manifest")
    return None


# --------------------------------------------------------------------------- launch.py's step
def _submission_problems(job: Job, overrides: list[str]) -> list[str]:
    return submission_problems(job.cluster, overrides) + cpu_problems(job.cluster, job.run.accelerator)


def _client_problems(job: Job) -> list[str]:
    import importlib.util

    if importlib.util.find_spec("kubernetes") is None:
        return ["applying the PyTorchJob needs the kubernetes client, which is not "
                "installed: pip install -e '.[k8s]' (or add --dry-run to print it)"]
    why = reachable()
    if why or job.cluster.k8s.volume_claim is None:  # (a missing claim: submission_problems said)
        return [why] if why else []
    _load_config()
    return claim_problems(claim_modes(job.cluster.k8s), job.cluster.k8s, job.cluster.nodes)


def _dry_run(job: Job, overrides: list[str]) -> tuple[str, list[str]]:
    return dry_run(manifest(job.cluster, overrides, job.run.accelerator))


def _submit(job: Job, overrides: list[str]) -> str:
    return f"created Kubeflow PyTorchJob {apply(manifest(job.cluster, overrides, job.run.accelerator))}"


@launcher("k8s", submission_problems=_submission_problems, client_problems=_client_problems,
          dry_run=_dry_run, submit=_submit)
def launch_problems(job: Job) -> list[str]:
    """Outside a pod (in one, torchrun started this process): launch.py submits the job."""
    return [f"cluster.launcher=k8s: the ranks start in the pods of a Kubeflow PyTorchJob; "
            f"submit it with python launch.py cluster={job.cluster.name} ... (--dry-run to see it first)"]
