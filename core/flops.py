"""
Peak FLOP/s, the denominator of MFU: a vendor's datasheet for a known GPU, else the best matmul rate measured on
the machine (CPUs, unlisted GPUs, and bf16 on GPUs that only emulate it).

    mfu = model.model_flops_utilization(tokens_per_s, peak_flops(rt), seq_len)
"""

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from core.runtime import Runtime, time_call


def peak_flops(rt: Runtime) -> float:
    """Peak FLOP/s in rt's dtype: the datasheet for a known GPU, else measured."""
    listed = datasheet_peak_flops(rt.name, rt.dtype) if rt.is_cuda else None
    return listed or measured_matmul_flops(rt)


@dataclass(frozen=True)
class GpuPeak:
    words: tuple[str, ...]  # all must be words of the upper-cased device name, '-' read as a space
    half: float             # dense bf16/fp16 tensor-core TFLOP/s (sparsity figures halved)
    fp32: float             # dense TF32 tensor-core TFLOP/s (TF32 is on, see resolve_runtime); plain FP32 without
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
    """The datasheet peak of a GPU by its device name, in FLOP/s; None for a GPU (or dtype) not listed."""
    words = set(name.upper().replace("-", " ").split())
    for peak in GPU_PEAKS:
        if words.issuperset(peak.words):
            if dtype == "bfloat16" and not peak.bf16:
                return None
            return 1e12 * (peak.fp32 if dtype == "float32" else peak.half)
    return None


@functools.lru_cache(maxsize=None)
def measured_matmul_flops(rt: Runtime, repeats: int = 5) -> float:
    """The practical peak FLOP/s of a CPU or an unlisted GPU in rt's dtype: the best rate of large square matmuls
    ever measured on this machine. A rate measured while other work loads the machine comes out low, and an MFU
    over it high (the same 4,100 tokens/s once read 0.19 and once 0.077), so each run measures, then keeps the
    best of its own figure and those of earlier runs (peak_flops.json in the user's cache folder): load can then
    only lower an MFU, as it lowers the speed it measures."""
    key = f"{rt.name}, {rt.dtype}, torch {torch.__version__}"
    cache = peak_flops_cache()
    try:
        known = json.loads(cache.read_text()) if cache.exists() else {}
    except (OSError, ValueError):
        known = {}
    measured = best_matmul_flops(rt, repeats)
    if measured > known.get(key, 0.0):
        known[key] = measured
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(known, indent=1))
        except OSError:
            pass  # a read-only home: this run's own figure stands
    return known[key]


def peak_flops_cache() -> Path:
    """Where the best measured peaks are kept: $XDG_CACHE_HOME (or ~/.cache)/nanogpt-attn/peak_flops.json."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nanogpt-attn" / "peak_flops.json"


def best_matmul_flops(rt: Runtime, repeats: int) -> float:
    """The best FLOP/s of `repeats` rounds of large square matmuls. On a GPU many matmuls run between two
    synchronizations, so launch latency is not what gets measured."""
    n, calls = (8192, 20) if rt.is_cuda else (1024, 3)
    with torch.random.fork_rng(devices=[]):  # leave the global RNG where training expects it
        a, b = (torch.randn(n, n).to(rt.device, rt.torch_dtype) for _ in range(2))
    a @ b  # the first call pays for setup

    def matmuls() -> None:
        for _ in range(calls):
            a @ b
    best = min(time_call(matmuls, rt)[1] for _ in range(repeats)) / calls
    return 2 * n ** 3 / best
