"""Typed schemas behind ``conf/``: stored in Hydra's ConfigStore so an unknown key or a wrong type
fails at compose time, each field with its allowed values declared (``knob``) so a bad value
fails validation with one sentence. Strategy schemas live with their families in
``strategies/``. Torch-free: plan.py and ``train.py --cfg job`` import this and nothing heavy.

Schemas are stored at the ConfigStore's root (``train_schema``, ``logger_schema``; strategy
families as ``<family>_schema``), not inside the groups, so ``--help`` lists only real options.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from strategies.checks import free, knob
from strategies.conf import CONF_DIR

PRECISIONS = ("32", "bf16-mixed", "16-mixed")
# A backend is a file of conf/backend/ (and a module of backends/): the files are the choices.
BACKENDS = tuple(sorted(p.stem for p in (CONF_DIR / "backend").glob("*.yaml")))
# A logger is a file of conf/logger/ (and an ``@logger`` of observers/loggers.py): the choices.
LOGGERS = tuple(sorted(p.stem for p in (CONF_DIR / "logger").glob("*.yaml")))
OPTIMIZERS = ("adamw", "sgd")
SCHEDULERS = ("constant", "cosine", "linear")


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ARCHITECTURES = ("gpt", "llama", "mistral", "qwen2")


@dataclass
class LoraConfig:
    """``model.lora``: low-rank adapters through ``peft`` (model=hf). The base model is frozen;
    only the adapters train (and hold gradients and optimizer state)."""

    rank: int = knob(0, min=0)
    """Adapter rank r; 0: no LoRA, every parameter trains."""
    alpha: float = knob(16.0, above=0.0)
    """Scaling numerator: the update is (alpha / rank) x B A."""
    dropout: float = knob(0.0, min=0.0, below=1.0)
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Linear layers, by their name inside a decoder layer, that get adapters (LORA_TARGETS)."""


