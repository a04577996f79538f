"""Will it fit, what will it cost, which strategy -- before any device is touched.

    python plan.py model=llama_70b cluster=slurm_8x8_h100                # every preset, ranked
    python plan.py model=llama_7b cluster=node_8x_a100_80g strategy=zero3  # one preset, in full
    python plan.py model=llama_7b cluster=node_8x_a100_80g planner.format=json

Takes the same overrides as train.py and composes the same conf/ with Hydra's compose API (a
query, not a job: one composition, nothing written to disk), then validates what the config
says (not this machine: plan a GPU cluster from a laptop), and a ``trainer.resume_from`` path
found here as train.py checks it (``resume_checked``). It imports neither torch nor an engine. Method and JSON contract: docs/PLANNER.md.
"""

from __future__ import annotations

import sys

from recipes import cli


def main(argv: list[str]) -> None:
    if (composed := cli.query(argv, __doc__, "plan.py")) is None:
        return
    cfg, groups, argv, origin = composed
    from planner import choose, plan_all, run_overrides, what_ifs
    from planner.machine import ensure
    from planner.render import render
    from core.knobs import paths_elsewhere
    from recipes.job import CONFIG, validate

    chosen = "strategy" in groups  # strategy=auto: chosen as train.py strategy=auto chooses
    try:
        with paths_elsewhere(lambda path: True):  # (the data, tokenizer, NVMe: the cluster's files)
            job = cli.or_exit(lambda: validate(cfg, depth=CONFIG, auto=choose if chosen else None,
                                                      origin=origin))
        ensure(job)  # planner.calibrate=true: this machine measured once, in a subprocess (no torch here)
    except RuntimeError as e:
        sys.exit(f"{e}")
    if note := cli.or_exit(lambda: resume_checked(job)):  # (a refusal: exit 2, before any plan)
        print(note, file=sys.stderr)
    report = cli.or_exit(lambda: plan_all(job, chosen=chosen))
    fmt = job.planner.format
    if job.auto:
        report.recommendation.reason = job.auto
    render(report, fmt, detailed=chosen)
    for line in job.implied:  # (which of the batch and precision above the cluster set)
        print(f"note: {line}", file=sys.stderr if fmt == "json" else sys.stdout)
    if job.auto and fmt != "json":
        print(job.chosen_by)
        # (the degrees and knobs it chose, spelled out: the command trains and plans the same)
        mine = [a for a in argv if a.split("=")[0].lstrip("+~").split(".")[0] != "strategy"]
        print(f"run it: {start(job)} {' '.join([*mine, *run_overrides(job.preset)])}"
              "   (what strategy=auto trains)")
    if chosen and (problems := report.plans[0].problems):  # a layout that cannot run here
        what = "cannot run on" if report.plans[0].blocking else "is incomplete for"
        print(f"strategy={job.strategy_option} {what} {report.cluster} "
              f"({len(problems)} problem(s)):", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        sys.exit(2)
    if what_ifs(job) and not chosen and fmt != "json":
        print("run it: no command for planner.params / planner.trainable, a what-if of a parameter "
              "count: name the model (model=..., model.lora.rank=...) to get one")
    elif not chosen and fmt != "json" and (picked := report.recommendation.config) is not None:
        # (no strategy= among them; a strategy.<key> set the default preset, planned with it, and
        # no other: the command keeps it only if that preset is the one picked)
        mine = [a for a in argv if a.split("=")[0].lstrip("+~").startswith("strategy.")]
        keep = argv if picked.name == job.preset.name else [a for a in argv if a not in mine]
        if mine and keep is not argv:
            print(f"note: {' '.join(mine)} set the default preset ({job.preset.name}), which the ranking "
                  f"planned with it, and no other: the command leaves it out (planner.activation_"
                  f"checkpointing, planner.tp and planner.pp plan every preset with theirs)")
        run = run_overrides(picked)  # every degree and setting the plan used
        if job.model.is_hf and job.model.path is None:  # (a named shape: planned without weights)
            print(f"note: model={job.model.name} is planned without weights; train.py builds it from "
                  "them: put the checkpoint's directory (save_pretrained) in model.path below")
            run = [f"model.path=/path/to/{job.model.name}", *run]
        auto = ("(tight: strategy=auto refuses it; lower planner.reserve_GB to let it)"
                if report.recommendation.tight else "(or strategy=auto)")
        print(f"run it: {start(job)} {' '.join([*keep, *run])}   {auto}")
        if (micro := report.recommendation.micro_batch_size) is not None:
            keep = [a for a in keep if a.split("=")[0] != "trainer.micro_batch_size"]
            print(f"   or: {start(job)} {' '.join([*keep, *run, f'trainer.micro_batch_size={micro}'])}"
                  "   (the largest micro batch that fits)")


def resume_checked(job) -> str | None:
    """``trainer.resume_from``, checked as train.py checks it before launch (checkpoints
    ``checked``: whether this preset and model continue from it, a path not past
    ``trainer.max_steps``) but for what torch reads (every file, the model's shapes): a refusal is
    one ConfigError. A path not on this machine (the cluster's) is a note: not checked."""
    from pathlib import Path

    import checkpoints

    path = job.trainer.resume_from
    if path not in (None, checkpoints.AUTO) and not Path(path).exists():
        return (f"note: trainer.resume_from={path} is not on this machine: plan.py did not check it "
                "(train.py does, before launch)")
    checkpoints.checked(job, files=False)
    return None


def start(job) -> str:
    """The command that starts ``job`` from the user's machine (its launcher's: a Slurm cluster's
    jobs are submitted through Hydra's submitit launcher, k8s and SageMaker ones by launch.py)."""
    from launchers.registry import get

    return get(job.cluster.launcher).command


if __name__ == "__main__":
    main(sys.argv[1:])
