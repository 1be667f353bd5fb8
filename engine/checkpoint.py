"""
The checkpoint format, in one place, and how train.py writes it: ckpt.pt (SingleFileSaver: the full state gathered
on rank 0; tensors and plain Python types only, so it loads with torch.load(weights_only=True); written to a
temporary file and renamed into place), or a sharded checkpoint (engine/sharded.py: a folder per step, each rank
writing its own shards through torch.distributed.checkpoint). Every reader reads
through Checkpoint.load(out_dir / "ckpt.pt") (below: this project's files of each format, and nanoGPT's, upgraded
in one place), which reads out_dir's newer one of the two: no reader needs to know the format.

    Checkpoint(model=model.state_dict(), model_config=asdict(model.config), iter_num=100, ...).save(path)
    model = Checkpoint.load(out_dir / "ckpt.pt").build_model(attn="flash")
"""

import dataclasses
import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from core import files
from core import runtime
from core.errors import UserError
from model import GPT, GPTConfig
from core.runtime import Runtime

# 1: every file before the version field (the same fields); 2: with it. Older layouts are read through upgrade().
FORMAT_VERSION = 2
POINTER = "latest"  # the file in out_dir naming its newest whole sharded step (engine/sharded.py)
TRAIN = "train"  # a sharded step's key for everything but the tensors of the model and optimizer
# DCP says so at every save and load of a process without a process group, which is how one process works here
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


@dataclass
class Checkpoint:
    model: dict                          # the full (unsharded) state dict, keyed by parameter name
    model_config: dict                   # GPTConfig's fields
    iter_num: int = 0                    # optimizer steps taken
    best_val_loss: float = math.inf
    optimizer: Optional[dict] = None     # the full optimizer state dict, keyed by parameter name
    rng: Optional[dict] = None           # every rank's RNG state and the data sampler's generator (train.py;
                                         # None in a nanoGPT checkpoint: a resume starts fresh streams)
    settings: dict = field(default_factory=dict)  # the run's settings
    meta: Optional[dict] = None          # the dataset's meta.json: which tokenizer decodes the model's ids
    version: int = FORMAT_VERSION        # of the format; what load() returns is always the current one
    shards: Optional[str] = None         # not saved: the step folder of a sharded checkpoint loaded for training,
                                         # whose model and optimizer state each rank reads in place (train.restore)

    def build_model(self, **overrides) -> GPT:
        """The model it holds; `overrides` may choose another attention, masks or dropout (model.RUN_FIELDS)."""
        model = GPT(GPTConfig.build(self.model_config, overrides))
        if self.shards is None:
            model.load_state_dict(self.model)
        return model

    def save(self, path: Path) -> None:
        """Write it whole or not at all (files.staged_outputs): a crash or a full disk keeps the previous one."""
        path = Path(path)
        # not asdict (it copies tensors); `shards` says where a loaded one lives, it is not part of the file
        contents = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "shards"}
        with files.staged_outputs(path.parent, [path.name], what=f"the checkpoint to {path}",
                                  advice="free disk space or pass --out_dir= another folder, then resume") as tmp:
            with open(tmp[path.name], "wb") as f:  # a file object: a full disk is an OSError, not a RuntimeError
                torch.save(contents, f)

    @staticmethod
    def describe(path: Path) -> str:
        """A few words on the run a checkpoint holds ('iter 3000, val loss 1.600'), read without loading its
        tensors; 'an unreadable checkpoint' when it cannot be read."""
        return describe(path)

    @classmethod
    def load(cls, path: Path, for_training: bool = False, data_dir: Path | None = None) -> "Checkpoint":
        """The checkpoint at `path` (ckpt.pt, or out_dir's newer sharded one), on the CPU, or one sentence on why
        it cannot be read. `for_training`: it must also hold the optimizer and RNG state that resuming needs.
        `data_dir`: the training data, where a nanoGPT checkpoint's vocabulary (meta.pkl) is looked for first."""
        return load(path, for_training, data_dir)


def sharded_folder(path: Path) -> Path | None:
    """The sharded checkpoint to read for `path`: path itself when it is a folder (a step); for out_dir/ckpt.pt, the
    step out_dir/latest names when there is no ckpt.pt or the pointer was written after it (a format switched)."""
    pointer = path.parent / POINTER
    if path.is_dir():
        return path
    if pointer.is_file() and (not path.is_file() or pointer.stat().st_mtime > path.stat().st_mtime):
        return path.parent / pointer.read_text().strip()
    return None


def rng_state(data_generator: torch.Generator, rt: Runtime) -> dict:
    """Every rank's dropout RNG (collective: all ranks call it) and the shared data generator."""
    mine = torch.cat([torch.get_rng_state()] + ([torch.cuda.get_rng_state()] if rt.is_cuda else []))
    per_rank = [mine]
    if rt.is_distributed:
        per_rank = [None] * rt.world_size
        torch.distributed.all_gather_object(per_rank, mine)
    return {"per_rank": per_rank, "data": data_generator.get_state()}