@dataclass
class ModelConfig:
    """A decoder-only transformer's shape (recipes/gpt.py builds it, or transformers for
    ``model=hf``). Also the torch-free model description the planner reads: shape fields plus
    the exact parameter counts below."""

    name: str = MISSING
    path: str | None = free(None, "a directory written by save_pretrained (config.json + "
                            "safetensors), or a model id in the local Hugging Face cache")
    """model=hf: where the model is. Its shape fields are read from its config.json."""
    pretrained: bool = True
    """model=hf: load the weights from ``path``; false: random weights from the config and seed."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    architecture: str = knob("gpt", choices=ARCHITECTURES)
    """gpt: recipes/gpt.py; llama | mistral | qwen2: a transformers model (model=hf). The
    planner's activation calibration is per architecture."""
    attention_bias: str = knob("none", choices=("none", "qkv", "all"))
    """Which attention projections have a bias (Qwen2: qkv; Llama's attention_bias: all)."""
    max_seq_len: int | None = knob(None, min=1)
    """The longest sequence the model supports (an HF config's max_position_embeddings)."""
    dim: int = knob(MISSING, min=1)
    """Hidden size."""
    n_layers: int = knob(MISSING, min=1)
    n_heads: int = knob(MISSING, min=1)
    n_kv_heads: int = knob(MISSING, min=1)
    """Key/value heads; fewer than n_heads is grouped-query attention."""
    vocab_size: int = knob(MISSING, min=1)
    seq_len: int = knob(MISSING, min=1)
    """Tokens per sample (and the RoPE table length)."""
    dropout: float = knob(0.0, min=0.0, below=1.0)
    ffn_dim: int | None = knob(None, min=1)
    """SwiGLU hidden size; None: 8/3 x dim rounded up to a multiple of 64."""
    tie_embeddings: bool = False
    """Share the input embedding with the output projection."""
    norm_eps: float = knob(1e-5, above=0.0)
    rope_theta: float = knob(10000.0, above=0.0)
    n_experts: int = knob(0, min=0)
    """Mixture of experts: routed experts per MoE layer (recipes/gpt.py's MoE); 0: a dense MLP."""
    top_k: int = knob(2, min=1)
    """Experts each token is routed to (softmax gate, the top-k weights renormalized, as Mixtral)."""
    capacity_factor: float = knob(1.25, above=0.0, fix="set model.capacity_factor > 0 (1.0: exactly the "
                                  "balanced share; 1.25 is Switch's default)")
    """Slots per expert and sequence = ceil(capacity_factor x seq_len x top_k / n_experts); the
    assignments over it are dropped (the token keeps its residual) and counted."""
    aux_loss_coef: float = knob(0.01, min=0.0)
    """Weight of the load-balancing loss (Switch/GShard: n_experts x sum_e f_e x P_e per sequence)
    added to the training loss."""
    moe_ffn_dim: int | None = knob(None, min=1)
    """Each expert's SwiGLU hidden size; None: model.ffn_dim (the dense MLP's)."""
    n_shared_experts: int = knob(0, min=0)
    """Experts every token goes through (DeepSeek-MoE), one MLP of n x moe_ffn_dim."""
    first_dense_layers: int = knob(0, min=0)
    """The first layers keep a dense MLP (DeepSeek-MoE: 1)."""

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts."""
        return max(0, self.n_layers - self.first_dense_layers) if self.is_moe else 0

    @property
    def expert_hidden(self) -> int:
        return self.moe_ffn_dim or self.hidden

    def expert_params(self) -> int:
        """Parameters of the routed experts, all layers (what expert parallelism splits)."""
        return self.moe_layers * self.n_experts * 3 * self.dim * self.expert_hidden

    def capacity(self, seq_len: int | None = None) -> int:
        """Expert slots per sequence (recipes/gpt.py's MoE)."""
        t = seq_len or self.seq_len
        return math.ceil(self.capacity_factor * t * self.top_k / max(1, self.n_experts))

    @property
    def is_hf(self) -> bool:
        return self.architecture != "gpt"
    @property
    def hidden(self) -> int:
        """The MLP's inner size."""
        return self.ffn_dim or 64 * math.ceil(8 * self.dim / 3 / 64)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def block_params(self, moe: bool | None = None) -> int:
        """Parameters of one transformer block (attention, SwiGLU MLP, two norms); of a MoE
        model, a MoE block (router, routed and shared experts) unless ``moe=False``."""
        kv = self.n_kv_heads * self.head_dim
        attn = self.dim * (self.dim + 2 * kv) + self.dim * self.dim
        bias = {"none": 0, "qkv": self.dim + 2 * kv, "all": 2 * self.dim + 2 * kv}[self.attention_bias]
        if self.is_moe and moe is not False:
            e = self.expert_hidden
            mlp = self.dim * self.n_experts + (self.n_experts + self.n_shared_experts) * 3 * self.dim * e
        else:
            mlp = 3 * self.dim * self.hidden
        return attn + bias + mlp + 2 * self.dim

    def lora_params(self) -> int:
        """Parameters of the LoRA adapters (rank x (in + out) per targeted linear layer); 0
        without LoRA."""
        r, kv = self.lora.rank, self.n_kv_heads * self.head_dim
        sizes = {"q_proj": (self.dim, self.dim), "k_proj": (self.dim, kv), "v_proj": (self.dim, kv),
                 "o_proj": (self.dim, self.dim), "gate_proj": (self.dim, self.hidden),
                 "up_proj": (self.dim, self.hidden), "down_proj": (self.hidden, self.dim)}
        return self.n_layers * sum(r * sum(sizes[m]) for m in self.lora.target_modules if m in sizes)

    def embedding_params(self) -> int:
        """Parameters of one vocab x dim matrix (the input embedding; the output head is
        another unless ``tie_embeddings``)."""
        return self.vocab_size * self.dim

    def num_params(self) -> int:
        """Exact parameter count of ``GPT(self)``, without building it."""
        embeddings = self.embedding_params() * (1 if self.tie_embeddings else 2)
        dense = self.n_layers - self.moe_layers
        return (dense * self.block_params(moe=False) + self.moe_layers * self.block_params()
                + embeddings + self.dim)

    def moe_problems(self) -> list[str]:
        """The mixture-of-experts keys together (a dense model: none)."""
        if not self.is_moe:
            return []
        out = []
        if self.is_hf:
            out.append(f"model.n_experts={self.n_experts} applies to the built-in GPT (recipes/gpt.py), "
                       "not model=hf: set model.n_experts=0")
        if self.top_k > self.n_experts:
            out.append(f"model.top_k={self.top_k} > model.n_experts={self.n_experts}: a token is "
                       f"routed to top_k distinct experts; allowed: 1..{self.n_experts}. Set "
                       f"model.top_k<={self.n_experts} or raise model.n_experts")
        if self.first_dense_layers > self.n_layers:
            out.append(f"model.first_dense_layers={self.first_dense_layers} > model.n_layers="
                       f"{self.n_layers}: set it to at most n_layers")
        return out

    def tp_collectives(self) -> tuple[int, int]:
        """All-reduces per block under tensor parallelism (forward, backward): recipes/gpt.py's
        tp_plan has 2 row-parallel layers (attention output, MLP down) and 5 column-parallel
        ones (q, k, v, gate, up), each all-reducing its input's gradient."""
        return (2, 5)

    def flops_per_token(self) -> float:
        """Model FLOPs to train on one token (forward + backward), the convention MFU uses
        (PaLM, Chowdhery et al. 2022, app. B): 6 per parameter of every matmul (all but the input
        embedding, a lookup) plus 12 x layers x seq x dim for attention's scores and mixing."""
        matmul = self.num_params() - (0 if self.tie_embeddings else self.embedding_params())
        if self.is_moe:  # a token runs through top_k of the routed experts (and the shared ones)
            matmul -= self.expert_params() * (1 - self.top_k / self.n_experts)
        return 6 * matmul + 12 * self.n_layers * self.seq_len * self.dim

    def problems(self) -> list[str]:
        """Shape rules that involve more than one field (single fields declare their own)."""
        out = []
        if self.dim % self.n_heads:
            out.append(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}: "
                       "choose n_heads dividing dim")
        elif self.head_dim % 2:
            out.append(f"head dim model.dim / model.n_heads = {self.dim}/{self.n_heads} = "
                       f"{self.head_dim} must be even for rotary embeddings")
        if self.n_heads % self.n_kv_heads:
            out.append(f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}")
        out += self.moe_problems()
        if self.max_seq_len is not None and self.seq_len > self.max_seq_len:
            out.append(f"model.seq_len={self.seq_len} exceeds the model's max_position_embeddings "
                       f"{self.max_seq_len}: set model.seq_len<={self.max_seq_len}")
        if not self.is_hf:
            for key, value in (("path", self.path), ("lora.rank", self.lora.rank)):
                if value:
                    out.append(f"model.{key}={value} applies to model=hf only (this is the built-in "
                               f"{self.name}): remove it, or use model=hf model.path=...")
        bad = sorted(set(self.lora.target_modules) - set(LORA_TARGETS))
        if bad:
            out.append(f"model.lora.target_modules: {', '.join(bad)} not a decoder layer's linear "
                       f"layer; allowed: {', '.join(LORA_TARGETS)}")
        return out


