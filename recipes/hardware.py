"""Known machines as data, for configs that name one instead of spelling out its numbers.

``${instance:<type>,<field>}`` (a resolver, conf/cluster/sagemaker_*.yaml) reads a SageMaker
training instance's GPUs per node, memory per GPU, dense bf16 peak, links and host memory, so
``cluster.sagemaker.instance_type=...`` moves the planner's numbers with it; a field set
explicitly wins. Sources: the instance pages of AWS and NVIDIA's data sheets (dense peaks, no
sparsity); EFA bandwidth is per node, divided here by its GPUs.
"""

from __future__ import annotations

from typing import Any

# type -> GPUs per node, GB per GPU, dense bf16 TFLOP/s per GPU, intra-node GB/s per GPU,
# inter-node GB/s per GPU, host memory GB, NVMe GB
INSTANCES: dict[str, dict[str, float]] = {
    "ml.p5.48xlarge": dict(devices=8, device_memory_GB=80, peak_tflops=989, intra_node_GBps=900,
                           inter_node_GBps=50, host_memory_GB=2048, nvme_GB=30720),        # 8 x H100 SXM, 3200 Gb/s EFA
    "ml.p5e.48xlarge": dict(devices=8, device_memory_GB=141, peak_tflops=989, intra_node_GBps=900,
                            inter_node_GBps=50, host_memory_GB=2048, nvme_GB=30720),       # 8 x H200
    "ml.p5en.48xlarge": dict(devices=8, device_memory_GB=141, peak_tflops=989, intra_node_GBps=900,
                             inter_node_GBps=50, host_memory_GB=2048, nvme_GB=30720),      # 8 x H200
    "ml.p4d.24xlarge": dict(devices=8, device_memory_GB=40, peak_tflops=312, intra_node_GBps=600,
                            inter_node_GBps=6.25, host_memory_GB=1152, nvme_GB=8000),      # 8 x A100 40GB, 400 Gb/s EFA
    "ml.p4de.24xlarge": dict(devices=8, device_memory_GB=80, peak_tflops=312, intra_node_GBps=600,
                             inter_node_GBps=6.25, host_memory_GB=1152, nvme_GB=8000),     # 8 x A100 80GB
    "ml.g5.48xlarge": dict(devices=8, device_memory_GB=24, peak_tflops=70, intra_node_GBps=32,
                           inter_node_GBps=1.5625, host_memory_GB=768, nvme_GB=7600),      # 8 x A10G (PCIe), 100 Gb/s
}


def instance(kind: str, field: str) -> Any:
    """One number of a known instance type (the ``instance`` resolver)."""
    known = INSTANCES.get(str(kind))
    if known is None:
        raise ValueError(f"cluster.sagemaker.instance_type={kind!r} is not a known instance type "
                         f"({', '.join(INSTANCES)}): set cluster.devices, cluster.device_memory_GB, "
                         "cluster.peak_tflops, cluster.intra_node_GBps, cluster.inter_node_GBps, "
                         "cluster.host_memory_GB and cluster.nvme_GB for it")
    value = known[field]
    return int(value) if field == "devices" else float(value)
