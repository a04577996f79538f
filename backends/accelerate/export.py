"""Native configs for a preset: an ``accelerate launch`` config YAML and the DeepSpeed JSON.

The YAML says what Accelerate's launcher and state need (compute environment, distributed type,
processes, machines, mixed precision, the FSDP or DeepSpeed section); it is translated from the
same objects the backend builds (the family's ``accelerate()``), and the DeepSpeed JSON is the
same generated config the Lightning and Accelerate paths train with (``deepspeed_json``), with
the run's batch, clipping and precision filled in, so it also stands alone for DeepSpeed's own
launcher. Both are checked by the tools themselves in tests (``accelerate launch`` trains with
the YAML; ``DeepSpeedConfig`` parses the JSON).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from backends.accelerate import families
from core.precision import of

if TYPE_CHECKING:
    from recipes.job import Job


def deepspeed_config(job: Job) -> dict[str, Any]:
    """The preset's DeepSpeed JSON for this run (batch, accumulation, clipping, precision)."""
    return job.strategy.deepspeed_json(job.run)


def accelerate_config(job: Job, deepspeed_file: str | None = None) -> dict[str, Any]:
    """The ``accelerate launch --config_file`` YAML of this preset and cluster, as a mapping."""
    from backends.accelerate.families.fsdp import SIZE_WRAP_PARAMS

    w, run = job.mesh, job.run
    # the wrap policy is for the script the user launches (train.py builds its own plugin):
    # the block class they name, else by size -- never our model's class unless they name it
    wrap = job.export.wrap if job.export is not None and job.export.wrap else SIZE_WRAP_PARAMS
    kwargs = families.builder(job.strategy, run).kwargs(wrap)
    cfg: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "num_machines": w.nodes,
        "num_processes": w.size,
        "machine_rank": 0,
        "rdzv_backend": "static" if w.nodes == 1 else "c10d",
        "same_network": True,
        "use_cpu": run.accelerator == "cpu",
    }
    if w.nodes == 1:
        cfg["main_process_ip"] = "127.0.0.1"
    else:  # node 0's address differs per job: each node passes it (node_instructions)
        cfg["main_process_port"] = 29500
    if "deepspeed_plugin" in kwargs:
        if deepspeed_file is None:
            raise ValueError("a DeepSpeed preset's accelerate config points at its DeepSpeed JSON")
        # precision lives in the JSON; Accelerate refuses it in both places. ZeRO-3: a script's
        # from_pretrained builds the model partitioned (deepspeed.zero.Init) instead of whole on
        # every rank (train.py builds under zero.Init itself and ignores the flag). On CPU a plain
        # Accelerator() would train DDP or lone processes: the file it reads is the hook's refusal
        # (train.py and the hook pass their own plugin and never read it)
        if run.accelerator == "cpu":
            deepspeed_file = hook_required(job, "DeepSpeed", f"{JSON_NAMED}{deepspeed_file}")
        section = {"deepspeed_config_file": deepspeed_file, "zero3_init_flag": job.strategy.stage == 3}
        if w.nodes > 1:  # every node runs the same command (node_instructions); Accelerate's
            section["deepspeed_multinode_launcher"] = "standard"  # default is pdsh from node 0
        return cfg | {"distributed_type": "DEEPSPEED", "deepspeed_config": section}
    cfg["mixed_precision"] = of(run.precision).accelerate
    if "fsdp_plugin" in kwargs:
        section = _fsdp_section(kwargs["fsdp_plugin"])
        if run.accelerator == "cpu":  # Accelerate alone would train DDP: refuse without the hook
            wrap = ("fsdp_transformer_layer_cls_to_wrap" if "fsdp_transformer_layer_cls_to_wrap" in section
                    else "fsdp_min_num_params")
            section["fsdp_auto_wrap_policy"] = hook_required(job, "FSDP", f"it wraps by {wrap}")
        return cfg | {"distributed_type": "FSDP", "fsdp_config": section}
    # DDP: the launcher's multi-process path (also for CPU ranks: Accelerate's MULTI_CPU launch
    # starts one process); the preset's hooks and buckets are applied by train.py itself
    return cfg | {"distributed_type": "MULTI_GPU" if w.size > 1 else "NO"}


