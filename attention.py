"""
The attention implementations GPT switches between (IMPLEMENTATIONS), and the one decision whether one runs here
(attention_problem). Each computes the same causal attention with another kernel:

    q: (B, nh, Tq, hs), k and v: (B, nh, Tk, hs) -> (B, nh, Tq, hs)
    mask None: causal, aligned to the end (query i sees keys 0 .. i + Tk - Tq); else documents and a window in the
        implementation's form (doc_window_mask), or a decode step's masks.CacheSpan (decode_inputs).
"""

import functools
import math
import sys
import warnings
from dataclasses import KW_ONLY, dataclass
from typing import Callable, Optional

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

import masks
from core import runtime
from core.errors import UserError

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], float], torch.Tensor]


def causal_mask(q_len: int, kv_len: int, device) -> torch.Tensor:
    """(q_len, kv_len) bool, True where query i may see key j: j <= i + kv_len - q_len."""
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)


def manual_attention(q, k, v, mask, dropout_p):
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, Tq, Tk)
    if mask is None:
        mask = causal_mask(q.size(-2), k.size(-2), q.device)
    att = att.masked_fill(~mask, float("-inf"))
    att = F.softmax(att, dim=-1)
    att = F.dropout(att, p=dropout_p, training=dropout_p > 0)
    return att @ v


def sdpa_mask_attention(q, k, v, mask, dropout_p):
    # An explicit mask is what pushes CUDA off the fused kernels and onto the generic one.
    if mask is None:
        mask = causal_mask(q.size(-2), k.size(-2), q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def sdpa_attention(q, k, v, mask, dropout_p):
    # is_causal is aligned to the start (top-left) in PyTorch; without a mask the model only passes square
    # problems or a single query, where start and end alignment agree.
    is_causal = False
    if mask is None and q.size(-2) > 1:  # a branch, not a flag: a concrete bool even when the length is dynamic
        is_causal = True
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)


def _forced_backend(backend: SDPBackend) -> AttentionFn:
    def attention(q, k, v, mask, dropout_p):
        with sdpa_kernel(backend):
            return sdpa_attention(q, k, v, mask, dropout_p)
    attention.__name__ = f"{backend.name.lower()}_attention"
    return attention


def _cudnn() -> AttentionFn:
    forced = _forced_backend(SDPBackend.CUDNN_ATTENTION)

    def cudnn_attention(q, k, v, mask, dropout_p):
        # cuDNN refuses a key length of 1 ("cudnn SDPA does not support key/value sequence length 1"), which the first
        # step of cache-free generation from a one-token prompt asks for. The one key visible then takes all the
        # weight, so its value is the exact answer, the one every kernel gives.
        if k.size(-2) == 1 and mask is None and dropout_p == 0.0:
            return v  # (B, nh, 1, hs)
        return forced(q, k, v, mask, dropout_p)
    return cudnn_attention


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


_block_masks: dict = {}


def _causal_block_mask(q_len: int, kv_len: int, device: torch.device):
    # Building a block mask costs milliseconds; one per shape and device is enough (a dict, not lru_cache: dynamo
    # traces through a cache wrapper, and warns that it does)
    key = (q_len, kv_len, str(device))
    if key not in _block_masks:
        _block_masks[key] = create_block_mask(_causal, None, None, q_len, kv_len, device=device)
    return _block_masks[key]


FLEX_REGION = "attention.flex_attention"  # the profiler region every flex call runs in
FLEX_RECOMPILE_LIMIT = 16  # per use: fp32/bf16 x grad/no-grad x a static then a dynamic length, with room to spare


@functools.cache
def _compiled_flex_attention(use: str):
    """flex_attention compiled for one use ('causal': training and prefill, with a block mask; 'decode': one query
    and a score mod), each with a recompile count of its own: one shared callable would meet fp32 and
    bf16, grad and no-grad, every length and the probes, and past dynamo's shared limit (8) run eagerly without a
    word. FlexAttention is meant to be compiled: eager, it is PyTorch's unfused reference (the T x T scores in
    memory). A sweep over many shapes and masks calls reset_compiled_flex between its rows."""
    return runtime.compile_isolated(flex_attention, recompile_limit=FLEX_RECOMPILE_LIMIT)


