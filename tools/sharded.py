"""
Sharded checkpoints (checkpoint_format='sharded'): DCP writes each rank's part, nothing gathered, resharded on
reading. Only the folder `latest` names is read, so a save killed half-way leaves the previous step loadable:

    out_dir/step-000500/   DCP's files, one per rank, and .metadata (written last)
    out_dir/latest         the newest complete step's name, replaced only once a save is complete
"""

import pickle
import re
import shutil
import threading
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
# private API, read again at each release (docs/torch_versions.md)
from torch.distributed.checkpoint._traverse import set_element  # what DCP's own planner sets an entry with
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, set_model_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from core import writing
from core import runtime
from engine.checkpoint import POINTER, TRAIN, sharded_folder
from core import errors
from core.errors import UserError
from core.runtime import Runtime

# -----------------------------------------------------------------------------
# a sharded checkpoint's folders

def step_folder(out: Path, iter_num: int) -> Path:
    return Path(out) / f"step-{iter_num:06d}"


def steps_in(out: Path) -> dict[int, Path]:
    """out_dir's step folders, complete or not, by step."""
    found = {}
    for path in Path(out).glob("step-*"):
        if match := re.fullmatch(r"step-(\d+)", path.name):
            found[int(match[1])] = path
    return found


def is_whole(folder: Path) -> bool:
    """DCP renames .metadata into place after every rank's files are written: its presence means a whole save."""
    return (folder / ".metadata").is_file()


def os_cause(error: BaseException) -> str:
    """The OSError under a failed write (a full disk, a file size limit), not PyTorch's text on top of it (DCP's
    texts: docs/torch_versions.md)."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        seen = seen.__cause__ or seen.__context__
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    if any(cut in text for cut in writing.CUT_SHORT):  # torch.save's writer inside DCP's, as in a single-file save
        return "a shard was cut short: the disk is full or the file size limit (ulimit -f) was reached"
    return text


def interruption(error: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C or SIGTERM (errors.Terminated) a failed save was, directly or in DCP's per-rank failures."""
    failures = getattr(error, "failures", None) or {0: (error, None)}
    return next((e for e, _ in failures.values() if isinstance(e, KeyboardInterrupt)), None)


def failure_text(error: BaseException, folder: Path) -> str:
    failures = getattr(error, "failures", None) or {0: (error, None)}  # DCP's CheckpointException: every rank's
    ranks = "; ".join(f"rank {r}: {os_cause(e)}" for r, (e, _) in sorted(failures.items()))
    return (f"could not write the checkpoint {folder} ({ranks}); the previous one ({folder.parent / POINTER}) is "
            f"kept - free disk space, raise the file size limit or pass --out_dir= another folder, then resume.")


