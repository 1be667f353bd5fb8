"""
Measuring calls for bench.py: time (round robin, so drift hits every row alike), added tensor memory, and the
kernel that really ran, read from torch.profiler; a row out of memory is reported, not fatal.

    results = measure_calls({"manual": step_a, "flash": step_b}, rt, bar, warmup=2, iters=10)
"""

import contextlib
import gc
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, TypeVar

import numpy as np
from tqdm import tqdm
import torch

from torch import profiler
from torch.autograd import DeviceType

from attention.attn_auto import round_robin
from core import runtime
from model import FLEX_REGION
from core.runtime import Runtime

@dataclass(frozen=True)
class Audit:
    """What the audit may see an implementation run."""
    kernels: str               # its kernels, '+' between
    ops: tuple = ()            # profiler ops of a kernel of its own, labelled with `kernels`
    decode: str = ""           # the implementation its decode steps run through, when another (varlen: SDPA)
    eager_reference: str = ""  # devices where an eager call runs PyTorch's unfused reference (flex off CUDA)


AUDIT = {"manual": Audit("none"), "sdpa_mask": Audit("flash+efficient+cudnn+math"),
         "sdpa": Audit("flash+efficient+cudnn"), "flash": Audit("flash+cudnn"), "flash2": Audit("flash"),
         "efficient": Audit("efficient"), "cudnn": Audit("cudnn"), "math": Audit("math"),
         "flex": Audit("flex", ops=("FlexAttentionAutogradOp", FLEX_REGION), eager_reference="cpu mps"),
         "varlen": Audit("varlen", ops=("torch_attn::_varlen_attn",), decode="sdpa")}

# The op that names the kernel SDPA dispatched to (forward; the backward ops mirror them), and the ops of the
# implementations with kernels of their own (AUDIT's ops: flex's autograd op and profiler region, varlen's custom op).
# Compiled code is audited through an eager twin (bench.py): inductor decomposes math and generates flex's.
KERNEL_OPS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_attention_math_for_mps": "math",
    **{op: audit.kernels for audit in AUDIT.values() for op in audit.ops},
}
CPU_KERNELS = {"none", "flash", "math", "flex"}  # SDPA has no efficient or cuDNN kernel off CUDA
# On CUDA the kernels themselves say what ran, whatever op launched them (cuDNN's through attn=flash on Hopper, or
# FA3/FA4 registered in place of PyTorch's flash op): parts of the kernel names the profiler shows, first match wins.
# They replace the op labels where any is seen (a CPU run shows none); efficient and cuDNN run under their own ops.
CUDA_KERNEL_NAMES = (("cudnn_generated_fort_native_sdpa", "cudnn"),  # cuDNN's fused flash kernels, forward and back
                     ("fmha_cutlass", "efficient"),                  # the memory-efficient kernels (xFormers')
                     ("FlashAttnFwdSm", "fa3_fa4"), ("FlashAttnBwdSm", "fa3_fa4"),  # FA3's Hopper kernels
                     ("FlashAttentionForwardSm", "fa3_fa4"), ("FlashAttentionBackwardSm", "fa3_fa4"),  # FA4's
                     ("flash_fwd", "flash"), ("flash_bwd", "flash"))  # PyTorch's FlashAttention-2
T = TypeVar("T")


# How running out of device memory reads when it is not a torch.OutOfMemoryError: cuBLAS and cuDNN failing to
# allocate their workspace, or CUDA's own error from an allocation outside the caching allocator.
OOM_MESSAGES = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")


def is_out_of_memory(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and any(m in str(e) for m in OOM_MESSAGES))


def free_memory(rt: Runtime) -> None:
    """Let go of what a failed or finished attempt held: unreachable tensors, then CUDA's cached blocks."""
    gc.collect()
    if rt.is_cuda:
        torch.cuda.empty_cache()


