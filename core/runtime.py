"""
Where and how a script runs: the Runtime (device, dtype, autocast, grad scaler, memory, the ranks), its CPU threads,
compiling, joining the ranks (core/distributed.py once RANK is set), collectives, the clock, and a script's exit.
"""

import functools
import inspect
import os
import platform
import resource
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from core import errors
from core.errors import UserError

T = TypeVar("T")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# -- device and precision: one Runtime, resolved once and shared by train, sample and bench ---------------

def pick_device(device: str = "auto") -> str:
    """'auto' is cuda > mps > cpu; anything else is checked and kept. CUDA always gets its index ('cuda:0')."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    kind = device.split(":")[0]
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if kind not in available:
        raise UserError(f"unknown device '{device}'; use auto, cpu, cuda, cuda:N or mps.")
    if not available[kind]:
        raise UserError(f"device '{device}' is not available on this machine; use --device=auto or --device=cpu.")
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    if kind == "cuda" and not int(device.split(":")[1]) < torch.cuda.device_count():
        raise UserError(f"device '{device}' does not exist: this machine has {torch.cuda.device_count()} GPU(s); "
                        f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}.")
    return device


@functools.cache
def cpu_capability() -> str:
    """What this CPU has for matmuls, as every published figure names it: 'AMX', 'AVX512_BF16', else torch's own
    ('AVX512', 'AVX2', ...)."""
    if torch.cpu._is_amx_tile_supported():  # private API (docs/torch_versions.md)
        return "AMX"
    if torch.cpu._is_avx512_bf16_supported():
        return "AVX512_BF16"
    return torch.backends.cpu.get_cpu_capability()


MAX_THREADS_PER_CPU = 4  # more threads than this per CPU stops with an error: OpenMP starts them all, or crashes


def set_threads(requested: int) -> None:
    """A CPU run's thread count, set once at its start: --threads=N, else OMP_NUM_THREADS, else torch's default (one
    per physical core). A count no machine runs (OMP_NUM_THREADS=10000 would start 10,000 threads) stops with an error."""
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    setting = f"--threads={requested}"
    if requested == 0 and omp.isdigit() and int(omp) > 0:
        requested, setting = int(omp), f"OMP_NUM_THREADS={omp}"
    elif requested == 0 and "OMP_NUM_THREADS" in os.environ:  # OpenMP's own line, if any, names no fix
        errors.note(f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']!r} is not a positive whole number, so it is not "
                    f"used: this run takes torch's default of {torch.get_num_threads()} threads (set it to a count, "
                    f"or pass --threads=N).")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if requested > MAX_THREADS_PER_CPU * cpus:
        raise UserError(f"{setting} is more threads than the {cpus} CPU(s) this process may use can run; pass "
                        f"--threads= at most {MAX_THREADS_PER_CPU * cpus} ({MAX_THREADS_PER_CPU} per CPU), or 0 for "
                        f"torch's default.")
    if requested > 0:  # set, not assumed: with MKL_NUM_THREADS set too, torch would start with MKL's count
        torch.set_num_threads(requested)


def bf16_native(device_type: str, training: bool = False) -> bool:
    """bf16 matmuls run in hardware: CUDA from Ampere on, CPUs with AMX or AVX512-BF16 (AVX2 emulates them, ~20-35x
    slower than fp32). For training, AMX only: a bf16 step with AVX512-BF16 alone measured 1.5x *slower* than fp32
    (docs/training.md, "Precision on CPU")."""
    if device_type == "cuda":  # torch counts emulation by default, which would pick slow bf16 over fp16 on a V100
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return device_type == "cpu" and cpu_capability() in (("AMX",) if training else ("AMX", "AVX512_BF16"))


# On a CPU, Muon's Newton-Schulz is faster in bf16 only from this width on (AMX, 2 threads: 1.2x slower than fp32 at
# 128 x 128, 0.86x at 128 x 512, 0.55x at 256 x 256, ~0.3x from 384; docs/training.md "Precision on CPU")
MUON_BF16_WIDTH = 256


def pick_dtype(dtype: str, device: str) -> str:
    """'auto' is bf16 where the hardware runs it fast, fp16 (with a GradScaler) on older GPUs, fp32 otherwise."""
    if dtype != "auto":  # a key of DTYPES: every script's LIMITS says so
        return dtype
    kind = device.split(":")[0]
    if bf16_native(kind, training=True):
        return "bfloat16"
    return "float16" if kind == "cuda" else "float32"


@dataclass(frozen=True)
class Runtime:
    """Where and in what precision a script runs, and this process's place among the ranks; made once by
    resolve_runtime, asked by every script."""
    device: str  # "cpu", "cuda:N" or "mps"
    dtype: str   # a key of DTYPES: the autocast dtype, or float32 for none
    muon_dtype: str = "float32"  # a key of DTYPES: Muon's Newton-Schulz dtype (bf16 where it is faster: resolve_runtime)
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def autocast(self):
        """Mixed precision for the forward pass; fp32 runs without autocast."""
        if self.dtype == "float32":
            return nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.torch_dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """fp16 gradients underflow without loss scaling; for other dtypes the scaler is a no-op."""
        return torch.amp.GradScaler(self.device_type, enabled=self.dtype == "float16")

    def to_device(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Tensors on this run's device; on CUDA copied from pinned memory without the host waiting."""
        if not self.is_cuda:
            return tuple(t.to(self.device) for t in tensors)
        return tuple(t if t.is_cuda else t.pin_memory().to(self.device, non_blocking=True) for t in tensors)

    def synchronize(self) -> None:
        """Wait for queued device work, so a clock read afterwards measures it."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
        elif self.device_type == "mps":
            torch.mps.synchronize()

    @functools.cached_property
    def name(self) -> str:
        """The device as tables name it; a CPU with its thread count and capability ('AMD EPYC (2 threads, AVX2)')."""
        if self.is_cuda:
            return torch.cuda.get_device_name(self.device)
        if self.device_type == "mps":
            return "Apple MPS"
        n = torch.get_num_threads()
        threads = f"{n} thread{'s' if n != 1 else ''}"
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), None)
        return f"{model or platform.processor() or 'CPU'} ({threads}, {cpu_capability()})"

    @property
    def orthogonalize_dtype(self) -> torch.dtype:
        return DTYPES[self.muon_dtype]

    def memory_metrics(self) -> dict:
        """Memory for the training log: on CUDA the peak of tensor memory (bench.py's mem/peak_gb); a CPU has no such
        statistic, so there the peak resident set, under a name of its own."""
        if self.is_cuda:
            return {"mem/peak_gb": torch.cuda.max_memory_allocated(self.device) / 1e9}
        if self.device_type == "mps":
            return {"mem/mps_driver_gb": torch.mps.driver_allocated_memory() / 1e9}
        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
        return {"mem/peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 1e9}


def resolve_runtime(device: str = "auto", dtype: str = "auto", muon_dtype: str = "auto",
                    distributed: bool = False, threads: int = 0, backend: str = "auto",
                    joined: Optional[Runtime] = None, width: int = 0) -> Runtime:
    """The one place device, autocast dtype, Muon's dtype and CPU threads are decided (bf16_native says where each
    picks bf16); a cuda:N device made current, TF32 on. `distributed`: under torchrun, join the process group first.
    `joined`: decided again for a resume's settings, in the ranks (and under torchrun on the device) already joined."""
    set_threads(threads)
    if distributed and "RANK" in os.environ and joined is None:  # before CUDA starts: it reads CUDA_VISIBLE_DEVICES
        from core.distributed import one_mig_slice_per_rank
        mig = one_mig_slice_per_rank(os.environ)
        if mig:
            errors.note(mig)
    if joined is not None:
        rank, local_rank, world_size = joined.rank, joined.local_rank, joined.world_size
        device = joined.device if joined.is_distributed else pick_device(device)
    else:
        device = pick_device(device)
        rank, local_rank, world_size, device = init_distributed(device, backend) if distributed else (0, 0, 1, device)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    kind = device.split(":")[0]
    if muon_dtype == "auto":  # `width`: the model's n_embd, every block matrix's smaller side
        muon_dtype = "bfloat16" if bf16_native(kind, training=True) and (kind != "cpu" or width >= MUON_BF16_WIDTH) \
            else "float32"
    return Runtime(device, pick_dtype(dtype, device), muon_dtype, rank, local_rank, world_size)


