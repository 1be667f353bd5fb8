"""
nanoGPT's checkpoints read as this project's, so an out_dir written by karpathy/nanoGPT resumes and samples here:
`model` (with `_orig_mod.` prefixes when compiled, older files with `attn.bias` buffers), AdamW's `optimizer`
state by parameter number, `model_args`, and the vocabulary in meta.pkl.
"""

import dataclasses
import pickle
import shutil
from collections import Counter
from pathlib import Path

from core import writing
from core.files import GPT2_VOCAB_SIZE
from core.errors import UserError
from model import GPTConfig

NANOGPT_PADDED_VOCAB = 50304  # nanoGPT's default for GPT-2 BPE: 50257 rounded up to a multiple of 64
COMPILED_PREFIX = "_orig_mod."  # what torch.compile's wrapper puts before every key


def from_nanogpt(contents: dict, path: Path, for_training: bool = False, data_dir: Path | None = None) -> dict:
    """A Checkpoint's fields for nanoGPT's `contents`; only a resume (`for_training`) converts the optimizer state.
    `data_dir`: where its meta.pkl is looked for first."""
    args = contents["model_args"]
    meta = nanogpt_meta(path.parent, contents.get("config") or {}, args["vocab_size"], path, data_dir)
    # nanoGPT's 50304 rows are GPT-2's 50257 padded: here the padding is a switch, and padded ids get a -inf
    # logit (never sampled), where nanoGPT leaves them trainable; the 50257 real logits are the same
    padded = args["vocab_size"] == NANOGPT_PADDED_VOCAB and meta["tokenizer"] == "gpt2"
    shape = {**args, "vocab_size": GPT2_VOCAB_SIZE if padded else args["vocab_size"], "pad_vocab": padded,
             "gelu": "none"}  # nanoGPT's nn.GELU() is the exact (erf) one
    config = GPTConfig.build(shape, {"dropout": args.get("dropout", 0.0)})
    model_state = nanogpt_model_state(contents["model"])
    optimizer = contents.get("optimizer") if for_training else None
    if for_training and optimizer is None:
        raise UserError(f"{path} is a nanoGPT checkpoint without optimizer state; it samples, but only one with its "
                        f"optimizer resumes.")
    return dict(model=model_state, model_config=dataclasses.asdict(config), iter_num=int(contents.get("iter_num", 0)),
                best_val_loss=float(contents.get("best_val_loss", float("inf"))),
                optimizer=named_optimizer_state(optimizer, model_state, path) if optimizer else None,
                rng=None, settings=dict(contents.get("config") or {}), meta=meta)


def keep_original(path: Path) -> None:
    """Keep nanoGPT's ckpt.pt beside the file this run saves over it, as ckpt.nanogpt.pt (written completely); train.py
    calls it on rank 0, before its first save."""
    kept = path.with_name("ckpt.nanogpt.pt")
    if kept.exists():
        return
    with writing.staged_outputs(path.parent, [kept.name], what=str(kept)) as tmp:
        shutil.copy2(path, tmp[kept.name])
    print(f"nanoGPT's original checkpoint is kept as {kept}")


def nanogpt_model_state(state: dict) -> dict:
    """nanoGPT's state dict without the compile prefix and the causal-mask buffers."""
    out = {}
    for key, tensor in state.items():
        key = key.removeprefix(COMPILED_PREFIX)
        if key.endswith(".attn.bias"):  # the (1, 1, T, T) mask buffer; the attention's own bias is c_attn.bias
            continue
        out[key] = tensor
    return out


def named_optimizer_state(state: dict, model_state: dict, path: Path) -> dict:
    """AdamW's state keyed by parameter number -> by name. nanoGPT numbers the >= 2-D parameters, then the rest, each in
    named_parameters order, without lm_head.weight (tied to the embedding)."""
    params = {name: tensor for name, tensor in model_state.items() if name != "lm_head.weight"}
    order = [n for n, p in params.items() if p.dim() >= 2] + [n for n, p in params.items() if p.dim() < 2]
    if not is_numbered_optimizer_state(state, len(order)):
        raise UserError(f"{path}'s optimizer state is not AdamW's as nanoGPT's configure_optimizers writes it "
                        f"({len(order)} parameters numbered 0-{len(order) - 1} in param_groups); it samples and "
                        f"exports, but does not resume.")
    groups = [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]
    return {"state": {order[i]: s for i, s in state["state"].items()}, "param_groups": groups}


