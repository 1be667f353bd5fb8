"""
Fast decoding, opted into: the prefill and the decode step compiled (sample.py --compile, bench's compiled rows),
and int8 weight-only weights (--quantize=int8, torchao).

    prefill, decode = compiled_steps(model, torch.float32)
    idx = decode_tokens(model, idx, 100, temperature=0, prefill=prefill, decode=decode)
"""

import contextlib
import io
import logging
import warnings
from typing import Callable, Optional

import torch

from core import runtime
from core.errors import UserError
from model import IMPLEMENTATIONS, GPT, last_logits
from attention.kernels import decodes_with_mask

Step = Callable[[GPT, torch.Tensor, Optional[torch.Tensor | int]], torch.Tensor]


# Two functions with one body: dynamo keeps compiled code per code object, so the prefill (dynamic length) and the
# decode step (one shape) each get their own, and neither's guards are tried on the other's calls.
def prefill_logits(model: GPT, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    return last_logits(model, idx, input_pos)


def decode_logits(model: GPT, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    return last_logits(model, idx, input_pos)


# a CPU's compiled decode step: its matmuls autotuned on frozen weights (~2.5x here; a changed model needs a new
# Decoder), which takes minutes to compile; False compiles the same graphs, untuned, in seconds
AUTOTUNE = True


def compiled_steps(model: GPT, dtype: torch.dtype) -> tuple[Step, Step]:
    """The prefill, compiled for any prompt length, and the decode step, compiled for its one shape (fullgraph): on
    CUDA a CUDA graph, on a CPU autotuned (AUTOTUNE)."""
    weight = model.transformer.wpe.weight
    attn = model.config.attn
    if not decodes_with_mask(attn, IMPLEMENTATIONS[attn], weight.device.type, dtype, model.config.head_size):
        raise UserError(f"attn='{model.config.attn}' takes no mask on {weight.device.type}, and a compiled decode "
                        f"step (one shape at every position) needs one; compile with attn=sdpa or run without compile.")
    prefill = runtime.compile_isolated(prefill_logits, fullgraph=True, dynamic=True)
    if weight.is_cuda:
        decode = runtime.compile_isolated(decode_logits, fullgraph=True, mode="reduce-overhead")
    elif AUTOTUNE:
        quiet = {"autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}  # no tables
        decode = runtime.compile_isolated(decode_logits, fullgraph=True, options={"max_autotune_gemm": True, **quiet})
    else:
        decode = runtime.compile_isolated(decode_logits, fullgraph=True)
    return _compiled_step(prefill), _compiled_step(decode, freeze=AUTOTUNE and not weight.is_cuda)


def _compiled_step(step: Step, freeze: bool = False) -> Step:
    """The compiled step as decoding calls it: inductor's own warnings kept off the console, and freezing on while it
    compiles (it is read outside torch.compile's per-call options)."""
    def call(model, idx, input_pos):
        if isinstance(input_pos, int):  # the decode loop's position: a (1,) tensor to the graph, the same graph at each
            input_pos = torch.full((1,), input_pos, device=idx.device)  # a fill, not a copy from the host
        with torch._inductor.config.patch(freezing=freeze), warnings.catch_warnings():
            # inductor's texts (docs/torch_versions.md)
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
            warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching")
            return step(model, idx, input_pos)
    return call


# -----------------------------------------------------------------------------
# int8 weights

@contextlib.contextmanager
def quiet_imports():
    """Around importing torchao (directly or through transformers): its notes about CUDA extensions and torch's pytree
    deprecations are nothing a user can act on. Errors still raise. (Their logger names: docs/torch_versions.md.)"""
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


def int8_weights():
    """torchao's int8 weight-only (config, quantize_), or one error line; called before any work that would need it."""
    try:
        with quiet_imports():
            from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError:
        raise UserError("--quantize=int8 needs torchao; pip install torchao.") from None
    return Int8WeightOnlyConfig, quantize_


def quantize_int8(model: GPT) -> GPT:
    """int8 weight-only (torchao), one scale per output row, in place. lm_head gets its own int8 copy: the embedding it
    was tied to is a lookup, whose bytes do not bound decoding."""
    config, quantize_ = int8_weights()
    with quiet_imports():
        quantize_(model, config())
    return model
