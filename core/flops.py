"""
Peak FLOP/s, the denominator of MFU: a datasheet for a known GPU, else the best matmul rate measured while
nothing else used the cores (None when no such measurement exists).

    mfu = model.model_flops_utilization(tokens_per_s, peak_flops(rt), seq_len)
"""

import functools
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from core import files
from core import runtime
from core.runtime import Runtime

# A measurement counts as a peak only if this process had the CPU to itself: its threads' CPU time at least this
# share of wall time x threads (another busy process on 2 cores leaves ~0.5)
ALONE = 0.9


def peak_flops(rt: Runtime) -> Optional[float]:
    """Peak FLOP/s in rt's dtype: the datasheet for a known GPU, else measured (rank 0 alone, the others waiting);
    None where no measurement could be trusted, since an MFU over a busy machine's rate would be inflated."""
    listed = datasheet_peak_flops(rt.name, rt.dtype) if rt.is_cuda else None
    if listed:
        return listed
    mine = (measured_matmul_flops(rt) or 0.0) if rt.is_master else 0.0
    shared = runtime.mean_across_ranks(mine, rt.device) * rt.world_size
    return shared or None


def peak_line(rt: Runtime, peak: Optional[float]) -> str:
    """Where MFU's denominator came from, said once where MFU is shown: a datasheet, or a measurement and the file
    that keeps it (a MIG slice's is an achieved rate, so its MFU compares with no whole GPU's)."""
    if peak is None:
        return (f"mfu not shown: other processes used this machine's cores while its peak FLOP/s was measured, and "
                f"no earlier run measured it alone; the next run on an idle machine will, and keeps it in "
                f"{peak_flops_cache()}")
    if rt.is_cuda and datasheet_peak_flops(rt.name, rt.dtype):
        return f"mfu against the datasheet peak of the {rt.name}, {peak / 1e12:.1f} TFLOP/s in {rt.dtype}"
    mig = (", an achieved rate and no datasheet peak: this MFU compares with no whole GPU's"
           if "MIG" in rt.name.upper().split() else "")
    return (f"mfu against the best matmul rate measured on this machine alone, {peak / 1e12:.3g} TFLOP/s in "
            f"{rt.dtype}{mig}; kept in {peak_flops_cache()} (delete it to measure again)")


@functools.lru_cache(maxsize=None)
def measured_matmul_flops(rt: Runtime, repeats: int = 5) -> Optional[float]:
    """The best large-matmul rate ever measured alone on this machine (this run's and peak_flops.json's); a round
    taken under load is never kept. None if there is none yet."""
    key = f"{rt.name}, {rt.dtype}, torch {torch.__version__}"
    cache = peak_flops_cache()
    known = files.read_cache(cache, is_flops, "a positive number of FLOP/s")
    measured = best_matmul_flops(rt, repeats)
    if measured is not None and measured > known.get(key, 0.0):
        known[key] = measured
        files.write_cache(cache, known)
    return known.get(key)


def is_flops(entry) -> bool:
    return isinstance(entry, (int, float)) and not isinstance(entry, bool) and math.isfinite(entry) and entry > 0


