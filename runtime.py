"""
What train.py, sample.py and bench.py would otherwise each write again: device and dtype choice, autocast,
seeding, process-group setup and teardown, checkpoint files, peak FLOP/s, memory, timing, and the top-level
wrapper that turns a UserError into one line.
"""

import functools
import os
import platform
import resource
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from model import GPT, GPTConfig, UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# -- device and precision ----------------------------------------------------------------------------

def pick_device(device: str = "auto") -> str:
    """'auto' is cuda > mps > cpu; anything else is checked and kept."""
    if device == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "mps" if torch.backends.mps.is_available() else "cpu"
    kind = device.split(":")[0]
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if kind not in available:
        raise UserError(f"unknown device '{device}'; use auto, cpu, cuda, cuda:N or mps.")
    if not available[kind]:
        raise UserError(f"device '{device}' is not available on this machine; use --device=auto or --device=cpu.")
    return device


def cpu_has_amx_bf16() -> bool:
    """True when the CPU has AMX tiles for bf16. Only those make bf16 autocast pay on CPU: with AVX512-BF16
    alone (no AMX) a bf16 training step measured 1.5x *slower* than fp32 here (README, "Precision on CPU")."""
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def pick_dtype(dtype: str, device: str) -> str:
    """'auto' is bf16 where the hardware runs it fast, fp16 (with a GradScaler) on older GPUs, fp32 otherwise."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise UserError(f"unknown dtype '{dtype}'; use auto, {', '.join(DTYPES)}.")
        return dtype
    kind = device.split(":")[0]
    if kind == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    if kind == "cpu" and cpu_has_amx_bf16():
        return "bfloat16"
    return "float32"


def autocast(device: str, dtype: str):
    """Mixed precision for the forward pass; fp32 runs without autocast."""
    if dtype == "float32":
        return nullcontext()
    return torch.autocast(device_type=device.split(":")[0], dtype=DTYPES[dtype])


def grad_scaler(device: str, dtype: str) -> torch.amp.GradScaler:
    """fp16 gradients underflow without loss scaling; for other dtypes the scaler is a no-op."""
    return torch.amp.GradScaler(device.split(":")[0], enabled=dtype == "float16")


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)  # seeds CUDA too


def synchronize(device: str) -> None:
    """Wait for queued device work, so a clock read afterwards measures it."""
    kind = device.split(":")[0]
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "mps":
        torch.mps.synchronize()


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    if device.startswith("mps"):
        return "Apple MPS"
    n = torch.get_num_threads()
    threads = f"{n} thread{'s' if n != 1 else ''}"
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()} ({threads})"
    return f"{platform.processor() or 'CPU'} ({threads})"


# -- memory and peak FLOP/s ------------------------------------------------------------------------------

def reset_peak_memory(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device: str) -> float:
    """CUDA: the most memory tensors held since the last reset. CPU: the process's peak resident set, which
    only grows (bench.py measures per-run tensor memory on CPU with the profiler instead)."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 1e9
    if device.startswith("mps"):
        return torch.mps.driver_allocated_memory() / 1e9
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 1e9


# Dense (no sparsity) peak tensor-core FLOP/s from the vendors' datasheets, by name fragment; bf16 and fp16 alike.
# fp32 runs compare against the fp32 peak measured below, since TF32 use depends on settings.
GPU_PEAK_FLOPS = {
    "H200": 989e12, "H100 SXM": 989e12, "H100 NVL": 835e12, "H100": 756e12, "GH200": 989e12,
    "A100": 312e12, "A10G": 70e12, "A10": 125e12, "L40S": 362e12, "L40": 181e12, "L4": 121e12,
    "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12, "T4": 65e12,
}


@functools.lru_cache(maxsize=None)
def measured_matmul_flops(device: str, dtype: str, n: int = 1024, seconds: float = 1.0) -> float:
    """The best FLOP/s of an n x n matmul in `dtype` here: the practical peak of a CPU or an unknown GPU."""
    with torch.random.fork_rng(devices=[]):  # leave the global RNG where training expects it
        a = torch.randn(n, n, dtype=DTYPES[dtype]).to(device)
        b = torch.randn(n, n, dtype=DTYPES[dtype]).to(device)
    best = float("inf")
    deadline = time.perf_counter() + seconds
    for i in range(1000):
        synchronize(device)
        t0 = time.perf_counter()
        a @ b
        synchronize(device)
        if i > 0:  # the first call pays for setup
            best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > deadline and i > 2:
            break
    return 2 * n ** 3 / best


def peak_flops(device: str, dtype: str) -> float:
    """Peak FLOP/s of this device in this dtype, the denominator of MFU."""
    if device.startswith("cuda") and dtype != "float32":
        name = torch.cuda.get_device_name(device)
        for fragment, flops in GPU_PEAK_FLOPS.items():  # most specific fragments come first
            if fragment in name:
                return flops
    return measured_matmul_flops(device, dtype)


# -- distributed -----------------------------------------------------------------------------------

@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: str = "cpu"

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str) -> Dist:
    """Under torchrun (RANK set): join the process group, NCCL on CUDA and gloo elsewhere, one GPU per local
    rank. Otherwise a single process on `device`."""
    if "RANK" not in os.environ:
        return Dist(device=device)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if device.startswith("cuda"):
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl", device_id=torch.device(device))
    else:
        dist.init_process_group(backend="gloo")
    return Dist(rank, local_rank, world_size, device)


