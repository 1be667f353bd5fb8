"""
Which keys a query may see beyond causality, for doc_mask and window: its own document only (the dataset's
end-of-text token opens the next, as a beginning-of-sequence token would) and at most the last `window` tokens.
One rule, `allowed`, in the layout each implementation takes (build_mask picks it, once per forward):

    dense_mask      (B, 1, T, T) bool, True where allowed: manual, sdpa_mask and the SDPA rows
    block_mask      a FlexAttention BlockMask: blocks where nothing is allowed are skipped
    varlen_packing  the documents as varlen_attn's cu_seqlens (and the window as its window_size)
    visible_mask    a decode step's visible keys: a row over the cache, or a score mod for flex
    decode_step     what one decode step, eager or compiled, passes to attention: the cache positions it reads and
                    visible_mask over them

Positions stay GPT-2's absolute ones (position p is p whatever document it is in).
"""

import functools
from dataclasses import dataclass
from typing import Optional

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask


def doc_window_mask(config, layout: str, idx: torch.Tensor):
    """The mask a model with doc_mask and/or window (a GPTConfig) takes for training or a prefill of idx (B, T), in
    its implementation's `layout` (model.Attention.mask)."""
    docs = document_ids(idx, config.eot_token) if config.doc_mask else None  # (B, T)
    return build_mask(layout, docs, config.window, idx.size(0), idx.size(1), idx.device)


def build_mask(layout: str, docs: Optional[torch.Tensor], window: int, B: int, T: int, device):
    """The mask for documents (docs (B, T), or None) and/or a window in an implementation's layout: "block", a
    BlockMask (flex); "packed", varlen's packing; "dense", a dense mask."""
    if layout == "block":
        return block_mask(docs, window, T, device)
    if layout == "packed":
        return varlen_packing(docs, window, B, T, device)
    return dense_mask(docs, window, T, device)


def document_ids(idx: torch.Tensor, eot_token: int) -> torch.Tensor:
    """(B, T) tokens -> (B, T) the index of each token's document within its row, counting from 0."""
    return torch.cumsum(idx == eot_token, dim=1)


def allowed(q_idx, kv_idx, q_doc, kv_doc, window):
    """Whether query position q_idx may see key position kv_idx: causal, same document, and fewer than `window` back
    (an int: when > 0; a tensor: always). Elementwise on broadcast tensors, and inside a FlexAttention mask_mod."""
    ok = kv_idx <= q_idx
    if q_doc is not None:
        ok = ok & (q_doc == kv_doc)
    if isinstance(window, torch.Tensor) or window:
        ok = ok & (q_idx - kv_idx < window)
    return ok


def dense_mask(docs: Optional[torch.Tensor], window: int, T: int, device) -> torch.Tensor:
    """(B, 1, T, T) bool (batch dimension 1 without documents): True where query i may see key j."""
    pos = torch.arange(T, device=device)
    q_doc = kv_doc = None
    if docs is not None:
        q_doc, kv_doc = docs[:, None, :, None], docs[:, None, None, :]  # (B, 1, T, 1), (B, 1, 1, T)
    ok = allowed(pos[:, None], pos[None, :], q_doc, kv_doc, window)  # (T, T) or (B, 1, T, T)
    return ok if ok.dim() == 4 else ok[None, None]


def block_mask(docs: Optional[torch.Tensor], window: int, T: int, device) -> BlockMask:
    """The same rule as a FlexAttention BlockMask (one per row when documents are given)."""
    # Built eagerly and handed to a compiled flex (bench.py), the window rides as a tensor (T: no limit): compiled
    # flex would see another window as a dynamic int, which torch 2.13's CPU flex template fails to compile (C++
    # "cur_qSplitSize0 was not declared"; docs/torch_versions.md). Built inside a compiled model it stays the model's int: a tensor made
    # there is a constant the CPU template cannot read ("No choices to select").
    span = window if torch.compiler.is_compiling() else _window_tensor(window or T, str(device))
    if docs is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return allowed(q_idx, kv_idx, None, None, span)
        return create_block_mask(mask_mod, None, None, T, T, device=device)

    def doc_mask_mod(b, h, q_idx, kv_idx):
        return allowed(q_idx, kv_idx, docs[b, q_idx], docs[b, kv_idx], span)
    return create_block_mask(doc_mask_mod, docs.size(0), None, T, T, device=device)


@functools.lru_cache(maxsize=64)
def _window_tensor(window: int, device: str) -> torch.Tensor:
    # made once per window and device: a tensor made from a number is a host-to-device copy, on CUDA a sync, which
    # every eager forward would otherwise pay
    return torch.tensor(window, device=device)


@dataclass(frozen=True)
class VarlenPacking:
    """The batch as varlen_attn sees it: every document of every row one sequence of the flattened (B*T) tokens."""
    cu_seqlens: torch.Tensor  # (N + 1,) int32: where each sequence starts, and the total at the end
    max_len: int              # the longest sequence
    window: int               # 0: causal over the whole document


