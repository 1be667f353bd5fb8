"""
Generation: a prefill of the prompt, then a token at a time over the model's KV cache, eagerly or with both steps
compiled; and int8 weight-only weights for sampling.

    idx = Decoder(model, compile=True).generate(idx, max_new_tokens=100, temperature=0)
"""

import contextlib
import io
import logging
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from core import runtime
from attention import decodes_with_mask
from core.errors import UserError
from decode import decode_tokens, last_logits
from model import GPT

QUANTIZE = ("", "int8")  # --quantize: none, or torchao's int8 weight-only


Step = Callable[[GPT, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


# Two functions with one body: dynamo keeps compiled code per code object, so the prefill (dynamic length) and the
# decode step (one shape) each get their own, and neither's guards are tried on the other's calls.
def prefill_logits(model: GPT, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    return last_logits(model, idx, input_pos)


def decode_logits(model: GPT, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    return last_logits(model, idx, input_pos)


def compiled_steps(model: GPT, dtype: torch.dtype, tune: bool = True) -> tuple[Step, Step]:
    """The prefill, compiled for any prompt length, and the decode step, compiled for its one shape (fullgraph). With
    `tune`, on CPU the decode step's matmuls are autotuned on frozen weights (~2.5x here; a changed model needs a new
    Decoder); on CUDA it runs as a CUDA graph."""
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
    """A compiled step with inductor's own warnings kept off the console, and freezing on while it compiles (it is read
    outside torch.compile's per-call options)."""
    def call(model, idx, input_pos):
        with torch._inductor.config.patch(freezing=freeze), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
            warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching")
            return step(model, idx, input_pos)
    return call


class Decoder:
    """Generation with one model, eager or compiled (once, then reused). `dtype`: the one decoding runs in (by default
    the compute dtype at construction), which decides whether the kernel takes a compiled decode step's mask."""

    def __init__(self, model: GPT, compile: bool = False, tune: bool = True, dtype: Optional[torch.dtype] = None):
        self.model, self.compiled = model, compile
        self.dtype = dtype or model.compute_dtype()
        self.prefill, self.decode = compiled_steps(model, self.dtype, tune) if compile else (last_logits, last_logits)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, generator: Optional[torch.Generator] = None,
                 use_cache: bool = True) -> torch.Tensor:
        """model.decode_tokens with this Decoder's steps: append max_new_tokens sampled tokens to idx (B, T)."""
        dtype = self.model.compute_dtype()  # the keys' (autocast's, if on)
        if self.compiled and dtype != self.dtype:
            raise ValueError(f"this Decoder compiled its steps for {self.dtype} and now decodes in {dtype}; "
                             f"pass Decoder(..., dtype={dtype})")
        return decode_tokens(self.model, idx, max_new_tokens, temperature, top_k, generator, use_cache,
                             self.prefill, self.decode, dtype)


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
    """num_samples samples drawn as one batch with sampling.seed: their new tokens, their seconds, and the seconds of an
    untimed warm-up of `warmup` tokens first (compilation, per-shape CPU kernels)."""
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
    """Around importing torchao (directly or through transformers): its notes about CUDA extensions and torch's pytree
    deprecations are nothing a user can act on. Errors still raise."""
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
    """int8 weight-only (torchao), one scale per output row, in place. lm_head gets its own int8 copy: the embedding it
    was tied to is a lookup, whose bytes do not bound decoding."""
    try:
        with quiet_imports():
            from torchao.quantization import Int8WeightOnlyConfig, quantize_
            quantize_(model, Int8WeightOnlyConfig())
    except ImportError:
        raise UserError("--quantize=int8 needs torchao; pip install torchao.") from None
    return model


def for_inference(model: GPT, device: str, dtype: torch.dtype, quantize: str = "") -> GPT:
    """The model as generation reads it, in place and in eval mode: on `device`, weights in `dtype` (decoding at batch 1
    is bound by reading the weights, so the weights themselves must be bf16), then optionally int8."""
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