def destroy_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def on_master(work: Callable[[], None], device: str) -> None:
    """Run `work` on rank 0 only (say, preparing data), the other ranks waiting. If it raises a UserError every
    rank raises one, so none is left waiting at a later collective until the process-group timeout."""
    problem = None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        try:
            work()
        except UserError as e:
            problem = str(e)
    failed = mean_across_ranks(float(problem is not None), device) > 0  # also the barrier
    if problem is not None:
        raise UserError(problem)
    if failed:
        raise UserError("rank 0 stopped with an error (printed above); the other ranks stop with it.")


def mean_across_ranks(value: float, device: str) -> float:
    """The mean of a number over all ranks (the number itself in a single process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


# -- checkpoints --------------------------------------------------------------------------------------

def check_writable_dir(path: Path, setting: str = "out_dir") -> None:
    """Create the folder if needed and make sure a file can be written in it, before any work is done."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        what = "is a file, not a folder" if path.is_file() else f"cannot be written to ({e.strerror or e})"
        wanted = "a writable folder" if setting.endswith("dir") else "a path in a writable folder"
        raise UserError(f"{setting} {path} {what}; pass --{setting}= {wanted}.") from None


def save_checkpoint(checkpoint: dict, path: Path) -> None:
    """Write to a temporary file and rename it into place, so a crash or a full disk never leaves half a
    checkpoint: the previous one stays whole, and the temporary file is removed."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:  # a file object: a full disk is an OSError, not torch's bare RuntimeError
            torch.save(checkpoint, f)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        kept = f"the previous {path.name} is kept" if path.exists() else "no checkpoint was written"
        raise UserError(f"could not save the checkpoint to {path} ({e.strerror or e}); {kept} - free disk space "
                        f"or pass --out_dir= another folder, then resume.") from None


def model_config_from(settings: dict) -> GPTConfig:
    """The GPTConfig named by a script's settings (n_layer, n_embd, attn, pad_vocab, ...)."""
    return GPTConfig(**{f.name: settings[f.name] for f in fields(GPTConfig) if f.name in settings})


def model_from_checkpoint(checkpoint: dict, **overrides) -> GPT:
    """The model a checkpoint holds, optionally read through another attn (or with another dropout).
    A checkpoint is {"model": state dict, "model_config": dict(GPTConfig), ...}: see train.py."""
    config = GPTConfig(**{**checkpoint["model_config"], **overrides})
    model = GPT(config)
    model.load_state_dict(checkpoint["model"])
    return model


TRAINING_STATE = ("optimizer", "iter_num", "best_val_loss", "rng")  # what resuming needs beyond the weights


def load_checkpoint(path: Path, map_location="cpu", for_training: bool = False) -> dict:
    """A checkpoint of tensors and plain types (weights_only) in this project's format, or one clear sentence
    on why it cannot load. `for_training`: it must also hold the optimizer, step and RNG state."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no checkpoint at {path}; train one first (python train.py ...) or set out_dir.")
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise UserError(f"checkpoint {path} cannot be read ({type(e).__name__}); it is corrupt or not a "
                        f"checkpoint of this project - restore it or train again.") from None
    if isinstance(checkpoint, dict) and checkpoint and all(torch.is_tensor(v) for v in checkpoint.values()):
        raise UserError(f"{path} is a bare state dict (only tensors); this project's checkpoints are a dict with "
                        f"'model' and 'model_config', as train.py writes them.")
    if isinstance(checkpoint, dict) and "model_args" in checkpoint and "model_config" not in checkpoint:
        raise UserError(f"{path} is a nanoGPT checkpoint ('model_args', not 'model_config'), which this project "
                        f"does not read; train here or load GPT-2 weights with --init_from=gpt2.")
    missing = [k for k in ("model", "model_config") + (TRAINING_STATE if for_training else ())
               if not isinstance(checkpoint, dict) or k not in checkpoint]
    if missing:
        raise UserError(f"{path} has no {', '.join(missing)}; it is not a {'resumable ' if for_training else ''}"
                        f"checkpoint written by train.py.")
    return checkpoint


# -- timing -------------------------------------------------------------------------------------------

class StepTimer:
    """Wall time of training steps only: pause it around evaluation and checkpointing."""

    def __init__(self, device: str):
        self.device = device
        self.total = 0.0                    # seconds of training so far, for max_seconds
        self.window, self.steps = 0.0, 0    # since the last read, for ms per step
        self._t0 = None

    @property
    def running(self) -> bool:
        return self._t0 is not None

    def start(self) -> None:
        synchronize(self.device)
        self._t0 = time.perf_counter()

    def pause(self) -> None:
        if self._t0 is not None:
            synchronize(self.device)
            seconds = time.perf_counter() - self._t0
            self.total += seconds
            self.window += seconds
            self._t0 = None

    def step(self) -> None:
        self.steps += 1

    def read_and_reset(self) -> tuple[float, int]:
        """(seconds, steps) since the last read; a running timer keeps running."""
        running = self.running
        self.pause()
        seconds, steps = self.window, self.steps
        self.window, self.steps = 0.0, 0
        if running:
            self.start()
        return seconds, steps


# -- scripts ------------------------------------------------------------------------------------------

def run_main(main) -> None:
    """Run a script's main(): a UserError becomes one line on stderr and exit code 2; the process group is
    destroyed on every way out."""
    try:
        code = main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    finally:
        destroy_distributed()
    sys.exit(code or 0)
