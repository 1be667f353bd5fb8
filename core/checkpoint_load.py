"""
Reading checkpoints: what a resume, sample.py, export_hf.py and the tests call through Checkpoint.load and
Checkpoint.describe (core/checkpoint.py, the format), read only by a process that reads one. A sharded checkpoint
(core/sharded.py) is read through the same call when it is out_dir's newer one; nanoGPT's files and this project's
older ones become the current format in upgrade().
"""

import dataclasses
from pathlib import Path

import torch

from core.checkpoint import FORMAT_VERSION, Checkpoint, sharded_folder
from core.errors import UserError

TRAINING_STATE = ("optimizer", "rng")  # what resuming needs beyond the weights and the step


def describe(path: Path) -> str:
    """Checkpoint.describe: 'iter 3000, val loss 1.600', read without loading tensors, or 'an unreadable
    checkpoint'."""
    try:
        contents = read(path, sharded_folder(path), parts=set(), mmap=True)
        return f"iter {int(contents['iter_num'])}, val loss {float(contents['best_val_loss']):.4g}"
    except Exception:
        return "an unreadable checkpoint"


def load(path: Path, for_training: bool = False, data_dir: Path | None = None) -> Checkpoint:
    """Checkpoint.load: the checkpoint at `path`, or one sentence on why it cannot be read."""
    path = Path(path)
    shards = sharded_folder(path)
    if not path.is_file() and shards is None:
        raise UserError(f"no checkpoint at {path}; train one first (python train.py ...) or set out_dir.")
    try:  # a sharded one for training: each rank reads its tensors in place later (train.restore)
        contents = read(path, shards, parts=set() if for_training else {"model"}, mmap=False)
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"checkpoint {path} cannot be read ({type(e).__name__}); it is corrupt or not a "
                        f"checkpoint of this project - restore it or train again.") from None
    if not isinstance(contents, dict):
        raise UserError(f"{path} holds a {type(contents).__name__}, not a checkpoint written by train.py.")
    if contents and all(torch.is_tensor(v) for v in contents.values()):
        raise UserError(f"{path} is a bare state dict (only tensors); this project's checkpoints are a dict "
                        f"with 'model' and 'model_config', as train.py writes them.")
    # nanoGPT's files carry no RNG state: a resumed run starts fresh streams
    training_state = ("optimizer",) if is_nanogpt(contents) else TRAINING_STATE
    contents = upgrade(contents, path, for_training, data_dir)
    required = ("model_config",) if shards and for_training else (
        ("model", "model_config") + (training_state if for_training else ()))
    missing = [k for k in required if contents.get(k) is None]
    if missing:
        raise UserError(f"{path} has no {', '.join(missing)}; it is not a {'resumable ' if for_training else ''}"
                        f"checkpoint written by train.py.")
    known = {f.name for f in dataclasses.fields(Checkpoint)}
    return Checkpoint(**{"model": None, **{k: v for k, v in contents.items() if k in known}},
                      shards=str(shards) if shards and for_training else None)


def read(path: Path, shards: Path | None, parts: set[str], mmap: bool) -> dict:
    """A checkpoint's contents on the CPU: ckpt.pt's, or a sharded step's TRAIN part and `parts` ('model')."""
    if shards is None:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    from core import sharded  # only a sharded checkpoint reads DCP's files
    return sharded.read(shards, parts)


def is_nanogpt(contents: dict) -> bool:
    """nanoGPT's ckpt.pt: its shape under model_args, where this project's files have model_config."""
    return "model_args" in contents and "model_config" not in contents


def upgrade(contents: dict, path: Path, for_training: bool, data_dir: Path | None) -> dict:
    """The one place older files become the current format: nanoGPT's layout (nanogpt.py: only a run that resumes
    converts its optimizer state, and keeps nanoGPT's file, which its first save replaces, as ckpt.nanogpt.pt) and
    this project's files from before the version field (version 1: the same fields). A file from a newer version of
    this project is refused."""
    if is_nanogpt(contents):
        from interop import nanogpt  # the conversion is read only for nanoGPT's files
        contents = nanogpt.from_nanogpt(contents, path, for_training, data_dir)
    version = contents.get("version", 1)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise UserError(f"{path} is checkpoint format {version}, newer than this code reads ({FORMAT_VERSION}); "
                        f"update this repository to read it.")
    return {**contents, "version": FORMAT_VERSION}