def varlen_packing(docs: Optional[torch.Tensor], window: int, B: int, T: int, device) -> VarlenPacking:
    """Sequences start at each row's first token and wherever the document id changes."""
    if docs is None:  # one sequence per row: no search, no host sync
        return VarlenPacking(torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device), T, window)
    starts = torch.zeros(B, T, dtype=torch.bool, device=device)
    starts[:, 0] = True
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    # One host sync per forward, and only one: the kernel's grid is sized on the host by the number of documents
    # and the longest, which only the data knows. The boundaries come over once; the rest is host arithmetic.
    offsets = starts.flatten().cpu().nonzero().flatten()  # (N,): every sequence's first token
    cu_seqlens = torch.cat([offsets, torch.tensor([B * T])]).to(torch.int32)  # (N + 1,)
    max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    if str(device).startswith("cuda"):  # back without a second sync: a pinned copy queued on the stream
        cu_seqlens = cu_seqlens.pin_memory().to(device, non_blocking=True)
    return VarlenPacking(cu_seqlens.to(device), max_len, window)


def visible_mask(layout: str, start: torch.Tensor, end: torch.Tensor, kv_len: int,
                 dtype: Optional[torch.dtype] = None):
    """A decode step's visible keys, [start, end) of kv_len (start (1 or B,), end (1,)), in a layout: "block" (flex) a
    score mod, the others a (1 or B, 1, 1, kv_len) row, bool or (with `dtype`) additive: 0 seen, -inf not. An
    additive row made once per step spares SDPA turning a bool one into it in every layer (three kernels a call on
    CUDA)."""
    if layout != "block":
        kv = torch.arange(kv_len, device=end.device)
        seen = ((kv[None, :] >= start[:, None]) & (kv[None, :] < end[:, None]))[:, None, None, :]
        if dtype is None:
            return seen
        return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, float("-inf"))
    first, length = start, end - start  # (1 or B,) each
    if not start.is_cuda and torch.compiler.is_compiling():
        # torch 2.13's CPU flex template reads only tensors inductor materialises (docs/torch_versions.md): a reduction
        # over a row is one, the start and length tensors passed in are not
        rows = visible_mask("dense", start, end, kv_len)[:, 0, 0]  # (1 or B, kv_len)
        first, length = rows.int().argmax(-1), rows.sum(-1)  # (1 or B,) each: argmax finds the first True
    per_row = first.size(0) > 1

    def visible(score, b, h, q_idx, kv_idx):
        r = b if per_row else 0
        return torch.where((kv_idx >= first[r]) & (kv_idx < first[r] + length[r]), score, -float("inf"))
    return visible


DECODE_BLOCK = 128  # an eager decode step reads a multiple of this many cache positions (or the whole cache)


def decode_keys(end: int, window: int, block_size: int) -> tuple[int, int, int]:
    """An eager decode step at position end - 1 sees keys [first, end) and reads cache positions [lo, hi) around them:
    a multiple of DECODE_BLOCK (or the whole cache), so at most block_size / DECODE_BLOCK + 1 lengths in a
    generation."""
    first = max(0, end - window) if window else 0
    length = min(-(-(end - first) // DECODE_BLOCK) * DECODE_BLOCK, block_size)
    lo = max(0, min(first, block_size - length))
    return first, lo, lo + length


def decode_step(layout: str, end, window: int, block_size: int, takes_mask: bool, device,
                dtype: Optional[torch.dtype] = None, doc_start: Optional[torch.Tensor] = None):
    """What a decode step at position end - 1 passes to attention, decided here alone for every caller: the model's
    step (GPT._attention_mask, once for all layers), the kernel probe (attention/kernels.py) and attn=auto's timing.
    Returns (the cache positions it reads, the mask over them).

    - `end` a (1,) tensor (a compiled step's): the whole cache behind a mask row, one shape at every position
      (gpt-fast's);
    - `end` an int (the decode loop's position, known on the host): the keys it sees, read within decode_keys' range behind a mask row, so
      attention meets a few shapes (cuDNN builds a plan per shape); an implementation that takes no mask
      (FlashAttention-2, `takes_mask` False) reads exactly the keys it sees.
    Each row sees keys from its document's start on (doc_start (B,)), and at most `window` back."""
    if isinstance(end, torch.Tensor):  # positions in the cache are positions in the text
        lo, hi = 0, block_size
        starts = (end - window).clamp(min=0) if window else torch.zeros_like(end)  # (1,)
    else:  # positions from lo: host arithmetic, then fills (not copies from the host)
        first, lo, hi = decode_keys(end, window, block_size)
        if not takes_mask:
            return slice(first, end), None
        starts, end = torch.full((1,), first - lo, device=device), torch.full((1,), end - lo, device=device)
    if doc_start is not None:  # documents: each row from its own start
        starts = torch.maximum(doc_start - lo, starts)  # (B,)
    return slice(lo, hi), visible_mask(layout, starts, end, hi - lo, dtype)