def reset_compiled_flex() -> None:
    """The next flex call compiles afresh, with a full recompile budget (bench.py's rows: see above)."""
    _compiled_flex_attention.cache_clear()


def _compile_flex_here(q: torch.Tensor) -> bool:
    """On CUDA flex is always compiled (inside a compiled model dynamo traces flex_attention itself). On CPU only
    inside a compiled model (compile=True): compiling costs seconds per shape, and CPU flex is inference-only."""
    return q.is_cuda and not torch.compiler.is_compiling()


def _flex() -> AttentionFn:
    """FlexAttention with inductor's own kernels."""

    def flex_causal_attention(q, k, v, mask, dropout_p):
        if dropout_p > 0:
            raise UserError("FlexAttention has no attention dropout; set dropout=0.0 or pick another attn.")
        if q.size(-2) == 1 and torch.compiler.is_compiling():
            # inductor's flex lowering (torch 2.13, CPU) fails on a one-query view whose size-1 dimension keeps an
            # odd stride ("not enough values to unpack"); a copy with plain strides compiles. One query: tiny.
            q = q.clone(memory_format=torch.contiguous_format)
        compile_here = _compile_flex_here(q)
        # a decode step's span is read by a score mod; training and prefill take a block mask, causal or the
        # documents' and window's (built once per forward by the model)
        score_mod = None
        if isinstance(mask, masks.CacheSpan):
            score_mod = span_score_mod(mask, k.size(-2), not q.is_cuda)
        block_mask = mask if isinstance(mask, BlockMask) else None
        if mask is None and q.size(-2) > 1:
            block_mask = _causal_block_mask(q.size(-2), k.size(-2), q.device)
        use = "causal" if score_mod is None else "decode"
        flex = _compiled_flex_attention(use) if compile_here else flex_attention
        if torch.compiler.is_compiling():  # inside a compiled model: bench audits it through an eager twin
            return flex(q, k, v, score_mod=score_mod, block_mask=block_mask)
        # a compiled call shows the profiler no FlexAttention op of its own, only a compiled region: name it, so the
        # kernel audit (measure.py) sees flex in both cases
        with torch.profiler.record_function(FLEX_REGION):
            return flex(q, k, v, score_mod=score_mod, block_mask=block_mask)
    return flex_causal_attention


def varlen_attention(q, k, v, mask, dropout_p):
    # varlen_attn (FlashAttention, CUDA) takes the batch as one packed sequence of documents: no dense mask, and
    # the window as flash's window_size (left, right), which counts the query itself apart. Imported here: its
    # module imports dynamo (1.4 s at every start of every script), which only a varlen run needs.
    from torch.nn.attention.varlen import varlen_attn
    if isinstance(mask, torch.Tensor):  # a decode step, one query over the cache: nothing to pack, SDPA runs it
        return sdpa_attention(q, k, v, mask, dropout_p)
    B, nh, Tq, hs = q.shape
    Tk = k.size(-2)  # more keys than queries: a one-query step over the written keys, causal aligned to the end
    packing = mask if mask is not None else masks.varlen_packing(None, 0, B, Tq, q.device)  # Tq == Tk with documents
    keys = packing if Tk == Tq else masks.varlen_packing(None, 0, B, Tk, q.device)
    window_size = (packing.window - 1 if packing.window else -1, 0)  # (-1, 0): causal, bottom-right aligned
    q = q.transpose(1, 2).reshape(B * Tq, nh, hs)  # (B*Tq, nh, hs): rows end to end
    k, v = (t.transpose(1, 2).reshape(B * Tk, nh, hs) for t in (k, v))  # (B*Tk, nh, hs)
    y = varlen_attn(q, k, v, packing.cu_seqlens, keys.cu_seqlens, packing.max_len, keys.max_len,
                    window_size=window_size)  # (B*Tq, nh, hs)
    return y.reshape(B, Tq, nh, hs).transpose(1, 2)