def restore_rng(state: dict, data_generator: torch.Generator, rt: Runtime) -> None:
    data_generator.set_state(state["data"])
    if len(state["per_rank"]) != rt.world_size:
        return  # another world size: dropout streams cannot continue, the seeds already set stand
    saved, cpu_size = state["per_rank"][rt.rank], torch.get_rng_state().numel()
    torch.set_rng_state(saved[:cpu_size])
    if rt.is_cuda and saved.numel() > cpu_size:
        torch.cuda.set_rng_state(saved[cpu_size:])


def claim_out_dir(out: Path, resuming: bool, overwrite: bool) -> None:
    """A new run never replaces another run's checkpoint or adds to its metrics unless --overwrite=True says so;
    then the old metrics.jsonl goes now and the old ckpt.pt at the first save."""
    if resuming:
        return
    ckpt, log = out / "ckpt.pt", out / "metrics.jsonl"
    has_checkpoint = ckpt.exists() or sharded_folder(ckpt) is not None
    if overwrite:
        log.unlink(missing_ok=True)
    elif has_checkpoint or log.exists():
        what = (f"another run's checkpoint ({Checkpoint.describe(ckpt)})" if has_checkpoint
                else "another run's metrics.jsonl")
        raise UserError(f"{out} already holds {what}; continue it with --init_from=resume, pass another --out_dir=, "
                        f"or replace it with --overwrite=True.")


FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)


class SingleFileSaver:
    """ckpt.pt: every rank gathers the full model and optimizer state (collective), rank 0 writes them."""

    def __init__(self, out: Path, rt: Runtime):
        self.path, self.rt = Path(out) / "ckpt.pt", rt

    def save(self, model: torch.nn.Module, optimizers: list, fields: dict) -> None:
        checkpoint = Checkpoint(model=get_model_state_dict(model, options=FULL_STATE),
                                optimizer=get_optimizer_state_dict(model, optimizers, options=FULL_STATE), **fields)
        # rank 0 writes; if it cannot (a full disk), every rank stops with it rather than wait at the next step
        runtime.on_master(lambda: checkpoint.save(self.path), self.rt.device)

    def close(self) -> None:
        pass  # nothing is written after save returns


# -----------------------------------------------------------------------------
# reading: every reader, every format

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
    return read_step(shards, parts)


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


# -----------------------------------------------------------------------------
# a sharded step, as DCP wrote it (engine/sharded.py)

def step_folder(out: Path, iter_num: int) -> Path:
    return Path(out) / f"step-{iter_num:06d}"


def steps_in(out: Path) -> dict[int, Path]:
    """out_dir's step folders, whole or not, by step."""
    found = {}
    for path in Path(out).glob("step-*"):
        if match := re.fullmatch(r"step-(\d+)", path.name):
            found[int(match[1])] = path
    return found


def is_whole(folder: Path) -> bool:
    """DCP renames .metadata into place after every rank's files are written: its presence means a whole save."""
    return (folder / ".metadata").is_file()


def read_step(folder: Path, parts: set[str]) -> dict:
    """The named parts of a step ('model', 'optimizer'; TRAIN always) as a Checkpoint's fields, full tensors on the
    CPU, read by this process alone: how DCP's own conversion to one file (format_utils.dcp_to_torch_save) reads."""
    if not is_whole(folder):
        raise UserError(f"{folder} is not a whole sharded checkpoint (no .metadata: its save never finished); "
                        f"resume from the step {folder.parent / POINTER} names.")
    import torch.distributed.checkpoint as dcp  # DCP: only a sharded checkpoint reads its files
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    state: dict = {}
    try:
        _load_state_dict(state, storage_reader=dcp.FileSystemReader(folder),
                         planner=_EmptyStateDictLoadPlanner(keys=parts | {TRAIN}), no_dist=True)
    except CheckpointException as e:  # DCP's, a BaseException: each rank's error with its traceback
        error = next(iter(e.failures.values()))[0]
        raise UserError(f"checkpoint {folder} cannot be read ({type(error).__name__}); it is corrupt or not a "
                        f"checkpoint of this project - restore it or train again.") from None
    return {**state.pop(TRAIN), **state}


def load_into(model: torch.nn.Module, optimizers: list, folder: Path) -> dict:
    """A step's weights read into the model as it is placed (each rank reads only what it holds: its FSDP2 shards,
    or a whole replica) and its optimizer state shaped for set_optimizer_state_dict (returned: the caller keeps its
    own peak learning rates). Collective under torchrun."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizers)}
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state["model"])
    return state["optimizer"]
