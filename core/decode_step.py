"""
How a decode step reaches each attention implementation: the KV cache hands attention a masks.Span (the cache
positions each row sees), and this turns it into what the implementation takes. Only generation decodes, so only
generation reads this file (attention.py imports it where a Span arrives).

    flex        a score mod that reads the interval (span_score_mod)
    the others  a dense (1 or B, 1, 1, kv_len) row over the whole cache (decode_form), so that a compiled decode
                step keeps one shape; eagerly, a kernel that takes no mask (CUDA's flash) reads exactly the keys in
                the span instead, when every row sees the same ones (decode_inputs)
"""

import functools

import torch

import masks
from attention import FLEX, probe


def decode_form(attn: str, span: masks.Span, kv_len: int):
    """A decode step's span in `attn`'s form: flex's score mod reads the interval itself, the others a dense row."""
    return span if attn in FLEX else masks.span_rows(span, kv_len)


def decode_inputs(attn: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: masks.Span):
    """Eager, where the whole-cache mask does not suit the kernel (reads_written_keys) and every row sees the
    same interval, the keys in it and no mask; else the span in the implementation's form."""
    if not torch.compiler.is_compiling() and reads_written_keys(attn, q):
        first, last, end = torch.stack([*span.start.aminmax(), span.end[0]]).tolist()  # one sync
        if first == last:
            return k[:, :, first:end], v[:, :, first:end], None
    return k, v, decode_form(attn, span, k.size(-2))


@functools.lru_cache(maxsize=None)
def decodes_with_mask(attn: str, device_type: str, dtype: torch.dtype, head_size: int) -> bool:
    """Whether `attn` takes an explicit mask for a decode step over a fixed-size KV cache. CUDA's flash kernel
    takes none: eager decoding then reads exactly the positions written so far, and compiled decoding (one shape
    for every position) cannot use it."""
    return probe(attn, device_type, dtype, 0.0, head_size, False, 16, masked_decode=True) is None


def reads_written_keys(attn: str, q: torch.Tensor) -> bool:
    """Whether an eager decode step reads exactly the keys written so far rather than the whole cache and a mask: a
    kernel that takes no mask (CUDA's flash), or eager flex off CUDA, PyTorch's unfused reference, where a score
    mod costs more than the whole step."""
    return not decodes_with_mask(attn, q.device.type, q.dtype, q.size(-1)) or (attn in FLEX and not q.is_cuda)


def span_score_mod(span: masks.Span, kv_len: int, on_cpu: bool):
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
