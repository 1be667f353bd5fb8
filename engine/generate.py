"""
Generation: a prefill of the prompt, then one token at a time over the model's static KV cache - eagerly, or
with both steps compiled - and int8 weight-only weights for sampling.

    decoder = Decoder(model, compile=True)     # the decode step compiles once (fullgraph), the prefill once too
    idx = decoder.generate(idx, max_new_tokens=100, temperature=0)
    idx = generate(model, idx, 100)            # nanoGPT's model.generate: the same loop, eager

Positions are absolute (learned position embeddings), so once the text is longer than block_size every new token
shifts the whole window: each such step is a full prefill of block_size tokens, which is what the cache-free path
pays at every step. The cache saves work while the text fits in block_size.
"""

import contextlib
import io
import logging
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from core import runtime
from attention import decodes_with_mask
from core.errors import UserError
import masks
from model import GPT, GPTConfig

QUANTIZE = ("", "int8")  # --quantize: none, or torchao's int8 weight-only


class LayerCache(nn.Module):
    """One layer's keys and values, (B, nh, block_size, hs) each: a buffer of its own, not a view into one for all
    layers (torch 2.13's CPU flex template refuses a key tensor that starts inside another's storage)."""

    def __init__(self, shape: tuple, device, dtype):
        super().__init__()
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)


