"""
What PyTorch's attention kernels say beyond what running them shows: the reason in SDPA's warnings for a refusal,
and a known cuDNN hazard that no probe of one length can see.
"""

import re
from typing import Optional

import torch

# The headers SDPA warns before each kernel's reasons ("Flash attention kernel not used because:"), by the attn
# that forces that kernel. CUDA checks them in the order efficient, flash, cuDNN whatever is forced, so a forced
# flash also explains that the efficient kernel "has been runtime disabled": only the forced kernel's lines count.
KERNEL_HEADERS = {"flash": "Flash attention", "efficient": "Memory efficient", "cudnn": "CuDNN attention"}
_TRIGGERED = re.compile(r"\s*\(Triggered internally at .*\)\s*$")  # what a warning from C++ carries at its end


def refusal_reason(messages: list[str], attn: str) -> Optional[str]:
    """The first reason SDPA's warnings give for refusing the kernel `attn` forces (any kernel's for the others),
    without the C++ source location; None if they give none."""
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
    if attn in KERNEL_HEADERS:
        return next(iter(sections.get(attn, [])), None)
    reasons = [line for lines in sections.values() for line in lines if "has been runtime disabled" not in line]
    return next(iter(reasons), None)


def cudnn_mask_hazard(attn: str, needs_grad: bool, masked: bool, seq_len: int, capability: tuple[int, int],
                      cudnn_version: int) -> Optional[str]:
    """A known cuDNN bug (torch 2.13): its backward with an explicit mask gives NaN gradients when the length is 64
    past a multiple of 128 and a row's logsumexp is very negative. A forced `cudnn` row meets it; `sdpa` and
    `sdpa_mask` meet it where SDPA picks cuDNN for a masked call (torch 2.13 prefers cuDNN newer than 9.15 on
    compute capability 9.x and 10.x, and its checks look at the mask's shape only). The sentence, or None."""
    explicit_mask = masked or attn == "sdpa_mask"
    if not (needs_grad and explicit_mask and seq_len % 128 == 64):
        return None
    picks_cudnn = attn == "cudnn" or (attn in ("sdpa", "sdpa_mask") and capability[0] in (9, 10)
                                      and cudnn_version > 91500)
    if not picks_cudnn:
        return None
    return (f"cuDNN's backward with an explicit mask can give NaN gradients at a length of 64 past a multiple of 128 "
            f"({seq_len}); use a block_size that is a multiple of 128")


def cuda_facts() -> tuple[tuple[int, int], int]:
    """The GPU's compute capability and cuDNN's version (0 without cuDNN)."""
    return torch.cuda.get_device_capability(), torch.backends.cudnn.version() or 0
