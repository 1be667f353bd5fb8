"""
What really ran, and the memory it took, read from torch.profiler: the kernel audit and the per-step tensor memory
of bench.py (and of the GPU acceptance tests).

    ops, added_bytes = profiled_run(step, rt)
    kernel, op_names = kernel_of(ops)           # 'flash', 'efficient', 'cudnn', 'math', 'flex' or 'none'
"""

import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Optional

from torch import profiler
from torch.autograd import DeviceType

from runtime import Runtime

# The op that names the kernel SDPA dispatched to (forward; the backward ops mirror them), and flex's autograd op.
# Compiled code is audited through an eager twin (bench.py): inductor decomposes math and generates flex's kernel.
KERNEL_OPS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_attention_math_for_mps": "math",
    "FlexAttentionAutogradOp": "flex",
}
FUSED = {"flash", "efficient", "cudnn"}


def expected_kernels(attn: str, device_type: str) -> set[str]:
    """The kernels an honest run of `attn` may show in the audit; anything else is a silent fallback."""
    if attn == "manual":
        return {"none"}  # no SDPA op at all: bmm, masked_fill, softmax
    if attn == "sdpa_mask":
        return FUSED | {"math"}  # the generic row: the mask leaves the choice to PyTorch
    if attn == "sdpa":  # PyTorch picks by priority; on CPU the only fused kernel is flash
        return FUSED if device_type == "cuda" else {"flash"}
    return {attn}  # flash, efficient, cudnn, math, flex: forced


def kernel_of(op_names: set[str]) -> tuple[str, list[str]]:
    """The attention kernel among the ops that ran: a label ('none' if no SDPA/flex op ran) and the op names."""
    ops = sorted(name for name in op_names if name in KERNEL_OPS)
    return "+".join(sorted({KERNEL_OPS[op] for op in ops})) or "none", ops


def cpu_peak_bytes(prof: profiler.profile) -> int:
    """The most tensor bytes live at once during a profiled region, beyond those live when it began.
    With profile_memory=True the profiler records every allocation (+bytes) and free (-bytes); their running
    sum in time order is the live tensor memory, the CPU twin of CUDA's max_memory_allocated. The process's
    peak RSS would not do: it only grows, and it counts the allocator's caches, Python and the libraries.
    (Frees of blocks allocated before the region are not recorded, so this can only err upwards.)"""
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
    """torch's profiler prints 'USDT: ... profiler_start' and '... profiler_stop' on stderr from C++, past
    sys.stderr, straight through a progress bar. Send file descriptor 2 to a temporary file for the region,
    then pass on every other line (warnings, errors) as it was."""
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
    rt.reset_peak_memory()
    before = rt.memory_allocated()
    with without_profiler_banner(), profiler.profile(activities=activities, profile_memory=not rt.is_cuda) as prof:
        call()
        rt.synchronize()
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    added = round(rt.peak_memory_gb() * 1e9) - before if rt.is_cuda else cpu_peak_bytes(prof)
    return {e.name() for e in prof.profiler.kineto_results.events()}, added
