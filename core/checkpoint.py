"""
The checkpoint format, in one place: what train.py saves and what train.py (resuming), sample.py and the tests
read. Tensors and plain Python types only, so it loads with torch.load(weights_only=True); written to a
temporary file and renamed into place.

    Checkpoint(model=model.state_dict(), model_config=asdict(model.config), iter_num=100, ...).save(path)
    model = Checkpoint.load(out_dir / "ckpt.pt").build_model(attn="flash")
"""

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from core import files
from core.errors import UserError
from model import GPT, GPTConfig
from core.runtime import Runtime

TRAINING_STATE = ("optimizer", "rng")  # what resuming needs beyond the weights and the step
# 1: every file before the version field (the same fields); 2: with it. Older layouts are read through upgrade().
FORMAT_VERSION = 2


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

    def build_model(self, **overrides) -> GPT:
        """The model it holds; `overrides` may choose another attention, masks or dropout (model.RUN_FIELDS)."""
        model = GPT(GPTConfig.build(self.model_config, overrides))
        model.load_state_dict(self.model)
        return model

    def save(self, path: Path) -> None:
        """Write it whole or not at all (files.staged_outputs): a crash or a full disk keeps the previous one."""
        path = Path(path)
        contents = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # not asdict: it copies tensors
        with files.staged_outputs(path.parent, [path.name], what=f"the checkpoint to {path}",
                                  advice="free disk space or pass --out_dir= another folder, then resume") as tmp:
            with open(tmp[path.name], "wb") as f:  # a file object: a full disk is an OSError, not a RuntimeError
                torch.save(contents, f)

    @staticmethod
    def describe(path: Path) -> str:
        """A few words on the run a checkpoint holds ('iter 3000, val loss 1.600'), read without loading its
        tensors; 'an unreadable checkpoint' when it cannot be read."""
        try:
            contents = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            return f"iter {int(contents['iter_num'])}, val loss {float(contents['best_val_loss']):.4g}"
        except Exception:
            return "an unreadable checkpoint"

    @classmethod
    def load(cls, path: Path, for_training: bool = False, data_dir: Path | None = None) -> "Checkpoint":
        """The checkpoint at `path`, on the CPU, or one sentence on why it cannot be read. `for_training`: it
        must also hold the optimizer and RNG state that resuming needs. `data_dir`: the training data, where a
        nanoGPT checkpoint's vocabulary (meta.pkl) is looked for first."""
        path = Path(path)
        if not path.is_file():
            raise UserError(f"no checkpoint at {path}; train one first (python train.py ...) or set out_dir.")
        try:
            contents = torch.load(path, map_location="cpu", weights_only=True)
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
        required = ("model", "model_config") + (training_state if for_training else ())
        missing = [k for k in required if contents.get(k) is None]
        if missing:
            raise UserError(f"{path} has no {', '.join(missing)}; it is not a {'resumable ' if for_training else ''}"
                            f"checkpoint written by train.py.")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in contents.items() if k in known})


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
    if overwrite:
        log.unlink(missing_ok=True)
        return
    if ckpt.exists() or log.exists():
        what = (f"another run's checkpoint ({Checkpoint.describe(ckpt)})" if ckpt.exists()
                else "another run's metrics.jsonl")
        raise UserError(f"{out} already holds {what}; continue it with --init_from=resume, pass another --out_dir=, "
                        f"or replace it with --overwrite=True.")