class KVCache(nn.Module):
    """Everything decoding keeps between steps, in one place: every layer's keys and values for positions
    [0, block_size), written in place (fixed buffers, so a decode step has one shape at every position and compiles
    once), how many positions hold the text (`length`, the generator's bookkeeping), and with documents where each
    row's current document starts (its decode steps see keys from there on)."""

    def __init__(self, config: GPTConfig, batch_size: int, device, dtype):
        super().__init__()
        self.mask, self.batch_size, self.dtype = config.mask, batch_size, dtype
        shape = (batch_size, config.n_head, config.block_size, config.head_size)
        self.layers = nn.ModuleList([LayerCache(shape, device, dtype) for _ in range(config.n_layer)])
        starts = torch.zeros(batch_size, dtype=torch.long, device=device) if config.mask.documents else None  # (B,)
        self.register_buffer("doc_start", starts, persistent=False)
        self.length = 0

    def checked(self, T: int, input_pos: torch.Tensor) -> "KVCache":
        """This cache, for a call of T tokens at input_pos (T,): a prefill starts at position 0."""
        # compiled code was checked when it was traced; reading a position costs a sync, so eager only
        if not torch.compiler.is_compiling() and T > 1 and input_pos[0].item() != 0:
            raise ValueError("a prefill of several tokens starts at position 0; later positions come one by one")
        return self

    def update(self, layer: int, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write layer's k, v (B, nh, T, hs) at positions input_pos (T,); return its whole cache, (B, nh, block, hs)
        each."""
        cache = self.layers[layer]
        cache.k.index_copy_(2, input_pos, k.to(cache.k.dtype))
        cache.v.index_copy_(2, input_pos, v.to(cache.v.dtype))
        return cache.k, cache.v

    def prefill(self, idx: torch.Tensor) -> None:
        """A prompt idx (B, T) is written from position 0: where its rows' last documents start (0 without
        end-of-text)."""
        if self.doc_start is not None:
            pos = torch.arange(idx.size(1), device=idx.device)  # (T,)
            self.doc_start.copy_(torch.where(idx == self.mask.eot_token, pos, 0).amax(dim=1))  # (B,)

    def step(self, idx: torch.Tensor, input_pos: torch.Tensor) -> masks.Span:
        """A decode step writes idx (B, 1) at input_pos (1,); it sees the cache positions
        [max(document start, pos - window + 1), pos], and an end-of-text it writes opens a document."""
        end = input_pos + 1  # (1,)
        start = (end - self.mask.window).clamp(min=0) if self.mask.window else torch.zeros_like(end)  # (1,)
        if self.doc_start is not None:
            self.doc_start.copy_(torch.where(idx[:, 0] == self.mask.eot_token, input_pos, self.doc_start))  # (B,)
            start = torch.maximum(start, self.doc_start)  # (B,): each row's own document
        return masks.Span(start, end)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())


def sample_next(logits: torch.Tensor, temperature: float, top_k: Optional[int],
                generator: Optional[torch.Generator]) -> torch.Tensor:
    """One token id per row from logits (B, V) -> (B, 1)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits = logits.masked_fill(logits < v[:, [-1]], float("-inf"))
    probs = F.softmax(logits.float(), dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


def last_logits(model: GPT, idx: torch.Tensor, input_pos: Optional[torch.Tensor]) -> torch.Tensor:
    """One generation step: idx (B, T) at positions input_pos (None: no cache) -> next-token logits (B, V)."""
    logits, _ = model(idx, input_pos=input_pos)  # (B, 1, V)
    return logits[:, -1]


Step = Callable[[GPT, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


# Two functions with one body: dynamo keeps compiled code per code object, so the prefill (dynamic length) and the
# decode step (one shape) each get their own, and neither's guards are tried on the other's calls.
def prefill_logits(model: GPT, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    return last_logits(model, idx, input_pos)


def decode_logits(model: GPT, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    return last_logits(model, idx, input_pos)


def compiled_steps(model: GPT, dtype: torch.dtype, tune: bool = True) -> tuple[Step, Step]:
    """The prefill, compiled for any prompt length, and the decode step, compiled for its one shape with
    fullgraph=True; `dtype` is the one decoding computes in (the KV cache's). With `tune`, on CPU the decode
    step's matmuls are autotuned with the weights frozen into the graph (prepacked for batch-1 matmuls: ~2.5x the
    untuned step here, for ~10 s more compiling); on CUDA it runs as a CUDA graph. Frozen weights are a copy: a
    model changed after its first decode step needs a new Decoder."""
    weight = model.transformer.wpe.weight
    if not decodes_with_mask(model.config.attn, weight.device.type, dtype, model.config.head_size):
        raise UserError(f"attn='{model.config.attn}' takes no mask on {weight.device.type}, and a compiled decode "
                        f"step (one shape at every position) needs one; compile with attn=sdpa or run without compile.")
    prefill = runtime.compile_isolated(prefill_logits, fullgraph=True, dynamic=True)
    if not tune:
        decode = runtime.compile_isolated(decode_logits, fullgraph=True)
    elif weight.is_cuda:
        decode = runtime.compile_isolated(decode_logits, fullgraph=True, mode="reduce-overhead")
    else:
        quiet = {"autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}  # no tables
        decode = runtime.compile_isolated(decode_logits, fullgraph=True, options={"max_autotune_gemm": True, **quiet})
    return _quietly(prefill), _quietly(decode, freeze=tune and not weight.is_cuda)


def _quietly(step: Step, freeze: bool = False) -> Step:
    """A compiled step that keeps inductor's own warnings (deprecated storage access; a tensor subclass without a
    cache hash) off the console, with freezing on while it compiles: freezing is read outside torch.compile's
    per-call options, so it is patched around the call."""
    def call(model, idx, input_pos):
        with torch._inductor.config.patch(freezing=freeze), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
            warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching")
            return step(model, idx, input_pos)
    return call


class Decoder:
    """Generation with one model: its prefill and decode steps, eager or compiled (once, then reused). `dtype`: the
    one decoding will run in, which decides whether the kernel takes a compiled decode step's mask (cuDNN does in
    bf16, not in fp32); by default the dtype at construction (autocast's if on, else the weights')."""

    def __init__(self, model: GPT, compile: bool = False, tune: bool = True, dtype: Optional[torch.dtype] = None):
        self.model, self.compiled = model, compile
        self.dtype = dtype or model.compute_dtype()
        self.prefill, self.decode = compiled_steps(model, self.dtype, tune) if compile else (last_logits, last_logits)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, generator: Optional[torch.Generator] = None,
                 use_cache: bool = True) -> torch.Tensor:
        """Append max_new_tokens sampled tokens to idx (B, T); temperature=0 is greedy. Every row of the batch is
        its own text (several prompts of one length, or num_samples copies of one)."""
        model, block_size = self.model, self.model.config.block_size
        cache = self._ensure_cache(idx.size(0)) if use_cache else None
        if cache is not None:
            cache.length = 0  # a new text: none of it is in the cache yet
        token = None  # the token sampled last, (B, 1): a decode step's input
        for _ in range(max_new_tokens):
            context = idx[:, -block_size:]  # (B, <= block_size)
            if cache is None:
                logits = last_logits(model, context, None)
            elif 0 < cache.length < block_size and cache.length == idx.size(1) - 1:  # one new token fits after them
                logits = self.decode(model, token, torch.tensor([cache.length], device=idx.device))
                cache.length += 1
            else:  # the first step, or the text outgrew block_size and every position shifted: run it all again
                positions = torch.arange(context.size(1), device=idx.device)  # (T,)
                step = self.prefill if context.size(1) > 1 else self.decode
                # a fresh contiguous tensor, never a view of idx: one layout, so one compiled prefill serves all
                logits = step(model, context.clone(memory_format=torch.contiguous_format), positions)
                cache.length = context.size(1)
            token = sample_next(logits, temperature, top_k, generator)  # (B, 1): the next step's input
            idx = torch.cat((idx, token), dim=1)
        return idx

    def _ensure_cache(self, batch_size: int):
        """The model's cache, for this batch in the dtype the keys will have (autocast's, if on); an existing one is
        reused, so compiled steps keep reading the same buffers."""
        dtype = self.model.compute_dtype()
        if self.compiled and dtype != self.dtype:
            raise ValueError(f"this Decoder compiled its steps for {self.dtype} and now decodes in {dtype}; "
                             f"pass Decoder(..., dtype={dtype})")
        cache = self.model.cache
        if cache is None or cache.batch_size != batch_size or cache.dtype != dtype:
            self.model.setup_cache(batch_size, dtype)
        return self.model.cache


def generate(model: GPT, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: Optional[int] = None, generator: Optional[torch.Generator] = None,
             use_cache: bool = True) -> torch.Tensor:
    """nanoGPT's `model.generate`, as a function: eager generation over the KV cache (use_cache=False: the
    cache-free loop)."""
    return Decoder(model).generate(idx, max_new_tokens, temperature, top_k, generator, use_cache)


# -----------------------------------------------------------------------------
# sampling a batch, timed (sample.py, compare.py)

@dataclass
class Sampling:
    num_samples: int
    max_new_tokens: int
    temperature: float
    top_k: Optional[int]
    seed: int


def draw_samples(decoder: Decoder, prompt: list[int], rt: runtime.Runtime, sampling: Sampling, use_cache: bool = True,
                 warmup: int = 8) -> tuple[list[list[int]], float, float]:
    """num_samples samples drawn together (one batch) from a generator seeded with sampling.seed: the new tokens
    of each, the seconds they took, and the seconds of an untimed warm-up of `warmup` tokens first, which pays
    for one-time work (compilation; CPU kernels are built per shape)."""
    x = torch.tensor([prompt] * sampling.num_samples, dtype=torch.long, device=rt.device)  # (num_samples, T)
    generator = torch.Generator(rt.device).manual_seed(sampling.seed)
    with rt.autocast():
        _, warmup_s = runtime.time_call(lambda: decoder.generate(
            x, warmup, sampling.temperature, sampling.top_k, torch.Generator(rt.device), use_cache), rt)
        y, seconds = runtime.time_call(lambda: decoder.generate(
            x, sampling.max_new_tokens, sampling.temperature, sampling.top_k, generator, use_cache), rt)
    return y[:, len(prompt):].tolist(), seconds, warmup_s  # y: (num_samples, T + new)


def full_warmup(model: GPT, sampling: Sampling) -> int:
    """Warm-up tokens that meet every shape a timed run will (the cache refills past block_size)."""
    return min(sampling.max_new_tokens, model.config.block_size + 1)


def tokens_per_s(seconds: float, sampling: Sampling) -> float:
    """New tokens per second over the whole batch."""
    return sampling.num_samples * sampling.max_new_tokens / seconds


def print_samples(tok, prompt: list[int], samples: list[list[int]]) -> None:
    for sample in samples:
        print(tok.decode(prompt + sample))
        print("---------------")


# -----------------------------------------------------------------------------
# weights for inference: dtype and int8

@contextlib.contextmanager
def quiet_imports():
    """Around importing torchao (directly, or through transformers): it prints that it cannot load CUDA extensions
    (on any machine without them), and torch's pytree logs deprecation notes for torchao's enums - nothing a user
    of this repository can act on. Errors still raise."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def quantize_int8(model: GPT) -> GPT:
    """int8 weight-only (torchao): every Linear's weight as int8 with one scale per output row; activations stay in
    the model's dtype. lm_head gets its own int8 copy: the token embedding it was tied to stays as it was (a
    lookup reads one row per token, so its bytes do not bound decoding). In place; returns the model."""
    try:
        with quiet_imports():
            from torchao.quantization import Int8WeightOnlyConfig, quantize_
            quantize_(model, Int8WeightOnlyConfig())
    except ImportError:
        raise UserError("--quantize=int8 needs torchao; pip install torchao.") from None
    return model


def check_quantize(quantize: str) -> None:
    if quantize not in QUANTIZE:
        raise UserError(f"quantize must be '' (none) or 'int8', got '{quantize}'.")


def for_inference(model: GPT, device: str, dtype: torch.dtype, quantize: str = "") -> GPT:
    """The model as generation reads it: on `device`, weights in `dtype` (at batch 1 decoding is bound by
    reading the weights, so bf16 weights, not bf16 autocast over fp32 ones, is what halves the bytes), then
    optionally int8. In place; returns the model in eval mode."""
    check_quantize(quantize)
    model = model.to(device=device, dtype=dtype).eval()
    return quantize_int8(model) if quantize == "int8" else model


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds; a quantized tensor subclass counts its int8 data and scales."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def weight_bytes(model: GPT) -> int:
    """Parameters and buffers, each once (tied weights once), the KV cache (and doc_mask's starts) not included."""
    tensors = {id(t): t for name, t in [*model.named_parameters(), *model.named_buffers()]
               if not name.startswith("cache.")}
    return sum(tensor_bytes(t) for t in tensors.values())
