"""
The prepared data a training run reads: finding a dataset (preparing an embedded one on first use), checking its
files once, and drawing the batches.

    batches = Batches(dataset_dir("", "shakespeare_char"), block_size=256, batch_size=64, seed=1337)
    x, y = batches.micro_batches("train", 1)[0]          # (B, T) each
"""

import difflib
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from core.errors import UserError, problems_of, refuse_all
from core.files import TOKEN_BYTES, TOKEN_DTYPE, cache_folder, read_cache, token_file

DATA = Path(__file__).resolve().parent.parent / "data"
EMBEDDED_DATASETS = {"shakespeare_char", "shakespeare"}  # prepared offline from packaged text, automatically
NO_END_OF_TEXT = {"shakespeare_char"}  # datasets whose vocabulary has no end-of-text token (characters only)


def dataset_dir(data_dir: str, name: str) -> Path:
    """The folder the run reads: data_dir when given (it must exist), else data/<name> of a known dataset."""
    if data_dir:
        if not Path(data_dir).is_dir():
            what = "is a file, not a folder" if Path(data_dir).exists() else "does not exist"
            raise UserError(f"data_dir {data_dir} {what}; pass --data_dir= the folder that holds "
                            f"train.bin and val.bin.")
        return Path(data_dir)
    if Path(name).name != name or name in ("", ".", ".."):  # a folder elsewhere is a data_dir, never prepared
        raise UserError(f"dataset {name!r} is not the name of a folder in data/; pass --dataset= such a name, or "
                        f"--data_dir= the folder that holds train.bin and val.bin.")
    if not (DATA / name / "prepare.py").exists() and not (DATA / name / "train.bin").exists():
        known = sorted({p.parent.name for pattern in ("*/prepare.py", "*/train.bin") for p in DATA.glob(pattern)})
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean --dataset={close[0]}? The datasets are" if close else "use one of"
        raise UserError(f"unknown dataset '{name}' (no data/{name}/); {hint} {', '.join(known)}, "
                        f"or --data_dir= a folder with train.bin and val.bin.")
    return DATA / name


