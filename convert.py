"""Convert a checkpoint into a plain full state dict that loads without stratagem.

    python convert.py outputs/run/checkpoints/step300 --to full
    python convert.py outputs/run/checkpoints/step300 --to full --out model.safetensors
    python convert.py outputs/run/checkpoints/step300 --to hf --out /models/my-finetune [--no-merge-lora]

Reads any checkpoint trainer.checkpoint_every wrote (any strategy, any world size: DCP read whole,
or DeepSpeed's zero_to_fp32) and writes one safetensors file of fp32 tensors keyed as the plain
model; by default <checkpoint>.safetensors next to the checkpoint directory. ``--to hf`` (runs of
model=hf) writes a directory that transformers' ``from_pretrained`` loads, with LoRA adapters
merged into the weights (``--no-merge-lora``: the base plus a peft adapter in <out>/adapter).
Exit 2 on a bad checkpoint, naming the file.
"""

from __future__ import annotations

import argparse
import logging
import sys

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

    from backends.common.quiet import install
    from checkpoints import CheckpointError
    from checkpoints.convert import to_full, to_hf

    install()  # (the engines' known console noise, as train.py's: peft's deprecated getattr)

    if args.to == "hf" and args.out is None:
        parser.error("--to hf needs --out: the directory to write the model into")
    try:
        path = (to_hf(args.checkpoint, args.out, merge_lora=args.merge_lora, model_path=args.model_path)
                if args.to == "hf"
                else to_full(args.checkpoint, args.out))
    except CheckpointError as e:
        log.error("%s", e)
        return 2
    log.info("wrote %s", path)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
