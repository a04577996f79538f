"""Will it fit, what will it cost, which strategy -- before any device is touched.

    python plan.py model=llama_70b cluster=slurm_8x8_h100                # every preset, ranked
    python plan.py model=llama_7b cluster=node_8x_a100_80g strategy=zero3  # one preset, in full
    python plan.py model=llama_7b cluster=node_8x_a100_80g planner.format=json

Shares conf/ with train.py. It writes nothing to disk: Hydra's output directory, .hydra/ and log
files are switched off by the overrides in ``_NO_OUTPUT``, added to the command line (each only
when the user did not set that key). Method and JSON contract: docs/PLANNER.md.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

import recipes.config  # noqa: F401  (typed schemas into the ConfigStore)
import strategies  # noqa: F401  (strategy family schemas)

_NO_OUTPUT = ("hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=disabled",
              "hydra/hydra_logging=disabled")


@hydra.main(config_path="conf", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from strategies.plan_render import render
    from strategies.planner import plan_all

    chosen = any(o.split("=")[0].lstrip("+~") == "strategy"
                 for o in HydraConfig.get().overrides.task)
    render(plan_all(cfg, chosen=chosen), str(cfg.planner.format), detailed=chosen)


def _quiet(argv: list[str]) -> list[str]:
    given = {a.split("=")[0] for a in argv}
    return argv + [o for o in _NO_OUTPUT if o.split("=")[0] not in given]


if __name__ == "__main__":
    sys.argv[1:] = _quiet(sys.argv[1:])
    main()