LAUNCHERS = ("local", "torchrun", "slurm", "sagemaker", "ray", "k8s")


@dataclass
class SlurmConfig:
    """``cluster.launcher=slurm``: what every Slurm job of the run asks for. The launch callback
    (launchers/slurm.py) hands these to hydra-submitit-launcher, with one task per device."""

    partition: str | None = free(None, "a partition name; checked against sinfo before submission")
    time_min: int = knob(60, min=1)
    """Time limit of each job, minutes (sbatch --time)."""
    account: str | None = free(None, "an account name, checked by Slurm")
    qos: str | None = free(None, "a QOS name, checked by Slurm")
    constraint: str | None = free(None, "a feature expression, checked by Slurm")
    cpus_per_task: int = knob(1, min=1)
    """CPUs per rank (sbatch --cpus-per-task)."""
    mem_gb: int | None = knob(None, min=1)
    """Memory per node, GB (sbatch --mem); None: the partition's default."""
    requeue_signal_s: int = knob(90, min=0)
    """Seconds before the time limit Slurm sends SIGUSR1: Lightning saves a checkpoint and
    requeues the job, which resumes from it (0: no signal)."""
    array_parallelism: int = knob(256, min=1)
    """At most this many jobs of a sweep's array run at once."""


@dataclass
class SageMakerConfig:
    """``cluster.launcher=sagemaker``: the training job launch.py builds (the SageMaker SDK)."""

    instance_type: str = free("ml.p5.48xlarge", "a SageMaker training instance type")
    role: str | None = free(None, "an IAM role ARN; None: the SDK's default execution role")
    image_uri: str | None = free(None, "a training image; None: the SDK's PyTorch image")
    framework_version: str = free("2.8.0", "a PyTorch image version the SDK knows")
    py_version: str = free("py312", "the PyTorch image's Python")
    region: str | None = free(None, "an AWS region; None: the SDK's default")
    output_path: str | None = free(None, "s3://bucket/prefix for the job's output")
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
    job_name: str = free("stratagem", "the PyTorchJob's name: lowercase letters, digits and '-' "
                                      "(checked before launch)")
    workdir: str = free("/workspace/stratagem", "the repository's path inside the image")
    volume_claim: str | None = free(None, "a ReadWriteMany PersistentVolumeClaim's name")
    """Mounted at ``mount_path`` on every pod: the run directory (report, checkpoints) every node
    must see; None is refused (they would vanish with the pods)."""
    mount_path: str = free("/mnt/stratagem", "an absolute path inside the pods")
    """Where ``volume_claim`` is mounted; the run directory is <mount_path>/<job_name>."""
    cpus: float = knob(8.0, above=0.0)
    """CPUs each pod requests (and is limited to)."""
    memory_GB: float = knob(64.0, above=0.0)
    """Memory each pod requests (and is limited to), GB."""
    gpu_resource: str = free("nvidia.com/gpu", "the cluster's GPU resource name")
    """The extended resource a pod asks cluster.devices of (accelerator gpu)."""


