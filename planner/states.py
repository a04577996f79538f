"""Model states per device: bytes per parameter by category and precision (and float8's
gathers), and how sharding divides them (ZeRO, Rajbhandari et al. 2020, §3 and §5). Closed forms; docs/PLANNER.md."""

from __future__ import annotations

from strategies.footprint import Footprint, Sizes, StateBytes

GB, GiB, MiB = 10**9, 2**30, 2**20
ACCOUNTINGS = ("actual", "mixed16", "mixed20")


def state_bytes(accounting: str = "actual", precision: str = "bf16-mixed", *,
                master_weights: bool = False, sharded_params: bool = False) -> StateBytes:
    """mixed16 (ZeRO paper, 16 B/param), mixed20 (deep-dive, 20 B/param), or what is allocated."""
    if accounting == "mixed16":
        return StateBytes(2, 2, 4, 8, gather=2, reduce=2, activation=2)
    if accounting == "mixed20":  # the deep-dive's items add to 18; its stated 20 B/param and
        # 140 GB for 7B also count the bf16 gradient backward produces beside the fp32 one
        return StateBytes(2, 2 + 4, 4, 8, gather=2, reduce=4, activation=2)
    if accounting != "actual":
        raise ValueError(f"planner.accounting={accounting!r} is not one of "
                         f"{', '.join(ACCOUNTINGS)}; set planner.accounting=actual")
    p = str(precision)
    if p.startswith(("32", "64")):  # an engine with master weights copies even fp32 params
        return StateBytes(4, 4, 4 if master_weights else 0, 8, gather=4, reduce=4, activation=4)
    if p.endswith("-true"):  # everything, Adam moments included, in the 16-bit dtype
        return StateBytes(2, 2, 0, 4, gather=2, reduce=2, activation=2)
    if master_weights:
        return StateBytes(2, 2, 4, 8, gather=2, reduce=2, activation=2)
    # torch AMP: fp32 parameters and gradients; FSDP's MixedPrecision gathers/reduces in bf16
    return StateBytes(4, 4, 0, 8, gather=2, reduce=2 if sharded_params else 4, activation=2)


def float8_gather(sb: StateBytes, converted: float) -> StateBytes:
    """FSDP2's float8 all-gather (``trainer.float8=tensorwise``, parallel/float8.py): the blocks'
    Linear weights, the fraction ``converted`` of the gathered parameters, travel and sit
    gathered in 1 byte each (float8 e4m3, cast from the shard before the gather), the rest in
    ``sb.gather``. Parameters, gradients, optimizer states and activations are bf16's: torchao
    keeps the fp32 weights and saves each Linear's bf16 input for backward."""
    import dataclasses

    converted = min(max(converted, 0.0), 1.0)
    return dataclasses.replace(sb, gather=converted * 1 + (1 - converted) * sb.gather)


def model_states(params: float, footprint: Footprint, shard: int, sb: StateBytes,
                 trainable: float | None = None) -> dict[str, int]:
    """Per-device bytes of parameters, gradients, fp32 master and optimizer moments under
    ``footprint`` before offload (``shard``: ranks a sharded state is split over; ZeRO pads
    shards: ceil)."""
    import dataclasses

    on_device = dataclasses.replace(footprint, params_offload="device", optimizer_offload="device")
    held = on_device.states(Sizes(params, params if trainable is None else trainable, sb, dp=shard,
                                  shard=shard))
    return {"params": held.params, "grads": held.grads, "master": held.master, "optimizer": held.optimizer}


def gb(nbytes: float) -> str:
    """Human units, always GB = 1e9 bytes (GiB is shown separately where it helps)."""
    return f"{nbytes / GB:,.1f} GB" if abs(nbytes) >= GB / 10 else f"{nbytes / MiB:,.1f} MiB"


def gb_apart(need: float, has: float) -> tuple[str, str]:
    """``need`` and ``has`` in one unit, with the digits that show which is larger (a refusal
    read "needs 0.2 GB per device, has 0.2 GB" for 215.9 MB against 200 MB)."""
    scale, unit = (GB, "GB") if max(abs(need), abs(has)) >= GB / 10 else (MiB, "MiB")
    for digits in (1, 2, 3):
        a, b = (f"{x / scale:,.{digits}f} {unit}" for x in (need, has))
        if a != b or need == has:
            break
    return a, b
    return a, b
