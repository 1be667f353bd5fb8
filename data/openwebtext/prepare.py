"""
OpenWebText (or any local corpus) with GPT-2 BPE: train.bin / val.bin (uint16 token ids) and meta.json,
next to this script.

Each document is encoded with the offline GPT-2 tokenizer and followed by the end-of-text token (50256);
a random validation split is held out (--val_fraction of the documents, at least one). Splits are written
shard by shard through np.memmap, so no whole split is ever held in memory.

$ python data/openwebtext/prepare.py                                   # Hugging Face "openwebtext", needs network
$ python data/openwebtext/prepare.py --data_files=a.jsonl,b.jsonl      # local corpus: .jsonl/.json, .parquet, .txt
$ python data/openwebtext/prepare.py --data_files=books.txt --num_proc=4 --out_dir=/data/books

Text files hold one document per blank-line-separated paragraph; json and parquet files one per row, with the
text in --text_column (default "text").
"""
from __future__ import annotations

if __name__ == "__main__":  # a Ctrl-C while the imports below load ends the process quietly (main handles its own)
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import contextlib
import math
import os
import socket
import sys
from pathlib import Path
from typing import Iterator
from urllib.parse import urlparse

import datasets
import numpy as np
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # so `from core import ...` works however this script is started

from core import errors  # noqa: E402
from core import files, writing  # noqa: E402
from data import textdata  # noqa: E402
from core import tokenizer  # noqa: E402
from core.configurator import PATH, as_list, check_limits, configure  # noqa: E402
from core.errors import UserError  # noqa: E402

DEFAULT_DATASET = "openwebtext"
SEED = 2357  # the validation split nanoGPT holds out
MAX_WRITE_SHARDS = 1024  # a split is written in this many contiguous shards (fewer for small corpora)
LIMITS = {"num_proc": "[1, inf)", "val_fraction": "(0, 1)", "block_size": "[1, inf)",  # each numeric option's range
          "out_dir": PATH, "cache_dir": PATH, "dataset": PATH}
DEFAULT_BLOCK_SIZE = 1024  # train.py's default (and GPT-2's): a split must hold more tokens than one block
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".text": "text"}
# token ids are stored as uint16 in datasets' cache too: a quarter of the disk of the default int64
TOKENIZED_FEATURES = datasets.Features({"ids": datasets.List(datasets.Value("uint16")), "len": datasets.Value("int64")})
QUIET_LOAD_BYTES = 100 * 2**20  # local files smaller than this load in seconds: no progress bars, so that a problem
                                # found in them is the only line printed

# I/O
dataset = None                    # a Hugging Face dataset name (downloaded); None: "openwebtext", unless data_files
data_files = None                 # a local corpus instead: PATH[,PATH...] (.jsonl/.json, .parquet, .txt)
text_column = "text"              # the column (json: the field) that holds each document's text
out_dir = ""                      # where to write train.bin, val.bin and meta.json; empty: this script's folder
cache_dir = None                  # datasets' cache; None: ~/.cache/huggingface/datasets
overwrite = False                 # replace data out_dir holds that was prepared from another text, or of an origin
                                  # this script cannot tell (a nanoGPT data folder)
# splits
val_fraction = 0.0005             # the share of documents held out for val (at least one document)
block_size = DEFAULT_BLOCK_SIZE   # the block you will train with: each split must hold more tokens than this
# system
num_proc = None                   # worker processes; None: min(8, half the CPU cores)