def summarize(values: list[float]) -> dict[str, float]:
    """Median, quartiles and extremes of repeated measurements: the statistics every timing report gives."""
    p25, median, p75 = np.percentile(values, [25, 50, 75])
    return {"median": float(median), "p25": float(p25), "p75": float(p75), "min": min(values), "max": max(values)}


def expected_kernels(attn: str, device_type: str, generation: bool = False) -> set[str]:
    """The kernels an honest run of `attn` may show in the audit (AUDIT's); anything else is a silent fallback. A
    generation row's decode steps may run through another (varlen's through SDPA)."""
    impl = AUDIT[attn]
    kernels = set(impl.kernels.split("+"))
    if device_type != "cuda":
        kernels = kernels & CPU_KERNELS or kernels
    if generation and impl.decode:
        kernels |= expected_kernels(impl.decode, device_type)
    return kernels


def ran_as_expected(kernel: str, expected: set[str]) -> bool:
    """Whether every kernel a row ran (kernel_of's label: one name, or several joined by '+') is one it may run:
    a bf16 sdpa generation row runs flash for the prompt and efficient (or cuDNN) for the masked decode steps."""
    return set(kernel.split("+")) <= expected


def cuda_kernel_label(name: str) -> Optional[str]:
    return next((label for part, label in CUDA_KERNEL_NAMES if part in name), None)


def kernel_of(op_names: set[str]) -> tuple[str, list[str]]:
    """The attention kernel among the ops and CUDA kernels that ran: a label ('none' if no SDPA/flex op ran), by the
    CUDA kernels where any attention kernel is among them, and the names it was read from."""
    ops = sorted(name for name in op_names if name in KERNEL_OPS)
    labels = {KERNEL_OPS[op] for op in ops}
    kernels = sorted(name for name in op_names if cuda_kernel_label(name))
    sdpa = labels & {"flash", "efficient", "cudnn"}
    if kernels and sdpa:  # SDPA's ops named by the kernels they ran; flex and varlen keep their ops' labels
        ran = {cuda_kernel_label(name) for name in kernels}
        if "varlen" in labels and "flash" not in sdpa:
            ran.discard("flash")  # FlashAttention's kernels ran for varlen's op (its varlen kernel), not for SDPA
        labels = (labels - sdpa) | ran
    return "+".join(sorted(labels)) or "none", ops + kernels


def ran_eager_flex(op_names: set[str]) -> bool:
    """Whether a call ran FlexAttention's unfused reference (the whole T x T scores), as a compiled flex past its
    recompile limit does: its softmax is an aten op that compiled flex never calls."""
    return "aten::_safe_softmax" in op_names and not op_names & {
        op for op, kernel in KERNEL_OPS.items() if kernel == "math"}


def with_eager_flex(kernel: str) -> str:
    """The label with flex written flex_eager: what the row really ran."""
    return "+".join("flex_eager" if k == "flex" else k for k in kernel.split("+"))


# -- what decided the kernel, and how compiling went -------------------------------------------------------------

def kernel_context(rt: Runtime) -> dict:
    """What decides which kernel a row runs besides its attn: cuDNN's version and the GPU's compute capability
    (None on a CPU)."""
    capability = torch.cuda.get_device_capability(rt.device) if rt.is_cuda else None
    return dict(cudnn_version=torch.backends.cudnn.version() if rt.is_cuda else None,
                compute_capability=f"{capability[0]}.{capability[1]}" if capability else None)


def dynamo_counts() -> Counter:
    """Graphs compiled, graph breaks, and frames past their recompile limit (each then runs eagerly) so far."""
    from torch._dynamo.utils import counters
    return Counter(graphs_compiled=counters["stats"]["unique_graphs"],
                   graph_breaks=sum(counters["graph_break"].values()),
                   recompile_limit_hits=sum(n for msg, n in counters["unimplemented"].items()
                                            if "recompile limit" in msg))


def compile_health(tally: Counter) -> dict[str, int]:
    """A row's compile-health columns from its tally (zeros for a row dynamo never saw)."""
    return {name: tally[name] for name in ("graphs_compiled", "graph_breaks", "recompile_limit_hits")}


