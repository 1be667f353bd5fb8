"""
What is on disk, read without torch (preparing data never imports it): a prepared dataset and the cache folder;
core/writing.py writes. A prepared dataset is a folder of train.bin and val.bin (uint16 token ids) and meta.json
naming the tokenizer, or nanoGPT's meta.pkl:
    {"tokenizer": "gpt2", "vocab_size": 50257}
    {"tokenizer": "char", "vocab_size": 65, "chars": ["\\n", " ", "!", ...]}
"""

import json
import os
from pathlib import Path
from typing import Callable

import numpy as np

from core import errors
from core.errors import UserError

TOKEN_DTYPE = np.uint16  # every .bin file holds token ids in this dtype
TOKEN_BYTES = np.dtype(TOKEN_DTYPE).itemsize
GPT2_VOCAB_SIZE = 50257
GPT2_EOT_TOKEN = 50256  # <|endoftext|>: ends each document in GPT-2's data (and in openwebtext's here)


def read_meta(data_dir: Path) -> dict | None:
    """A prepared folder's meta.json, else None: GPT-2 BPE, or nanoGPT's meta.pkl beside (tools/nanogpt.py reads it)."""
    path = Path(data_dir) / "meta.json"
    if path.exists():
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise UserError(f"could not read {path} ({e}); rerun the dataset's prepare.py") from e
        if not isinstance(meta, dict) or "tokenizer" not in meta:
            raise UserError(f"{path} has no \"tokenizer\" entry; rerun the dataset's prepare.py")
        size = meta.get("vocab_size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise UserError(f"{path} has no positive whole \"vocab_size\" (it holds {size!r}); rerun the dataset's "
                            f"prepare.py")
        most = int(np.iinfo(TOKEN_DTYPE).max) + 1
        if size > most:
            raise UserError(f"{path} says vocab_size {size:,}, but train.bin and val.bin hold uint16 ids, at most "
                            f"{most:,} of them; use a tokenizer of at most {most:,} ids (GPT-2's has 50,257).")
        eot = meta.get("eot_token", -1)  # -1: no end-of-text token
        if not isinstance(eot, int) or isinstance(eot, bool) or not -1 <= eot < size:
            raise UserError(f"{path} has an \"eot_token\" that is not a token id below its vocab_size {size}, nor -1 "
                            f"for none (it holds {eot!r}); rerun the dataset's prepare.py")
        chars = meta.get("chars")
        if meta["tokenizer"] == "char" and (not isinstance(chars, list) or len(chars) != size or not all(
                isinstance(c, str) and len(c) == 1 for c in chars)):
            have = f"{len(chars)} characters" if isinstance(chars, list) else f"{chars!r}"
            raise UserError(f"{path} is a character vocabulary of vocab_size {size} but its \"chars\" are {have}, "
                            f"not {size} single characters; rerun the dataset's prepare.py")
        return meta
    return None


def token_file(path: Path, at_least: int = 1, fix: str = "") -> np.memmap:
    """A .bin file's token ids, read in place; a file that is not whole uint16 tokens, or holds fewer than
    `at_least` of them, is one error line (`fix`: what to do about too few, when the caller knows better)."""
    size = path.stat().st_size
    if size % TOKEN_BYTES:
        raise UserError(f"{path} is {size:,} bytes, not a whole number of uint16 tokens; it is truncated or not a "
                        f"token file - prepare the dataset again.")
    if size < at_least * TOKEN_BYTES:
        raise UserError(f"{path} has {size // TOKEN_BYTES:,} tokens, fewer than the {at_least:,} needed; "
                        f"{fix or 'it is truncated or not a token file - prepare the dataset again'}.")
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r")


def eot_token_of(meta: dict | None) -> int:
    """The end-of-text id between a dataset's documents: meta.json's "eot_token", GPT-2's for GPT-2 BPE, else -1."""
    if meta is None:
        return GPT2_EOT_TOKEN
    return int(meta.get("eot_token", GPT2_EOT_TOKEN if meta.get("tokenizer") == "gpt2" else -1))


def cache_folder() -> Path:
    """The project's measurements kept between runs: $XDG_CACHE_HOME (or ~/.cache)/nanogpt-attn/ (attn=auto's
    decisions, the largest token id of each data file read, bench's read bandwidths)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nanogpt-attn"


def read_cache(path: Path, entry_ok: Callable[[object], bool], what: str) -> dict:
    """A JSON cache in the user's cache folder, as far as it can be used; what cannot is left out and printed in one
    line, and the caller measures again."""
    if not path.exists():
        return {}
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        known, problem = None, f"it cannot be read as JSON ({type(e).__name__})"
    else:
        problem = None if isinstance(known, dict) else f"it holds a JSON {type(known).__name__}, not an object"
    usable = {key: entry for key, entry in known.items() if entry_ok(entry)} if problem is None else {}
    if problem is None and len(usable) < len(known):
        problem = f"{len(known) - len(usable)} of its {len(known)} entries are not {what}"
    if problem is not None:
        errors.note(f"{path} is not what this project wrote ({problem}); measuring again, and the file is "
                    f"rewritten with the result.")
    return usable