@dataclass
class ClusterConfig:
    """Hardware as data: the launcher reads nodes, devices, accelerator and the launch keys, the
    planner the hardware."""

    name: str = "local"
    nodes: int = knob(1, min=1)
    devices: int = knob(1, min=1)
    """Processes per node (one per GPU; on CPU, per core at most unless oversubscribe)."""
    accelerator: str = knob("auto", choices=("auto", "cpu", "gpu"))
    device_memory_GB: float = knob(24.0, above=0.0)
    """Memory per device, GB = 1e9 bytes (for CPU: the host memory shared by its processes)."""
    peak_tflops: float = knob(0.2, above=0.0)
    """Dense bf16 peak per device, TFLOP/s."""
    intra_node_GBps: float = knob(0.0, min=0.0)
    """Per-device bandwidth to devices on the same node, GB/s (0: no peers)."""
    inter_node_GBps: float = knob(0.0, min=0.0)
    """Per-device bandwidth to other nodes, GB/s (0: one node)."""
    host_memory_GB: float = knob(0.0, min=0.0)
    nvme_GB: float = knob(0.0, min=0.0)
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

    def hardware(self) -> str | None:
        """What ``accelerator=auto`` found on this machine, for the plan's assumptions; None when
        the cluster names its accelerator or the machine has no GPU."""
        from recipes.hardware import describe_gpus, local_gpus

        gpus = local_gpus() if self.accelerator == "auto" else ()
        return f"cluster.accelerator=auto: this machine's {describe_gpus(gpus)}" if gpus else None

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