def default_num_proc() -> int:
    return min(8, (os.cpu_count() or 1) // 2 or 1)


# -----------------------------------------------------------------------------
# loading

def builder_for(files: list[str]) -> str:
    """The datasets builder ("json", "parquet" or "text") that reads these files, from their extensions."""
    if not files:
        raise UserError("--data_files is empty; pass one or more files, comma-separated")
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        raise UserError(f"data file {missing[0]} does not exist; pass --data_files= existing files, comma-separated")
    if all(Path(f).stat().st_size == 0 for f in files):
        raise UserError(f"data files {', '.join(files)} are empty; pass files holding at least 2 documents")
    kinds = {BUILDERS.get(Path(f).suffix.lower()) for f in files}
    if None in kinds or len(kinds) > 1:
        raise UserError(f"--data_files must all be one kind, by extension: {', '.join(BUILDERS)}; got {', '.join(files)}")
    return kinds.pop()


def error_reason(e: BaseException) -> str:
    """First line of the innermost cause: datasets wraps the useful message (say, a JSON parse error) in a
    generic one."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def load_corpus(dataset: str | None, data_files: list[str] | None, text_column: str,
                num_proc: int, cache_dir: str | None) -> tuple[datasets.Dataset, str, int]:
    """All documents as one Dataset, a short description of where they came from, and how many records were
    skipped for having no text (a JSON record without the field, a null)."""
    if data_files is not None:
        builder = builder_for(data_files)
        source = ", ".join(data_files)
        kwargs = {"data_files": data_files}
        if builder == "text":
            kwargs["sample_by"] = "paragraph"  # the text builder's default, one row per line, splits documents
        hint = f"check that the files are valid {builder}"
    else:
        builder = source = dataset or DEFAULT_DATASET
        kwargs = {}
        hint = "check the name and your network, or pass --data_files=PATH[,PATH...] for a local corpus"
    if data_files is None and not hub_reachable():  # else the hub client retries for half a minute, line by line
        raise UserError(f"could not reach the Hugging Face hub to download {source} (no network here); pass "
                        f"--data_files=PATH[,PATH...] for a local corpus, or with {source} in the cache, set "
                        f"HF_HUB_OFFLINE=1")
    quiet = data_files is not None and sum(Path(f).stat().st_size for f in data_files) < QUIET_LOAD_BYTES
    try:
        with quiet_datasets(quiet):
            ds = datasets.load_dataset(builder, split="train", num_proc=num_proc, cache_dir=cache_dir, **kwargs)
    except Exception as e:  # network, parse and schema failures come as many types; to a user they mean the same
        raise UserError(f"could not load {source} ({error_reason(e)}); {hint}") from e
    if text_column not in ds.column_names:
        raise UserError(f"{source} has no column {text_column!r} (columns: {', '.join(ds.column_names)}); "
                        f"pass --text_column=NAME")
    if ds.features[text_column] not in (datasets.Value("string"), datasets.Value("large_string")):
        raise UserError(f"column {text_column!r} of {source} holds {ds.features[text_column]}, not text; "
                        f"pass --text_column= a text column")
    with quiet_datasets(quiet):
        with_text = ds.filter(lambda texts: [t is not None for t in texts], input_columns=text_column, batched=True,
                              num_proc=min(num_proc, ds.num_rows), desc="dropping records without text")
    skipped = ds.num_rows - with_text.num_rows
    if with_text.num_rows < 2:
        without = f" ({skipped} of {ds.num_rows} records have no {text_column!r})" if skipped else ""
        raise UserError(f"{source} has {with_text.num_rows} document(s){without}; a train and a val split need at "
                        f"least 2 - pass --text_column= the field that holds the text")
    return with_text, source, skipped


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the hub answers at all (one TCP connection); HF_HUB_OFFLINE=1 says to read the cache instead."""
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        return True
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


@contextlib.contextmanager
def quiet_datasets(quiet: bool = True) -> Iterator[None]:
    """datasets' progress bars and its log lines below errors off inside (when `quiet`), as they were after."""
    if not quiet:
        yield
        return
    bars, verbosity = datasets.is_progress_bar_enabled(), datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()


def split_corpus(ds: datasets.Dataset, val_fraction: float) -> dict[str, datasets.Dataset]:
    n_val = max(1, math.ceil(val_fraction * ds.num_rows))  # a tiny corpus still gets one val document
    if n_val >= ds.num_rows:
        raise UserError(f"--val_fraction={val_fraction} leaves no training documents out of {ds.num_rows}; lower it")
    split = ds.train_test_split(test_size=n_val, seed=SEED, shuffle=True)
    return {"train": split["train"], "val": split["test"]}


# -----------------------------------------------------------------------------
# tokenizing and writing

def encode_batch(batch: dict[str, list], text_column: str) -> dict[str, list]:
    """datasets.map worker: GPT-2 ids of each document, then end-of-text. It runs in worker processes, so it
    builds the offline tokenizer there (once per process) rather than having a large Encoding pickled over."""
    enc = tokenizer.gpt2_encoding()
    ids = [enc.encode_ordinary(text or "") + [tokenizer.GPT2_EOT_TOKEN] for text in batch[text_column]]
    return {"ids": ids, "len": [len(x) for x in ids]}


def tokenize(ds: datasets.Dataset, text_column: str, num_proc: int, name: str) -> datasets.Dataset:
    return ds.map(
        encode_batch,
        fn_kwargs={"text_column": text_column},
        batched=True,
        remove_columns=ds.column_names,
        features=TOKENIZED_FEATURES,
        num_proc=min(num_proc, ds.num_rows),
        desc=f"tokenizing {name}",
    )


def write_split(tokenized: datasets.Dataset, path: Path, name: str) -> tuple[int, int]:
    """Write all ids of one split to path as uint16, shard by shard; returns the number of tokens and the largest."""
    total = int(np.sum(tokenized.with_format("numpy")["len"], dtype=np.uint64))
    arr = np.memmap(path, dtype=files.TOKEN_DTYPE, mode="w+", shape=(total,))
    n_shards = min(MAX_WRITE_SHARDS, tokenized.num_rows)
    idx, top = 0, -1
    for i in tqdm(range(n_shards), desc=f"writing {name}", disable=None):
        shard = tokenized.shard(num_shards=n_shards, index=i, contiguous=True).with_format("numpy")
        chunk = np.concatenate(list(shard["ids"]))
        arr[idx : idx + len(chunk)] = chunk
        idx, top = idx + len(chunk), max(top, int(chunk.max(initial=-1)))
    assert idx == total, f"wrote {idx} tokens, expected {total}"
    arr.flush()
    del arr  # close the memmap before the file is renamed into place
    return total, top


def check_split_sizes(splits: dict[str, datasets.Dataset], block_size: int) -> None:
    """Each split must hold more than block_size tokens: train.py reads block_size + 1 at a time from both."""
    for name, part in splits.items():
        tokens = int(np.sum(part.with_format("numpy")["len"], dtype=np.uint64))
        if tokens <= block_size:
            raise UserError(f"the {name} split would hold {tokens:,} tokens, and training reads {block_size + 1:,} "
                            f"at a time (--block_size={block_size}); add documents, raise --val_fraction, or pass "
                            f"--block_size= the block you will train with. Nothing was written.")


def prepare(out_dir: Path = HERE, dataset: str | None = None, data_files: list[str] | None = None,
            text_column: str = "text", num_proc: int | None = None, val_fraction: float = 0.0005,
            cache_dir: str | None = None, block_size: int = DEFAULT_BLOCK_SIZE, overwrite: bool = False) -> dict:
    """Write train.bin, val.bin and meta.json into out_dir; returns what was written.
    Reads `data_files` when given, else the Hugging Face dataset `dataset` (default "openwebtext")."""
    if dataset and data_files is not None:
        raise UserError("pass either --dataset or --data_files, not both")
    errors.refuse_all(list(check_limits({"num_proc": num_proc, "val_fraction": val_fraction, "block_size": block_size},
                                        LIMITS, {}).values()))
    if num_proc is not None and type(num_proc) is not int:
        raise UserError(f"num_proc must be a whole number, got {num_proc!r}; pass --num_proc= a count of processes.")
    num_proc = default_num_proc() if num_proc is None else num_proc
    text = ", ".join(str(Path(f).resolve()) for f in data_files) if data_files else dataset or DEFAULT_DATASET
    textdata.check_replace(out_dir, {"tokenizer": "gpt2", "text": text}, overwrite)  # before hours of work
    tokenizer.gpt2_encoding()  # fail on bad vocabulary files here, with a clear message, not inside a worker
    ds, source, skipped = load_corpus(dataset, data_files, text_column, num_proc, cache_dir)
    splits = {name: tokenize(part, text_column, num_proc, name) for name, part in split_corpus(ds, val_fraction).items()}
    check_split_sizes(splits, block_size)
    with writing.staged_outputs(out_dir, ["train.bin", "val.bin", "meta.json"]) as tmp:
        written = {name: write_split(part, tmp[f"{name}.bin"], name) for name, part in splits.items()}
        textdata.write_meta(tmp["meta.json"], {"tokenizer": "gpt2", "vocab_size": files.GPT2_VOCAB_SIZE,
                                               "eot_token": files.GPT2_EOT_TOKEN, "text": text, "max_token_ids": {
                                                   f"{name}.bin": top for name, (_, top) in written.items()}})
    tokens = {name: n for name, (n, _) in written.items()}
    return {
        "source": source,
        "skipped_records": skipped,  # records with no text (no such field, or null)
        "train_documents": splits["train"].num_rows,
        "val_documents": splits["val"].num_rows,
        "vocab_size": files.GPT2_VOCAB_SIZE,
        "train_tokens": tokens["train"],
        "val_tokens": tokens["val"],
        "files": [Path(out_dir) / name for name in ("train.bin", "val.bin", "meta.json")],
    }


def main(argv: list[str] | None = None) -> int:
    def run() -> None:
        cfg = configure(globals(), sys.argv[1:] if argv is None else argv, LIMITS)
        data_files = as_list(cfg.data_files) if cfg.data_files is not None else None
        tokenizer.print_report(prepare(Path(cfg.out_dir or HERE), cfg.dataset, data_files, cfg.text_column,
                                       cfg.num_proc, cfg.val_fraction, cfg.cache_dir, cfg.block_size,
                                       cfg.overwrite))
    return errors.exit_code(run)


if __name__ == "__main__":
    sys.exit(main())
