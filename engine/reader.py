"""
Reading checkpoints: the one path for every reader and format (ckpt.pt, a sharded step read through DCP, nanoGPT's
ckpt.pt).

    model = load_checkpoint(out_dir / "ckpt.pt").build_model(attn="flash")
"""

import dataclasses
from pathlib import Path

import torch

from core.errors import UserError
from engine.checkpoint import POINTER, TRAIN, Checkpoint, sharded_folder
from engine.sharded import is_whole, steps_in

TRAINING_STATE = ("optimizer", "rng")  # what resuming needs beyond the weights and the step


def describe_checkpoint(path: Path) -> str:
    """A few words on the run a checkpoint holds ('iter 3000, val loss 1.600'), read without loading its tensors;
    'an unreadable checkpoint' when it cannot be read."""
    try:
        contents = read(path, sharded_folder(path), parts=set(), mmap=True)
        return f"iter {int(contents['iter_num'])}, val loss {float(contents['best_val_loss']):.4g}"
    except Exception:
        return "an unreadable checkpoint"


def load_checkpoint(path: Path, for_training: bool = False, data_dir: Path | None = None) -> Checkpoint:
    """The checkpoint at `path` (ckpt.pt, or out_dir's newer sharded step; a step folder named directly), on the CPU,
    or one sentence on why not. `for_training`: it must hold what resuming needs; `data_dir`: where nanoGPT's meta.pkl
    is looked for first."""
    path = Path(path)
    shards = sharded_folder(path)
    if not path.is_file() and shards is None:
        if path.parent.is_file():  # out_dir given as the checkpoint file itself
            raise UserError(f"out_dir {path.parent} is a file; out_dir is the folder that holds ckpt.pt: pass "
                            f"--out_dir={path.parent.parent}.")
        raise UserError(f"no checkpoint at {path}; train one first (python train.py ...) or pass --out_dir= the "
                        f"folder a run wrote its ckpt.pt to.")
    if shards is not None:
        check_step(shards, path.parent / POINTER)
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
    training_state = TRAINING_STATE
    if "model_args" in contents and "model_config" not in contents:  # nanoGPT's ckpt.pt: converted
        from engine import nanogpt  # the conversion is read only for nanoGPT's files
        contents = nanogpt.from_nanogpt(contents, path, for_training, data_dir)
        training_state = ("optimizer",)  # no RNG state: a resumed run starts fresh streams
    required = ("model_config",) if shards and for_training else (
        ("model", "model_config") + (training_state if for_training else ()))
    missing = [k for k in required if contents.get(k) is None]
    if missing:
        raise UserError(f"{path} has no {', '.join(missing)}; it is not a {'resumable ' if for_training else ''}"
                        f"checkpoint written by train.py.")
    known = {f.name for f in dataclasses.fields(Checkpoint)}  # earlier files' `version` field is read no more
    return Checkpoint(**{"model": None, **{k: v for k, v in contents.items() if k in known}},
                      shards=str(shards) if shards and for_training else None)


def read(path: Path, shards: Path | None, parts: set[str], mmap: bool) -> dict:
    """A checkpoint's contents on the CPU: ckpt.pt's, or a sharded step's TRAIN part and `parts` ('model')."""
    if shards is None:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    return read_step(shards, parts)


# -----------------------------------------------------------------------------
# a sharded step, as DCP wrote it

def check_step(folder: Path, pointer: Path) -> None:
    """One sentence, if the step to read is not there whole: what is wrong with the pointer or the folder, and what
    can be read instead (fallback)."""
    if folder == pointer:  # sharded_folder: the pointer names no step
        held = pointer.read_bytes()
        text = held.decode("utf-8", errors="replace").strip()
        what = ("is empty" if not text else "holds no text (binary bytes)" if "\ufffd" in text
                else f"holds {text[:40]!r}, not a step folder's name")
        raise UserError(f"{pointer} {what}; {fallback(pointer.parent)}")
    if not folder.is_dir():
        raise UserError(f"{pointer} names {folder.name}, which is not in {folder.parent}; {fallback(folder.parent)}")
    if not is_whole(folder):
        raise UserError(f"{folder} has no .metadata (its save never finished, or the file was lost); "
                        f"{fallback(folder.parent, folder)}")


def fallback(out: Path, failed: Path | None = None) -> str:
    """What can be read instead of a damaged step: the newest whole one before it (named, and how to point at it),
    else a fresh run. Nothing is deleted: the damaged files are the user's to keep or remove."""
    step = int(failed.name.removeprefix("step-")) if failed is not None else None
    whole = [f for n, f in sorted(steps_in(out).items()) if f != failed and is_whole(f) and (step is None or n < step)]
    if whole:
        return (f"the newest whole step{' before it' if failed else ''} is {whole[-1]}: point {out / POINTER} at it "
                f"(echo {whole[-1].name} > {out / POINTER}) and run again")
    return f"no whole step is left in {out}: start a fresh run there with --overwrite=True, or pass another --out_dir="


def unreadable(folder: Path, error: BaseException) -> UserError:
    """DCP's CheckpointException (a BaseException holding each rank's error) as the sentence of a damaged step."""
    failures = getattr(error, "failures", None)
    cause = next(iter(failures.values()))[0] if failures else error
    reason = str(cause).strip().splitlines()[0][:160] if str(cause).strip() else ""
    return UserError(f"{folder}'s shards cannot be read ({type(cause).__name__}{': ' + reason if reason else ''}); "
                     f"{fallback(folder.parent, folder)}")


def read_step(folder: Path, parts: set[str]) -> dict:
    """The named parts of a step ('model', 'optimizer'; TRAIN always) as a Checkpoint's fields, full tensors on the
    CPU, read by this process alone: how DCP's own conversion to one file (format_utils.dcp_to_torch_save) reads."""
    import torch.distributed.checkpoint as dcp  # DCP: only a sharded checkpoint reads its files
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    state: dict = {}
    try:
        _load_state_dict(state, storage_reader=dcp.FileSystemReader(folder),
                         planner=_EmptyStateDictLoadPlanner(keys=parts | {TRAIN}), no_dist=True)
    except (CheckpointException, Exception) as e:  # DCP's is a BaseException: each rank's error with its traceback
        raise unreadable(folder, e) from None
    return {**state.pop(TRAIN), **state}


def load_into(model: torch.nn.Module, optimizers: list, folder: Path) -> dict:
    """A sharded step read into the model as it is placed (each rank reads what it holds), and its optimizer state
    shaped for set_optimizer_state_dict. Collective under torchrun."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict)
    from torch.distributed.checkpoint.api import CheckpointException
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizers)}
    try:
        dcp.load(state, checkpoint_id=folder)
    except (CheckpointException, Exception) as e:  # a shard damaged after the step was read for its settings
        raise unreadable(folder, e) from None
    set_model_state_dict(model, state["model"])
    return state["optimizer"]