def cache_folder() -> Path:
    """The project's measurements kept between runs: $XDG_CACHE_HOME (or ~/.cache)/nanogpt-attn/ (peak_flops.json,
    attn=auto's attn_auto.json)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nanogpt-attn"


def peak_flops_cache() -> Path:
    """Where the best measured peaks (and read bandwidths) are kept."""
    return cache_folder() / "peak_flops.json"


def best_matmul_flops(rt: Runtime, repeats: int) -> Optional[float]:
    """The best FLOP/s of `repeats` rounds of large matmuls among those run alone (cpu_share >= ALONE); None if none
    was."""
    n, calls = (8192, 20) if rt.is_cuda else (1024, 3)
    with torch.random.fork_rng(devices=[]):  # leave the global RNG where training expects it
        a, b = (torch.randn(n, n).to(rt.device, rt.torch_dtype) for _ in range(2))
    a @ b  # the first call pays for setup

    def matmuls() -> None:
        for _ in range(calls):
            a @ b
    rates = []
    for _ in range(repeats):
        cpu = time.process_time()
        _, seconds = runtime.time_call(matmuls, rt)
        if rt.is_cuda or cpu_share(time.process_time() - cpu, seconds) >= ALONE:
            rates.append(2 * n ** 3 * calls / seconds)
    return max(rates, default=None)


def cpu_share(cpu_seconds: float, wall_seconds: float) -> float:
    """The share of torch's threads' time this process ran: 1 alone, ~0.5 beside one other busy process per core."""
    return cpu_seconds / (wall_seconds * torch.get_num_threads())


# -- memory bandwidth: the roofline of batch-1 decoding, which reads every weight once per token ------------------

def memory_bandwidth(rt: Runtime, nbytes: int, repeats: int = 5) -> Optional[float]:
    """Bytes/s this machine reads streaming over a buffer of about `nbytes` (a footprint the caches of the CPU or
    GPU hold reads faster than one they do not): the best ever measured alone, kept beside the peak FLOP/s."""
    return measured_bandwidth(rt, 2 ** max(20, math.ceil(math.log2(max(nbytes, 1)))), repeats)  # 1 MiB at least


def bandwidth_key(rt: Runtime, size: int) -> str:
    return f"bandwidth, {rt.name}, {size >> 20} MiB, torch {torch.__version__}"


@functools.lru_cache(maxsize=None)
def measured_bandwidth(rt: Runtime, size: int, repeats: int) -> Optional[float]:
    """memory_bandwidth at a power-of-two size, measured once per process (a sweep's rows share it). Never below what
    a larger footprint was read at here: fewer bytes read no slower, so a lower reading is the measurement's own
    overhead or a busy moment, and every row's share is judged against the same ceiling or a higher one."""
    cache, key = peak_flops_cache(), bandwidth_key(rt, size)
    known = files.read_cache(cache, is_flops, "a positive number")
    measured = best_read_rate(rt, size, repeats)
    if measured is not None and measured > known.get(key, 0.0):
        known[key] = measured
        files.write_cache(cache, known)
    keys = [bandwidth_key(rt, size << i) for i in range(16)]  # this size and larger ones, up to 32,768 times it
    return max((known[k] for k in keys if k in known), default=None)


def best_read_rate(rt: Runtime, size: int, repeats: int) -> Optional[float]:
    """The best bytes/s of `repeats` rounds of reading `size` bytes, two ways (a sum, and the batch-1 matmul that
    decoding does), among the rounds run alone; None if none was."""
    rows, passes = 4096, max(1, 2 ** 26 // size)  # a small buffer read again and again: a round of 64 MiB or more
    data = torch.ones(rows, size // 4 // rows, device=rt.device)  # fp32: (rows, size / rows / 4)
    x = torch.ones(1, rows, device=rt.device)
    rates = []
    for one in (lambda: data.sum(), lambda: x @ data):
        def read(one=one):
            for _ in range(passes):
                one()
        read()  # the first call pays for setup
        for _ in range(repeats):
            cpu = time.process_time()
            _, seconds = runtime.time_call(read, rt)
            if rt.is_cuda or cpu_share(time.process_time() - cpu, seconds) >= ALONE:
                rates.append(size * passes / seconds)
    return max(rates, default=None)


# -- vendors' datasheets ----------------------------------------------------------------------------------

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
    """The datasheet peak of a GPU by its device name, in FLOP/s; None for a GPU (or dtype) not listed, and for a MIG
    slice ("NVIDIA H100 80GB HBM3 MIG 1g.10gb"), which has a share of the GPU's SMs: its peak is measured instead."""
    words = set(name.upper().replace("-", " ").split())
    if "MIG" in words:
        return None
    for peak in GPU_PEAKS:
        if words.issuperset(peak.words):
            if dtype == "bfloat16" and not peak.bf16:
                return None
            return 1e12 * (peak.fp32 if dtype == "float32" else peak.half)
    return None
