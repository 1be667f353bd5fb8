"""
What is on disk, and writing it safely, without torch (preparing data never imports it). A prepared dataset is a
folder of train.bin and val.bin (uint16 token ids) and meta.json naming the tokenizer, or nanoGPT's meta.pkl:
    {"tokenizer": "gpt2", "vocab_size": 50257}
    {"tokenizer": "char", "vocab_size": 65, "chars": ["\\n", " ", "!", ...]}
"""

import contextlib
import errno
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Sequence

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


# -- writing safely -----------------------------------------------------------------------------------

def written_as(path: Path) -> tuple[Path, bool]:
    """Where a write of `path` lands, and whether it is a stream: a symlink is written through (its target, which the
    write replaces), and an existing device, FIFO or socket (/dev/stdout, a named pipe) is written to directly,
    never renamed over."""
    try:
        mode = os.stat(path).st_mode  # through any links
    except OSError:  # nothing there yet (or a link to nothing): its target is made
        mode = None
    if mode is not None and not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        return Path(path), True
    return Path(os.path.realpath(path)), False


# what torch.save's zip writer raises where the file takes fewer bytes than it writes, at any byte: its position check,
# or near the end its stream's own error (docs/torch_versions.md)
CUT_SHORT = ("unexpected pos", "iostream error")


@contextlib.contextmanager
def staged_outputs(out_dir: Path, names: Sequence[str], what: str = "",
                   advice: str = "pass --out_dir= a writable folder with free space") -> Iterator[dict[str, Path]]:
    """How a file is written completely or not at all (checkpoints, prepared data, reports, caches, a log's first
    line; metrics.jsonl's later lines are appended, and export_hf.py stages a whole folder): temporary paths of this
    process's own to write, beside each file (a symlink's target: written_as), renamed over it only when the block
    finishes without an error, so a crash, a full disk or a second writer at once keeps the previous files intact.
    A device or FIFO is written to directly. A failure is one error line."""
    out_dir = Path(out_dir)
    targets = {name: written_as(out_dir / name) for name in names}
    tmp = {name: target if stream else target.with_name(f"{target.name}.{os.getpid()}.tmp")  # two writers: two names
           for name, (target, stream) in targets.items()}
    staged = {name: path for name, path in tmp.items() if not targets[name][1]}
    # a Ctrl-C or SIGTERM in the block is noted and raised once the block's writes end, before any rename and once the
    # temporary files are removed; a second one ends the process at once
    with errors.deferred_signals() as stop:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            yield tmp
            for path in staged.values():
                if not path.exists():
                    raise RuntimeError(f"staged output {path} was never written")
            if stop.pending is not None:
                raise stop.pending
        except BaseException as e:  # still inside deferred_signals: a Ctrl-C now is noted, not raised mid-cleanup
            for path in staged.values():
                with contextlib.suppress(OSError):  # keep the original error, not one from the cleanup
                    path.unlink(missing_ok=True)
            if isinstance(e, RuntimeError) and any(text in str(e) for text in CUT_SHORT):
                e = OSError(errno.EIO, "the write was cut short: the disk is full, or the file past a size limit")
            if isinstance(e, OSError):  # a read-only folder or a full disk
                kept = [name for name in staged if targets[name][0].exists()]
                kept_text = f"the previous {', '.join(kept)} {'is' if len(kept) == 1 else 'are'} kept" if kept else \
                    "nothing was written" if staged else "what reached it may be partial"
                raise UserError(f"could not write {what or f'to {out_dir}'} ({e.strerror or e}); {kept_text} - "
                                f"{advice}.") from None
            raise
        for name, path in staged.items():  # a signal from here on is raised once the new files are in place
            fsync(path)  # the new bytes on disk before they replace the old: a node crash keeps one or the other
            os.replace(path, targets[name][0])
        for folder in {targets[name][0].parent for name in staged}:
            fsync(folder)  # and the renames