@dataclass
class TrainerConfig:
    max_steps: int = knob(50, min=1)
    """Optimizer steps."""
    global_batch_size: int = knob(16, min=1)
    """Samples per optimizer step across all ranks (= micro x dp x accumulation)."""
    micro_batch_size: int = knob(8, min=1)
    """Samples per forward/backward on one rank."""
    optimizer: str = knob("adamw", choices=OPTIMIZERS)
    """adamw (betas and eps below) | sgd (plain; momentum below)."""
    lr: float = knob(3e-3, above=0.0)
    """The peak learning rate (after warm-up, before decay)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW's (beta1, beta2), each in [0, 1)."""
    eps: float = knob(1e-8, above=0.0)
    """AdamW's epsilon."""
    momentum: float = knob(0.0, min=0.0, below=1.0)
    """SGD momentum (0: plain SGD). Ignored by adamw."""
    weight_decay: float = knob(0.0, min=0.0)
    no_decay: bool = True
    """Exempt norms, biases and embeddings from weight decay (every parameter with fewer than
    two dimensions, and every embedding table); false: decay every parameter."""
    warmup_steps: int = knob(0, min=0)
    """Linear learning-rate warm-up, in optimizer steps (then the scheduler's shape)."""
    scheduler: str = knob("constant", choices=SCHEDULERS)
    """After warm-up: constant | cosine | linear decay to lr x min_lr_ratio at decay_steps
    (then held there)."""
    min_lr_ratio: float = knob(0.0, min=0.0, max=1.0)
    """The final learning rate of a cosine or linear decay, as a fraction of lr."""
    decay_steps: int | None = knob(None, min=1)
    """The step at which the decay reaches lr x min_lr_ratio; None: trainer.max_steps."""
    precision: str = knob("32", choices=PRECISIONS)
    seed: int = knob(1234, min=0)
    grad_clip: float = knob(0.0, min=0.0)
    """Clip the global gradient norm to this value; 0 disables."""
    log_every: int = knob(1, min=1)
    """Log the loss every N optimizer steps."""
    export_params: bool = False
    """Write the final full parameters to params.pt (rank 0), for comparison and export."""
    compile: bool = False
    """torch.compile each transformer block (inductor), applied in the fixed order TP ->
    activation checkpointing -> compile -> FSDP; on CPU it needs a C++ compiler. Presets whose
    engine cannot run compiled blocks refuse it by name (FSDP1, ZeRO-3, tensor parallel)."""
    checkpoint_every: int = knob(0, min=0)
    """Save a checkpoint every N optimizer steps into <output>/checkpoints/step<N>; 0 disables."""
    save_last: bool = True
    """Also save a complete checkpoint at the final step, whatever checkpoint_every says (what
    convert.py exports, and what a re-run finds: "already finished")."""
    save_hf: bool = False
    """model=hf: also write the final model as a Hugging Face directory, <output>/hf (what
    ``convert.py --to hf`` writes: LoRA merged, the tokenizer beside it)."""
    keep_last: int = knob(0, min=0)
    """Keep only the newest N complete checkpoints (older ones are deleted after a save); 0 keeps all."""
    val_every: int = knob(0, min=0)
    """Validate every N optimizer steps (when the data has a validation split), and always at the
    end; 0: only at the end."""
    resume_from: str | None = knob("auto", choices=("auto",), exists="dir",
                                   fix="set trainer.resume_from=auto (the newest complete checkpoint "
                                       "in the run directory), a checkpoint directory "
                                       "<run>/checkpoints/step<N>, or null to start fresh")
    """auto: continue from the newest complete checkpoint in this run's directory (start fresh if
    there is none) | a checkpoint directory | null: start fresh."""


DATASETS = ("text", "synthetic", "jsonl", "parquet", "chat", "tokens")
TRAIN_ON = ("assistant", "all")
TOKEN_DTYPES = ("uint16", "uint32")


