"""
Writing files safely, without torch: completely or not at all (staged beside the target and renamed), through a
symlink, to a device or FIFO directly; out_dir's checks and its lock; the cache folder's and a report's JSON.

    with staged_outputs(out_dir, ["train.bin", "val.bin"]) as tmp:
        ids.tofile(tmp["train.bin"])
"""

import contextlib
import errno
import json
import os
import signal
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Sequence

from core import errors
from core.errors import UserError


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
            if isinstance(e, RuntimeError) and any(text in str(e) for text in CUT_SHORT) or \
                    isinstance(e, OSError) and e.errno == errno.EFBIG:  # torch's writer's words, or Python's
                e = OSError(errno.EIO, "the write was cut short: the disk is full, or the file past a size limit")
            if isinstance(e, OSError):  # a read-only folder or a full disk
                kept = [name for name in staged if targets[name][0].exists()]
                kept_text = f"the previous {', '.join(kept)} {'is' if len(kept) == 1 else 'are'} kept" if kept else \
                    "nothing was written" if staged else "what reached it may be partial"
                raise UserError(f"could not write {what or f'to {out_dir}'} ({e.strerror or e}); {kept_text} - "
                                f"{advice}.") from None
            raise
        for path in staged.values():  # the new bytes on disk before they replace the old: a crash keeps one or the
            fsync(path)                # other
        # the renames with Ctrl-C and SIGTERM held back (delivered once they are done): whatever the signals, the
        # files are all old or all new (train.bin, val.bin and meta.json belong together)
        held = signal.pthread_sigmask(signal.SIG_BLOCK, errors.STOP_SIGNALS) if hasattr(signal, "pthread_sigmask") \
            else None
        try:
            for name, path in staged.items():
                os.replace(path, targets[name][0])
        finally:
            if held is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)
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


def check_writable_dir(path: Path, setting: str = "out_dir", fix: str = "", make: bool = False) -> None:
    """That a file can be written in the folder, or, where it is not there yet, in the folder it would be made in,
    before any work is done; `make`: made now (a run that starts). `fix`: what to do instead of passing --setting=
    another folder (a setting from the environment)."""
    path = Path(path)
    try:
        if make:
            path.mkdir(parents=True, exist_ok=True)
        there = next(p for p in (path, *path.absolute().parents) if p.exists())
        if there != path and not there.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(there))
        with tempfile.TemporaryFile(dir=there):  # made and gone at once
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
        try:
            self.file = open(self.path, "a")
        except OSError as e:  # a read-only filesystem or folder; a .lock that is a folder, or a link to nothing
            what = "is a folder" if self.path.is_dir() else "is a link to a path that cannot be made" if \
                self.path.is_symlink() else None
            raise UserError(f"{self.path} {what}, not the run's lock file; remove it, or pass another --out_dir=." if
                            what else f"out_dir {self.out} cannot be written to ({e.strerror or e}): a run writes its "
                            f"lock, log and checkpoints there; pass --out_dir= a writable folder.") from None
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
    do not stop a new run). `describe(ckpt)`: a few words on the checkpoint the error line names."""
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
    check_writable_dir(Path(out_dir), make=True)
    lock = OutDirLock(Path(out_dir))
    try:
        check_out_dir(out_dir, overwrite, describe)
    except UserError:
        lock.release()
        raise
    return lock


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
