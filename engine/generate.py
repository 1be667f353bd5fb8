"""
Generation as sample.py, compare and bench run it: a Decoder (eager, or with compiled steps from tools/decoding.py),
a batch of samples drawn and timed, the weights made ready for inference.

    idx = Decoder(model).generate(idx, max_new_tokens=100, temperature=0)
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass  # private (docs/torch_versions.md)

from core import runtime
from attention.masks import decode_keys
from model import GPT, decode_tokens, last_logits

QUANTIZE = ("", "int8")  # --quantize: none, or torchao's int8 weight-only


class Decoder:
    """Generation with one model, eager or compiled (once, then reused). `dtype`: the one decoding runs in (by default
    the compute dtype at construction), which decides whether the kernel takes a compiled decode step's mask."""

    def __init__(self, model: GPT, compile: bool = False, dtype: Optional[torch.dtype] = None):
        self.model, self.compiled = model, compile
        self.dtype = dtype or model.compute_dtype()
        self.prefill, self.decode = last_logits, last_logits
        if compile:
            from tools.decoding import compiled_steps  # sample.py --compile, bench's compiled rows
            self.prefill, self.decode = compiled_steps(model, self.dtype)

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
    def warm() -> None:
        decoder.generate(x, warmup, sampling.temperature, sampling.top_k, torch.Generator(rt.device), use_cache)
        lengths = use_cache and not decoder.compiled  # a compiled step reads the whole cache: one shape
        for n in decode_warmups(decoder.model, len(prompt), sampling.max_new_tokens) if lengths else ():
            longer = x.repeat(1, -(-n // x.size(1)))[:, :n]  # (num_samples, n): the prompt over and over
            decoder.generate(longer, 2, temperature=0.0)  # a prefill of n, then a decode step over n + 1 keys
    with rt.autocast():
        _, warmup_s = runtime.time_call(warm, rt)
        y, seconds = runtime.time_call(lambda: decoder.generate(
            x, sampling.max_new_tokens, sampling.temperature, sampling.top_k, generator, use_cache), rt)
    return y[:, len(prompt):].tolist(), seconds, warmup_s  # y: (num_samples, T + new)


def decode_warmups(model: GPT, prompt_len: int, new_tokens: int) -> list[int]:
    """Prompt lengths whose first decode step meets each number of cache positions (attention/masks.py's
    decode_keys) that a generation of new_tokens after prompt_len tokens will read, and block_size if it refills past
    it: on a GPU each length can be a kernel plan built on first use (cuDNN's), which the timed run must not include."""
    block_size, window = model.config.block_size, model.config.window
    firsts = {}  # positions read -> the first position that reads that many
    for written in range(min(prompt_len, block_size), min(prompt_len + new_tokens - 1, block_size)):
        _, lo, hi = decode_keys(written + 1, window, block_size)
        firsts.setdefault(hi - lo, written)
    refills = prompt_len + new_tokens - 1 > block_size
    return sorted(set(firsts.values()) - {prompt_len}) + ([block_size] if refills else [])


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
# weights for inference

def for_inference(model: GPT, device: str, dtype: torch.dtype, quantize: str = "") -> GPT:
    """The model as generation reads it, in place and in eval mode: on `device`, weights in `dtype` (decoding at batch 1
    is bound by reading the weights, so the weights themselves must be bf16), then optionally int8."""
    model = model.to(device=device, dtype=dtype).eval()
    if quantize == "int8":
        from tools.decoding import quantize_int8  # torchao's int8 weights, asked for
        quantize_int8(model)
    return model


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
