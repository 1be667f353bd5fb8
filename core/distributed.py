"""
A launch of several ranks (runtime.init_distributed imports it where RANK is set): torchrun's variables checked, the
process group joined on a store of this restart's own, the model wrapped for it (DDP or FSDP2), the ranks' start-up
agreement, work rank 0 does while the other ranks wait at a barrier, and a rank lost mid-run.
"""

import inspect
import os
from typing import Callable

import torch
import torch.distributed as dist

from core.errors import StoppedWithRank0, UserError


def join(device: str, backend: str = "auto") -> tuple[int, int, int, str]:
    """(rank, local_rank, world_size, device), the process group joined (`backend`; auto: NCCL on CUDA, gloo
    elsewhere), one GPU per local rank."""
    rank, local_rank, world_size = launch_variables(os.environ)
    if backend == "nccl" and not device.startswith("cuda"):  # NCCL runs between GPUs only
        raise UserError(f"--backend=nccl needs CUDA GPUs and this run's device is {device}; pass --backend=gloo (or "
                        f"auto).")
    if device.startswith("cuda") and local_rank >= torch.cuda.device_count():
        raise UserError(f"LOCAL_RANK={local_rank} has no GPU of its own: this node shows "
                        f"{torch.cuda.device_count()}; pass torchrun --nproc_per_node= at most that many.",
                        own_rank=True)
    # torchrun's store outlives a restart (--max-restarts): keys of this attempt's own, or the restarted ranks read
    # the dead ones' addresses and hang or fail to connect
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size))
    store = dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
    if backend == "auto":
        backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                                device_id=torch.device(device))
    else:
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size)
    return rank, local_rank, world_size, device


def launch_variables(env) -> tuple[int, int, int]:
    """torchrun's RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; a set torchrun would not leave is one
    sentence."""
    fix = ("launch with torchrun --nproc_per_node=N train.py ..., or unset RANK, LOCAL_RANK and WORLD_SIZE for one "
           "process")
    missing = [name for name in ("LOCAL_RANK", "WORLD_SIZE") if name not in env]
    if missing:
        raise UserError(f"RANK is set but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not, as "
                        f"torchrun would set them; {fix}.")
    try:
        rank, local_rank, world_size = (int(env[name]) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    except ValueError:
        raise UserError(f"RANK, LOCAL_RANK and WORLD_SIZE must be whole numbers, got {env['RANK']!r}, "
                        f"{env['LOCAL_RANK']!r}, {env['WORLD_SIZE']!r}; {fix}.") from None
    if not (0 <= rank < world_size and 0 <= local_rank <= rank):
        raise UserError(f"RANK={rank}, LOCAL_RANK={local_rank}, WORLD_SIZE={world_size} cannot be one of torchrun's "
                        f"ranks; {fix}.")
    gone = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in env]
    if gone:
        raise UserError(f"RANK and WORLD_SIZE={world_size} are set without {' and '.join(gone)}: the ranks have "
                        f"nowhere to meet; {fix}.")
    port = env["MASTER_PORT"].strip()
    if not (port.isdigit() and 0 < int(port) < 65536):
        raise UserError(f"MASTER_PORT={env['MASTER_PORT']!r} is not a port number (1-65535); set it to a free port "
                        f"such as 29500, or {fix}.")
    return rank, local_rank, world_size


def one_mig_slice_per_rank(env) -> str | None:
    """Under torchrun, a CUDA_VISIBLE_DEVICES of several MIG slices narrowed to this rank's own, before CUDA starts:
    a process sees only the first slice it names, so local rank N has no cuda:N. Returns the note to print."""
    slices = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if len(slices) < 2 or not all(d.startswith("MIG-") for d in slices) or "LOCAL_RANK" not in env:
        return None
    local_rank = int(env["LOCAL_RANK"]) if env["LOCAL_RANK"].isdigit() else 0
    if local_rank >= len(slices):
        raise UserError(f"LOCAL_RANK={local_rank} has no MIG slice of its own: CUDA_VISIBLE_DEVICES names "
                        f"{len(slices)}; pass torchrun --nproc_per_node= at most that many.", own_rank=True)
    env["CUDA_VISIBLE_DEVICES"] = ",".join([slices[local_rank]] + slices[:local_rank] + slices[local_rank + 1:])
    return (f"CUDA_VISIBLE_DEVICES names {len(slices)} MIG slices and a process sees only the first named; "
            f"each rank puts its own first (local rank N runs on slice N)") if local_rank == 0 else None