def counted(call: Callable[[], T], tally: Counter) -> Callable[[], T]:
    """`call`, adding what dynamo did during it to `tally` (a recompile storm or a fallback shows in the row)."""
    def run() -> T:
        before = dynamo_counts()
        try:
            return call()
        finally:
            tally.update(dynamo_counts() - before)
    return run


def cpu_peak_bytes(prof: profiler.profile) -> int:
    """The most tensor bytes live at once in a profiled region beyond those at its start: the running sum of the
    profiler's allocations and frees, the CPU twin of CUDA's max_memory_allocated (peak RSS only grows)."""
    # The raw records, a private attribute: the public prof.events() books allocations to ops net of what each op
    # frees inside itself, which loses the peak within an op (the T x T scores of attention, for one).
    records = [e for e in prof.profiler.kineto_results.events()
               if e.name() == "[memory]" and e.device_type() == DeviceType.CPU]
    live = peak = 0
    for record in sorted(records, key=lambda e: e.start_ns()):
        live += record.nbytes()
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def without_profiler_banner() -> Iterator[None]:
    """Keep the profiler's C++ 'USDT: ... profiler_start/stop' lines on fd 2 out of the progress bar, passing every
    other line on."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().decode(errors="replace").splitlines(keepends=True)
                    if not line.startswith("USDT:")]
            sys.stderr.write("".join(kept))
            sys.stderr.flush()


def profiled_run(call: Callable[[], None], rt: Runtime, trace: Optional[Path] = None) -> tuple[set[str], int]:
    """Run `call` once under torch.profiler: (names of the ops it ran, the most tensor bytes it added)."""
    activities = [profiler.ProfilerActivity.CPU] + ([profiler.ProfilerActivity.CUDA] if rt.is_cuda else [])
    rt.synchronize()
    before = 0  # CPU: the bytes added come from the profiler's records
    if rt.is_cuda:
        torch.cuda.reset_peak_memory_stats(rt.device)
        before = torch.cuda.memory_allocated(rt.device)
    with without_profiler_banner(), profiler.profile(activities=activities, profile_memory=not rt.is_cuda) as prof:
        call()
        rt.synchronize()
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    added = torch.cuda.max_memory_allocated(rt.device) - before if rt.is_cuda else cpu_peak_bytes(prof)
    return {e.name() for e in prof.profiler.kineto_results.events()}, added


class ProgressLines:
    """The progress bar where stderr is a file or a pipe (`python bench.py > log 2>&1`), where a bar's redraws would
    pile up into one line: a line when a run ends and LINE_EVERY_S has passed since the last, and at the end."""
    LINE_EVERY_S = 15.0

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.done = total, desc, 0
        self.start = self.last = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self.last >= self.LINE_EVERY_S or self.done >= self.total:
            self.last = now
            left = (now - self.start) / self.done * (self.total - self.done)
            print(f"{self.desc}: {self.done}/{self.total} runs in {now - self.start:.0f} s, about {left:.0f} s left",
                  file=sys.stderr, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def progress(total: int, desc: str):
    """tqdm's bar on a terminal, else ProgressLines."""
    return tqdm(total=total, desc=desc, file=sys.stderr) if sys.stderr.isatty() else ProgressLines(total, desc)


def time_round_robin(calls: dict, iters: int, rt: Runtime, bar, failed: dict,
                     after_round: Optional[Callable[[dict], None]] = None) -> dict[str, list[float]]:
    """Milliseconds of each call, `iters` rounds of attn_auto.round_robin, the device synchronized around each call.
    A call that runs out of memory drops out, its reason put in `failed`. `after_round` sees the times so far."""
    def time_one(key: str) -> Optional[float]:
        try:
            return runtime.time_call(calls[key], rt)[1] * 1e3
        except Exception as e:
            failed[key] = out_of_memory(e, rt)
            return None
        finally:
            bar.update()
    return round_robin([key for key in calls if key not in failed], iters, time_one, after_round)


