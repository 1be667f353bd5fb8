"""
Peak FLOP/s, the denominator of MFU: a GPU's datasheet figure, as nanochat does. A CPU or an unlisted GPU has none,
so its training lines and bench's rows show no MFU (their ms/iter and tokens/s compare instead).

    mfu = model.model_flops_utilization(tokens_per_s, peak_flops(rt), seq_len)
"""

from dataclasses import dataclass
from typing import Optional

from core.runtime import Runtime


def peak_flops(rt: Runtime) -> Optional[float]:
    """The datasheet peak of a listed GPU in rt's dtype, in FLOP/s; None elsewhere (CPUs, MIG slices, unlisted GPUs)."""
    return datasheet_peak_flops(rt.name, rt.dtype) if rt.is_cuda else None


def peak_line(rt: Runtime, peak: Optional[float]) -> str:
    """Where MFU's denominator came from, or why there is no MFU, printed once before the training lines."""
    if peak is None:
        return (f"mfu not shown: no datasheet peak for {rt.name} in {rt.dtype} (MFU is measured against a GPU's "
                f"datasheet, listed in core/flops.py)")
    return f"mfu against the datasheet peak of the {rt.name}, {peak / 1e12:.1f} TFLOP/s in {rt.dtype}"


# -- vendors' datasheets ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class GpuPeak:
    words: tuple[str, ...]  # all must be words of the upper-cased device name, '-' read as a space
    half: float             # dense bf16/fp16 tensor-core TFLOP/s (sparsity figures halved)
    fp32: float             # dense fp32 TFLOP/s: TF32 tensor cores where the GPU has them (Ampere on: resolve_runtime
                            # turns TF32 on for fp32 matmuls), plain fp32 on the V100 and T4, which have none
    bf16: bool = True       # False: bf16 would be emulated, so it has no datasheet peak


# Vendors' datasheets, matched against torch.cuda.get_device_name() strings such as "NVIDIA H100 80GB HBM3"
# (the SXM part), "NVIDIA A100-SXM4-40GB", "Tesla V100-PCIE-32GB". Most specific first.
GPU_PEAKS = [
    GpuPeak(("B200",), 2250, 1100), GpuPeak(("GH200",), 989.4, 494.7),
    GpuPeak(("H200", "NVL"), 835.5, 417.5), GpuPeak(("H200",), 989.4, 494.7),
    GpuPeak(("H100", "NVL"), 835.5, 417.5), GpuPeak(("H100", "PCIE"), 756.5, 378.0), GpuPeak(("H100",), 989.4, 494.7),
    GpuPeak(("H800", "PCIE"), 756.5, 378.0), GpuPeak(("H800",), 989.4, 494.7),
    GpuPeak(("A100",), 312, 156),  # SXM4 and PCIe, 40 and 80 GB alike
    GpuPeak(("L40S",), 362, 183), GpuPeak(("L40",), 181, 90.5), GpuPeak(("L4",), 121, 60), GpuPeak(("A10",), 125, 62.5),
    GpuPeak(("RTX", "4090"), 165.2, 82.6), GpuPeak(("RTX", "3090", "TI"), 80, 40), GpuPeak(("RTX", "3090"), 71, 35.6),
    GpuPeak(("V100S",), 130, 16.4, bf16=False), GpuPeak(("V100", "PCIE"), 112, 14, bf16=False),
    GpuPeak(("V100",), 125, 15.7, bf16=False), GpuPeak(("T4",), 65, 8.1, bf16=False),
]


def datasheet_peak_flops(name: str, dtype: str) -> float | None:
    """The datasheet peak of a GPU by its device name, in FLOP/s; None for a GPU (or dtype) not listed, and for a MIG
    slice ("NVIDIA H100 80GB HBM3 MIG 1g.10gb"), which has a share of the GPU's SMs and no datasheet figure."""
    words = set(name.upper().replace("-", " ").split())
    if "MIG" in words:
        return None
    for peak in GPU_PEAKS:
        if words.issuperset(peak.words):
            if dtype == "bfloat16" and not peak.bf16:
                return None
            return 1e12 * (peak.fp32 if dtype == "float32" else peak.half)
    return None
