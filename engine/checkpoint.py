"""
The checkpoint train.py writes: ckpt.pt, the full state gathered on rank 0, tensors and plain types only
(torch.load(weights_only=True) reads it), written completely or not at all.

    Checkpoint(model=model.state_dict(), model_config=asdict(model.config), iter_num=100, ...).save(path)

engine/reader.py reads one back (and builds its model); engine/resume.py is what a resume adds.
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

from core import runtime
from core.runtime import Runtime

POINTER = "latest"  # the file in out_dir naming its newest whole sharded step (tools/sharded.py)
TRAIN = "train"  # a sharded step's key for everything but the tensors of the model and optimizer
# DCP says so at every save and load of a process without a process group, which is how one process works here
# (its text: docs/torch_versions.md)
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")



def describe_tokens(meta: dict) -> str:
    chars = meta.get("chars")
    return f"{meta.get('tokenizer')}" + (f", {len(chars)} characters from {''.join(chars[:12])!r}" if chars else "")


@dataclass
class Checkpoint:
    model: dict                          # the full (unsharded) state dict, keyed by parameter name
    model_config: dict                   # GPTConfig's fields
    iter_num: int = 0                    # optimizer steps taken
    best_val_loss: float = math.inf
    train_time_s: float = 0.0            # training time to iter_num, evaluations left out, summed over resumes
    optimizer: Optional[dict] = None     # the full optimizer state dict, keyed by parameter name
    rng: Optional[dict] = None           # every rank's RNG state and the data sampler's generator (train.py;
                                         # None in a nanoGPT checkpoint: a resume starts fresh streams)
    settings: dict = field(default_factory=dict)  # the run's settings
    meta: Optional[dict] = None          # the dataset's meta.json: which tokenizer decodes the model's ids
    attn_decision: Optional[dict] = None  # attn=auto's table and pick, which a resume on the same shapes reuses
    shards: Optional[str] = None         # not saved: the step folder of a sharded checkpoint loaded for training,
                                         # whose model and optimizer state each rank reads in place (restore)

    def save(self, path: Path) -> None:
        """Write it completely or not at all (writing.staged_outputs): a crash or a full disk keeps the previous one."""
        path = Path(path)
        # not asdict (it copies tensors); `shards` says where a loaded one lives, it is not part of the file
        contents = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "shards"}
        from core import writing  # only what trains writes: sample.py reads checkpoints
        with writing.staged_outputs(path.parent, [path.name], what=f"the checkpoint to {path}",
                                  advice="free disk space or pass --out_dir= another folder, then resume") as tmp:
            with open(tmp[path.name], "wb") as f:  # opened here: a folder made read-only is Python's OSError
                torch.save(contents, f)  # its writer refuses a write cut short (writing.CUT_SHORT)


def sharded_folder(path: Path) -> Path | None:
    """The sharded checkpoint to read for `path`: path itself when it is a folder (a step); for out_dir/ckpt.pt, the
    step out_dir/latest names when there is no ckpt.pt or the pointer was written after it (a format switched).
    Where the pointer names no step (empty, not text), the pointer itself: reader.load_checkpoint says what is wrong."""
    pointer = path.parent / POINTER
    if path.is_dir():
        return path if re.fullmatch(r"step-\d+", path.name) else None
    if pointer.is_file() and (not path.is_file() or pointer.stat().st_mtime > path.stat().st_mtime):
        name = pointer.read_bytes().decode("utf-8", errors="replace").strip()
        return path.parent / name if re.fullmatch(r"step-\d+", name) else pointer
    return None


def rng_state(data_generator: torch.Generator, rt: Runtime) -> dict:
    """Every rank's dropout RNG (collective: all ranks call it) and the shared data generator."""
    mine = torch.cat([torch.get_rng_state()] + ([torch.cuda.get_rng_state()] if rt.is_cuda else []))
    per_rank = [mine]
    if rt.is_distributed:
        per_rank = [None] * rt.world_size
        torch.distributed.all_gather_object(per_rank, mine)
    return {"per_rank": per_rank, "data": data_generator.get_state()}


FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)


class SingleFileSaver:
    """ckpt.pt: the full model and optimizer state gathered to rank 0's CPU (collective: every rank calls it, only
    rank 0 receives them, cpu_offload), which writes them."""

    def __init__(self, out: Path, rt: Runtime):
        self.path, self.rt = Path(out) / "ckpt.pt", rt

    def save(self, model: torch.nn.Module, optimizers: list, fields: dict) -> None:
        checkpoint = Checkpoint(model=get_model_state_dict(model, options=FULL_STATE),
                                optimizer=get_optimizer_state_dict(model, optimizers, options=FULL_STATE), **fields)
        # rank 0 writes; if it cannot (a full disk), every rank stops with it rather than wait at the next step
        runtime.on_master(lambda: checkpoint.save(self.path), self.rt.device)
        if self.rt.is_master:
            print(f"saved {self.path} (iter {fields['iter_num']})", flush=True)

    def close(self) -> None:
        pass  # nothing is written after save returns
