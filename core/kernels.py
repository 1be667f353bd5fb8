"""
What PyTorch's attention kernels need and say, beyond what the probe (attention.py) finds by running them: the
reasons SDPA's warnings give for a refusal, a known cuDNN hazard, and what the optional kernels need, asked before
the probe runs them, so that a missing package or GPU generation is refused in one sentence that names what to
install or which GPU it takes:

    flash3      FlashAttention 3 behind SDPA's flash backend (torch.nn.attention.activate_flash_attention_impl('FA3')):
                Hopper (compute capability 9.x) and the flash_attn_interface module
    flash4      FlashAttention 4 behind SDPA's flash backend ('FA4'): Hopper or Blackwell (9.x, 10.x) and flash-attn-4
    flex_flash  FlexAttention with kernel_options={'BACKEND': 'FLASH'}: the same cute-dsl FlashAttention 4 kernel
                generated from the mask (flash-attn-4), Hopper or Blackwell

The kernels' own limits (dtype, head size, masks) are then the probe's to find, as for every other implementation.
"""

import importlib.util
import re
from typing import Optional

import torch

from core.errors import BuildUnavailable

# attn -> (the kernel, the module that must import, how to get it, the compute capability majors it is built for,
# its name in torch's flash registry (None: not behind SDPA))
NEEDS = {
    "flash3": ("FlashAttention 3", "flash_attn_interface",
               "FlashAttention 3's flash_attn_interface (build the hopper/ folder of Dao-AILab/flash-attention)", (9,),
               "FA3"),
    "flash4": ("FlashAttention 4", "flash_attn.cute", "the flash-attn-4 package (pip install --pre flash-attn-4)",
               (9, 10), "FA4"),
    "flex_flash": ("FlexAttention's FLASH backend (FlashAttention 4)", "flash_attn.cute",
                   "the flash-attn-4 package (pip install --pre flash-attn-4)", (9, 10), None),
}
GENERATIONS = {9: "9.x (Hopper: H100, H200)", 10: "10.x (Blackwell: B200)"}


def has_module(name: str) -> bool:
    """Whether `name` imports, without importing it (a parent package that is missing counts as missing)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # find_spec imports the parents: flash_attn missing for flash_attn.cute
        return False


def build_problem(attn: str, device_type: str, capability: Optional[tuple[int, int]] = None) -> Optional[str]:
    """None if `attn`'s package and GPU are here, else the one sentence that says what is missing. `capability`:
    the GPU's (major, minor), asked of CUDA when not given (a test passes what a GPU would report)."""
    kernel, module, install, majors, build = NEEDS[attn]
    gpus = " or ".join(GENERATIONS[m] for m in majors)
    if device_type != "cuda":
        return f"{kernel} is CUDA-only: compute capability {gpus}, with {install}"
    if build is not None and build not in torch.nn.attention.list_flash_attention_impls():
        return f"this torch ({torch.__version__}) cannot put {build} behind SDPA; torch 2.13 or later can"
    capability = capability or torch.cuda.get_device_capability()
    if capability[0] not in majors:
        return f"{kernel} needs compute capability {gpus}; this GPU is {capability[0]}.{capability[1]}"
    if not has_module(module):
        return f"{kernel} needs {install}"
    return None


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


def use_flash_build(build: Optional[str]) -> None:
    """Make `build` ('FA3', 'FA4', or None for PyTorch's own FA2) the kernel behind SDPA's flash backend, for the
    whole process (torch 2.13's registry: activating one replaces the aten flash ops' CUDA kernels)."""
    if torch.nn.attention.current_flash_attention_impl() == build:
        return
    if build is None:
        torch.nn.attention.restore_flash_attention_impl()
        return
    try:
        torch.nn.attention.activate_flash_attention_impl(build)
    except (ImportError, RuntimeError, ValueError) as e:  # its package is missing or not the one torch expects
        attn = next(a for a, needs in NEEDS.items() if needs[4] == build)
        raise BuildUnavailable(f"{build} cannot be put behind SDPA's flash backend ({type(e).__name__}: {e}), and "
                               f"attn='{attn}' needs {NEEDS[attn][2]} and a GPU of compute capability "
                               f"{' or '.join(GENERATIONS[m] for m in NEEDS[attn][3])}") from None
