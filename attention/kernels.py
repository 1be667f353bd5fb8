"""
Whether an attention implementation runs here, asked once per device, dtype and mode (GPTConfig.check_attention, attn=auto,
bench), and the error line when it cannot: what was asked, why it cannot run, and what can.

    call = AttnCall("cpu", torch.float32, 64, needs_grad=True, dropout_p=0.1)
    problem = attention_problem("flash", call, model.IMPLEMENTATIONS["flash"])   # None, or why it cannot run
    refuse_unless_runs("flash", call, model.IMPLEMENTATIONS)   # raises UserError naming what runs instead
"""

import functools
import re
import warnings
from dataclasses import KW_ONLY, dataclass
from typing import Callable, Optional

import torch

from torch.nn.attention import SDPBackend

from core.errors import UserError

# The headers SDPA warns before each kernel's reasons ("Flash attention kernel not used because:"), by the attn
# that forces that kernel. CUDA checks them in the order efficient, flash, cuDNN whatever is forced, so a forced
# flash also explains that the efficient kernel "has been runtime disabled": only the forced kernel's lines count.
KERNEL_HEADERS = {SDPBackend.FLASH_ATTENTION: "Flash attention", SDPBackend.EFFICIENT_ATTENTION: "Memory efficient",
                  SDPBackend.CUDNN_ATTENTION: "CuDNN attention"}
_TRIGGERED = re.compile(r"\s*\(Triggered internally at .*\)\s*$")  # what a warning from C++ carries at its end


def why_declined(messages: list[str], backend: Optional[SDPBackend]) -> Optional[str]:
    """The first reason SDPA's warnings give for refusing the `backend` forced (any kernel's where none is), without
    the C++ source location; None if they give none. The text is torch 2.11-2.13's (docs/torch_versions.md)."""
    sections: dict[Optional[str], list[str]] = {}
    current = None
    for message in messages:
        for line in message.splitlines():
            line = _TRIGGERED.sub("", line).strip()
            kernel = next((k for k, h in KERNEL_HEADERS.items() if line.startswith(h) and line.endswith("because:")),
                          None)
            if kernel is not None:
                current = kernel
            elif line:
                sections.setdefault(current, []).append(line)
    if backend in KERNEL_HEADERS:
        return next(iter(sections.get(backend, [])), None)
    reasons = [line for lines in sections.values() for line in lines if "has been runtime disabled" not in line]
    return next(iter(reasons), None)


# -----------------------------------------------------------------------------
# the decision: rules PyTorch states, then one run of the implementation on what the model passes it, because which
# kernel accepts which device/dtype/dropout/head size/layout changes from release to release

@dataclass(frozen=True)
class AttnCall:
    """What decides whether a kernel takes a call, beside the implementation."""
    device_type: str
    dtype: torch.dtype
    head_size: int
    _: KW_ONLY
    needs_grad: bool = False        # training: checked with its backward
    dropout_p: float = 0.0
    seq_len: int = 64               # training is checked at its own length (cuDNN's hazard depends on it)
    masked: bool = False            # with a document or window mask
    decode_step: bool | str = True  # inference also checked as an eager decode step; False: whole sequences only;
                                    # "compiled": only a compiled decode step (the whole cache behind a mask row)

    def describe(self) -> str:
        mask = ", a document or window mask" if self.masked else ""
        return (f"for {'training' if self.needs_grad else 'inference'} on {self.device_type} in "
                f"{str(self.dtype).removeprefix('torch.')} with dropout={self.dropout_p}{mask} and head size "
                f"{self.head_size}")


@functools.cache  # asked once per process: (attn, its record, call)
def attention_problem(attn: str, call: AttnCall, impl) -> Optional[str]:
    """None if `attn` (its model.Attention record `impl`) runs `call` here, else why not."""
    return _rules(impl, call) or probe(attn, impl, call)


def _rules(impl, call: AttnCall) -> Optional[str]:
    """What PyTorch states, as the record says it (model.IMPLEMENTATIONS)."""
    device = call.device_type
    if device not in impl.devices.split():
        return f"{impl.title} is {impl.devices.upper().replace(' ', '/')}-only"
    if call.dropout_p > 0 and device not in impl.dropout.split():
        return f"{impl.title} has no attention dropout{' on ' + device.upper() if impl.dropout else ''}"
    if call.needs_grad and device not in impl.grad.split():
        return f"{impl.title} has no backward pass on {device.upper()}"
    if device == "cuda" and (impl.backend == SDPBackend.CUDNN_ATTENTION or impl.tries_cudnn):  # cudnn; flash
        from attention.cuda import cuda_facts, cudnn_mask_hazard  # what only a GPU asks
        return cudnn_mask_hazard(impl, call.needs_grad, call.masked, call.seq_len, *cuda_facts())
    return None