def fsync(path: Path) -> None:
    """fsync a written file, or a folder's entries; a filesystem that cannot (some FUSE mounts) is left as it is."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def check_writable_file(path: Path, setting: str) -> None:
    """A file a script writes at its end, checked before any work: a path that is no folder, in a writable one (a
    symlink's target's), or a device or FIFO this process may write to."""
    if path.is_dir():
        raise UserError(f"{setting} {path} is a folder; pass --{setting}= a file path, such as {path / 'out.json'}.")
    target, stream = written_as(path)
    if stream and not os.access(target, os.W_OK):
        raise UserError(f"{setting} {path} cannot be written to (no permission); pass --{setting}= a writable path.")
    if not stream:
        check_writable_dir(target.parent, setting)


def check_writable_dir(path: Path, setting: str = "out_dir", fix: str = "") -> None:
    """Create the folder if needed and make sure a file can be written in it, before any work is done. `fix`: what
    to do instead of passing --setting= another folder (a setting from the environment)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        what = "is a file, not a folder" if path.is_file() else f"cannot be written to ({e.strerror or e})"
        wanted = "a writable folder" if setting.endswith("dir") else "a path in a writable folder"
        raise UserError(f"{setting} {path} {what}; {fix or f'pass --{setting}= {wanted}'}.") from None


class OutDirLock:
    """One run per out_dir: flock on out_dir/.lock (an empty file) for the run's life, released by the OS when the
    process dies. The file always stays: a lock on a file another run had already unlinked would be no lock. Readers
    take none: a checkpoint is renamed into place once it is complete."""

    def __init__(self, out_dir: Path):
        import fcntl
        self.out, self.path = Path(out_dir), Path(out_dir) / ".lock"
        self.file = open(self.path, "a")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.close()
            raise UserError(f"{self.out} is in use by another run; wait for it to finish, or pass another "
                            f"--out_dir=.") from None
        except OSError as e:  # a shared filesystem without flock (Lustre without -o flock, some NFS)
            if e.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOLCK):
                raise
            errors.note(f"{self.out}'s filesystem has no file locks ({e.strerror}); this run goes on unlocked, so "
                        f"start no other run on this out_dir until it ends.")

    def release(self) -> None:
        self.file.close()  # closing the file drops the lock


def check_out_dir(out_dir: str, overwrite: bool, describe: Callable[[Path], str]) -> None:
    """A new run's out_dir, before anything is written: a folder (or one to make) that can be written, and, unless
    --overwrite=True, holding no other run's checkpoint (a log and a .lock alone, a run stopped before its first save,
    are no reason to refuse). `describe(ckpt)`: a few words on the checkpoint the error line names."""
    if not str(out_dir):
        raise UserError("out_dir is empty (an unset shell variable?); pass --out_dir= a folder name.")
    out = Path(out_dir)
    if (out / "ckpt.pt").exists() or (out / "latest").is_file():  # ckpt.pt, or the pointer to a sharded step
        if not overwrite:
            raise UserError(f"{out} already holds another run's checkpoint ({describe(out / 'ckpt.pt')}); continue "
                            f"it with --init_from=resume, pass another --out_dir=, or replace it with "
                            f"--overwrite=True.")
    there = next(p for p in (out, *out.absolute().parents) if p.exists())  # the folder to write in, or to make
    if not there.is_dir() or not os.access(there, os.W_OK | os.X_OK):
        what = "is a file, not a folder" if there == out else f"cannot be written to ({there} is not a writable folder)"
        raise UserError(f"out_dir {out} {what}; pass --out_dir= a writable folder.")


def lock_out_dir(out_dir: str, overwrite: bool, describe: Callable[[Path], str]) -> OutDirLock:
    """A new run's out_dir, made and locked once every check has passed; checked again under the lock, for a run
    that took it meanwhile (the old log is replaced at the new run's first line, an old checkpoint at its first save:
    a run stopped before then leaves both as they were)."""
    check_writable_dir(Path(out_dir))
    lock = OutDirLock(Path(out_dir))
    try:
        check_out_dir(out_dir, overwrite, describe)
    except UserError:
        lock.release()
        raise
    return lock


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


def write_cache(path: Path, entries: dict) -> None:
    """Write a cache read_cache reads; a read-only home keeps the result in memory only."""
    with contextlib.suppress(UserError):
        with staged_outputs(path.parent, [path.name]) as tmp:
            tmp[path.name].write_text(json.dumps(entries, indent=1))


def write_json(path: Path, contents: dict, setting: str) -> None:
    """A report written completely or not at all (sample's --json, time_to_loss's), or to a device or FIFO directly;
    a failure names the setting to change."""
    path = Path(path)
    with staged_outputs(path.parent, [path.name], what=str(path), advice=f"pass --{setting}= a writable path") as tmp:
        tmp[path.name].write_text(json.dumps(contents, indent=1) + "\n")
