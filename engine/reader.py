"""
Reading a checkpoint of this project or nanoGPT's: what sample, export and a resume all call, for every format
(ckpt.pt, a sharded step read through DCP, nanoGPT's ckpt.pt). A sharded resume's tensors are read in place later,
by tools/sharded.py; Hugging Face's files are core/hf.py's.

    model = build_model(load_checkpoint(out_dir / "ckpt.pt"), attn="flash")
"""

import dataclasses
from pathlib import Path

import torch

from core.errors import UserError, note
from engine.checkpoint import POINTER, Checkpoint, sharded_folder
from model import GPT, IMPLEMENTATIONS, GPTConfig

TRAINING_STATE = ("optimizer", "rng")  # what resuming needs beyond the weights and the step


def build_model(checkpoint: Checkpoint, **overrides) -> GPT:
    """The model a checkpoint holds; `overrides` may choose another attention, masks or dropout (model.RUN_FIELDS)."""
    shape = checkpoint.model_config
    if "attn" not in overrides and shape.get("attn") not in IMPLEMENTATIONS:  # every one computes the same
        note(f"the checkpoint was trained with attn={shape.get('attn')!r}, which this version does not have; it is "
             f"read through attn='sdpa' (--attn= picks another).")
        shape = {**shape, "attn": "sdpa"}
    model = GPT(GPTConfig.build(shape, overrides))
    model.load_state_dict(checkpoint.model)
    return model


def describe_checkpoint(path: Path) -> str:
    """A few words on the run a checkpoint holds ('iter 3000, val loss 1.600'), read without loading its tensors;
    'an unreadable checkpoint' when it cannot be read."""
    try:
        contents = read(path, sharded_folder(path), parts=set(), mmap=True)
        return f"iter {int(contents['iter_num'])}, val loss {float(contents['best_val_loss']):.3f}"
    except Exception:
        return "an unreadable checkpoint"


def find_checkpoint(path: Path) -> Path | None:
    """That a checkpoint is at `path`, without reading it (the newer sharded step, if one is), or one error line."""
    shards = sharded_folder(path)
    if not path.is_file() and shards is None:
        if path.is_dir():
            raise UserError(f"{path} is a folder, not a checkpoint file; pass --out_dir= the folder a run wrote its "
                            f"ckpt.pt to.")
        if path.parent.is_file():  # out_dir given as the checkpoint file itself
            raise UserError(f"out_dir {path.parent} is a file; out_dir is the folder that holds ckpt.pt: pass "
                            f"--out_dir={path.parent.parent}.")
        raise UserError(f"no checkpoint at {path}; train one first (python train.py ...) or pass --out_dir= the "
                        f"folder a run wrote its ckpt.pt to.")
    return shards


def load_checkpoint(path: Path, for_training: bool = False, data_dir: Path | None = None) -> Checkpoint:
    """The checkpoint at `path` (ckpt.pt, or out_dir's newer sharded step; a step folder named directly), on the CPU,
    or one error line on why not. `for_training`: it must hold what resuming needs; `data_dir`: where nanoGPT's meta.pkl
    is looked for first."""
    path = Path(path)
    shards = find_checkpoint(path)
    while True:
        try:  # a sharded one for training: each rank reads its tensors in place later (engine/resume.py's restore)
            contents = read(path, shards, parts=set() if for_training else {"model"}, mmap=False)
            break
        except UserError:
            newer = sharded_folder(path) if shards is not None else None
            if newer in (shards, None):
                raise
            shards = newer  # a live run saved a newer step and removed this one meanwhile
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
        from tools import nanogpt  # the conversion is read only for nanoGPT's files
        contents = nanogpt.from_nanogpt(contents, path, for_training, data_dir)
        training_state = ()  # its optimizer state required there; no RNG state: a resume starts fresh streams
    required = ("model_config",) if shards and for_training else (
        ("model", "model_config") + (training_state if for_training else ()))
    missing = [k for k in required if contents.get(k) is None]
    if missing:
        raise UserError(f"{path} has no {', '.join(missing)}; it is not a {'resumable ' if for_training else ''}"
                        f"checkpoint written by train.py.")
    check_shapes(contents, path)
    if isinstance(contents.get("model"), dict):  # a sharded step read for training: restore checks it in place
        check_finite(contents["model"], path)
    unknown = sorted(set(contents["model_config"]) - {f.name for f in dataclasses.fields(GPTConfig)})
    if unknown:  # a newer version's fields: the weights are read as this version's model
        note(f"{path}'s model_config has field(s) this version does not know ({', '.join(unknown)}: a newer "
             f"version's checkpoint?); the model is built without them.")
    known = {f.name for f in dataclasses.fields(Checkpoint)}  # earlier files' `version` field is read no more
    return Checkpoint(**{"model": None, **{k: v for k, v in contents.items() if k in known}},
                      shards=str(shards) if shards and for_training else None)


