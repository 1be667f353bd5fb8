"""
Decoding: the KV cache (all a model keeps between generation steps) and the one generation loop.

    model.setup_cache(batch_size=2)
    idx = decode_tokens(model, idx, max_new_tokens=100, temperature=0.0, top_k=None)
"""

from typing import Optional

import torch
import torch.nn as nn
from torch.nn import functional as F

import masks


class LayerCache(nn.Module):
    """One layer's keys and values, (B, nh, block_size, hs) each, in buffers of their own (torch 2.13's CPU flex
    template refuses a key tensor that starts inside another's storage)."""

    def __init__(self, shape: tuple, device, dtype):
        super().__init__()
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)


class KVCache(nn.Module):
    """Everything decoding keeps between steps: every layer's keys and values for positions [0, block_size), in fixed
    buffers (one shape at every position, so a decode step compiles once), and each row's document start."""

    def __init__(self, config, batch_size: int, device, dtype):  # config: a model.GPTConfig
        super().__init__()
        self.window, self.eot_token, self.batch_size, self.dtype = config.window, config.eot_token, batch_size, dtype
        shape = (batch_size, config.n_head, config.block_size, config.head_size)
        self.layers = nn.ModuleList([LayerCache(shape, device, dtype) for _ in range(config.n_layer)])
        starts = torch.zeros(batch_size, dtype=torch.long, device=device) if config.doc_mask else None  # (B,)
        self.register_buffer("doc_start", starts, persistent=False)
        self.length = 0

    def checked(self, T: int, input_pos: torch.Tensor) -> "KVCache":
        """This cache, for a call of T tokens at input_pos (T,): a prefill starts at position 0 (checked eagerly
        only: reading a position costs a sync, and compiled code was checked when it was traced)."""
        if not torch.compiler.is_compiling() and T > 1 and input_pos[0].item() != 0:
            raise ValueError("a prefill of several tokens starts at position 0; later positions come one by one")
        return self

    def update(self, layer: int, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write layer's k, v (B, nh, T, hs) at input_pos (T,); return its whole cache, (B, nh, block, hs) each."""
        cache = self.layers[layer]
        cache.k.index_copy_(2, input_pos, k.to(cache.k.dtype))
        cache.v.index_copy_(2, input_pos, v.to(cache.v.dtype))
        return cache.k, cache.v

    def prefill(self, idx: torch.Tensor) -> None:
        """A prompt idx (B, T) from position 0: where its rows' last documents start (0 without end-of-text)."""
        if self.doc_start is not None:
            pos = torch.arange(idx.size(1), device=idx.device)  # (T,)
            self.doc_start.copy_(torch.where(idx == self.eot_token, pos, 0).amax(dim=1))  # (B,)

    def step(self, idx: torch.Tensor, input_pos: torch.Tensor) -> masks.CacheSpan:
        """A decode step writes idx (B, 1) at input_pos (1,); it sees the cache positions
        [max(document start, pos - window + 1), pos], and an end-of-text it writes opens a document."""
        end = input_pos + 1  # (1,)
        start = (end - self.window).clamp(min=0) if self.window else torch.zeros_like(end)  # (1,)
        if self.doc_start is not None:
            self.doc_start.copy_(torch.where(idx[:, 0] == self.eot_token, input_pos, self.doc_start))  # (B,)
            start = torch.maximum(start, self.doc_start)  # (B,): each row's own document
        return masks.CacheSpan(start, end)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())


def sample_next(logits: torch.Tensor, temperature: float, top_k: Optional[int],
                generator: Optional[torch.Generator]) -> torch.Tensor:
    """One token id per row from logits (B, V) -> (B, 1)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    # <= 0 over a float32 temperature that cannot round to 0: no inf - inf or 0 / 0 however small it is
    logits = logits.float()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / max(temperature, torch.finfo(torch.float32).tiny)
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits = logits.masked_fill(logits < v[:, [-1]], float("-inf"))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


def last_logits(model, idx: torch.Tensor, input_pos: Optional[torch.Tensor]) -> torch.Tensor:
    """One generation step: idx (B, T) at positions input_pos (None: no cache) -> next-token logits (B, V)."""
    logits, _ = model(idx, input_pos=input_pos)  # (B, 1, V)
    return logits[:, -1]


def decode_tokens(model, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                  top_k: Optional[int] = None, generator: Optional[torch.Generator] = None, use_cache: bool = True,
                  prefill=last_logits, decode=last_logits, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Append max_new_tokens sampled tokens to idx (B, T), each row its own text; temperature=0 is greedy. Over the
    model's KV cache in `dtype`, with the given `prefill` and `decode` steps (Decoder passes compiled ones)."""
    block_size = model.config.block_size
    cache = None
    if use_cache:
        dtype = dtype or model.compute_dtype()
        if model.cache is None or model.cache.batch_size != idx.size(0) or model.cache.dtype != dtype:
            model.setup_cache(idx.size(0), dtype)  # else reused: compiled steps keep reading the same buffers
        cache = model.cache
        cache.length = 0  # a new text: none of it is in the cache yet
    token, position = None, None  # the token sampled last, (B, 1), and its position, (1,): a decode step's input
    for _ in range(max_new_tokens):
        context = idx[:, -block_size:]  # (B, <= block_size)
        if cache is None:
            logits = last_logits(model, context, None)
        elif 0 < cache.length < block_size and cache.length == idx.size(1) - 1:  # one new token fits after them
            logits = decode(model, token, position)
            position, cache.length = position + 1, cache.length + 1  # on the device: the host never waits
        else:  # the first step, or the text outgrew block_size and every position shifted: run it all again
            positions = torch.arange(context.size(1), device=idx.device)  # (T,)
            step = prefill if context.size(1) > 1 else decode
            # a fresh contiguous tensor, never a view of idx: one layout, so one compiled prefill serves all
            logits = step(model, context.clone(memory_format=torch.contiguous_format), positions)
            cache.length = context.size(1)
            position = torch.full((1,), cache.length, device=idx.device)  # (1,): a fill, not a copy from the host
        token = sample_next(logits, temperature, top_k, generator)  # (B, 1): the next step's input
        idx = torch.cat((idx, token), dim=1)
    return idx