IMPLEMENTATIONS: dict[str, AttentionFn] = {
    "manual": manual_attention,
    "sdpa_mask": sdpa_mask_attention,
    "sdpa": sdpa_attention,
    "flash": _forced_backend(SDPBackend.FLASH_ATTENTION),
    "efficient": _forced_backend(SDPBackend.EFFICIENT_ATTENTION),
    "cudnn": _cudnn(),
    "math": _forced_backend(SDPBackend.MATH),
    "flex": _flex(),
    "varlen": varlen_attention,
}
FLEX = {"flex"}  # FlexAttention: block masks, score mods, compiled

def doc_window_mask(attn: str, docs: Optional[torch.Tensor], window: int, B: int, T: int, device):
    """The mask `attn` takes for training or a prefill with documents (docs (B, T), or None) and/or a window: a
    BlockMask for flex, varlen's packing, a dense mask for the others."""
    if attn in FLEX:
        return masks.block_mask(docs, window, T, device)
    if attn == "varlen":
        return masks.varlen_packing(docs, window, B, T, device)
    return masks.dense_mask(docs, window, T, device)


# -----------------------------------------------------------------------------
# a decode step: the interval of the KV cache it sees (a masks.CacheSpan, made by decode.KVCache.step) in each
# implementation's form, and which kernels take a mask for it at all

def decodes_with_mask(attn: str, device_type: str, dtype: torch.dtype, head_size: int) -> bool:
    """Whether `attn` takes a mask for a decode step over the whole cache. CUDA's flash takes none: eager decoding
    then reads the written keys alone, and compiled decoding (one shape for every position) cannot use it."""
    call = AttnCall(device_type, dtype, head_size, seq_len=16, decode_step="masked")
    return attention_problem(attn, call) is None


def span_mask(attn: str, span: masks.CacheSpan, kv_len: int):
    """A decode step's span in `attn`'s form: flex's score mod reads the interval itself (span_score_mod), the others
    a dense (1 or B, 1, 1, kv_len) row over the whole cache, so a compiled decode step keeps one shape."""
    return span if attn in FLEX else masks.span_rows(span, kv_len)


def decode_inputs(attn: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: masks.CacheSpan):
    """k, v and the mask of a decode step: eagerly, where the whole-cache mask does not suit the kernel (one that
    takes no mask, CUDA's flash; or flex off CUDA, where a score mod costs more than the whole step) and every row
    sees the same interval, the keys in it and no mask; else the whole cache and the span in `attn`'s form."""
    if not torch.compiler.is_compiling() and (  # compiled steps keep one shape: the whole cache
            not decodes_with_mask(attn, q.device.type, q.dtype, q.size(-1)) or (attn in FLEX and not q.is_cuda)):
        if span.bounds is None:  # one read per decode step, shared by every layer (compiled steps make none)
            span.bounds = tuple(torch.stack([*span.start.aminmax(), span.end[0]]).tolist())
        first, last, end = span.bounds
        if first == last:
            return k[:, :, first:end], v[:, :, first:end], None
    return k, v, span_mask(attn, span, k.size(-2))


def span_score_mod(span: masks.CacheSpan, kv_len: int, on_cpu: bool):
    # A decode step's one query row has no blocks worth skipping: the score mod keeps the keys of the row's span,
    # read as its first key and its length, (1 or B,) each.
    first, length = span.start, span.end - span.start
    if on_cpu and torch.compiler.is_compiling():
        # torch 2.13's CPU flex template reads only tensors inductor materialises, and it inlines pointwise ones
        # (then "No choices to select"); reductions over more than a few elements are materialised, so the bounds
        # are taken as two over the span's row of the cache
        rows = masks.span_rows(span, kv_len)[:, 0, 0]  # (1 or B, kv_len)
        first, length = rows.int().argmax(-1), rows.sum(-1)  # (1 or B,) each: argmax finds the first True
    per_row = first.size(0) > 1

    def masked(score, b, h, q_idx, kv_idx):
        r = b if per_row else 0
        return torch.where((kv_idx >= first[r]) & (kv_idx < first[r] + length[r]), score, -float("inf"))
    return masked


# -----------------------------------------------------------------------------
# what can run here: we ask PyTorch by running each implementation once, because which kernel accepts which
# device/dtype/dropout/head size/layout changes from release to release.

