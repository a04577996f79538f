"""cluster=k8s: the Kubeflow PyTorchJob launch.py writes, checked against the Kubeflow training
SDK's models (kubeflow-training 1.9.4: the CRD's types as the operator's OpenAPI generates them)
and the rules its admission webhook enforces; the dry run's command carries every override once.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

# A 2 x 8 GPU job: global batch = micro 8 x dp 16.
OVERRIDES = ["cluster=k8s", "cluster.nodes=2", "cluster.devices=8", "strategy=fsdp", "model=llama_1b",
             "trainer.global_batch_size=128", "trainer.micro_batch_size=2", "trainer.max_steps=100",
             "cluster.k8s.image=registry.example/stratagem:1", "cluster.k8s.volume_claim=runs"]


def _job(overrides):
    from launchers import k8s
    from recipes.config import compose
    from recipes.job import RUN, validate

    job = validate(compose(overrides), depth=RUN)
    assert not k8s.submission_problems(job.cluster, list(overrides))
    return k8s.manifest(job.cluster, list(overrides), job.run.accelerator)


def _sdk(manifest: dict):
    """The manifest deserialized into the SDK's models (client-side validation on: required
    fields, enums), and serialized back: a key the models do not know is dropped there, so the
    round trip equal to the input means every key is the CRD's."""
    models = pytest.importorskip("kubeflow.training.models")
    from kubeflow.training import ApiClient
    from kubeflow.training.utils import utils

    client = ApiClient()
    job = client.deserialize(utils.FakeResponse(manifest), "KubeflowOrgV1PyTorchJob")
    assert isinstance(job, models.KubeflowOrgV1PyTorchJob)
    assert client.sanitize_for_serialization(job) == manifest
    return job


def _operator_rules(job) -> None:
    """What the training operator's webhook refuses (pkg/webhooks/pytorch): the name a DNS-1035
    label, exactly one Master, Workers >= 1, a Worker with an elasticPolicy, no
    elasticPolicy.nProcPerNode beside spec.nprocPerNode; every replica's container 'pytorch'."""
    import re

    assert re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", job.metadata.name)
    specs = job.spec.pytorch_replica_specs
    assert set(specs) <= {"Master", "Worker"} and specs["Master"].replicas == 1
    assert "Worker" not in specs or specs["Worker"].replicas >= 1
    if job.spec.elastic_policy is not None:
        assert "Worker" in specs and job.spec.elastic_policy.n_proc_per_node is None
    for spec in specs.values():
        assert [c.name for c in spec.template.spec.containers] == ["pytorch"]


@pytest.mark.unit
def test_the_2x8_manifest_validates_against_the_kubeflow_sdk_models():
    manifest = _job(OVERRIDES)
    job = _sdk(manifest)
    _operator_rules(job)
    assert (job.api_version, job.kind) == ("kubeflow.org/v1", "PyTorchJob")
    assert job.spec.nproc_per_node == "8"
    specs = job.spec.pytorch_replica_specs
    assert specs["Master"].replicas == 1 and specs["Worker"].replicas == 1  # 2 nodes
    container = specs["Worker"].template.spec.containers[0]
    assert container.image == "registry.example/stratagem:1"
    assert container.resources.limits == {"cpu": "16", "memory": "512G", "nvidia.com/gpu": "8"}
    assert container.resources.requests == container.resources.limits
    mounts = {m.name: m.mount_path for m in container.volume_mounts}
    assert mounts == {"dshm": "/dev/shm", "run": "/mnt/stratagem"}
    claims = [v.persistent_volume_claim.claim_name for v in specs["Master"].template.spec.volumes
              if v.persistent_volume_claim]
    assert claims == ["runs"]
    assert job.spec.elastic_policy is None and specs["Master"].restart_policy == "Never"


@pytest.mark.unit
def test_restarts_add_an_elastic_policy_and_restart_on_failure():
    job = _sdk(_job([*OVERRIDES, "cluster.max_restarts=3"]))
    _operator_rules(job)
    e = job.spec.elastic_policy
    assert (e.rdzv_backend, e.min_replicas, e.max_replicas, e.max_restarts) == ("c10d", 2, 2, 3)
    assert {s.restart_policy for s in job.spec.pytorch_replica_specs.values()} == {"OnFailure"}
    env = {v.name: v.value for v in job.spec.pytorch_replica_specs["Master"].template.spec.containers[0].env}
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    # one node: a Master alone (the operator wants a Worker beside an elasticPolicy)
    one = _sdk(_job([*OVERRIDES, "cluster.nodes=1", "cluster.max_restarts=3"]))
    _operator_rules(one)
    assert set(one.spec.pytorch_replica_specs) == {"Master"} and one.spec.elastic_policy is None


