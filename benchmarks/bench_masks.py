"""
bench.py's mask axis (causal, doc, window, doc+window): the documents a row's batch holds, and the share of the
score matrix each implementation computes under a mask.
"""

from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask

from core import files
from attention import masks
from core.dataset import dataset_dir, prepare_if_missing
from core.errors import UserError
from model import IMPLEMENTATIONS

MASKS = ("causal", "doc", "window", "doc+window")


def mask_settings(mask: str, window: int) -> tuple[bool, int]:
    """(doc_mask, window) of a mask name."""
    return "doc" in mask, window if "window" in mask else 0


def block_documents(doc_data: str, doc_len: int, B: int, T: int, seed: int) -> torch.Tensor:
    """(B, T) document ids of B blocks of T tokens: documents of doc_len tokens each (> 0), else random blocks of
    the prepared dataset doc_data (a name under data/, prepared if missing, or a folder), split at its end-of-text."""
    if doc_len > 0:
        return (torch.arange(T) // doc_len).expand(B, T).contiguous()
    folder = Path(doc_data)
    if not (folder / "train.bin").exists():  # a dataset's name: data/<name>, prepared on first use
        folder = dataset_dir("", doc_data)
        prepare_if_missing(folder, doc_data)
    eot = files.eot_token_of(files.read_meta(folder))
    if eot < 0:
        raise UserError(f"{folder} has no end-of-text token, so no documents; pass --doc_data= a BPE dataset "
                        f"(shakespeare, openwebtext) or --doc_len= a document length.")
    if not (folder / "train.bin").is_file():
        raise UserError(f"{folder} has no train.bin; pass --doc_data= a prepared dataset or --doc_len=.")
    data = files.token_file(folder / "train.bin", at_least=T + 1)
    starts = torch.randint(len(data) - T, (B,), generator=torch.Generator().manual_seed(seed)).tolist()
    blocks = torch.from_numpy(np.stack([data[s:s + T].astype(np.int64) for s in starts]))  # (B, T)
    return masks.document_ids(blocks, eot)


def tokens_with_documents(docs: torch.Tensor, vocab_size: int, eot_token: int, seed: int) -> torch.Tensor:
    """(B, T) random ids below eot_token, with eot_token wherever a document begins after the first: the batch a
    training row feeds a model whose doc_mask splits on eot_token."""
    idx = torch.randint(eot_token, docs.shape, generator=torch.Generator().manual_seed(seed))
    opens = torch.zeros_like(docs, dtype=torch.bool)
    opens[:, 1:] = docs[:, 1:] != docs[:, :-1]
    return idx.masked_fill(opens, eot_token).clamp(max=vocab_size - 1)


def fractions(attn: str, docs: Optional[torch.Tensor], window: int, T: int, device="cpu") -> dict[str, float]:
    """`visible`: the share of the T x T scores the mask allows; `computed`: the share the kernel computes (a dense
    mask: all; flex: its BlockMask's blocks, counted on `device`; the skipping kernels about what is visible)."""
    causal = docs is None and window == 0
    visible = mask_fraction(masks.dense_mask(docs, window, T, "cpu"))
    impl = IMPLEMENTATIONS[attn]
    if impl.mask == "block":  # flex: the blocks its BlockMask keeps
        computed = block_fraction(masks.block_mask(None if docs is None else docs.to(device), window, T, device))
    elif impl.mask == "packed" or (impl.skips_future_keys and causal):
        computed = visible
    else:
        computed = 1.0
    return {"visible": visible, "computed": computed}


def row_mask(attn: str, docs: Optional[torch.Tensor], window: int, B: int, T: int, device):
    """What an attention-mode row passes its implementation: None for causal, else the mask in its layout."""
    if docs is None and window == 0:
        return None
    return masks.build_mask(IMPLEMENTATIONS[attn].mask, None if docs is None else docs.to(device), window, B, T,
                           device)


def boundaries_per_block(docs: torch.Tensor) -> float:
    """Mean number of document boundaries inside a block."""
    return (docs[:, -1] - docs[:, 0]).float().mean().item()


def mask_fraction(mask: torch.Tensor) -> float:
    """The fraction of the (T, T) scores a dense mask lets through."""
    return mask.float().mean().item()


def block_fraction(mask: BlockMask) -> float:
    """The fraction of the score matrix a BlockMask computes (whole blocks: partly masked ones count in full)."""
    return 1.0 - mask.sparsity() / 100