@dataclass(frozen=True)
class AttnCall:
    """What decides whether a kernel takes a call, beside the implementation's name."""
    device_type: str
    dtype: torch.dtype
    head_size: int
    _: KW_ONLY
    needs_grad: bool = False        # training: checked with its backward
    dropout_p: float = 0.0
    seq_len: int = 64               # training is checked at its own length (cuDNN's hazard depends on it)
    masked: bool = False            # with a document or window mask
    decode_step: bool | str = True  # inference also checked as a decode step; False: whole sequences only;
                                    # "masked": a decode step over the whole cache with a mask, alone

    def describe(self) -> str:
        mask = ", a document or window mask" if self.masked else ""
        return (f"for {'training' if self.needs_grad else 'inference'} on {self.device_type} in "
                f"{str(self.dtype).removeprefix('torch.')} with dropout={self.dropout_p}{mask} and head size "
                f"{self.head_size}")


@functools.lru_cache(maxsize=None)
def attention_problem(attn: str, call: AttnCall) -> Optional[str]:
    """None if `attn` runs `call` here, else why not: the one answer, cached, that training, sampling, decoding,
    bench and attn=auto ask."""
    cpu, cuda = call.device_type == "cpu", call.device_type == "cuda"
    if attn in ("efficient", "cudnn") and not cuda:
        return f"the {'memory-efficient' if attn == 'efficient' else 'cuDNN'} kernel is CUDA-only"
    if attn == "varlen" and not cuda:
        return "varlen_attn is CUDA-only (FlashAttention's variable-length kernel)"
    if (attn in FLEX or attn == "varlen") and call.dropout_p > 0:
        return f"{'varlen_attn' if attn == 'varlen' else 'FlexAttention'} has no attention dropout"
    if attn in FLEX and cpu and call.needs_grad:
        return "FlexAttention has no backward pass on CPU"
    if attn == "flash" and cpu and call.dropout_p > 0:
        return "the CPU flash kernel does not support dropout"
    if attn == "cudnn" and cuda:
        from core import kernels  # a CUDA run's
        hazard = kernels.cudnn_mask_hazard(attn, call.needs_grad, call.masked, call.seq_len, *kernels.cuda_facts())
        if hazard is not None:
            return hazard
    return probe(attn, call)


def attention_pass(fn: AttentionFn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, dropout_p: float,
                   backward: bool) -> Callable[[], torch.Tensor]:
    """One pass of an implementation as every check and measurement makes it (the probe below, attn=auto's timing,
    bench's attention mode): the forward alone under no_grad, or forward and backward with q's values as the
    incoming gradient (any values cost the same), leaf gradients dropped after so repeated calls hold no more."""
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


