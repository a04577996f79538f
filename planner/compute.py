"""The compute side of a plan: model FLOPs per token and per step, the peak they are divided by
and where it comes from, the utilisation assumed, and a pipeline's bubble in closed form."""

from __future__ import annotations

from planner.inputs import Setup


def flops_per_token(su: Setup) -> float:
    """Model FLOPs to train on one token, forward and backward: the model's own count (PaLM's
    MFU convention: 6 per matmul parameter, the input embedding's lookup excluded, plus
    12 x layers x seq x dim for attention's scores and mixing), else 6 x parameters."""
    per = getattr(su.shape, "flops_per_token", None)
    return float(per()) if callable(per) else 6.0 * su.params


def flops_per_step(su: Setup, ckpt: float = 0.0) -> float:
    """FLOPs of one optimizer step over the whole world; ``ckpt``: the share of the forward run
    again in backward (true: all of it, one more forward; ``_Layout.recompute``)."""
    return flops_per_token(su) * su.trainer.global_batch_size * su.seq_len * (1 + float(ckpt) / 3)


def peak_flops(su: Setup) -> float:
    """FLOP/s per device the MFU divides by: the measured matmul rate on a calibrated machine,
    else cluster.peak_tflops."""
    return (su.machine.matmul_tflops if su.machine is not None else su.cluster.peak_tflops) * 1e12


def peak_source(su: Setup) -> str:
    if su.machine is not None:
        return f"matmul measured on this machine (planner.calibrate, precision {su.machine.precision})"
    return "cluster.peak_tflops"


def mfu(su: Setup) -> float:
    """Model-FLOPs utilisation: what a transformer block reached of the measured matmul rate on
    a calibrated machine, else planner.mfu."""
    return su.machine.efficiency if su.machine is not None else su.options.mfu


def bubble_fraction(p: int, m: int) -> float:
    """Idle fraction of a GPipe / 1F1B pipeline of ``p`` stages and ``m`` micro-batches (the
    closed form; ``parallel.pipeline.bubble`` simulates every schedule)."""
    return (p - 1) / (m + p - 1) if p > 1 else 0.0
