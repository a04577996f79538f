"""One preset built two ways -- by train.py's Lightning backend and by Lightning's registry
(``Trainer(strategy=<name>)``) -- each set up by a real one-step fit of the same model and data
on one CPU process, then described as data (``PresetStrategy.describe``): wrap policies, meshes,
DeepSpeed settings as the engine got them.

    python tests/registry_vs_train.py <preset> <out.json>
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

from backends.lightning.registry import entries
from backends.lightning.trainer import L, trainer_for
from backends.lightning.module import CausalLM, GlobalBatchData
from recipes.config import compose
from recipes.data import build_datasets
from recipes.job import validate
from strategies import load


def fit(trainer: L.Trainer, job) -> dict:
    train, _ = build_datasets(job.data, job.model, job.trainer.seed)
    data = GlobalBatchData(train, global_batch=job.batch.global_size, micro_batch=job.batch.per_step,
                           steps=job.trainer.max_steps, seed=job.trainer.seed)
    trainer.fit(CausalLM(job.model, job.trainer), datamodule=data)
    return trainer.strategy.describe()


def main(preset: str, out: str) -> None:
    job = validate(compose(["model=gpt_nano", "cluster.accelerator=cpu", "cluster.devices=1",
                            "trainer.max_steps=1", "trainer.global_batch_size=4",
                            "trainer.micro_batch_size=4", f"strategy={preset}", "callbacks=none"]))
    # the preset as its file says (the registry knows no model, so no conf/strategy_model/ tweak)
    job = dataclasses.replace(job, strategy=load(preset))
    with tempfile.TemporaryDirectory() as tmp:
        ours = fit(trainer_for(job, Path(tmp), []), job)
    key = next(k for k, v in entries().items() if v == preset and not k.startswith("stratagem_")) \
        if preset not in ("ddp", "fsdp") else f"stratagem_{preset}"
    # the same Trainer arguments as train.py's (clipping, precision, accumulation), the strategy by name
    theirs = fit(L.Trainer(strategy=key, accelerator="cpu", devices=1, max_steps=1, logger=False,
                           gradient_clip_val=job.trainer.grad_clip or None,
                           accumulate_grad_batches=job.batch.accumulation, precision="32-true",
                           enable_checkpointing=False, enable_progress_bar=False,
                           enable_model_summary=False, use_distributed_sampler=False,
                           limit_val_batches=0, num_sanity_val_steps=0), job)
    Path(out).write_text(json.dumps({"ours": ours, "theirs": theirs, "key": key}, default=str))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
