"""Convert a checkpoint into a plain full state dict that loads without stratagem.

    python convert.py outputs/run/checkpoints/step300 --to full
    python convert.py outputs/run/checkpoints/step300 --to full --out model.safetensors
    python convert.py outputs/run/checkpoints/step300 --to hf --out /models/my-finetune [--no-merge-lora]

Reads any checkpoint trainer.checkpoint_every wrote (any strategy, any world size: DCP read whole,
or DeepSpeed's zero_to_fp32) and writes one safetensors file of fp32 tensors keyed as the plain
model; by default <checkpoint>.safetensors next to the checkpoint directory. ``--to hf`` (runs of
model=hf) writes a directory that transformers' ``from_pretrained`` loads, in the source model's
dtype (its config.json's; fp32 for random weights), with LoRA adapters merged into the weights
(``--no-merge-lora``: the base plus a peft adapter in <out>/adapter).
Exit 2 on a bad checkpoint, naming the file, and on an output it cannot write, before reading one.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

log = logging.getLogger("convert")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint directory, <run>/checkpoints/step<N>")
    parser.add_argument("--to", choices=["full", "hf"], required=True,
                        help="full: one safetensors file with the full fp32 parameters; "
                             "hf: a Hugging Face model directory (model=hf runs)")
    parser.add_argument("--out", default=None, help="the file (full; default: <checkpoint>.safetensors) "
                                                    "or directory (hf; required) to write")
    parser.add_argument("--model-path", default=None,
                        help="hf: where the run's model.path (config.json, tokenizer) is now, if it moved")
    parser.add_argument("--no-merge-lora", dest="merge_lora", action="store_false",
                        help="hf: keep LoRA adapters apart (<out>/adapter) instead of merging them")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    if args.to == "hf" and args.out is None:
        parser.error("--to hf needs --out: the directory to write the model into")
    if (problem := _out_problem(args.checkpoint, args.to, args.out)) is not None:
        log.error("%s", problem)
        return 2

    from backends.common.quiet import install
    from checkpoints import CheckpointError
    from checkpoints.convert import to_full, to_hf

    install()  # (the engines' known console noise, as train.py's: peft's deprecated getattr)
    out = None if args.out is None else str(Path(args.out).expanduser())  # (as the check read it)
    try:
        path = (to_hf(args.checkpoint, out, merge_lora=args.merge_lora, model_path=args.model_path)
                if args.to == "hf"
                else to_full(args.checkpoint, out))
    except CheckpointError as e:
        log.error("%s", e)
        return 2
    log.info("wrote %s", path)
    print(path)
    return 0


def _out_problem(checkpoint: str, to: str, out: str | None) -> str | None:
    """Why the output cannot be written (one line naming --out, its value and the fix), before
    any conversion work; None when it can (``recipes.cli.unwritable``, as train.py's run
    directory). Without --out (``--to full``): the default file beside the checkpoint, checked
    once the checkpoint is one (reading it says what else it is)."""
    from checkpoints.store import MARKER, full_out
    from recipes.cli import unwritable

    if to == "hf":
        return unwritable("--out", out)
    if out is None:
        if not (Path(checkpoint) / MARKER).is_file():
            return None
        out = str(full_out(checkpoint))
    path = Path(out).expanduser()
    if path.is_dir():
        return (f"--out={out} is a directory, not a file: name the file to write, e.g. "
                f"--out={path / (Path(checkpoint).name + '.safetensors')}")
    return unwritable("--out", path.parent, file=out)


if __name__ == "__main__":
    sys.exit(main())
