"""
What only a CUDA run asks about attention: the GPU's compute capability and cuDNN's version, whether SDPA ranks
cuDNN first there, and cuDNN's masked-backward bug (attention/kernels.py imports it on a GPU only).
"""

import functools
from typing import Optional

import torch
from torch.nn.attention import SDPBackend

from core import errors


def cudnn_mask_hazard(impl, needs_grad: bool, masked: bool, seq_len: int, capability: tuple[int, int],
                      cudnn_version: int) -> Optional[str]:
    """A known cuDNN bug (torch 2.13, docs/torch_versions.md): its backward with an explicit mask gives NaN gradients when the length is 64
    past a multiple of 128 and a row's logsumexp is very negative. A forced `cudnn` row meets it; `sdpa` and
    `sdpa_mask` meet it where SDPA picks cuDNN for a masked call (torch 2.13 prefers cuDNN newer than 9.15 on
    compute capability 9.x and 10.x, and its checks look at the mask's shape only). The message, or None."""
    explicit_mask = masked or (impl.picks and not impl.skips_future_keys)  # SDPA handed a causal mask (sdpa_mask)
    if not (needs_grad and explicit_mask and seq_len % 128 == 64):
        return None
    picks_cudnn = impl.backend == SDPBackend.CUDNN_ATTENTION or (
        (impl.picks or impl.tries_cudnn) and cudnn_first(capability, cudnn_version))
    if not picks_cudnn:
        return None
    return (f"cuDNN's backward with an explicit mask can give NaN gradients at a length of 64 past a multiple of 128 "
            f"({seq_len}); use a block_size that is a multiple of 128")


def cuda_facts(device=None) -> tuple[tuple[int, int], int]:
    """The GPU's compute capability and cuDNN's version (0 without cuDNN)."""
    return torch.cuda.get_device_capability(device), torch.backends.cudnn.version() or 0


def cudnn_first(capability: tuple[int, int], cudnn_version: int) -> bool:
    """Whether SDPA ranks cuDNN's fused flash attention first on this GPU, as torch 2.13's sdp_utils.cpp does: on
    Hopper and Blackwell (compute capability 9.x, 10.x) with cuDNN newer than 9.15. There it uses instructions
    (TMA, wgmma) that PyTorch's FlashAttention-2 predates, so attn='flash' runs it first too (model.flash_kernels).
    Checked against each release's sdp_utils.cpp (docs/torch_versions.md)."""
    return capability[0] in (9, 10) and cudnn_version > 91500


@functools.cache  # once per process and setting
def note_cudnn_hazard(attn: str, impl, needs_grad: bool, masked: bool, seq_len: int) -> None:
    hazard = cudnn_mask_hazard(impl, needs_grad, masked, seq_len, *cuda_facts())
    if hazard is not None:
        errors.note(f"attn='{attn}' may run cuDNN here: {hazard}.")