def is_numbered_optimizer_state(state, count: int) -> bool:
    """A torch optimizer state dict whose groups number `count` parameters 0..count-1, state keyed by those numbers."""
    if not isinstance(state, dict) or not isinstance(state.get("param_groups"), list) or not isinstance(
            state.get("state"), dict):
        return False
    groups = state["param_groups"]
    if not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        return False
    numbers = [i for g in groups for i in g["params"]]
    return sorted(numbers) == list(range(count)) and all(i in range(count) for i in state["state"])


def nanogpt_meta(folder: Path, config: dict, vocab_size: int, path: Path, data_dir: Path | None = None) -> dict:
    """The vocabulary of a nanoGPT run: the meta.pkl in data_dir, beside ckpt.pt, in data/<dataset>/ or the nanoGPT
    checkout around out_dir; else GPT-2 BPE for a GPT-2-sized vocabulary."""
    dataset = str(config.get("dataset", ""))
    candidates = ([Path(data_dir) / "meta.pkl"] if data_dir else []) + [folder / "meta.pkl"]
    if dataset:
        candidates += [Path("data") / dataset / "meta.pkl", folder.parent / "data" / dataset / "meta.pkl"]
    found = next((p for p in candidates if p.is_file()), None)
    if found is not None:  # data_dir: the folder the run trained on, whose val.bin sample.py --compare reads
        return {**read_nanogpt_meta(found), "data_dir": str(found.parent)}
    if vocab_size in (GPT2_VOCAB_SIZE, NANOGPT_PADDED_VOCAB):  # its data folder unknown
        return {"tokenizer": "gpt2", "vocab_size": GPT2_VOCAB_SIZE, "data_dir": str(data_dir) if data_dir else None}
    raise UserError(f"{path} is a nanoGPT model with a {vocab_size}-token vocabulary and no meta.pkl was found "
                    f"({', '.join(str(p) for p in candidates)}); copy its data folder's meta.pkl next to ckpt.pt "
                    f"(train.py also reads it from --data_dir).")


def read_nanogpt_meta(path: Path) -> dict:
    """nanoGPT's meta.pkl ({'vocab_size', 'itos', 'stoi'} of a character vocabulary) as this project's meta."""
    meta = read_plain_pickle(path)
    itos = meta.get("itos") if isinstance(meta, dict) else None
    size = meta.get("vocab_size") if isinstance(meta, dict) else None
    if not isinstance(itos, dict) or sorted(itos) != list(range(len(itos))) or size != len(itos) or not all(
            isinstance(c, str) and len(c) == 1 for c in itos.values()):
        raise UserError(f"{path} is not a nanoGPT character meta.pkl (vocab_size and an itos of ids 0..n-1 to single "
                        f"characters); copy the one from the run's data folder.")
    chars = [itos[i] for i in range(size)]
    repeated = [c for c, count in Counter(chars).items() if count > 1]
    if repeated:
        raise UserError(f"{path} gives the character {repeated[0]!r} more than one id, and a character vocabulary "
                        f"holds each character once; copy the meta.pkl from the run's data folder.")
    return {"tokenizer": "char", "vocab_size": size, "chars": chars}


class _PlainUnpickler(pickle.Unpickler):
    """Refuses every import request, so nothing in the file can run: only what pickle makes without a class."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"refers to {module}.{name}")


def read_plain_pickle(path: Path):
    """A pickle of plain dicts, lists, strings and ints, read without executing anything; else one error line."""
    try:
        with open(path, "rb") as f:
            value = _PlainUnpickler(f).load()
        plain = _is_plain(value)
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, RecursionError) as e:
        raise UserError(f"{path} is refused: it is not a pickle of plain dicts, lists, strings and ints "
                        f"({type(e).__name__ if isinstance(e, RecursionError) else e}: nested too deep to be a "
                        f"meta.pkl); nothing in it was run." if isinstance(e, RecursionError) else
                        f"{path} is refused: it is not a pickle of plain dicts, lists, strings and ints ({e}); "
                        f"nothing in it was run.") from None
    if not plain:
        raise UserError(f"{path} is refused: it holds types other than dicts, lists, strings and ints.")
    return value


def _is_plain(value) -> bool:
    if isinstance(value, dict):
        return all(_is_plain(k) and _is_plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_is_plain(v) for v in value)
    return isinstance(value, (str, int))