def hook_required(job: Job, engine: str, note: str) -> str:
    """A CPU export's value that a plain ``Accelerator()`` reads at its first line and refuses with
    this text: FSDP's ``fsdp_auto_wrap_policy`` (``Invalid auto wrap policy: ...``), DeepSpeed's
    ``deepspeed_config_file`` (``Expected a string path to an existing deepspeed config ...
    Received: ...``), both built from the launcher's variables whatever ``cpu=`` says; read by
    ``stratagem_accelerator`` (backends/accelerate/user.py), which builds its own plugin. It names
    the hook's call that runs this export (``hook_call``)."""
    from backends.accelerate.user import HOOK_REQUIRED

    return (f"{HOOK_REQUIRED}: on CPU, Accelerate alone drops {engine} and trains DDP or lone processes; "
            f"this config runs strategy={job.preset.name} only in a script that builds its Accelerator with "
            f"`from backends.accelerate import stratagem_accelerator; accelerator = "
            f"{hook_call(job)}` ({note})")


JSON_NAMED = "the preset's DeepSpeed JSON: "
"""How a CPU export's hook text names the JSON beside the YAML; the hook reads the path back
(``unlike_the_export``)."""


def unlike_the_export(call: str, built: dict[str, Any]) -> str | None:
    """The warning of a hook whose call builds ``built`` under a launcher's config that names
    another DeepSpeed JSON (``ACCELERATE_DEEPSPEED_CONFIG_FILE``: a GPU export's path, or a CPU
    export's hook text naming it): each key that differs and the argument that gives the file's
    value. None when they agree or no readable file is named. Not compared: the micro batch (the
    script's DataLoader decides it) and sizes the hook leaves "auto" (Accelerate fills them from
    the script's model)."""
    import json
    import os

    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "").rsplit(JSON_NAMED, 1)[-1].removesuffix(")")
    try:
        with open(path) as f:
            theirs = _leaves(json.load(f))
    except (OSError, ValueError):
        return None
    ours = _leaves(built)
    keys = [k for k in {**theirs, **ours} if k != "train_micro_batch_size_per_gpu"
            and ours.get(k) != "auto" and theirs.get(k) != ours.get(k)]
    if not keys:
        return None
    def said(d: dict[str, Any], k: str) -> str:
        return json.dumps(d[k]) if k in d else "absent"

    told = "; ".join(f"{k}: {said(theirs, k)} there, {said(ours, k)} here" for k in keys)
    fixes = {"gradient_clipping": f"grad_clip={theirs.get('gradient_clipping', 0.0)!r}",
             "gradient_accumulation_steps": f"gradient_accumulation_steps={theirs.get('gradient_accumulation_steps', 1)}",
             "precision": "precision=" + repr("bf16" if theirs.get("bf16.enabled") else
                                              "fp16" if theirs.get("fp16.enabled") else "no")}
    wanted = {("precision" if k.split(".")[0] in ("bf16", "fp16") else k) for k in keys}
    args = [fixes[k] for k in fixes if k in wanted] + (["the preset's keys as 'strategy.<key>=<value>'"]
                                                       if wanted - set(fixes) else [])
    return (f"{call} builds another DeepSpeed config than the one the launcher's config names, {path} "
            f"(the hook builds it from its arguments and never reads that file): {told}. To train what "
            f"the file says, pass {', '.join(args)} (export.py prints the whole call)")


