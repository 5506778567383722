"""The accelerators dstrain knows, in one table: each variant's name as the driver reports it and its dense peak
TFLOP/s per precision (vendor datasheets, without sparsity). The metrics' MFU and the planner's device models both
read it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from dstrain.precision import Precision


@dataclass(frozen=True)
class DevicePeak:
    """One accelerator variant: how its name reads, the memory that tells look-alike names apart, dense peaks."""

    variant: str
    name: str  # regular expression searched in the device name
    tflops: dict[str, float]  # precision -> dense TFLOP/s (vendor datasheet, without sparsity); fp32 = non-tensor FP32
    min_memory_gib: float = 0.0  # the variant has at least this much device memory (when the name is ambiguous)
    max_memory_gib: float = float("inf")


_H100_SXM = {"bf16": 989.5, "fp16": 989.5, "fp32": 67.0}
_H100_NVL = {"bf16": 835.5, "fp16": 835.5, "fp32": 60.0}
_A100 = {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}
# First match wins: specific variants before the names they contain. Device names as the driver reports them
# (e.g. "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA A100-SXM4-40GB").
DEVICE_PEAKS = (
    DevicePeak("GH200", r"GH200", _H100_SXM),
    DevicePeak("H200 NVL", r"H200.*NVL", _H100_NVL),
    DevicePeak("H200 SXM", r"H200", _H100_SXM),
    DevicePeak("H100 NVL", r"H100.*NVL", _H100_NVL),
    DevicePeak("H100 PCIe", r"H100.*PCIe", {"bf16": 756.5, "fp16": 756.5, "fp32": 51.0}),
    DevicePeak("H100 SXM", r"H100.*(SXM|HBM3)", _H100_SXM),
    DevicePeak("H100 NVL", r"H100", _H100_NVL, min_memory_gib=88),  # 94 GB, whatever the name says
    DevicePeak("H800 PCIe", r"H800.*PCIe", {"bf16": 756.5, "fp16": 756.5, "fp32": 51.0}),
    DevicePeak("H800 SXM", r"H800", _H100_SXM),
    DevicePeak("A100 40GB", r"A100", _A100, max_memory_gib=48),
    DevicePeak("A100 80GB", r"A100", _A100, min_memory_gib=48),
    DevicePeak("L40S", r"L40S", {"bf16": 362.05, "fp16": 362.05, "fp32": 91.6}),
    DevicePeak("L40", r"L40\b", {"bf16": 181.05, "fp16": 181.05, "fp32": 90.5}),
    DevicePeak("L4", r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3}),
    DevicePeak("A10", r"\bA10\b", {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2}),
    DevicePeak("V100S", r"V100S", {"fp16": 130.0, "fp32": 16.4}),
    DevicePeak("V100 PCIe", r"V100.*PCIE", {"fp16": 112.0, "fp32": 14.0}),
    DevicePeak("V100 SXM2", r"V100", {"fp16": 125.0, "fp32": 15.7}),
    DevicePeak("MI300X", r"MI300X", {"bf16": 1307.4, "fp16": 1307.4, "fp32": 163.4}),
)


def lookup_peak(name: str, memory_bytes: int, precision: Precision) -> tuple[str | None, float | None]:
    """(variant, dense TFLOP/s for ``precision``) of a device; (None, None) for a device not in DEVICE_PEAKS,
    or a name that does not tell its variant (an "H100" of 80 GB: SXM or PCIe)."""
    memory_gib = memory_bytes / 2**30
    for peak in DEVICE_PEAKS:
        if re.search(peak.name, name, re.IGNORECASE) and peak.min_memory_gib <= memory_gib < peak.max_memory_gib:
            return peak.variant, peak.tflops.get(precision)
    return None, None


def device_peak(precision: Precision) -> tuple[float | None, str]:
    """This rank's device: its dense peak for ``precision`` (DSTRAIN_PEAK_TFLOPS wins), and a line naming it."""
    if os.environ.get("DSTRAIN_PEAK_TFLOPS"):
        tflops = float(os.environ["DSTRAIN_PEAK_TFLOPS"])
        return tflops, f"MFU against {tflops:g} TFLOP/s per device (DSTRAIN_PEAK_TFLOPS)"
    import torch
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    props = getattr(getattr(torch, accelerator.device_name(), None), "get_device_properties", None)
    if props is None:
        return None, f"MFU not logged: no known peak for {accelerator.device_name()} devices; set DSTRAIN_PEAK_TFLOPS"
    device = props(accelerator.current_device())
    variant, peak = lookup_peak(device.name, device.total_memory, precision)
    memory = f"{device.name}, {device.total_memory / 2**30:.0f} GiB"
    if peak is None:
        return None, f"MFU not logged: no known dense {precision} peak for {memory}; set DSTRAIN_PEAK_TFLOPS"
    return peak, f"MFU against {variant} dense {precision} peak {peak:g} TFLOP/s ({memory})"


def datasheet_peaks(variant: str) -> dict[str, float]:
    """The dense peaks of the variant named ``variant`` in DEVICE_PEAKS (the planner's device models take them)."""
    return next(peak.tflops for peak in DEVICE_PEAKS if peak.variant == variant)
