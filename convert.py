"""Convert a checkpoint into a plain full state dict that loads without stratagem.

    python convert.py outputs/run/checkpoints/step300 --to full
    python convert.py outputs/run/checkpoints/step300 --to full --out model.safetensors

Reads any checkpoint trainer.checkpoint_every wrote (any strategy, any world size: DCP read whole,
or DeepSpeed's zero_to_fp32) and writes one safetensors file of fp32 tensors keyed as the plain
model; by default <checkpoint>.safetensors next to the checkpoint directory. Exit 2 on a bad
checkpoint, naming the file.
"""

from __future__ import annotations

import argparse
import logging
import sys

log = logging.getLogger("convert")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint directory, <run>/checkpoints/step<N>")
    parser.add_argument("--to", choices=["full"], required=True,
                        help="full: one safetensors file with the full fp32 parameters")
    parser.add_argument("--out", default=None, help="the file to write (default: <checkpoint>.safetensors)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from checkpoints import CheckpointError
    from checkpoints.convert import to_full

    try:
        path = to_full(args.checkpoint, args.out)
    except CheckpointError as e:
        log.error("%s", e)
        return 2
    log.info("wrote %s", path)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