@dataclass
class DataConfig:
    """What the model reads (recipes/data.py builds it; recipes/tokens.py tokenizes and caches
    jsonl, parquet, chat and text inputs once)."""

    name: str = knob("text", choices=DATASETS)
    """text (a UTF-8 file: byte tokens, or tokenized with data.tokenizer) | synthetic (random
    tokens, for benchmarks) | jsonl | parquet (records tokenized with data.tokenizer) | chat
    (jsonl/parquet conversations rendered with the tokenizer's chat template) | tokens
    (pre-tokenized uint16/uint32 memmap shards)."""
    path: str | None = free(None, "a file, a directory, a glob or a save_to_disk directory; "
                                  "its existence and contents are checked before launch "
                                  "(recipes/tokens.py data_problems)")
    """The input: a file, a directory of them, a glob (``/data/*.parquet``), or (tokenized
    kinds) a ``datasets`` ``save_to_disk`` directory; None: the bundled corpus (text only)."""
    field: str = free("text", "a key of the jsonl records or a parquet column, checked before launch")
    """The record key (jsonl) or column (parquet) holding each document's text."""
    messages_field: str = free("messages", "a key of the chat records, checked before launch")
    """data=chat: the record key / column holding the conversation, a list of
    ``{role, content}`` messages."""
    train_on: str = knob("assistant", choices=TRAIN_ON)
    """data=chat: which tokens the loss counts: assistant (the assistant turns as the chat
    template renders them, end-of-turn included; every other target is ignored) | all."""
    tokenizer: str | None = knob(None, exists="any",
                                 fix="point data.tokenizer at a tokenizer directory (one "
                                     "AutoTokenizer.from_pretrained loads) or a tokenizer.json file")
    """A tokenizer directory or tokenizer.json; None: byte tokens (data=text), or the model's
    directory when the model has one (model.path)."""
    cache_dir: str | None = free(None, "a directory to create")
    """Where tokenized token files are cached; None: ~/.cache/stratagem/tokens."""
    dtype: str = knob("uint16", choices=TOKEN_DTYPES)
    """data=tokens: the shards' integer type (uint16 for vocabularies below 65536)."""
    val_fraction: float = knob(0.0, min=0.0, below=1.0)
    """Hold out this fraction of the samples (the last windows of the token stream) for
    validation; 0: none (unless data.val_path)."""
    val_path: str | None = free(None, "like data.path, checked before launch")
    """A separate validation input of the same kind (and forms) as data.path (wins over
    val_fraction)."""
    val_samples: int | None = knob(256, min=1)
    """Validate on at most this many held-out samples (the first ones: the same set on every
    world size); None: all."""
    num_samples: int = knob(4096, min=1)
    """Samples in the synthetic dataset."""
    num_workers: int = knob(0, min=0)

    @property
    def tokenized(self) -> bool:
        """Read through a tokenizer (recipes/tokens.py): jsonl, parquet, chat, or text with one."""
        return self.name in ("jsonl", "parquet", "chat") or (self.name == "text" and self.tokenizer is not None)

    @property
    def validates(self) -> bool:
        return self.val_path is not None or self.val_fraction > 0


@dataclass
class BackendConfig:
    name: str = knob("lightning", choices=BACKENDS)
    """The engine that runs the loop: a file of conf/backend/ and a module of backends/."""


@dataclass
class MemoryObserverConfig:
    enabled: bool = True
    """Bytes each rank holds (params, grads, optimizer, activations); on GPU, peaks per phase."""
    snapshot: bool = False
    """GPU: record a CUDA memory snapshot of the first ``snapshot_steps`` steps per rank."""
    snapshot_steps: int = knob(3, min=1)


@dataclass
class CallbacksConfig:
    """Observers (observers/), the same on every backend."""

    progress_bar: bool = True
    """A progress bar on rank 0 when stdout is a terminal: optimizer steps, loss, tokens/s."""
    log_every: int = knob(10, min=0)
    """When stdout is not a terminal (a log file, nohup, Slurm, CI) or there is no bar: one log line
    on rank 0 every this many optimizer steps, and at least every 60 s (step, loss, lr, tokens/s,
    step time, ETA, memory); 0: none."""
    report: bool = True
    """Write report.json at the end of the run."""
    memory: MemoryObserverConfig = field(default_factory=MemoryObserverConfig)
    throughput: bool = True
    """Step time, tokens/s, TFLOP/s and MFU into the report."""
    communication: bool = True
    """Every collective per optimizer step (kind, group, bytes); off: nothing is intercepted."""
    compare: bool = True
    """The planner's prediction next to what was measured (state, activations, communication)."""
    plots: bool = True
    """loss.png, memory.png and communication.png in the run directory (matplotlib)."""


@dataclass
class LoggerConfig:
    name: str = knob("csv", choices=LOGGERS)
    project: str = free("stratagem", "any wandb project name")
    """wandb: the project."""
    mode: str = knob("offline", choices=("online", "offline", "disabled"))
    """wandb: online | offline | disabled."""


@dataclass
class ExportConfig:
    """export.py: which native config to write for the preset and cluster."""

    name: str = knob("accelerate", choices=("accelerate", "deepspeed"))
    """accelerate (an `accelerate launch` config YAML) | deepspeed (the DeepSpeed JSON)."""
    out: str | None = free(None, "a file to create")
    """Where to write it; None: <strategy>-<cluster>.<name>.(yaml|json) in the current directory."""


