"""
What only a run of several ranks (torchrun) needs: wrapping the model so the ranks train one model together.
A single process never imports this file.

    ddp    every rank holds the whole model; gradients are averaged (DistributedDataParallel)
    fsdp   every rank holds a shard of each block's parameters, gathered for its forward and backward (FSDP2)
"""

import inspect

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from core.runtime import Runtime


def wrap(model: torch.nn.Module, parallel: str, compile: bool, rt: Runtime) -> torch.nn.Module:
    """The model compiled and wrapped for `parallel` ('ddp' or 'fsdp'). FSDP2: each block is a unit (gathered for its
    forward and backward, then freed), then the root holds the embeddings, final norm and tied lm_head; FSDP
    shards the model's parameters in place."""
    if parallel == "fsdp":
        mp = MixedPrecisionPolicy(param_dtype=rt.torch_dtype, reduce_dtype=torch.float32)
        for block in model.transformer.h:
            if compile:
                block.compile()  # per block: whole-model compile would trace through FSDP's hooks
            fully_shard(block, mp_policy=mp)
        return fully_shard(model, mp_policy=mp)
    return wrap_ddp(torch.compile(model) if compile else model, rt)


def wrap_ddp(model: torch.nn.Module, rt: Runtime) -> DDP:
    # the only buffers (causal masks, the padded-vocab bias) are derived and alike on every rank: DDP's default
    # would broadcast them from rank 0 before every forward (~13 MB at GPT-2 size). torch 2.13 renamed the switch.
    new_name = "forward_sync_buffers" in inspect.signature(DDP).parameters
    no_sync = {"forward_sync_buffers" if new_name else "broadcast_buffers": False}
    return DDP(model, device_ids=[rt.local_rank] if rt.is_cuda else None, **no_sync)