def wrap(model: torch.nn.Module, parallel: str, compile: bool, rt) -> torch.nn.Module:  # rt: a runtime.Runtime
    """DDP (a whole replica per rank), or FSDP2 (each block a unit, sharded over the ranks and gathered for its
    forward and backward; in place: the model's parameters are the shards afterwards)."""
    if parallel == "ddp":
        return wrap_ddp(torch.compile(model) if compile else model, rt)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # only an FSDP run shards
    mp = MixedPrecisionPolicy(param_dtype=rt.torch_dtype, reduce_dtype=torch.float32)
    for block in model.transformer.h:
        if compile:
            block.compile()  # per block: whole-model compile would trace through FSDP's hooks
        fully_shard(block, mp_policy=mp)
    return fully_shard(model, mp_policy=mp)


def wrap_ddp(model: torch.nn.Module, rt) -> torch.nn.Module:
    """DDP without its broadcast of buffers before every forward: the only one (the padded-vocab bias) is derived
    and alike on every rank (0.2 MB at GPT-2 size). torch 2.13 renamed the switch (docs/torch_versions.md)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    new_name = "forward_sync_buffers" in inspect.signature(DDP).parameters
    no_sync = {"forward_sync_buffers" if new_name else "broadcast_buffers": False}
    return DDP(model, device_ids=[rt.local_rank] if rt.is_cuda else None, **no_sync)


# -- the ranks agree before they train ------------------------------------------------------------------------

def agree(settings: dict, problems: list[UserError]) -> list[UserError]:
    """Every rank's start-up problems, the same list on each (rank 0 prints them), compared with their settings in the first collective:
    a rank given other settings (a config file that differs on one node) is named with each rank's value, and a
    problem of one node only (its data_dir missing) stops every rank now, named with its rank, not at a later
    collective. Collective."""
    if not dist.is_initialized():
        return problems
    mine = [str(p) for p in problems if not isinstance(p, StoppedWithRank0)]
    gathered: list = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(gathered, (settings, mine))
    except RuntimeError as e:  # a rank that died at start (killed, out of memory): this rank's own line
        if not lost_a_rank(e):
            raise
        raise UserError(f"another rank stopped before the ranks compared their settings "
                        f"({str(e).split('] ', 1)[-1].split('. ')[0]}); see its own lines, then launch again.",
                        own_rank=True) from None
    found = list(gathered[0][1])
    for rank, (_, theirs) in enumerate(gathered[1:], 1):
        found += [f"rank {rank}: {text}" for text in theirs if text not in gathered[0][1]]
    # settings compared where no rank had a problem (a resume a rank could not read keeps the command's settings)
    differ = [key for key in settings if len({repr(ranks.get(key)) for ranks, _ in gathered}) > 1] if not found else []
    if differ:
        values = ", ".join(f"rank {rank}: {ranks.get(differ[0])!r}" for rank, (ranks, _) in enumerate(gathered))
        more = f" (and {', '.join(differ[1:])})" if differ[1:] else ""
        found.append(f"the ranks were given different settings: {differ[0]} is {values}{more}; give every rank the "
                     f"same config file and command line.")
    return [UserError(text) for text in found]


# -- rank 0's work, and a rank lost ------------------------------------------------------------------------

def on_rank_0(work: Callable, device: str):
    """What `work` returns, run on rank 0 while the other ranks wait at a barrier (None there); a UserError on rank 0 is raised on every
    rank, so none waits at a later collective until the timeout."""
    problem, result = None, None
    if dist.get_rank() == 0:
        try:
            result = work()
        except UserError as e:
            problem = str(e)
    failed = mean_across_ranks(float(problem is not None), device) > 0  # also the barrier
    if problem is not None:
        raise UserError(problem)
    if failed:
        raise StoppedWithRank0("rank 0 stopped with an error (rank 0 prints it); the other ranks stop with it.")
    return result


def lost_a_rank(error: BaseException) -> bool:
    """Whether a collective failed because another rank's process is gone (killed, or out of memory): gloo's broken
    connection, or torch's distributed error (the texts: docs/torch_versions.md)."""
    dist_error = getattr(dist, "DistError", ())
    return isinstance(error, dist_error) or any(text in str(error) for text in (
        "Connection reset by peer", "Connection closed by peer", "Broken pipe"))


def mean_across_ranks(value: float, device: str) -> float:
    """The mean of a number over all ranks."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()
