"""
What train.py does before it builds a model: the runtime, out_dir locked (before a resume reads anything in it), a
resume's checkpoint and the settings it runs with, every problem of the command found at once, the data prepared.

    cfg, rt, checkpoint, data_dir, lock = start(configure(globals(), argv, LIMITS), LIMITS)
"""

import sys
from pathlib import Path
from typing import Optional

from core import errors, files, runtime
from core.configurator import Settings
from core.dataset import dataset_dir, prepare_if_missing
from core.errors import UserError
from core.runtime import Runtime
from engine.checkpoint import Checkpoint
from engine.trainer import schedule_notes


def start(cfg: Settings, limits: dict) -> tuple[Settings, Runtime, Optional[Checkpoint], Path,
                                              Optional[files.OutDirLock]]:
    """Settings, runtime, the checkpoint a resume continues (None for a new run), the data's folder (prepared if it is
    an embedded dataset) and the lock on out_dir (rank 0's), with all checked that needs no model. out_dir is locked
    before a resume reads its checkpoint (a run training there meanwhile may be removing old steps), and a refused
    start releases it. A resume runs with its checkpoint's settings (resumed_settings), so every check below is the
    resumed run's."""
    rt = runtime.resolve_runtime(cfg.device, cfg.dtype, cfg.muon_dtype, distributed=True, threads=cfg.threads,
                                 backend=cfg.backend)
    if rt.is_distributed:  # one config file that differs on one node: refused before anything runs
        from core.distributed import check_same_settings
        check_same_settings(cfg.as_dict())
    lock = None  # rank 0's lock on out_dir, for the run's life; evaluation writes nothing and takes none
    if not cfg.eval_only:
        lock = runtime.on_master(lambda: files.claim_out_dir(Path(cfg.out_dir), cfg.init_from == "resume",
                                                             cfg.overwrite, describe_run), rt.device)
    try:
        checkpoint = None
        if cfg.init_from == "resume":  # only a resume reads a checkpoint
            from engine.reader import load_checkpoint
            from engine.resume import resumed_settings
            checkpoint = load_checkpoint(Path(cfg.out_dir) / "ckpt.pt", for_training=not cfg.eval_only,
                                         data_dir=Path(cfg.data_dir) if cfg.data_dir else None)
            command, cfg = cfg, resumed_settings(checkpoint, cfg, limits, cfg.out_dir)
            if any(getattr(cfg, k) != getattr(command, k) for k in ("device", "dtype", "muon_dtype", "threads")):
                rt = runtime.resolve_runtime(cfg.device, cfg.dtype, cfg.muon_dtype, threads=cfg.threads, joined=rt)
        data_dir = check_start(cfg, rt)
    except BaseException:
        if lock is not None:
            lock.release(failed=True)
        raise
    return cfg, rt, checkpoint, data_dir, lock


def describe_run(ckpt: Path) -> str:  # a few words on the checkpoint a refused claim names
    from engine.reader import describe_checkpoint
    return describe_checkpoint(ckpt)


def check_start(cfg: Settings, rt: Runtime) -> Path:
    """Every start-up problem of the command, printed at once (with the CPU recipe where the model is GPU-sized),
    before anything is written; else the data's folder, prepared if it is an embedded dataset."""
    problems = [UserError(text) for wrong, text in (
        (cfg.optimizer == "muon" and rt.is_distributed and cfg.parallel == "fsdp", "optimizer='muon' does not run "
         "under --parallel=fsdp: Muon orthogonalizes each whole weight matrix and FSDP2 gives every rank a shard of "
         "it; use --parallel=ddp."),
        (cfg.async_save and cfg.checkpoint_format == "single",
         "async_save=True writes sharded checkpoints only; add --checkpoint_format=sharded."),
        (cfg.gradient_accumulation_steps % rt.world_size, f"gradient_accumulation_steps="
         f"{cfg.gradient_accumulation_steps} is not divisible by the {rt.world_size} ranks; make it a multiple of the "
         f"world size.")) if wrong]
    if cfg.compile:
        problems += errors.problems_of(runtime.check_compile_cache)
    if cfg.wandb_log:
        from tools.wandb_check import check_wandb
        problems += errors.problems_of(lambda: runtime.on_master(lambda: check_wandb(cfg.wandb_project), rt.device))
    data_dir = None
    try:
        data_dir = dataset_dir(cfg.data_dir, cfg.dataset)
    except UserError as e:
        problems.append(e)
    # rank 0 prepares an embedded dataset while the others wait (each takes part, whatever its own data_dir)
    problems += errors.problems_of(lambda: runtime.on_master(
        lambda: data_dir and prepare_if_missing(data_dir, cfg.dataset), rt.device))
    if rt.is_distributed:  # a node's own problem stops every rank now, not at a later collective
        from core.distributed import every_ranks_problems
        problems = every_ranks_problems(problems)
    hint = cpu_hint(cfg, rt)
    errors.refuse_all(problems, hint)
    if hint and rt.is_master:
        print(f"note: {hint}", file=sys.stderr)
    for note in schedule_notes(cfg) if rt.is_master and not cfg.eval_only else []:
        print(f"note: {note}.", file=sys.stderr)
    return data_dir


CPU_COMMAND = ("torchrun --standalone --nproc_per_node=2 train.py config/train_shakespeare_char_cpu.py "
               "--gradient_accumulation_steps=2 --batch_size=16 --out_dir=out-ddp-cpu")


def cpu_hint(cfg: Settings, rt: Runtime) -> str:
    """On a CPU, for a GPU-sized model (GPT-2 124M and up): the command that runs here."""
    if rt.device_type != "cpu" or 12 * cfg.n_layer * cfg.n_embd ** 2 <= 50e6:
        return ""
    return f"this is a GPU-sized model: on this CPU its first evaluation alone takes hours; the CPU recipe is " \
           f"{CPU_COMMAND}"