@pytest.mark.unit
def test_bad_k8s_values_are_one_error_each():
    from launchers import k8s
    from recipes.config import compose
    from recipes.job import RUN, validate
    from strategies import ConfigError

    base = ["cluster=k8s", "strategy=ddp", "trainer.global_batch_size=128"]
    with pytest.raises(ConfigError, match=r"cluster.k8s.cpus=0.0: must be > 0; set cluster.k8s.cpus to a value > 0"):
        validate(compose([*base, "cluster.k8s.cpus=0"]), depth=RUN)
    bad = [*base, "cluster.k8s.job_name=Run_1", "cluster.k8s.mount_path=runs", "hydra.run.dir=/x"]
    with pytest.raises(ConfigError) as e:
        validate(compose(bad[:-1]), depth=RUN,
                 extra=[lambda job: k8s.submission_problems(job.cluster, bad)])
    text = str(e.value)
    for expected in ("cluster.k8s.job_name='Run_1' is not a DNS-1035 label",
                     "cluster.k8s.volume_claim=null", "cluster.k8s.mount_path='runs' is not an absolute path",
                     "hydra.run.dir=/x: in the pods the run directory is"):
        assert text.count(expected) == 1, text


@pytest.mark.unit
def test_cpu_ranks_beyond_the_pods_cpus_are_refused():
    """cluster.k8s.cpus=2 with 4 CPU ranks per pod was accepted: 4 processes on 2 CPUs."""
    from launchers import registry
    from recipes.config import compose
    from recipes.job import RUN, validate
    from strategies import ConfigError

    over = ["cluster=k8s", "strategy=ddp", "cluster.accelerator=cpu", "cluster.devices=4",
            "trainer.global_batch_size=128", "cluster.k8s.volume_claim=runs"]
    step = registry.get("k8s").submission_problems
    with pytest.raises(ConfigError) as e:
        validate(compose([*over, "cluster.k8s.cpus=2"]), depth=RUN, extra=[lambda job: step(job, over)])
    assert e.value.problems == [
        "cluster.k8s.cpus=2 but each pod runs cluster.devices=4 CPU ranks (cluster.accelerator=cpu), one CPU "
        "each at least: set cluster.k8s.cpus>=4, or cluster.devices<=2, or cluster.oversubscribe=true to run "
        "more ranks than CPUs (slower, but correct)"]
    for fine in ("cluster.k8s.cpus=4", "cluster.oversubscribe=true"):
        validate(compose([*over, "cluster.k8s.cpus=2", fine]), depth=RUN, extra=[lambda job: step(job, over)])
    validate(compose([*over[:2], "cluster.k8s.cpus=2", *over[4:]]), depth=RUN,  # (GPU ranks: not CPUs)
             extra=[lambda job: step(job, over)])


_NO_CLIENT = """
import atexit, runpy, sys
atexit.register(lambda: sys.stderr.write('LOADED=' + ','.join(sorted({m.split('.')[0] for m in sys.modules}
                                           & {'kubernetes', 'kubeflow', 'torch', 'lightning', 'ray'})) + '\\n'))
sys.argv = %r
runpy.run_path(sys.argv[0], run_name='__main__')
"""