def _leaves(tree: dict[str, Any], key: str = "") -> dict[str, Any]:
    """A nested mapping as dotted keys -> leaf values."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out |= _leaves(v, f"{key}{k}.") if isinstance(v, dict) and v else {f"{key}{k}": v}
    return out


def hook_call(job: Job) -> str:
    """The call of a user's script that trains what this export describes: ``stratagem_accelerator``
    with every preset key the job changed (``strategy.*`` on the command line, an experiment's,
    ``trainer.gradient_checkpointing``), the run's precision, its accumulation and, under ZeRO, its
    clipping -- what the hook builds from its arguments alone (it reads neither the YAML's
    DeepSpeed JSON nor the trainer's keys). The micro batch is the script's DataLoader's
    (``script_notes``)."""
    from strategies.presets import overrides_of

    run = job.run
    name, keys = overrides_of(job.preset)  # (a user's own preset: the built-in one it differs least from)
    args = [repr(name), *map(repr, keys)]
    if (mixed := of(run.precision).accelerate) != "no":
        args.append(f"precision={mixed!r}")
    if run.grad_clip and _zero(job):  # (outside ZeRO the hook refuses it: the loop clips)
        args.append(f"grad_clip={float(run.grad_clip)!r}")
    if run.accumulation > 1:
        args.append(f"gradient_accumulation_steps={run.accumulation}")
    return f"stratagem_accelerator({', '.join(args)})"


def script_notes(job: Job) -> list[str]:
    """What export.py says a user's own script needs to train what this export describes: the
    hook's call, the micro batch as its DataLoader's ``batch_size``, the accumulation as
    Accelerate's ``accumulate`` context, and clipping outside ZeRO in its loop."""
    run = job.run
    b = run.batch
    loop = [f"a DataLoader of batch_size={run.micro_batch_size} per process (the micro batch: "
            f"{run.micro_batch_size} x {b.dp} processes x {run.accumulation} accumulated = "
            f"trainer.global_batch_size={b.global_size})"]
    if run.accumulation > 1:
        loop.append("each step under `with accelerator.accumulate(model):`")
    if run.grad_clip and not _zero(job):
        loop.append(f"`accelerator.clip_grad_norm_(model.parameters(), {float(run.grad_clip)!r})` "
                    "after accelerator.backward (trainer.grad_clip)")
    return [f"your own script trains this export with `accelerator = {hook_call(job)}` (from "
            f"backends.accelerate import stratagem_accelerator; the hook builds the preset from these "
            f"arguments, not from the files), {', '.join(loop[:-1]) + ' and ' if len(loop) > 1 else ''}{loop[-1]}"]


def _zero(job: Job) -> bool:
    return job.strategy.capabilities.native_config == "deepspeed"


UNHOOKED_SAYS = {"ddp": "trains DDP", "lone": "trains every rank alone"}


def unhooked_notes(job: Job, config: dict[str, Any]) -> list[str]:
    """What export.py says of an export for a script without the hook: the runs Accelerate alone
    would train without a word -- a ddp-family preset's comm hook or sync dropped (any machine),
    a GPU FSDP/ZeRO export's DDP or lone ranks (``user.unhooked``; a CPU one refuses them)."""
    from backends.accelerate.user import LAUNCHED, unhooked

    preset = job.strategy.name
    if (what := _ddp_hooks(job.strategy)) and config["num_processes"] > 1:
        return [f"a script without the hook trains plain DDP from this file: Accelerate's config has no "
                f"field for strategy={preset}'s {what}; `accelerator = {hook_call(job)}` "
                "(from backends.accelerate import stratagem_accelerator) registers it at prepare"]
    runs = {"with Accelerator(cpu=True)": unhooked(config, cuda=True, cpu=True),
            "on a machine without GPUs": unhooked(config, cuda=False, cpu=False)}
    wrong = [f"{UNHOOKED_SAYS[got]} {where}" for where, got in runs.items() if got in UNHOOKED_SAYS]
    if config["distributed_type"] not in LAUNCHED or not wrong:
        return []
    return [f"a script without the hook gets Accelerate's own {config['distributed_type']} from this "
            f"file on GPUs, but {' and '.join(wrong)}, without a word; "
            f"`accelerator = {hook_call(job)}` (from backends.accelerate import "
            "stratagem_accelerator) runs the preset in each case and checks its engine at prepare"]


def _ddp_hooks(preset: Any) -> str:
    """The ddp family's settings a launcher's config cannot carry (``comm_hook``, ``sync``), as
    ``key=value`` text, or '' (Accelerate names its comm hooks only in a script's kwargs)."""
    knobs = {"comm_hook": "none", "sync": "every_step"}
    return ", ".join(f"strategy.{k}={getattr(preset, k)}" for k, plain in knobs.items()
                     if getattr(preset, k, plain) != plain)


def node_instructions(job: Job, path: str) -> list[str]:
    """How each node of a multi-node job starts from the one YAML (it says node 0's rank): the
    lines export.py prints and the YAML carries as a comment; none for one node."""
    n = job.mesh.nodes
    if n == 1:
        return []
    return [f"{n} nodes: run the same command on every node, each with its own rank and node 0's address:",
            f"  accelerate launch --config_file {path} --machine_rank <0..{n - 1}, this node's> "
            "--main_process_ip <node 0's address> --main_process_port 29500 train.py backend=accelerate "
            "<the overrides you exported with>",
            "  (the flags override the file's machine_rank: 0; under Slurm: --machine_rank $SLURM_NODEID "
            "--main_process_ip $(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1))"]


def accelerate_yaml(job: Job, path: str, deepspeed_file: str | None = None) -> str:
    """``accelerate_config`` as the YAML file's text: a multi-node file says above
    ``machine_rank`` how each node sets its own and node 0's address (``node_instructions``)."""
    import yaml

    text = yaml.safe_dump(accelerate_config(job, deepspeed_file), sort_keys=False)
    notes = node_instructions(job, path)
    if not notes:
        return text
    comment = "".join(f"# {line}\n" for line in notes)
    return text.replace("machine_rank: 0\n", comment + "machine_rank: 0   # node 0's; each node passes its own\n", 1)


def _offloads(plugin: Any) -> bool:
    """FSDP1's CPUOffload(offload_params=...), or FSDP2's CPUOffloadPolicy."""
    offload = plugin.cpu_offload
    if hasattr(offload, "offload_params"):
        return bool(offload.offload_params)
    return type(offload).__name__ == "CPUOffloadPolicy"


def _fsdp_section(plugin: Any) -> dict[str, Any]:
    """The plugin's fields under the names Accelerate's config file uses."""
    v1 = plugin.fsdp_version == 1
    by_size = getattr(plugin.auto_wrap_policy, "__name__", "") == "size_based_auto_wrap_policy"
    wrap = ("TRANSFORMER_BASED_WRAP" if plugin.transformer_cls_names_to_wrap
            else "SIZE_BASED_WRAP" if by_size else "NO_WRAP")
    out = {
        "fsdp_version": plugin.fsdp_version,
        # FSDP1 names its sharding strategy here; FSDP2 takes a bool
        "fsdp_reshard_after_forward": (plugin.sharding_strategy.name if v1
                                       else bool(plugin.reshard_after_forward)),
        "fsdp_auto_wrap_policy": wrap,
        "fsdp_state_dict_type": plugin.state_dict_type.name,
        "fsdp_offload_params": _offloads(plugin),
        "fsdp_activation_checkpointing": bool(plugin.activation_checkpointing),
        # every rank builds the same weights from the seed: nothing to broadcast (and the
        # broadcast needs a CUDA-like device)
        "fsdp_sync_module_states": False,
        "fsdp_cpu_ram_efficient_loading": False,
    }
    if by_size:
        out["fsdp_min_num_params"] = int(plugin.min_num_params)
    if plugin.transformer_cls_names_to_wrap:
        out["fsdp_transformer_layer_cls_to_wrap"] = ",".join(plugin.transformer_cls_names_to_wrap)
    if v1:
        out |= {"fsdp_backward_prefetch": plugin.backward_prefetch.name if plugin.backward_prefetch
                else "NO_PREFETCH",
                "fsdp_forward_prefetch": bool(plugin.forward_prefetch),
                "fsdp_use_orig_params": bool(plugin.use_orig_params)}
    return out