class ShardedSaver:
    """train.py's sharded saves: every rank writes its shards, then rank 0 points `latest` at the step. async_save
    writes a CPU copy in a thread, its collectives on a gloo group of their own; the next save waits for it."""

    def __init__(self, out: Path, keep: int, use_async: bool, rt: Runtime):
        self.out, self.keep, self.use_async, self.rt = Path(out), keep, use_async, rt
        self.group = torch.distributed.new_group(backend="gloo") if use_async and rt.is_distributed else None
        self.written = threading.Event()  # the write in flight is done (and committed, or its failure recorded)
        self.written.set()
        self.failure: str | None = None

    def save(self, model: torch.nn.Module, optimizers: list, fields: dict) -> None:
        """Save a step (collective); `fields` are the Checkpoint's other fields."""
        self.written.wait()  # one write at a time
        folder = step_folder(self.out, fields["iter_num"])
        runtime.on_master(lambda: self.prepare(folder), self.rt.device)
        state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizers),
                 TRAIN: fields}
        if not self.use_async:
            try:
                # a signal is noted and raised once DCP returns: raised inside DCP's stream write, torch.save turns
                # it into 'unexpected pos', which would read as a full disk
                with errors.deferred_signals():
                    dcp.save(state, checkpoint_id=folder)
            except (CheckpointException, KeyboardInterrupt) as e:
                # DCP's failures reach every rank alike; a signal reaches each rank at its own point (torchrun sends
                # it to all), so the step is never committed: the pointer still names the previous whole step
                stop = interruption(e)
                if stop is None:
                    raise UserError(failure_text(e, folder)) from None
                shutil.rmtree(folder, ignore_errors=True)  # Ctrl-C or SIGTERM: no half-written step stays
                raise stop from None
            runtime.on_master(lambda: self.commit(fields["iter_num"]), self.rt.device)
            return
        self.written.clear()
        try:
            future = dcp.async_save(state, checkpoint_id=folder, process_group=self.group)
        except BaseException:  # failed while copying to the CPU: nothing in flight to wait for
            self.written.set()
            raise
        future.add_done_callback(lambda done: self.finished(done, fields["iter_num"]))

    def finished(self, done: Future, step: int) -> None:
        """In DCP's writer thread: rank 0 commits a whole save; a failure waits for the next save or the end."""
        folder = step_folder(self.out, step)
        try:
            if done.exception() is not None:
                self.failure = failure_text(done.exception(), folder)
            elif self.rt.is_master:
                self.commit(step)
        except UserError as e:
            self.failure = str(e)
        finally:
            self.written.set()

    def prepare(self, folder: Path) -> None:
        """Rank 0, before a save: stop on an earlier async save's failure, and clear what a killed or replaced run left
        at this step."""
        failure, self.failure = self.failure, None
        if failure:
            raise UserError(failure)
        if folder.exists():
            if sharded_folder(self.out / "ckpt.pt") == folder:  # the step readers would take
                (self.out / POINTER).unlink()
            shutil.rmtree(folder)

    def commit(self, step: int) -> None:
        """Rank 0, once a save is complete: point `latest` at it, then keep the newest `keep` complete steps up to it (later
        steps and unfinished folders go)."""
        folder = step_folder(self.out, step)
        with writing.staged_outputs(self.out, [POINTER], what=f"the pointer to {folder}",
                                  advice="free disk space, then resume") as tmp:
            tmp[POINTER].write_text(folder.name)
        print(f"saved {folder} (iter {step}; {self.out / POINTER} names it)", flush=True)
        steps = steps_in(self.out)
        kept = [n for n in sorted(steps) if n <= step and is_whole(steps[n])][-self.keep:]
        for n, old in steps.items():
            if n not in kept and n != step:
                shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        """The end of the run: wait for a write in flight; rank 0 says if it failed."""
        self.written.wait()
        if self.failure and self.rt.is_master:
            raise UserError(self.failure)


# -----------------------------------------------------------------------------
# a sharded step, as DCP wrote it

def check_step(folder: Path, pointer: Path) -> None:
    """One error line, if the step to read is not complete: what is wrong with the pointer or the folder, and what
    can be read instead (fallback)."""
    if folder == pointer:  # sharded_folder: the pointer names no step
        held = pointer.read_bytes()
        text = held.decode("utf-8", errors="replace").strip()
        what = ("is empty" if not text else "holds no text (binary bytes)" if "\ufffd" in text
                else f"holds {text[:40]!r}, not a step folder's name")
        raise UserError(f"{pointer} {what}; {fallback(pointer.parent)}")
    if not folder.is_dir():
        raise UserError(f"{pointer} names {folder.name}, which is not in {folder.parent}; {fallback(folder.parent)}")
    if not is_whole(folder):
        raise UserError(f"{folder} has no .metadata (its save never finished, or the file was lost); "
                        f"{fallback(folder.parent, folder)}")


def fallback(out: Path, failed: Path | None = None) -> str:
    """What can be read instead of a damaged step: the newest whole one before it (named, and how to point at it),
    else a fresh run. Nothing is deleted: the damaged files are the user's to keep or remove."""
    step = int(failed.name.removeprefix("step-")) if failed is not None else None
    whole = [f for n, f in sorted(steps_in(out).items()) if f != failed and is_whole(f) and (step is None or n < step)]
    if whole:
        return (f"the newest whole step{' before it' if failed else ''} is {whole[-1]}: point {out / POINTER} at it "
                f"(echo {whole[-1].name} > {out / POINTER}) and run again")
    return f"no whole step is left in {out}: start a fresh run there with --overwrite=True, or pass another --out_dir="