def probe(attn: str, call: AttnCall) -> Optional[str]:
    """Run `attn` on what the model really passes it, since kernels' limits differ between layouts: q, k, v as
    strided views of one projection (with backward when training), and for inference a one-query decode step over
    a longer cache: a slice of the written keys, or (decode_step="masked") the whole cache and a mask."""
    T, hs, device, dtype = call.seq_len, call.head_size, call.device_type, call.dtype
    # fork_rng: the probe must not move the RNG that dropout and resumed runs depend on. It may run inside a
    # forward: in exactly `dtype` whatever autocast says, with gradients when training whatever no_grad says
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device == "cuda" else []), \
            torch.autocast(device, enabled=False), torch.set_grad_enabled(call.needs_grad):
        qkv = torch.randn(1, T, 3 * hs, device=device, dtype=dtype, requires_grad=call.needs_grad)
        q, k, v = (t.view(1, T, 1, hs).transpose(1, 2) for t in qkv.split(hs, dim=2))  # (1, 1, T, hs)
        cache = torch.randn(2, 1, T + 8, hs, device=device, dtype=dtype)  # (k|v, 1, T + 8, hs)
        try:
            with warnings.catch_warnings(record=True) as caught:  # PyTorch explains kernel refusals as warnings
                warnings.simplefilter("always")
                if call.decode_step == "masked":
                    written = masks.CacheSpan(torch.zeros(1, dtype=torch.long, device=device),
                                              torch.full((1,), T, device=device))  # the last 8 unwritten
                    IMPLEMENTATIONS[attn](q[:, :, -1:], cache[:1], cache[1:], span_mask(attn, written, T + 8), 0.0)
                    return None
                mask = None
                if call.masked:
                    docs = (torch.arange(T, device=device) >= T // 2).long()[None]  # (1, T): two documents
                    mask = doc_window_mask(attn, docs, T // 4, 1, T, device)
                attention_pass(IMPLEMENTATIONS[attn], q, k, v, mask, call.dropout_p, call.needs_grad)()
                if not call.needs_grad and call.decode_step:
                    IMPLEMENTATIONS[attn](q[:, :, -1:], cache[:1, :, :T], cache[1:, :, :T], None, 0.0)
        except (RuntimeError, NotImplementedError) as e:
            from core import kernels  # read only when a kernel refuses
            reason = kernels.refusal_reason([str(w.message) for w in caught], attn) or str(e).splitlines()[0]
            return f"PyTorch has no kernel for it ({reason.rstrip('.')})"
    return None


@dataclass(frozen=True)
class Implementation:
    """An implementation resolved once (GPT.set_attention) and called by every layer. Its first eager call with new
    facts asks attention_problem (cached: every later call is a lookup), so a refusal is one sentence before any
    kernel runs, however the model was built."""
    name: str             # a key of IMPLEMENTATIONS
    block_size: int = 64  # inference is checked at this one length, whatever the prompt

    @property
    def fn(self) -> AttentionFn:
        return IMPLEMENTATIONS[self.name]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, dropout_p: float,
                 training: bool = False) -> torch.Tensor:
        """`training`: the calling module's mode; with gradients on, the call is checked with its backward."""
        decoding = isinstance(mask, masks.CacheSpan)  # a decode step: only generation makes one
        if decoding:
            k, v, mask = decode_inputs(self.name, q, k, v, mask)
        if torch.compiler.is_compiling():  # compiled code was checked before it was traced
            return self.fn(q, k, v, mask, dropout_p)
        needs_grad = training and q.requires_grad  # an eval-mode forward with gradients on is still inference
        call = AttnCall(q.device.type, q.dtype, q.size(-1), needs_grad=needs_grad, dropout_p=dropout_p,
                        seq_len=q.size(-2) if needs_grad else self.block_size,  # inference: one length for all
                        masked=mask is not None and not decoding, decode_step=q.size(-2) == 1)
        check_attention(self.name, call)
        try:
            return self.fn(q, k, v, mask, dropout_p)  # (B, nh, Tq, hs)
        except (RuntimeError, NotImplementedError) as e:  # a kernel refusing what the probe could not foresee
            if "No available kernel" not in str(e):
                raise
            check_attention(self.name, call, problem=f"PyTorch refused q of shape {tuple(q.shape)} at run time")
            raise


@functools.lru_cache(maxsize=None)  # once per process and setting
def _warn_cudnn_hazard(attn: str, needs_grad: bool, masked: bool, seq_len: int) -> None:
    from core import kernels  # a CUDA run's
    hazard = kernels.cudnn_mask_hazard(attn, needs_grad, masked, seq_len, *kernels.cuda_facts())
    if hazard is not None:
        print(f"warning: attn='{attn}' may run cuDNN here: {hazard}.", file=sys.stderr)


def check_attention(attn: str, call: AttnCall, problem: Optional[str] = None) -> None:
    """Raise UserError, naming what can run instead, if `attn` cannot run `call` here, or if the caller already
    knows the `problem` (a kernel that refused a real call)."""
    problem = problem or attention_problem(attn, call)
    if problem is None:
        if call.device_type == "cuda" and attn in ("sdpa", "sdpa_mask"):  # SDPA may pick cuDNN: it runs, warned
            _warn_cudnn_hazard(attn, call.needs_grad, call.masked, call.seq_len)
        return
    runnable = [a for a in IMPLEMENTATIONS if a != attn and attention_problem(a, call) is None]
    raise UserError(f"attn='{attn}' cannot run {call.describe()}: {problem}; use one of {', '.join(runnable)}.")