def check_memory_need(parts: dict[str, tuple[float, str]], rt: Runtime) -> None:
    """A run's memory need (`parts`: what holds it -> (bytes, a lower bound from the settings; the settings that
    drive it)) against the device's memory (the GPU's, else the machine's), before anything is built: one line naming
    the settings of the largest part."""
    if rt.is_cuda:
        have, where = torch.cuda.get_device_properties(rt.device).total_memory, f"the {rt.name}'s"
    elif hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        have, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's"
    else:
        return  # no figure to compare with
    need = sum(size for size, _ in parts.values())
    if need > have:
        held = ", ".join(f"{what} {size / 2**30:,.1f}" for what, (size, _) in parts.items() if size >= 0.01 * need)
        largest = max(parts.values())[1]
        raise UserError(f"this run needs at least {need / 2**30:,.1f} GiB ({held}) and {where} memory is "
                        f"{have / 2**30:,.1f} GiB; lower {largest}.")


def check_compile_cache() -> None:
    """torch.compile writes the code it generates under TORCHINDUCTOR_CACHE_DIR: a folder set there that cannot be
    written is one error line before any work, not inductor's traceback at the first compiled step."""
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if folder:  # unset: inductor's default, in the temporary folder
        from core.writing import check_writable_dir
        check_writable_dir(Path(folder), "TORCHINDUCTOR_CACHE_DIR", fix="torch.compile writes its code there: set it "
                           "to a writable folder, unset it, or pass --compile=False")