def attention_pass(fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, dropout_p: float,
                   backward: bool) -> Callable[[], torch.Tensor]:
    """One pass as every check and measurement makes it: the forward under no_grad, or forward and backward with q's
    values as the incoming gradient, leaf gradients dropped after so repeated calls hold no more."""
    def run() -> torch.Tensor:
        if not backward:
            with torch.no_grad():
                return fn(q, k, v, mask, dropout_p)
        y = fn(q, k, v, mask, dropout_p)
        y.backward(q.detach())
        for t in (q, k, v):
            if t.is_leaf:
                t.grad = None
        return y.detach()
    return run


def probe(attn: str, impl, call: AttnCall) -> Optional[str]:
    """Run the implementation `impl` on what the model passes it (kernels' limits differ between layouts): q, k, v as
    strided views of one projection (with backward when training), and for inference a one-query decode step as
    attention/masks.py's decode_step passes it: eager over the written keys, or (decode_step="compiled") compiled,
    over a longer cache behind a mask row."""
    hs, device, dtype = call.head_size, call.device_type, call.dtype
    # a kernel's support does not change past a few thousand positions (its length rule, cuDNN's 128s, kept): a
    # mistyped block_size=100000 is probed in a second, not for minutes through a (T, T) matrix
    T = min(call.seq_len, 4096 + call.seq_len % 128)
    # fork_rng: the probe must not move the RNG that dropout and resumed runs depend on. It may run inside a
    # forward: in exactly `dtype` whatever autocast says, with gradients when training whatever no_grad says
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device == "cuda" else []), \
            torch.autocast(device, enabled=False), torch.set_grad_enabled(call.needs_grad):
        qkv = torch.randn(1, T, 3 * hs, device=device, dtype=dtype, requires_grad=call.needs_grad)
        q, k, v = (t.view(1, T, 1, hs).transpose(1, 2) for t in qkv.split(hs, dim=2))  # (1, 1, T, hs)
        cache = torch.randn(2, 1, T + 8, hs, device=device, dtype=dtype)  # (k|v, 1, T + 8, hs): 8 unwritten
        compiled = call.decode_step == "compiled"
        try:
            with warnings.catch_warnings(record=True) as caught:  # PyTorch gives its reasons for declining as warnings
                warnings.simplefilter("always")
                mask = None
                if call.masked:
                    from attention.masks import build_mask  # only a masked model's check
                    docs = (torch.arange(T, device=device) >= T // 2).long()[None]  # (1, T): two documents
                    mask = build_mask(impl.mask, docs, T // 4, 1, T, device)
                if not compiled:
                    attention_pass(impl, q, k, v, mask, call.dropout_p, call.needs_grad)()
                if not call.needs_grad and call.decode_step:  # a decode step at position T, as it runs
                    from attention.masks import decode_step
                    end = torch.full((1,), T, device=device) if compiled else T
                    takes_mask = compiled or decodes_with_mask(attn, impl, device, dtype, hs)  # as KVCache asks
                    keys, row = decode_step(impl.mask, end, 0, T + 8, takes_mask, device, None if compiled else dtype)
                    impl(q[:, :, -1:], cache[:1, :, keys], cache[1:, :, keys], row, 0.0)
        except (RuntimeError, NotImplementedError) as e:
            reason = why_declined([str(w.message) for w in caught], impl.backend) or str(e).splitlines()[0]
            return f"PyTorch has no kernel for it ({reason.rstrip('.')})"
    return None


def decodes_with_mask(attn: str, impl, device_type: str, dtype: torch.dtype, head_size: int) -> bool:
    """Whether `attn` takes a decode step's mask row (over the whole cache, as a compiled step passes it): a compiled
    decode step (one shape at every position) needs one, and an eager one reads its keys behind one where it can
    (attention/masks.py's decode_step). FlashAttention-2 takes none."""
    call = AttnCall(device_type, dtype, head_size, seq_len=16, decode_step="compiled")
    return attention_problem(attn, call, impl) is None


def refuse_unless_runs(attn: str, call: AttnCall, implementations: dict, problem: Optional[str] = None) -> None:
    """Raise UserError, naming what can run instead, if `attn` cannot run `call` here, or if the caller already
    knows the `problem` (a kernel that refused a real call)."""
    problem = problem or attention_problem(attn, call, implementations[attn])
    if problem is None:
        if call.device_type == "cuda" and implementations[attn].picks:  # SDPA may pick cuDNN: it runs, with a note
            from attention.cuda import note_cudnn_hazard
            note_cudnn_hazard(attn, implementations[attn], call.needs_grad, call.masked, call.seq_len)
        return
    runnable = [a for a, fn in implementations.items() if a != attn and attention_problem(a, call, fn) is None]
    raise UserError(f"attn='{attn}' cannot run {call.describe()}: {problem}; use one of {', '.join(runnable)}.")