@pytest.mark.subprocess
def test_dry_run_command_carries_every_override_exactly_once():
    """The golden command of the 2 x 8 job; --dry-run loads no client, no engine."""
    argv = ["launch.py", *OVERRIDES, "--dry-run"]
    proc = subprocess.run([sys.executable, "-c", _NO_CLIENT % argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = next(x for x in proc.stderr.splitlines() if x.startswith("LOADED=")).removeprefix("LOADED=")
    assert loaded == "", f"--dry-run imported {loaded}"
    manifest = json.loads(proc.stdout)  # (the manifest alone: `... --dry-run | kubectl apply -f -`)
    golden = ["torchrun", "train.py", "cluster=k8s", "cluster.nodes=2", "cluster.devices=8", "strategy=fsdp",
              "model=llama_1b", "trainer.global_batch_size=128", "trainer.micro_batch_size=2",
              "trainer.max_steps=100",
              "cluster.k8s.image=registry.example/stratagem:1", "cluster.k8s.volume_claim=runs",
              f"hydra.run.dir=/mnt/stratagem/{manifest['metadata']['name']}"]
    assert re.fullmatch(r"stratagem-\d{8}-\d{6}-[0-9a-f]{4}", manifest["metadata"]["name"])  # new per launch
    for replica in ("Master", "Worker"):
        command = manifest["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]["containers"][0]["command"]
        assert command == golden
        for o in OVERRIDES:
            assert command.count(o) == 1
    assert f"every pod runs (8 ranks each): {' '.join(golden)}" in proc.stderr  # (what is said of it)
    _sdk(manifest)


@pytest.mark.subprocess
def test_applying_without_a_cluster_is_refused_with_the_fix(tmp_path):
    proc = subprocess.run([sys.executable, "launch.py", *OVERRIDES], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                                                         "KUBECONFIG": str(tmp_path / "none")})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no Kubernetes cluster configured" in proc.stdout + proc.stderr


@pytest.mark.unit
def test_the_elastic_rendezvous_is_hosted_on_the_master_service():
    """The operator's default rendezvous host is the first Worker's service; ours is the
    Master's, which the SDK's models accept as the CRD's fields."""
    manifest = _job([*OVERRIDES, "cluster.max_restarts=2", "cluster.k8s.job_name=run1"])
    e = _sdk(manifest).spec.elastic_policy
    assert (e.rdzv_host, e.rdzv_port) == ("run1-master-0", 29400)


class _Api:
    """A Kubernetes API server on loopback, enough for what launch.py asks: one claim (its access
    modes given) and the PyTorchJob it creates (recorded). The kubernetes client talks to it over
    HTTP as it would to a cluster's."""

    def __init__(self, tmp_path, modes):
        import http.server
        import threading

        created, claim = [], {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                              "metadata": {"name": "runs", "namespace": "default"},
                              "spec": {"accessModes": modes}}

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                if self.path == "/api/v1/namespaces/default/persistentvolumeclaims/runs" and modes:
                    return self._answer(200, claim)
                return self._answer(404, {"kind": "Status", "code": 404, "reason": "NotFound"})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                created.append((self.path, body))
                self._answer(201, body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.created = created
        self.kubeconfig = tmp_path / "kubeconfig"
        self.kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "local",
            "clusters": [{"name": "local", "cluster": {"server": f"http://127.0.0.1:{self.server.server_port}"}}],
            "contexts": [{"name": "local", "context": {"cluster": "local", "user": "me"}}],
            "users": [{"name": "me", "user": {"token": "t"}}]}))

    def launch(self, tmp_path, *extra):
        import os

        return subprocess.run([sys.executable, "launch.py", *OVERRIDES, *extra], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, check=False,
                              env={**os.environ, "KUBECONFIG": str(self.kubeconfig), "HOME": str(tmp_path)})


@pytest.mark.subprocess
def test_a_claim_that_is_not_read_write_many_is_refused_before_the_job_is_created(tmp_path):
    pytest.importorskip("kubernetes")
    api = _Api(tmp_path, ["ReadWriteOnce"])
    try:
        proc = api.launch(tmp_path)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        text = proc.stdout + proc.stderr
        assert "cluster.k8s.volume_claim=runs is ReadWriteOnce, not ReadWriteMany" in text, text[-2000:]
        assert api.created == []
        one_node = api.launch(tmp_path, "cluster.nodes=1", "trainer.global_batch_size=64")  # one pod: any claim
        assert one_node.returncode == 0, one_node.stdout + one_node.stderr
        (path, body), = api.created
        assert path == "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs"
        assert body["kind"] == "PyTorchJob" and "created Kubeflow PyTorchJob default/" in one_node.stdout
    finally:
        api.server.shutdown()


@pytest.mark.subprocess
def test_a_read_write_many_claim_submits_and_a_missing_one_is_named(tmp_path):
    pytest.importorskip("kubernetes")
    api = _Api(tmp_path, ["ReadWriteMany"])
    (tmp_path / "m").mkdir()
    missing = _Api(tmp_path / "m", None)
    try:
        proc = api.launch(tmp_path, "cluster.k8s.job_name=run1")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        (_, body), = api.created
        assert body["metadata"]["name"] == "run1" and set(body["spec"]["pytorchReplicaSpecs"]) == {"Master", "Worker"}
        gone = missing.launch(tmp_path)
        assert gone.returncode == 2 and missing.created == []
        assert "cluster.k8s.volume_claim=runs: no such PersistentVolumeClaim in namespace default" in (
            gone.stdout + gone.stderr)
    finally:
        api.server.shutdown()
        missing.server.shutdown()


@pytest.mark.subprocess
def test_a_job_over_the_pods_memory_limit_is_refused_before_submission():
    """The pod's memory limit (cluster.k8s.memory_GB) is the host memory the planner plans
    against: llama_70b zero3_offload keeps 945 GB per node on the host, which the planner had
    passed against the node preset's 2,000 GB while each pod is limited to 512 and the kernel
    would kill it. With pods of 1,000 GB it is submitted."""
    over = [*OVERRIDES, "model=llama_70b", "strategy=zero3_offload", "strategy.activation_checkpointing=true",
            "trainer.micro_batch_size=1", "--dry-run"]
    proc = subprocess.run([sys.executable, "launch.py", *over], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode != 0 and "{" not in proc.stdout
    assert "has 512.0 GB (cluster.k8s.memory_GB: each pod's memory limit)" in proc.stderr, proc.stderr[-2000:]
    roomy = subprocess.run([sys.executable, "launch.py", *over, "cluster.k8s.memory_GB=1000"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120, check=False)
    assert roomy.returncode == 0, roomy.stderr[-2000:]
    assert '"memory": "1000G"' in roomy.stdout