@dataclass
class PathsConfig:
    root_dir: str = MISSING
    output_dir: str = MISSING


@dataclass
class PlannerConfig:
    """plan.py and the pre-launch check of train.py."""

    format: str = knob("table", choices=("table", "json"))
    accounting: str = knob("actual", choices=("actual", "mixed16", "mixed20"))
    """actual (what the preset allocates) | mixed16 (16 B/param) | mixed20 (20 B/param)."""
    params: float | None = knob(None, above=0.0)
    """Plan model states of this many parameters, without a model shape (no activations);
    a float so that ``planner.params=1e10`` works."""
    trainable: float | None = knob(None, above=0.0)
    """Parameters that train (LoRA-style adapters); the rest are frozen and hold no gradient or
    optimizer state. None: all parameters train."""
    tp: int = knob(1, min=1)
    """Tensor-parallel degree for planned-only layouts."""
    pp: int = knob(1, min=1)
    """Pipeline-parallel degree for planned-only layouts."""
    microbatches: int | None = knob(None, min=1)
    """Pipeline micro-batches per step; None: the accumulation steps (at least pp)."""
    mfu: float = knob(0.4, above=0.0, max=1.0)
    """Assumed model-FLOPs utilisation for compute time, in (0, 1]."""
    enforce: bool = True
    """train.py refuses to launch a run predicted not to fit."""
    activation_checkpointing: bool | None = None
    """Plan with (true) or without (false) activation checkpointing; None: each preset's own."""
    sequence_parallel: bool = True
    """Planned-only TP layouts shard the non-TP activations too (Megatron sequence parallel)."""
    flash_attention: bool = True
    """Attention kernels that store no (seq x seq) scores (SDPA flash / memory-efficient)."""
    host_link_GBps: float = knob(25.0, above=0.0)
    """Per-device host<->device bandwidth for CPU offload, GB/s (PCIe 4 x16)."""
    nvme_GBps: float = knob(3.0, above=0.0)
    """Per-device NVMe bandwidth share for NVMe offload, GB/s."""
    reserve_GB: float = knob(3.0, min=0.0)
    """GPU memory the plan's states do not see: CUDA context, NCCL buffers, allocator
    fragmentation. A GPU plan that fits with less than this free is called tight."""
    intra_latency_us: float = knob(2.0, min=0.0)
    """Latency of one step of a collective inside a node, microseconds (NVLink / PCIe; the
    alpha of the alpha-beta cost: measure it with nccl-tests at small sizes)."""
    inter_latency_us: float = knob(8.0, min=0.0)
    """Latency of one step of a collective across nodes, microseconds (InfiniBand / RoCE)."""
    calibrate: bool = False
    """cluster=local: measure this machine once (matmul throughput, a transformer block's share
    of it, AdamW's step, the process group's bandwidth and latency; a subprocess, cached in
    ~/.cache/stratagem/machine per host, device, world and precision) and plan step time with it."""


@dataclass
class TrainConfig:
    model: ModelConfig = MISSING
    strategy: Any = MISSING
    cluster: ClusterConfig = MISSING
    backend: BackendConfig = MISSING
    data: DataConfig = MISSING
    trainer: TrainerConfig = MISSING
    callbacks: CallbacksConfig = MISSING
    logger: Any = None
    export: Any = None
    experiment: Any = None
    paths: PathsConfig = MISSING
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    preflight: bool = True
    """A multirun composes, validates and plans every point before it starts or queues any job,
    and starts none when one cannot run (launchers/sweep.py); ``+preflight=false`` skips that."""


# cfg group -> its schema: what validation checks field by field.
GROUP_SCHEMAS: dict[str, type] = {
    "model": ModelConfig, "cluster": ClusterConfig, "trainer": TrainerConfig, "data": DataConfig,
    "backend": BackendConfig, "callbacks": CallbacksConfig, "logger": LoggerConfig,
    "planner": PlannerConfig, "export": ExportConfig,
}


