"""
Peak FLOP/s, the denominator of MFU: a vendor's datasheet for a known GPU (core/gpu_peaks.py), else the best matmul
rate measured on the machine (CPUs, unlisted GPUs, and bf16 on GPUs that only emulate it).

    mfu = model.model_flops_utilization(tokens_per_s, peak_flops(rt), seq_len)
"""

import functools
import math
import os
from pathlib import Path

import torch

from core import files
from core.runtime import Runtime, time_call


def peak_flops(rt: Runtime) -> float:
    """Peak FLOP/s in rt's dtype: the datasheet for a known GPU, else measured."""
    listed = None
    if rt.is_cuda:
        from core.gpu_peaks import datasheet_peak_flops  # the vendors' table: read only on a GPU
        listed = datasheet_peak_flops(rt.name, rt.dtype)
    return listed or measured_matmul_flops(rt)


@functools.lru_cache(maxsize=None)
def measured_matmul_flops(rt: Runtime, repeats: int = 5) -> float:
    """The practical peak FLOP/s of a CPU or an unlisted GPU in rt's dtype: the best rate of large square matmuls
    ever measured on this machine. A rate measured while other work loads the machine comes out low, and an MFU
    over it high (the same 4,100 tokens/s once read 0.19 and once 0.077), so each run measures, then keeps the
    best of its own figure and those of earlier runs (peak_flops.json in the user's cache folder): load can then
    only lower an MFU, as it lowers the speed it measures."""
    key = f"{rt.name}, {rt.dtype}, torch {torch.__version__}"
    cache = peak_flops_cache()
    known = files.read_cache(cache, is_flops, "a positive number of FLOP/s")
    measured = best_matmul_flops(rt, repeats)
    if measured > known.get(key, 0.0):
        known[key] = measured
        files.write_cache(cache, known)
    return known[key]


def is_flops(entry) -> bool:
    return isinstance(entry, (int, float)) and not isinstance(entry, bool) and math.isfinite(entry) and entry > 0


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
