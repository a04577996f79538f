"""Write a preset's native configs: an `accelerate launch` config YAML, or the DeepSpeed JSON.

    python export.py strategy=zero3_offload cluster=node_8x_h100 export=accelerate   # + its JSON
    python export.py strategy=zero3_offload cluster=node_8x_h100 export=deepspeed
    accelerate launch --config_file zero3_offload-node_8x_h100.accelerate.yaml \\
        train.py backend=accelerate strategy=zero3_offload cluster=node_8x_h100

Takes train.py's overrides (the batch, precision and cluster shape the files describe) and checks
the run they describe as train.py would, but not this machine; ``strategy=auto`` writes the files
of the preset the planner picks, as train.py would run it. Files are written atomically;
their paths are printed (stdout). export=accelerate also says (stderr) the one line of a user's own
script that trains what the files describe -- ``stratagem_accelerator`` with every preset key,
the precision, the accumulation and ZeRO's clipping the export set -- and its DataLoader's batch
size (backends/accelerate/export.py ``script_notes``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from recipes import cli


def _problems(job) -> list[str]:
    if job.export is None:
        return ["export=null: choose what to write: export=accelerate (an accelerate launch config "
                "YAML) or export=deepspeed (the DeepSpeed JSON)"]
    kind, s = job.export.name, job.strategy
    if kind == "accelerate" and job.backend != "accelerate":
        return [f"export=accelerate writes a config for backend=accelerate, and backend={job.backend} "
                "was given: remove the backend override"]
    if s.family == "deepspeed" and getattr(s, "sp", 1) > 1:
        return [f"export={kind}: strategy={s.name} adds DeepSpeed Ulysses sequence parallelism "
                f"(strategy.sp={s.sp}), which train.py applies to its model's attention; neither a "
                f"DeepSpeed JSON nor an accelerate launch config carries it: export strategy=zero{s.stage} "
                f"(ZeRO-{s.stage} alone), or train it with train.py strategy={s.name}"]
    if kind == "deepspeed" and s.capabilities.native_config != "deepspeed":
        chose = " (strategy=auto chose it)" if job.auto else ""
        return [f"export=deepspeed writes a DeepSpeed config, but strategy={s.name}{chose} is a "
                f"{s.family} preset: choose a zero* preset, or export=accelerate"]
    from backends.accelerate import families

    return families.problems(job.strategy, job.run)


def _default_name(job) -> str:
    kind = job.export.name
    return f"{job.strategy_option}-{job.option('cluster')}.{kind}.{'yaml' if kind == 'accelerate' else 'json'}"


def _out(job) -> Path:
    """The file export.out names; unset: <strategy>-<cluster>.<kind>.(yaml|json) here."""
    return Path(job.export.out or _default_name(job)).expanduser()


def _out_problems(job) -> list[str]:
    """The file to write (and the DeepSpeed JSON beside an accelerate YAML): not a directory, in
    a directory this user can write, as train.py's output directory (``cli.unwritable``)."""
    if job.export is None:
        return []
    out = _out(job)
    if out.is_dir():
        return [f"export.out={job.export.out or out} is a directory, not a file: name the file to write, "
                f"e.g. export.out={out / _default_name(job)}"]
    problem = cli.unwritable("export.out", out.parent, file=str(job.export.out or out))
    return [problem] if problem else []


def main(argv: list[str]) -> None:
    implied = ()  # (what it runs on: strategy=auto picks for it)
    if "export=accelerate" in argv and not any(a.startswith("backend=") for a in argv):
        implied = ("backend=accelerate",)
    if (composed := cli.query(argv, __doc__, "export.py", implied)) is None:
        return
    cfg, _, _, origin = composed
    from planner import choose
    from recipes.job import RUN, validate

    # strategy=auto: the preset the planner picks, as train.py strategy=auto would run it
    job = cli.or_exit(lambda: validate(cfg, depth=RUN, extra=[_problems, _out_problems], auto=choose,
                                       origin=origin))
    if job.auto:
        print(job.chosen_by, file=sys.stderr)
    from backends.accelerate.export import deepspeed_config
    from backends.common.quiet import install
    from observers.files import atomic_write_text

    install()  # (the engines' console noise, as in a run: building the plugins to export them)

    kind = job.export.name
    out = _out(job)
    written = []
    ds_file = None
    if job.strategy.capabilities.native_config == "deepspeed":
        # (beside the YAML, named after it: two exports into one folder keep their own JSON)
        ds_file = out if kind == "deepspeed" else out.with_name(
            out.name.removesuffix(".yaml").removesuffix(".yml").removesuffix(".accelerate") + ".deepspeed.json")
        atomic_write_text(ds_file, json.dumps(deepspeed_config(job), indent=2) + "\n")
        written.append(ds_file)
    if kind == "accelerate":
        from backends.accelerate.export import (accelerate_config, accelerate_yaml, node_instructions,
                                                script_notes, unhooked_notes)

        ds_path = str(ds_file.resolve()) if ds_file else None
        atomic_write_text(out, accelerate_yaml(job, str(out), ds_path))
        written.append(out)
        notes = node_instructions(job, str(out)) + unhooked_notes(job, accelerate_config(job, ds_path))
        for line in notes + script_notes(job):  # (stderr: stdout is the list of files)
            print(line, file=sys.stderr)
    for path in written:
        print(path)


if __name__ == "__main__":
    main(sys.argv[1:])
