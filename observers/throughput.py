"""Throughput: how long each optimizer step took, and what that is in tokens, samples and model
FLOPs per second.

Report key ``throughput``: ``step_seconds`` (median over the run's steps, the first excluded
when there are others: it carries warm-up), ``tokens_per_second`` and ``samples_per_second`` at
that median, ``tflops_per_second`` (model FLOPs: ``ModelConfig.flops_per_token`` x tokens, over
the whole world) and ``mfu`` -- that rate over the devices' dense peak for the run's precision
(``PEAK_TFLOPS``, by GPU name, or the matmul rate ``planner.calibrate`` measured on this
machine; None on an uncalibrated CPU or an unlisted GPU) -- with ``peak_tflops`` and
``mfu_formula``, the formula and the peak it divides by -- ``step_cpu_seconds`` (this rank's
process CPU time per step, every thread's, the same median: what the step cost the host whatever
else the machine runs, bench/overhead.py's load-independent measure) and ``steps_timed``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from observers.base import Engine, Observer, Selection, observer

# Dense peak TFLOP/s per device by name fragment: (16-bit tensor cores, fp32 as TF32).
PEAK_TFLOPS = {"H200": (989.0, 494.5), "H100": (989.0, 494.5), "A100": (312.0, 156.0),
               "L40S": (362.0, 183.0), "A10G": (125.0, 62.5), "L4": (121.0, 60.0),
               "V100": (125.0, 15.7)}


def device_peak_tflops(precision: str) -> float | None:
    """This process's device peak for ``precision`` (None: CPU, or a GPU not in the table)."""
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for fragment, (half, single) in PEAK_TFLOPS.items():
        if fragment in name:
            return single if precision == "32" else half
    return None


class Throughput(Observer):
    def __init__(self, tokens_per_step: int, samples_per_step: int, *, flops_per_token: float,
                 precision: str = "32", peak: tuple[float, str] | None = None):
        """``peak``: (TFLOP/s per device, where it comes from) to compute MFU against, instead of
        the GPU table (a calibrated machine's measured matmul rate)."""
        self.tokens_per_step, self.samples_per_step = tokens_per_step, samples_per_step
        self.flops_per_token, self.precision, self.peak = flops_per_token, precision, peak
        self.seconds: list[float] = []
        self.cpu_seconds: list[float] = []
        self.world_size = 1
        self._t0 = self._c0 = 0.0

    def on_train_start(self, engine: Engine, step: int) -> None:
        self.world_size = engine.world_size

    def on_step_start(self, engine: Engine, step: int) -> None:
        self._t0, self._c0 = time.perf_counter(), time.process_time()

    def on_step_end(self, engine: Engine, step: int, loss: float) -> None:
        self.seconds.append(time.perf_counter() - self._t0)
        self.cpu_seconds.append(time.process_time() - self._c0)

    def step_seconds(self, cpu: bool = False) -> float:
        """The median step (the first excluded when there are others): wall clock, or ``cpu``."""
        times = self.cpu_seconds if cpu else self.seconds
        timed = times[1:] or times
        return statistics.median(timed) if timed else 0.0

    def report(self) -> dict[str, Any]:
        step = self.step_seconds()

        def rate(n: float) -> float:
            return n / step if step > 0 else 0.0

        tflops = rate(self.tokens_per_step * self.flops_per_token) / 1e12
        peak, source = self.peak or (device_peak_tflops(self.precision), "dense peak of the GPU model")
        formula = (f"model FLOPs/s ({self.flops_per_token:,.0f} per token: 6 x matmul params + 12 x "
                   f"layers x seq x dim, x tokens/s) / ({self.world_size} device(s) x "
                   f"{peak:.3g} TFLOP/s, {source})") if peak else None
        return {"throughput": {
            "step_seconds": step, "tokens_per_second": rate(self.tokens_per_step),
            "samples_per_second": rate(self.samples_per_step), "tflops_per_second": tflops,
            "mfu": tflops / (peak * self.world_size) if peak else None,
            "peak_tflops": peak, "mfu_formula": formula, "step_cpu_seconds": self.step_seconds(cpu=True),
            "steps_timed": len(self.seconds[1:] or self.seconds)}}


@dataclass
class ThroughputKnobs:
    throughput: bool = True
    """Step time, tokens/s, TFLOP/s and MFU into the report."""


@observer("throughput", order=50, knobs=ThroughputKnobs)
def _selected(s: Selection) -> Observer | None:
    """``callbacks.throughput``; MFU against the peak ``planner.calibrate`` measured, if any."""
    job = s.job
    if not job.callbacks.throughput:
        return None
    compute = (s.plan or {}).get("compute") or {}
    calibrated = "planner.calibrate" in str(compute.get("peak_source", ""))
    return Throughput(job.tokens_per_step, job.batch.global_size, flops_per_token=job.model.flops_per_token(),
                      precision=job.run.precision,
                      peak=(compute["peak_tflops"], compute["peak_source"]) if calibrated else None)