def out_of_memory(e: Exception, rt: Runtime) -> str:
    """The reason to report for an out-of-memory error (any other error is raised again), its memory freed."""
    if not is_out_of_memory(e):
        raise e
    free_memory(rt)
    return f"out of memory ({str(e).splitlines()[0][:100]})"


def measure_calls(calls: dict, rt: Runtime, bar, warmup: int, iters: int, trace_prefix: Optional[str] = None,
                  audits: Optional[dict] = None) -> dict:
    """Warm each call up, profile one run of each (ops, memory, a chrome trace if asked), then time them round-robin.
    `audits`: eager twins of compiled calls, profiled for the kernel audit. A call out of memory comes back as
    {"status": "oom", "reason": ...}; the others still run."""
    out, failed, tallies = {}, {}, {key: Counter() for key in calls}
    calls = {key: counted(call, tallies[key]) for key, call in calls.items()}
    for key, call in calls.items():
        trace = Path(f"{trace_prefix}_{key}.json") if trace_prefix else None
        try:
            for _ in range(warmup):
                call()
            ran_ops, added = profiled_run(call, rt, trace)
            ops = profiled_run(audits[key], rt)[0] if audits is not None else ran_ops
            out[key] = dict(ops=ops, ran_ops=ran_ops, added_bytes=added, trace=str(trace) if trace else None,
                            kernel_audit="eager twin" if audits is not None else "this run", **kernel_context(rt))
        except Exception as e:
            failed[key] = out_of_memory(e, rt)
        bar.update(warmup + 1)
    for key, ms in time_round_robin(calls, iters, rt, bar, failed).items():
        stats = summarize(ms)
        out[key].update(ms_per_iter=stats["median"], ms_p25=stats["p25"], ms_p75=stats["p75"], ms_min=stats["min"],
                        ms_max=stats["max"], ms_all=ms)
    for key in out:
        out[key].update(compile_health(tallies[key]))
    out.update({key: dict(status="oom", reason=reason) for key, reason in failed.items()})
    return out


def paired_speedup(base: dict, row: dict) -> float:
    """The median over iterations of base time / row time: within one iteration the rows run back to back, so the
    ratio cancels drift that a ratio of medians would keep."""
    return float(np.median(np.array(base["ms_all"]) / np.array(row["ms_all"])))


def audited_row(row: dict, measured: dict, attn: str, rt: Runtime) -> dict:
    """A row with its timing, memory and audited kernel; kernel_ok is False on a silent fallback."""
    if measured.get("status") == "oom":
        row.update(measured)
        return row
    verdict = audit(measured.pop("ops"), measured.pop("ran_ops"), attn, rt.device_type, row.get("eager_reference"),
                    measured.get("recompile_limit_hits", 0))
    row.update(measured, **verdict)
    return row


def audit(ops: set[str], ran_ops: set[str], attn: str, device_type: str, eager_reference: bool,
          recompile_limit_hits: int, generation: bool = False) -> dict:
    """The audit's columns: the kernel the profiled ops show (flex_eager when the row's own call ran flex's reference),
    what was expected, and kernel_ok; a row run eagerly on purpose (`eager_reference`) expects the reference."""
    kernel, names = kernel_of(ops)
    if ran_eager_flex(ran_ops):
        kernel = with_eager_flex(kernel)
    expected = {"flex_eager"} if eager_reference else expected_kernels(attn, device_type, generation)
    return dict(kernel=kernel, kernel_ops=names, kernel_expected=sorted(expected),
                kernel_ok=ran_as_expected(kernel, expected) and not recompile_limit_hits)


def max_batch_size(fits_batch: Callable[[int], bool], limit: int) -> int:
    """The largest batch size in [1, limit] that fits (0 if none): double until one fails, then bisect."""
    good, bad, b = 0, limit + 1, 1
    while b <= limit:
        if not fits_batch(b):
            bad = b
            break
        good, b = b, b * 2
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits_batch(mid) else (good, mid)
    return good
