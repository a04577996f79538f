"""Run ``train.py`` and note when each rank finishes its first optimizer step, and which heavy
libraries are loaded by then (``python -m bench startup`` runs this instead of train.py).

    BENCH_T0=<time.time()> BENCH_OUT=<dir> python bench/firststep.py train.py <overrides>

A global optimizer step post-hook (torch.optim) fires after every optimizer's step -- ours, the
one Accelerate wraps, the torch AdamW DeepSpeed steps -- and writes ``rank<N>.json`` with the
wall-clock time and the heavy modules in ``sys.modules``. The ranks are forked from this
process on CPU, so they inherit the hook.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from pathlib import Path

HEAVY = ["deepspeed", "wandb", "transformers", "sagemaker", "accelerate", "lightning", "tensorboard"]


def _hook(optimizer, args, kwargs) -> None:
    out = Path(os.environ["BENCH_OUT"]) / f"rank{os.environ.get('RANK', '0')}.json"
    if out.exists():
        return
    out.write_text(json.dumps({"t": time.time(), "loaded": [m for m in HEAVY if m in sys.modules]}))


def main() -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(_hook)
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
