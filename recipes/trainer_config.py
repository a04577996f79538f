"""``trainer``'s and ``data``'s schemas: the optimization loop (``TrainerConfig``: steps, batch,
optimizer, schedule, precision, checkpoints) and what the model reads (``DataConfig``). Torch-free."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from core.precision import PRECISIONS
from core.knobs import free, knob
from parallel.float8 import CHOICES as FLOAT8

OPTIMIZERS = ("adamw", "sgd")
OPTIMIZER_IMPLS = ("auto", "fused", "foreach", "for-loop")
COMPILE = ("auto", "true", "false")
SCHEDULERS = ("constant", "cosine", "linear")
SAVE_HF_FROM = ("last", "best")
OBJECTIVES = ("lm", "dpo")  # objective.name (recipes/dpo.py)


@dataclass
class ObjectiveConfig:
    """``objective``: what the loss trains. lm: next-token cross entropy (pre-training, SFT) |
    dpo: Direct Preference Optimization on ``data=preference`` pairs against the frozen base
    model (recipes/dpo.py): per pair z = (log pi(chosen) - log ref(chosen)) - (log pi(rejected)
    - log ref(rejected)), loss = -(1 - ls) logsigmoid(beta z) - ls logsigmoid(-beta z)."""

    name: str = knob("lm", choices=OBJECTIVES)
    """lm (next-token cross entropy) | dpo (on data=preference pairs)."""
    beta: float = knob(0.1, min=0.0)
    """objective=dpo: the KL penalty's inverse temperature (TRL's default 0.1)."""
    label_smoothing: float = knob(0.0, min=0.0, below=0.5)
    """objective=dpo: the share of pairs assumed mislabelled (conservative DPO; TRL's sigmoid loss
    with label_smoothing); 0: plain DPO."""

    READ_BY: ClassVar[dict[str, str]] = {"beta": "dpo", "label_smoothing": "dpo"}
    """The keys one objective alone reads -> that objective: set away from its default under
    another, refused at validate (recipes/dpo_checks.py ``unread_problems``)."""


@dataclass
class EarlyStoppingConfig:
    """``trainer.early_stopping`` (Hugging Face's EarlyStoppingCallback on the validation loss,
    recipes/stopping.py): stop after ``patience`` validations in a row whose loss is not below the
    best before it by more than ``min_delta``."""

    patience: int = knob(0, min=0)
    """Validations without improvement before the run stops; 0: never stop early."""
    min_delta: float = knob(0.0, min=0.0)
    """How much lower than the best so far a validation loss must be to count as an improvement."""


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
    optimizer_impl: str = knob("auto", choices=OPTIMIZER_IMPLS)
    """How torch's optimizer steps: auto (fused kernels where the optimizer steps on CUDA and the
    running torch has them, foreach elsewhere) | fused | foreach | for-loop (one parameter at a
    time, torch's CPU default). Resolved at validate; a choice the running torch cannot do on
    this run's device is refused there."""
    lr: float = knob(3e-3, above=0.0)
    """The peak learning rate (after warm-up, before decay)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW's (beta1, beta2), each in [0, 1)."""
    eps: float = knob(1e-8, above=0.0)
    """AdamW's epsilon."""
    momentum: float = knob(0.0, min=0.0, below=1.0)
    """SGD momentum (0: plain SGD). Ignored by adamw."""
    weight_decay: float = knob(0.0, min=0.0)
    """The optimizer's weight decay (AdamW's decoupled); 0: none."""
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
    """32 (fp32 throughout) | bf16-mixed | 16-mixed (mixed precision: matmuls in bf16 or fp16;
    16-mixed on a GPU only)."""
    seed: int = knob(1234, min=0)
    """Seeds the model's initial weights, the data order and each rank's dropout: a config and a
    seed give the same run."""
    grad_clip: float = knob(0.0, min=0.0)
    """Clip the global gradient norm to this value; 0 disables."""
    log_every: int = knob(1, min=1)
    """The experiment logger (logger=csv, tensorboard, wandb) gets a step's scalars every N
    optimizer steps and at the last (the console's lines: callbacks.log_every)."""
    export_params: bool = False
    """Write the final full parameters to params.pt (rank 0), for comparison and export."""
    compile: str = knob("auto", choices=COMPILE)
    """torch.compile each transformer block (inductor), applied in the fixed order TP ->
    activation checkpointing -> compile -> FSDP; on CPU it needs a C++ compiler. true | false |
    auto: on for the presets where compiled equals eager (single, ddp, fsdp2, zero2) on CUDA,
    off elsewhere and on CPU. Resolved at validate into the Job's ``run.compile`` (a bool: what
    the engines read; this field keeps the intent the planner re-derives for each candidate
    preset). Presets whose engine cannot run compiled blocks refuse true by name (FSDP1, ZeRO-3,
    tensor parallel)."""
    float8: str = knob("none", choices=FLOAT8)
    """FP8 training with torchao (pip install 'stratagem[fp8]'): none | tensorwise (one scale per
    tensor; FSDP2 all-gathers the weights in float8) | rowwise (one scale per row: more accurate,
    slower). The blocks' Linear layers compute in float8 (the output head and layers whose
    dimensions are not divisible by 16 stay bf16); strategy=single or fsdp2, trainer.precision=
    bf16-mixed, a CUDA GPU of compute capability 8.9+ (H100, L4). Fast only compiled
    (trainer.compile=true fuses the casts)."""
    loss_chunk: int = knob(0, min=0)
    """Compute the loss this many tokens' logits at a time (recipes/head.py): the whole
    (tokens, vocab) fp32 logits and their gradient never exist, only one chunk's, for the
    weight's gradient held from forward to backward (4 x vocab x dim bytes) and no extra
    compute; the same loss and gradients. 0: the whole logits at once. The built-in GPT,
    without tensor or pipeline parallelism."""
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
    keep_best: bool = False
    """Also save the checkpoint of each validation that lowers the best validation loss so far,
    and keep the best one whatever keep_last says (report key ``best``: its step, loss and
    path). Needs validations during the run (a validation split, trainer.val_every > 0)."""
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    save_hf_from: str = knob("last", choices=SAVE_HF_FROM)
    """trainer.save_hf: which checkpoint becomes <output>/hf: last (the run's final one) | best
    (the lowest validation loss; trainer.keep_best=true)."""
    gradient_checkpointing: bool | None = None
    """The fine-tuner's name for strategy.activation_checkpointing (one switch): true turns it on
    (recompute each block in backward) where the preset has it off; false where it is on is an
    error; null: strategy.activation_checkpointing decides."""
    resume_from: str | None = knob("auto", choices=("auto",), exists="dir",
                                   fix="set trainer.resume_from=auto (the newest complete checkpoint "
                                       "in the run directory), a checkpoint directory "
                                       "<run>/checkpoints/step<N>, or null to start fresh")
    """auto: continue from the newest complete checkpoint in this run's directory (start fresh if
    there is none) | a checkpoint directory | null: start fresh."""

    def __post_init__(self) -> None:
        # YAML's and the command line's booleans reach a str field as "True" / "False"
        if isinstance(self.compile, str) and self.compile.lower() in ("true", "false"):
            self.compile = self.compile.lower()


DATASETS = ("text", "synthetic", "jsonl", "parquet", "chat", "tokens", "preference")
TRAIN_ON = ("assistant", "all")
PACKINGS = ("concat", "document", "pad")  # data.packing (recipes/packing.py)
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
    world size); None: all. A data.val_fraction's held-out samples past it are neither trained
    on nor validated (the run warns with their number)."""
    num_samples: int = knob(4096, min=1)
    """Samples in the synthetic dataset."""
    num_workers: int = knob(0, min=0)
    """DataLoader worker processes per rank; 0: the rank loads its batches itself."""
    packing: str = knob("concat", choices=PACKINGS)
    """How documents share the model's windows (recipes/packing.py): concat (windows cut the
    token stream; attention crosses documents) | document (the same windows, attention and
    rotary positions restart at each document) | pad (one document per row, padding not counted).
    document and pad need tokenized data (the tokenizer's EOS separates documents)."""
    mixture: list[Any] = dataclasses.field(default_factory=list)  # (`field` is a key above)
    """Several sources, each drawn with its weight (recipes/mixture.py): a list of
    ``{name: <data group>, weight: <number > 0>, <that group's keys>...}``; empty: the one source
    above. Checked at validate (recipes/mixture.py ``settle``)."""

    @property
    def tokenized(self) -> bool:
        """Read through a tokenizer (recipes/tokens.py): jsonl, parquet, chat, or text with one."""
        return self.name in ("jsonl", "parquet", "chat", "preference") or (self.name == "text" and self.tokenizer is not None)

    @property
    def validates(self) -> bool:
        if self.mixture:
            from recipes.mixture import validates

            return validates(self.mixture)
        return self.val_path is not None or self.val_fraction > 0
