"""
nanoGPT's meta.pkl, the vocabulary of its character datasets, read as this project's meta.json would be - without
running any code, and without torch (preparing and reading data never imports it).
"""

import pickle
from collections import Counter
from pathlib import Path

from core.errors import UserError


def read_nanogpt_meta(path: Path) -> dict:
    """nanoGPT's meta.pkl ({'vocab_size', 'itos', 'stoi'} of a character vocabulary), read without running any code,
    as this project's character meta."""
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
    """Builds only what pickle makes without naming a class or function: every import request is refused, so
    nothing in the file can run."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"refers to {module}.{name}")


def read_plain_pickle(path: Path):
    """A pickle of plain dicts, lists, strings and ints, read without executing anything; anything else is refused
    in one sentence."""
    try:
        with open(path, "rb") as f:
            value = _PlainUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError) as e:
        raise UserError(f"{path} is refused: it is not a pickle of plain dicts, lists, strings and ints ({e}); "
                        f"nothing in it was run.") from None
    if not is_plain(value):
        raise UserError(f"{path} is refused: it holds types other than dicts, lists, strings and ints.")
    return value


def is_plain(value) -> bool:
    if isinstance(value, dict):
        return all(is_plain(k) and is_plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(is_plain(v) for v in value)
    return isinstance(value, (str, int))