def check_shapes(contents: dict, path: Path) -> None:
    """A damaged checkpoint is one error line, not a traceback where it is loaded: its model_config must be a model
    GPTConfig accepts, and its weights (a strict load_state_dict on the meta device) and optimizer state (where read)
    must have that model's names and shapes."""
    damaged = f"{path} is damaged: its"
    fix = "restore it from a copy or train again"
    try:  # attention does not change the shape, and an older file may name one this version lacks
        config = GPTConfig.build(dict(contents["model_config"]), {"attn": "sdpa"})
    except (UserError, TypeError, ValueError) as e:
        raise UserError(f"{damaged} model_config is not a model this version can build ({str(e).rstrip('.')}); "
                        f"{fix}.") from None
    with torch.device("meta"):  # shapes only, no memory
        model = GPT(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    weights = contents.get("model")
    if isinstance(weights, dict):
        try:  # names and shapes, torch's own check; nothing is copied onto the meta device (assign)
            model.load_state_dict(weights, assign=True)
        except RuntimeError as e:
            said = str(e).split("\n")[1].strip().rstrip(".")  # the first of torch's findings
            raise UserError(f"{damaged} weights do not fit its model_config ({config.n_layer} layers of width "
                            f"{config.n_embd}; {said[:200]}{'...' if len(said) > 200 else ''}); {fix}.") from None
    state = contents.get("optimizer", {}).get("state", {}) if isinstance(contents.get("optimizer"), dict) else {}
    for name, tensors in state.items():
        misfit = [k for k, t in tensors.items()
                  if torch.is_tensor(t) and t.dim() > 0 and tuple(t.shape) != shapes.get(name)]
        if name not in shapes or misfit:
            raise UserError(f"{damaged} optimizer state does not fit its model ({name}"
                            f"{' ' + misfit[0] if misfit else ''} is not a parameter of that shape); {fix}.")


def check_finite(weights: dict, path, device: str | None = None) -> None:
    """Weights holding NaN or inf are one error line in every reader, not a traceback in sampling or a silent export.
    `device`: the weights are this rank's shards (a sharded resume), and the ranks agree over it."""
    bad = []  # the names of the tensors holding NaN or inf
    for name, tensor in weights.items():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # an FSDP shard: this rank's part
        if torch.is_tensor(local) and local.is_floating_point() and not bool(torch.isfinite(local).all()):
            bad.append(name)
    if device is not None and torch.distributed.is_initialized():  # the ranks agree
        from core.distributed import mean_across_ranks
        if mean_across_ranks(float(len(bad)), device) > 0 and not bad:
            bad = ["a tensor another rank holds"]
    if bad:
        raise UserError(f"{path} holds weights that are not finite (NaN or inf: {bad[0]}"
                        f"{f' and {len(bad) - 1} more' if len(bad) > 1 else ''}), so it can be neither trained on "
                        f"nor sampled from; use an earlier checkpoint.")


def read(path: Path, shards: Path | None, parts: set[str], mmap: bool) -> dict:
    """A checkpoint's contents on the CPU: ckpt.pt's, or a sharded step's TRAIN part and `parts` ('model'), checked
    whole first."""
    if shards is None:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    from tools.sharded import check_step, read_step  # a sharded checkpoint's reader
    check_step(shards, path.parent / POINTER)
    return read_step(shards, parts)