def unreadable(folder: Path, error: BaseException) -> UserError:
    """DCP's CheckpointException (a BaseException holding each rank's error) as the error line of a damaged step."""
    failures = getattr(error, "failures", None)
    cause = next(iter(failures.values()))[0] if failures else error
    reason = str(cause).strip().splitlines()[0][:160] if str(cause).strip() else ""
    return UserError(f"{folder}'s shards cannot be read ({type(cause).__name__}{': ' + reason if reason else ''}); "
                     f"{fallback(folder.parent, folder)}")


# -----------------------------------------------------------------------------
# reading without running code: DCP unpickles a step's .metadata and loads its non-tensor entries with
# weights_only=False, so a crafted step could run a command when read. These read both with an allow-list, as
# torch.load(weights_only=True) reads ckpt.pt.

# exactly the (module, name) pairs DCP's .metadata names (torch 2.11-2.13), nothing under them: a protocol-4 pickle
# resolves a dotted name ('os.system') through what an admitted module imports, so no module is admitted whole
METADATA_CLASSES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                    ("pathlib._local", "PosixPath"),  # Python 3.13 pickles a path under pathlib._local
                    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("collections", "OrderedDict"),
                    *(("torch.distributed.checkpoint.metadata", name) for name in (
                        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
                    *(("torch", name) for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype))}


class MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata: its own dataclasses, torch's sizes and dtypes, paths; nothing else is looked up."""

    def find_class(self, module: str, name: str):
        if (module, name) not in METADATA_CLASSES:
            raise pickle.UnpicklingError(f"its .metadata names {module}.{name}, which no checkpoint holds: a pickle "
                                         f"that would run code, not read")
        return super().find_class(module, name)


class SafeReader(dcp.FileSystemReader):
    """DCP's reader, its .metadata unpickled by MetadataUnpickler (FileSystemReader.read_metadata, pickle.load aside),
    once: DCP asking again gets the same, so a step removed meanwhile (a run's keep_checkpoints) fails at its shards,
    in our words, not in DCP's logged fallback and its tracebacks."""
    metadata = None

    def read_metadata(self, *args, **kwargs):
        if self.metadata is None:
            path = self._get_metadata_path(kwargs.get("rank")) if hasattr(self, "_get_metadata_path") else \
                self.fs.concat_path(self.path, ".metadata")  # releases before per-rank metadata (torch_versions.md)
            with self.fs.create_stream(path, "rb") as stream:
                metadata = MetadataUnpickler(stream).load()
            if type(metadata) is not Metadata:
                raise pickle.UnpicklingError(f"its .metadata holds a {type(metadata).__name__}, not DCP's Metadata")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            self.metadata = metadata
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


def weights_only_bytes(planner_class):
    """A DCP load planner whose non-tensor entries (the TRAIN part: counters, RNG state, settings) are read as
    torch.load(weights_only=True) reads them."""
    class Planner(planner_class):
        def load_bytes(self, read_item, value):
            value = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], value)
            else:
                self.state_dict[read_item.dest_index.fqn] = value
    return Planner


def read_step(folder: Path, parts: set[str]) -> dict:
    """The named parts of a step ('model', 'optimizer'; TRAIN always) as a Checkpoint's fields, full tensors on the
    CPU, read by this process alone: how DCP's own conversion to one file (format_utils.dcp_to_torch_save) reads."""
    state: dict = {}
    try:
        reader = SafeReader(folder)
        reader.read_metadata()  # a .metadata the reader does not admit, in its own words (DCP would wrap them)
        _load_state_dict(state, storage_reader=reader,
                         planner=weights_only_bytes(_EmptyStateDictLoadPlanner)(keys=parts | {TRAIN}), no_dist=True)
    except (CheckpointException, Exception) as e:  # DCP's is a BaseException: each rank's error with its traceback
        raise unreadable(folder, e) from None
    return {**state.pop(TRAIN), **state}


def load_into(model: torch.nn.Module, optimizers: list, folder: Path) -> dict:
    """A sharded step read into the model where it is placed (each rank reads what it holds), and its optimizer state
    shaped for set_optimizer_state_dict. Collective under torchrun."""
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizers)}
    try:
        reader = SafeReader(folder)
        reader.read_metadata()
        dcp.load(state, storage_reader=reader, planner=weights_only_bytes(DefaultLoadPlanner)())
    except (CheckpointException, Exception) as e:  # a shard damaged after the step was read for its settings
        raise unreadable(folder, e) from None
    set_model_state_dict(model, state["model"])
    return state["optimizer"]