def prepare_if_missing(data_dir: Path, name: str, check_only: bool = False) -> None:
    """Prepare an embedded dataset into its own folder when that folder holds neither split (a meta.json alone is
    what preparing writes again); a split there and a data_dir are never written over. `check_only`: say whether it
    could be, and prepare nothing."""
    missing = [f for f in ("train.bin", "val.bin") if not (data_dir / f).exists()]
    if not missing or data_dir != DATA / name:
        return
    if name not in EMBEDDED_DATASETS or len(missing) < 2:
        raise UserError(f"dataset '{name}' is not prepared (data/{name}/{missing[0]} is missing); "
                        f"run: python data/{name}/prepare.py")
    elsewhere = (f"prepare it elsewhere with python data/{name}/prepare.py --out_dir=DIR and pass --data_dir=DIR")
    if not os.access(data_dir, os.W_OK):
        raise UserError(f"dataset '{name}' is not prepared and data/{name}/ cannot be written to; {elsewhere}.")
    if check_only:
        return
    print(f"preparing {name} (data/{name}/prepare.py) ...", flush=True)
    done = subprocess.run([sys.executable, str(data_dir / "prepare.py"), f"--out_dir={data_dir}"],
                          stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:  # its one error line, printed as ours
        last_line = next((line for line in reversed(done.stderr.splitlines()) if line.strip()), "no message")
        raise UserError(f"preparing dataset '{name}' failed ({last_line.removeprefix('error: ')}); {elsewhere}, or run "
                        f"python data/{name}/prepare.py to see why.")


def max_token_id(path: Path, known: dict) -> int:
    """The largest id in a token file, read through once and then remembered (`known`: the cache folder's entries)
    by its path, size, inode and change times: OpenWebText's 17 GB are not read again at every start and resume. A file
    rewritten since, even to its old size and modification time (cp -p, tar, rsync -t), has a new change time
    (st_ctime, which no user call sets), and is read again."""
    stat = path.stat()
    key = f"{path.resolve()}, {stat.st_size} bytes, inode {stat.st_ino}, mtime {stat.st_mtime_ns}, ctime " \
          f"{stat.st_ctime_ns}"
    if key not in known:
        known[key] = scan_max_token_id(path)
    return known[key]


def scan_max_token_id(path: Path, chunk: int = 1 << 26) -> int:
    """The largest id in a token file, read in chunks (128 MB each) so no split is ever held whole in memory."""
    data = np.memmap(path, dtype=TOKEN_DTYPE, mode="r")
    return max((int(data[i:i + chunk].max()) for i in range(0, len(data), chunk)), default=-1)


def check_token_files(data_dir: Path, vocab_size: int, block_size: int, remember: bool = True,
                      recorded: dict | None = None) -> None:
    """When the data is opened: both splits exist, hold whole uint16 tokens, more than block_size of them, only ids
    the model has embeddings for (each file read through once, max_token_id), and the largest id meta.json recorded
    when it was written with them (`recorded`: a folder whose files come from two preparations is named); the problems
    of both, together. `remember`: the ids read go to the cache folder where both files pass (a command that stops
    with an error writes nothing)."""
    cache = cache_folder() / "token_ids.json"
    known = read_cache(cache, lambda v: isinstance(v, int) and not isinstance(v, bool), "token ids")
    remembered = dict(known)

    def check(path: Path) -> None:
        if not path.is_file():
            what = "is a folder, not a token file" if path.is_dir() else "is missing"
            raise UserError(f"{path} {what}; a dataset folder needs train.bin and val.bin "
                            f"(python data/<name>/prepare.py writes both).")
        token_file(path, at_least=block_size + 1, fix=f"block_size={block_size} takes {block_size + 1} a sequence: "
                                                   f"use a smaller block_size or more data")
        top, written = max_token_id(path, known), (recorded or {}).get(path.name, None)
        if isinstance(written, int) and top != written:
            raise UserError(f"{path}'s largest token id is {top}, but the meta.json written with it records {written}: "
                            f"the folder holds files of two preparations, or the file changed since; prepare the "
                            f"dataset again.")
        if top >= vocab_size:
            raise UserError(f"{path} holds token id {top} but the model's vocabulary has {vocab_size} ids "
                            f"(0-{vocab_size - 1}); the data was tokenized for another vocabulary - check its "
                            f"meta.json (or nanoGPT's meta.pkl) or prepare the data again.")
    problems = [p for split in ("train", "val") for p in problems_of(lambda: check(data_dir / f"{split}.bin"))]
    refuse_all(problems)
    if remember and known != remembered:
        from core.writing import write_cache  # only a file read for the first time is remembered
        write_cache(cache, known)


def read_windows(path, offsets: list[int], block_size: int) -> torch.Tensor:
    """(len(offsets), block_size + 1) token ids starting at each offset: inputs and targets in one read (`path`: a
    file's path, or the file itself, open)."""
    # a fresh memmap per read: a long-lived one grows resident memory (numpy keeps pages)
    data = np.memmap(path, dtype=TOKEN_DTYPE, mode="r")
    return torch.stack([torch.from_numpy(data[i:i + 1 + block_size].astype(np.int64)) for i in offsets])


class Batches:
    """Random windows of a token file. One generator, seeded alike on every rank, draws the whole global batch and each
    rank takes its share: N ranks see what one process with N times the accumulation sees. The two token files are
    opened once (`opened`: another Batches' own, an evaluation's) and read through the open files for the run's life:
    a prepare that replaces them meanwhile renames new files over the names, and this run reads what it checked."""

    def __init__(self, data_dir: Path, block_size: int, batch_size: int, seed: int, opened: dict | None = None):
        self.data_dir, self.block_size, self.batch_size = data_dir, block_size, batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.opened = opened or {split: open(Path(data_dir) / f"{split}.bin", "rb") for split in ("train", "val")}

    def tokens(self, split: str) -> int:
        return os.fstat(self.opened[split].fileno()).st_size // TOKEN_BYTES

    def windows(self, split: str, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        windows = read_windows(self.opened[split], offsets.tolist(), self.block_size)  # (B, T + 1)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()  # (B, T) each, targets shifted by one

    def micro_batches(self, split: str, micro_steps: int, rank: int = 0, world_size: int = 1,
                      lazy: bool = False) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's share of one optimizer step's global batch: micro_steps pairs (x, y), each (B, T); `lazy`:
        a generator, each read when it is reached (an evaluation's many batches); else a list."""
        high = self.tokens(split) - self.block_size  # >= 1: check_token_files made sure
        offsets = torch.randint(high, (micro_steps * world_size, self.batch_size), generator=self.generator)
        mine = offsets[rank * micro_steps:(rank + 1) * micro_steps]  # (micro_steps, B)
        pairs = (self.windows(split, row) for row in mine)
        return pairs if lazy else list(pairs)