def compile_isolated(fn, recompile_limit: int = 8, **compile_options):
    """torch.compile a function, or a module in place, with a recompile count of its own: dynamo counts recompiles per
    code object (GPT.forward is shared by every model), and past its limit runs later models eagerly without a word.
    Releases without isolate_recompiles raise dynamo's global limit instead (docs/torch_versions.md)."""
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
        options = {"isolate_recompiles": True, "recompile_limit": recompile_limit, **compile_options}
    else:
        options = dict(compile_options)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 8 * recompile_limit)
    if isinstance(fn, torch.nn.Module):
        fn.compile(**options)  # in place: methods such as generate() then reach the compiled forward
        return fn
    return torch.compile(fn, **options)


# -- distributed -----------------------------------------------------------------------------------

def init_distributed(device: str, backend: str = "auto") -> tuple[int, int, int, str]:
    """(rank, local_rank, world_size, device): under torchrun (RANK set), the process group joined by
    core/distributed.py; otherwise one rank of one."""
    if "RANK" not in os.environ:
        return 0, 0, 1, device
    from core.distributed import join  # torchrun's environment: only a launch of several ranks reads it
    return join(device, backend)


def destroy_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def on_master(work: Callable[[], T], device: str) -> Optional[T]:
    """What `work` returns, run on rank 0 while the other ranks wait (None there); on one process, a plain call."""
    if not (dist.is_available() and dist.is_initialized()):
        return work()
    from core.distributed import on_rank_0
    return on_rank_0(work, device)


def sum_across_ranks_(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor summed over all ranks, in place and queued, not waited for (itself at world size 1, torchrun's
    single process included: no collective)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor


# -- timing -------------------------------------------------------------------------------------------

def time_call(call: Callable[[], T], rt: Runtime) -> tuple[T, float]:
    """What `call` returns and the seconds it took, its queued device work included (the device is synchronized
    before and after): sample's and bench's clock, and attn=auto's (train.py's train_loop times its steps)."""
    rt.synchronize()
    t0 = time.perf_counter()
    result = call()
    rt.synchronize()
    return result, time.perf_counter() - t0


# -- scripts ------------------------------------------------------------------------------------------

def run_main(main) -> None:
    """Exit with errors.exit_code(main), the process group destroyed on every way out. Every line printed reaches a
    log file or pipe at once (line buffering), so a run killed early still shows its banner and notes."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    try:
        code = errors.exit_code(main, exiting=True)
    finally:
        destroy_distributed()
    sys.exit(code)
