"""The one object that owns the process arithmetic -- nodes x devices = dp_replicate x dp_shard x
cp x tp x pp -- and the batch arithmetic (global = micro x chunks x dp x accumulation).

The sequence dimension ``cp`` is the ranks that read the *same* samples, each a shard of their
sequence: torch's context parallelism (ring attention, ``strategy.cp``) or DeepSpeed Ulysses
(``strategy.sp``, an all-to-all from sequence shards to head shards around attention). Both
split the sequence the same way, so Ulysses' degree takes the same place in the arithmetic
(``seq = cp x sp``; one of them is 1 in every preset): it divides the data-parallel degree
(samples), and, as torchtitan folds cp into FSDP's shard group and DeepSpeed folds its sequence
group into the data-parallel group, gradients are reduced (and sharded states split) over
``dp x seq`` ranks (``dp_seq``).

Every other module asks a ``Mesh`` (or a ``Batch``) instead of multiplying sizes itself, so an
inconsistent layout fails here, before any process starts, with the arithmetic printed.

``Axis`` names the device-mesh axes: one vocabulary for the families, the builders and the
communication observer, instead of each spelling string literals.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Axis(str, Enum):
    """A device-mesh axis, by the name its DeviceMesh dimension (or process group) carries in our
    code: the value is what torch sees (``init_device_mesh(..., mesh_dim_names=(Axis.REPLICATE,
    Axis.SHARD))``, ``mesh[Axis.TENSOR]``; torch describes the group ``mesh_<value>``), so these
    values are the names outside libraries already use where we meet them -- FSDP's hybrid mesh
    (``replicate``, ``shard``), Lightning's ModelParallelStrategy (``data_parallel``,
    ``tensor_parallel``; its own mesh, which the FSDP2 builders read). The short degree names
    (dp, tp, pp, cp, sp, ep) are ``Mesh``'s fields and the strategy keys, not axes; other
    libraries' mesh names (torchtitan's, Accelerate's ParallelismConfig: ``dp_shard``, ``tp``, ...)
    are mapped where they are read (observers/comm.py)."""

    REPLICATE = "replicate"
    """FSDP's replicate dimension (HSDP: copies of one shard group)."""
    SHARD = "shard"
    """FSDP's shard dimension (the ranks one sharded state is split over)."""
    DATA = "data_parallel"
    """The data-parallel dimension of a DP x [CP x] PP x TP mesh (Lightning's name)."""
    CONTEXT = "context_parallel"
    """Context parallelism: ranks sharing samples, each a sequence shard (ring attention)."""
    PIPELINE = "pipeline_parallel"
    """Pipeline stages."""
    TENSOR = "tensor_parallel"
    """Tensor parallelism, innermost (neighbouring ranks; Lightning's name)."""
    DP_CP = "dp_cp"
    """DATA x CONTEXT flattened: FSDP2's shard group with context parallelism (torchtitan's fold)."""
    EP = "ep"
    """Expert parallelism: ranks each holding 1/ep of every MoE layer's experts (all-to-all)."""
    EP_REPLICATE = "ep_replicate"
    """The ranks holding the same experts: the experts' FSDP2 shard group."""
    SP = "sp"
    """DeepSpeed Ulysses' sequence group (a group we create, described by this name)."""

    def __str__(self) -> str:  # the value wherever it is formatted (torch's ``mesh_<name>``)
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def role(self) -> str:
        """The group's name in the communication report (``communication.by_group``) and the
        planner's word for what travels on it."""
        return _ROLES.get(self, self.value)


# What each axis carries, as report.json's communication groups name it (data-shard, tensor, ...);
# the expert axes are reported by their own names.
_ROLES = {Axis.SHARD: "data-shard", Axis.REPLICATE: "data-replicate", Axis.DATA: "data",
          Axis.CONTEXT: "cp", Axis.PIPELINE: "pipeline", Axis.TENSOR: "tensor",
          Axis.DP_CP: "data-shard", Axis.SP: "sp"}


