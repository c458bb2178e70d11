"""Peak FLOP/s (the vendors' dense figures per dtype) and memory bandwidth of named devices, ``"cpu"`` measured,
and the roofline over them: docs/roofline.md. A peak is ``"<device>-<dtype>"`` or a number of FLOP/s.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)

__all__ = ["DEVICES", "DTYPES", "Device", "Roof", "check_peak", "device", "peak_flops", "this_cpu"]

#: dtype names as torch spells them -> the table's
DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float8_e4m3fn": "fp8", "float64": "fp64"}


@dataclass(frozen=True)
class Device:
    """One device's dense peak FLOP/s per dtype, its memory bandwidth in bytes/s, and where they come from."""

    name: str
    flops: Mapping[str, float]
    bandwidth: float
    source: str

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s at *dtype* (``"bf16"`` or torch's ``"bfloat16"``)."""
        key = DTYPES.get(dtype, dtype)
        if key not in self.flops:
            raise ValueError(f"{self.name} has no peak for {dtype!r} in the table; known: {', '.join(self.flops)}")
        return self.flops[key]

    def ridge(self, dtype: str) -> float:
        """FLOP per byte where the roofline bends: above it an op is compute-bound."""
        return self.peak(dtype) / self.bandwidth

    def seconds(self, flops: float, moved: float, dtype: str) -> float:
        """The roofline time of *flops* FLOP that move *moved* bytes: the slower of compute and memory."""
        return max(flops / self.peak(dtype), moved / self.bandwidth)

    def bound(self, flops: float, moved: float, dtype: str) -> str:
        """``"compute"`` or ``"memory"``: which side of the ridge the arithmetic intensity falls."""
        return "compute" if moved == 0 or flops / moved >= self.ridge(dtype) else "memory"


@dataclass(frozen=True)
class Roof:
    """One part on a device's roofline: its FLOPs, the bytes its products read and write, the time the slower of
    the two takes at the device's peak and bandwidth, and which it is (``"compute"`` or ``"memory"``)."""

    part: str
    flops: int
    weight_bytes: int
    activation_bytes: int
    seconds: float
    bound: str

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.activation_bytes

    @property
    def intensity(self) -> float:
        """FLOP per byte moved."""
        return self.flops / self.bytes if self.bytes else math.inf


T = 1e12
DEVICES: Mapping[str, Device] = {
    "h100-sxm": Device("H100 SXM", {"fp64": 67 * T, "fp32": 67 * T, "tf32": 494.7 * T, "bf16": 989.4 * T,
                                    "fp16": 989.4 * T, "fp8": 1978.9 * T}, 3.35e12,
                       "NVIDIA H100 Tensor Core GPU datasheet (SXM5, dense; sparsity doubles the tensor figures)"),
    "h100-pcie": Device("H100 PCIe", {"fp64": 51 * T, "fp32": 51 * T, "tf32": 378 * T, "bf16": 756 * T,
                                      "fp16": 756 * T, "fp8": 1513 * T}, 2.0e12,
                        "NVIDIA H100 Tensor Core GPU datasheet (PCIe, dense)"),
    "a100-80gb": Device("A100 SXM 80GB", {"fp64": 19.5 * T, "fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T,
                                          "fp16": 312 * T}, 2.039e12,
                        "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB, dense)"),
    "a100-40gb": Device("A100 SXM 40GB", {"fp64": 19.5 * T, "fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T,
                                          "fp16": 312 * T}, 1.555e12,
                        "NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB, dense)"),
    "l4": Device("L4", {"fp32": 30.3 * T, "tf32": 60 * T, "bf16": 121 * T, "fp16": 121 * T, "fp8": 242.5 * T},
                 300e9, "NVIDIA L4 Tensor Core GPU datasheet (dense; sparsity doubles the tensor figures)"),
}


def device(name: str) -> Device:
    """A device of the table, or ``"cpu"`` (this machine, measured)."""
    if name == "cpu":
        return this_cpu()
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; known: {', '.join([*DEVICES, 'cpu'])}")
    return DEVICES[name]


def _named(peak: str) -> tuple[str, str]:
    """(device, dtype) of ``"<device>-<dtype>"``, checked against the table (this CPU: float32, not measured)."""
    name, _, dtype = peak.rpartition("-")
    if not name:
        raise ValueError(f"peak {peak!r} names no dtype: give '<device>-<dtype>' such as 'h100-sxm-bf16'; devices: "
                         f"{', '.join([*DEVICES, 'cpu'])}")
    if name == "cpu" and DTYPES.get(dtype, dtype) != "fp32":
        raise ValueError("this CPU's peak is measured in float32 only: peak='cpu-fp32'")
    if name != "cpu":
        device(name).peak(dtype)
    return name, dtype


def check_peak(peak: object) -> str | float:
    """*peak* as a marker keeps it, checked (``"cpu-fp32"`` is measured when it is used, not here)."""
    if isinstance(peak, str):
        _named(peak)
        return peak
    if isinstance(peak, bool) or not isinstance(peak, (int, float)) or not math.isfinite(peak) or peak <= 0:
        raise ValueError(f"peak must be a device such as 'h100-sxm-bf16' or a positive number of FLOP/s, got {peak!r}")
    return float(peak)


def peak_flops(peak: str | float) -> tuple[float, str]:
    """(FLOP/s, its name) of ``"<device>-<dtype>"`` (``"h100-sxm-bf16"``, ``"cpu-fp32"``) or a number of FLOP/s."""
    checked = check_peak(peak)
    if not isinstance(checked, str):
        return checked, f"a peak of {checked:.4g} FLOP/s"
    name, dtype = _named(checked)
    found = device(name)
    return found.peak(dtype), f"{found.name} {dtype}'s {found.peak(dtype) / T:.4g} TFLOP/s"


@functools.cache
def this_cpu(size: int = 1024, repeats: int = 5) -> Device:
    """This machine's float32 matrix-product FLOP/s and copy bandwidth (bytes read and written per second),
    best of *repeats*, with torch's threads as they are set."""
    import torch

    a, b = torch.full((size, size), 0.5), torch.full((size, size), 0.25)  # no random numbers: the user's RNG stays
    big = torch.empty(64 * 2**20 // 4)  # 64 MiB: past the caches
    out = torch.empty_like(big)
    best_product, best_copy = math.inf, math.inf
    for _ in range(repeats + 1):  # the first run warms up
        start = time.perf_counter()
        torch.mm(a, b)
        best_product = min(best_product, time.perf_counter() - start)
        start = time.perf_counter()
        out.copy_(big)
        best_copy = min(best_copy, time.perf_counter() - start)
    flops = 2 * size**3 / best_product
    return Device(f"this CPU ({torch.get_num_threads()} threads)", {"fp32": flops}, 2 * big.nbytes / best_copy,
                  f"measured: a {size}x{size} float32 product and a 64 MiB copy, best of {repeats}")