def run_name(nodes: Any, launcher: Any, endpoint: Any = None) -> str:
    """A run directory's name under outputs/: the same on every process of one job. Each process
    of a job composes its own config, so a clock time differs between nodes (and srun tasks)
    started a second apart: a multi-node torchrun job is named by its rendezvous endpoint, a Slurm
    srun step by its job id (the same after a requeue: the next attempt finds the checkpoints);
    anything else by the date and time."""
    import datetime
    import os

    if os.environ.get("SLURM_JOB_ID") and os.environ.get("SLURM_STEP_ID"):
        return f"slurm-{os.environ['SLURM_JOB_ID']}"
    if launcher == "torchrun" and int(nodes) > 1 and endpoint:
        return "torchrun-" + "".join(c if c.isalnum() or c in "-." else "-" for c in str(endpoint))
    return datetime.datetime.now().strftime("%Y-%m-%d/%H-%M-%S")


def _store() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    if not OmegaConf.has_resolver("hf"):  # model=hf: shape fields from the model's config.json
        from recipes.hf_config import resolve

        OmegaConf.register_new_resolver("hf", resolve)
    if not OmegaConf.has_resolver("instance"):  # conf/cluster/sagemaker_*.yaml: an instance's numbers
        from recipes.hardware import instance

        OmegaConf.register_new_resolver("instance", instance)
    if not OmegaConf.has_resolver("launched"):  # conf/cluster/local.yaml: torchrun's / srun's world
        from recipes.hardware import launched

        OmegaConf.register_new_resolver("launched", launched)
    if not OmegaConf.has_resolver("local"):  # conf/cluster/local.yaml: this machine's GPUs, no torch
        from recipes.hardware import local

        OmegaConf.register_new_resolver("local", local)
    if not OmegaConf.has_resolver("run_name"):  # conf/hydra/default.yaml: hydra.run.dir
        OmegaConf.register_new_resolver("run_name", run_name, use_cache=True)
    cs.store(name="logger_schema", node=LoggerConfig)  # opt-in groups: typed per file
    cs.store(name="export_schema", node=ExportConfig)


_store()


def describe(model: Any) -> ModelConfig:
    """The torch-free description of a composed ``cfg.model`` that the planner reads; a value
    that cannot be read (a ``${hf:...}`` shape of a ``model.path`` that holds no model, a missing
    mandatory value) is a ``ConfigError`` in the resolver's own words, as validation says it."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not OmegaConf.is_config(model):
        return model
    try:
        return OmegaConf.to_object(model)
    except OmegaConfBaseException as e:
        from strategies.mesh import ConfigError

        raise ConfigError(f"model: {unreadable(e)}") from None


def unreadable(error: Exception) -> str:
    """Why a config node could not be read, in the words of whoever raised it (a resolver's
    message without OmegaConf's preamble and key listing)."""
    import re

    return re.sub(r"^\w+ raised while resolving interpolation: ", "", str(error).splitlines()[0])


def compose(overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """Compose ``conf/train.yaml`` with CLI-style overrides, as train.py would, without running."""
    return compose_chosen(overrides)[0]


def compose_chosen(overrides: list[str] | tuple[str, ...] = ()) -> tuple[Any, set[str]]:
    """``compose``, and the config groups the composition chose rather than took by default: an
    override of the group (as Hydra parses it) or a choice that differs from conf/train.yaml's
    default (an ``experiment=`` that sets it)."""
    import hydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import open_dict

    import strategies  # noqa: F401  (family schemas)
    from recipes.cli import normalize
    from strategies.presets import hydra_context

    overrides = normalize(list(overrides))
    with hydra_context():
        cfg = hydra.compose(config_name="train", overrides=overrides, return_hydra_config=True)
    choices = dict(cfg.hydra.runtime.choices)
    named = {o.key_or_group.split("@")[0] for o in OverridesParser.create().parse_overrides(overrides)}
    defaults = _default_choices()
    chosen = {g for g, c in choices.items() if g in named or (g in defaults and c != defaults[g])}
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, chosen


def _default_choices() -> dict[str, str]:
    """conf/train.yaml's defaults list: group -> its default option."""
    import yaml

    out = {}
    for entry in yaml.safe_load((CONF_DIR / "train.yaml").read_text()).get("defaults", []):
        if isinstance(entry, dict):
            out |= {str(g): str(o) for g, o in entry.items() if not str(g).startswith(("optional", "override"))}
    return out