@dataclass(frozen=True)
class Mesh:
    """How many processes run and how they split into parallel dimensions.

    ``devices`` is processes per node (Lightning's ``devices``, torchrun's ``nproc_per_node``).
    The data-parallel degree is what the model-parallel degrees leave; ``shard`` (a hybrid
    family's shard group, validated by that family, which names its key) splits it into
    ``dp_replicate x dp_shard``.
    """

    nodes: int = 1
    devices: int = 1
    tp: int = 1
    pp: int = 1
    shard: int | None = None
    """Ranks one sharded state is split over (HYBRID/HSDP); None: every data-parallel rank."""
    cp: int = 1
    """Context-parallel degree (ring attention): ranks sharing samples, each a sequence shard."""
    sp: int = 1
    """Ulysses sequence-parallel degree: the same place in the arithmetic as cp (see above)."""
    ep: int = 1
    """Expert-parallel degree: ranks each holding 1/ep of every MoE layer's experts, trading
    tokens by all-to-all. It consumes no ranks of its own: it folds into dp_shard x cp as
    torchtitan does (the ep group is ``ep`` neighbouring ranks of those), so it must divide them."""

    @property
    def size(self) -> int:
        return self.nodes * self.devices

    @property
    def seq(self) -> int:
        """The sequence degree: ranks that read the same samples, each a shard of the sequence."""
        return self.cp * self.sp

    @property
    def dp(self) -> int:
        """Data-parallel degree: the ranks that see different samples of one global batch."""
        return max(1, self.size // max(1, self.tp * self.pp * self.seq))  # (invalid: problems())

    @property
    def dp_seq(self) -> int:
        """Ranks gradients are reduced over (and sharded states split over): dp x seq."""
        return self.dp * self.seq

    @property
    def dp_shard(self) -> int:
        return max(1, min(self.shard or self.dp, self.dp))

    @property
    def dp_replicate(self) -> int:
        return max(1, self.dp // self.dp_shard)

    def problems(self) -> list[str]:
        """The parallel arithmetic (nodes and devices >= 1 are the cluster fields' own checks)."""
        if min(self.tp, self.pp, self.cp, self.sp) < 1:
            return [f"tp={self.tp}, pp={self.pp}, cp={self.cp}, sp={self.sp}: parallel degrees "
                    "must be >= 1"]
        model = self.tp * self.pp * self.seq
        if self.size % model:
            given = [f"strategy.{k}={v}" for k, v in
                    (("tp", self.tp), ("pp", self.pp), ("cp", self.cp), ("sp", self.sp)) if v > 1]
            degrees = " x ".join(given) + (f" = {model}" if len(given) > 1 else "")
            fit = [d for d in range(1, 2 * max(self.devices, model) + 1) if self.nodes * d % model == 0]
            near = sorted(fit, key=lambda d: (abs(d - self.devices), d))[:2]
            return [f"world size {self.size} (cluster.nodes={self.nodes} x cluster.devices={self.devices}) "
                    f"is not a multiple of {degrees}, the ranks of one model replica "
                    f"(data-parallel degree {self.size / model:g}): set cluster.devices="
                    f"{' or '.join(map(str, sorted(near)))}, or degrees whose product divides {self.size}"]
        fold = self.dp_shard * self.seq
        if self.ep < 1 or fold % self.ep:
            return [f"strategy.ep={self.ep} must divide dp_shard({self.dp_shard}) * cp({self.seq}) "
                    f"= {fold} (world size {self.size} / (tp({self.tp}) * pp({self.pp})); ep folds "
                    "into the data-parallel ranks and takes none of its own): choose ep among "
                    f"{', '.join(str(d) for d in range(1, fold + 1) if fold % d == 0)}"]
        return []


    def model_problems(self, model: object, preset: str) -> list[str]:
        """What this layout cannot train of ``model`` (``recipes.config.ModelConfig``): a mixture
        of experts routes each sequence as one group (its capacity and load-balancing loss are
        per sequence, recipes/gpt.py), so no rank may hold a shard of a sequence; its experts
        split over ``ep`` ranks, whole experts each (``ep`` divides them)."""
        n = getattr(model, "n_experts", 0) or 0
        if n and self.ep > 1 and n % self.ep:
            return [_expert_degree_problem(n, self.ep, self.dp_shard * self.seq)]
        if self.seq > 1 and getattr(model, "is_moe", False):
            return [f"model={getattr(model, 'name', '?')} (a mixture of experts) with a sequence-parallel "
                    f"preset (strategy={preset}, sequence degree {self.seq}): the router's capacity and "
                    "load-balancing loss are per sequence, and each rank would hold a shard of it, "
                    "routing it alone; use a data- or expert-parallel preset (fsdp2, fsdp_ep) for MoE "
                    "models"]
        return []


def _expert_degree_problem(n: int, ep: int, fold: int) -> str:
    """n experts do not divide over ep ranks: the degrees dividing both the experts and the
    data-parallel ranks ep folds into, or (only 1 does) the n_experts change."""
    head = (f"model.n_experts={n} is not divisible by strategy.ep={ep}: each expert-parallel rank "
            f"holds n_experts / ep whole experts, and ep also divides the data-parallel ranks it "
            f"folds into (dp_shard x cp = {fold})")
    fits = [d for d in range(1, min(n, fold) + 1) if n % d == 0 and fold % d == 0]
    if len(fits) > 1:
        return f"{head}; choose ep among {', '.join(map(str, fits))} (dividing both), or change model.n_experts"
    more = -(-n // ep) * ep
    return (f"{head}; no ep > 1 divides both: set model.n_experts={more} (a multiple of "
            f"strategy.ep={ep}), or strategy.ep=1 (no expert parallelism)")


def training_seed(seed: int, mesh: Mesh, rank: int) -> int:
    """The seed of ``rank``'s training RNG (dropout masks) in a run of ``trainer.seed`` on
    ``mesh``, as torchtitan and Megatron seed theirs: ranks that hold different tokens -- data-
    parallel replicas and shards, sequence shards (cp or Ulysses' sp), pipeline stages -- draw
    different masks; tensor-parallel peers, which hold the same activations and must keep the
    replicated ones identical, draw the same. Ranks are laid out (data, sequence, pipeline,
    tensor), tensor innermost (``Axis.TENSOR``'s neighbouring ranks, Ulysses' sp group likewise
    when tp is 1); expert parallelism folds into data and sequence and adds no ranks."""
    data, rest = divmod(rank, mesh.seq * mesh.pp * mesh.tp)
    sequence, rest = divmod(rest, mesh.pp * mesh.tp)
    stage = rest // mesh.tp  # (its tensor coordinate left out: the peers share the seed)
    return seed + (data * mesh.seq + sequence) * mesh.pp + stage


@dataclass(frozen=True)
class Batch:
    """global = micro x chunks x dp x accumulation, with accumulation derived. ``chunks``: the
    micro-batches a pipeline cuts one engine step into (``strategy.microbatches``), 1 otherwise."""

    global_size: int
    micro_size: int
    dp: int
    chunks: int = 1

    @property
    def per_step(self) -> int:
        """Samples one data-parallel rank reads per engine step (micro x chunks)."""
        return self.micro_size * self.chunks

    @property
    def accumulation(self) -> int:
        return max(1, self.global_size // (self.per_step * self.dp))

    def problems(self) -> list[str]:
        g, m, dp, c = self.global_size, self.micro_size, self.dp, self.chunks
        if g < 1 or m < 1:
            return [f"trainer.global_batch_size={g}, trainer.micro_batch_size={m}: both must be >= 1"]
        unit = m * c * dp
        if g % unit:
            lo = max(unit, (g // unit) * unit)
            factors = (f"micro_batch_size({m}) x strategy.microbatches({c}) x data-parallel size({dp})"
                       if c > 1 else f"micro_batch_size({m}) x data-parallel size({dp})")
            return [
                f"trainer.global_batch_size={g} is not divisible by {factors} = {unit}: "
                f"global = {'micro x microbatches' if c > 1 else 'micro'} x dp x accumulation needs "
                f"{g} / {unit} = {g / unit:g} to be an integer; use global_batch_size={lo} or "
                f"{lo + unit}, or change micro_batch_size"
                + (" or strategy.microbatches" if c > 1 else "")
            ]
        return []


__all__ = ["Axis", "Batch", "Mesh", "training_seed"]
