"""Data preparation and tokenizers: offline GPT-2 BPE, the three prepare.py scripts, and failure handling."""
import importlib.util
import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data import textdata
from core import files, writing
from core import tokenizer
from core.errors import UserError

REPO_ROOT = Path(__file__).resolve().parent.parent


def load_script(name: str):
    """data/<name>/prepare.py as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(f"prepare_{name}", REPO_ROOT / "data" / name / "prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_bin(path: Path) -> list[int]:
    return np.fromfile(path, dtype=np.uint16).tolist()


@pytest.fixture(scope="module")
def char_prep():
    return load_script("shakespeare_char")


@pytest.fixture(scope="module")
def plays_prepared(char_prep, tmp_path_factory):
    """shakespeare_char prepared from the packaged plays, once for the module: (out_dir, text, report)."""
    out_dir = tmp_path_factory.mktemp("shakespeare_char")
    report = char_prep.prepare(out_dir)
    return out_dir, textdata.shakespeare_text(), report


# -----------------------------------------------------------------------------
# offline GPT-2 BPE

def test_gpt2_file_hashes_are_the_ones_tiktoken_pins():
    from tiktoken_ext import openai_public
    source = inspect.getsource(openai_public.gpt2)
    for digest in tokenizer.GPT2_FILE_HASHES.values():
        assert digest in source


def test_offline_gpt2_encodes_hello_world_as_openai_ids():
    assert tokenizer.gpt2_encoding().encode_ordinary("Hello world") == [15496, 995]
    assert tokenizer.tokenizer_from_meta(None).encode("Hello world") == [15496, 995]


@pytest.mark.parametrize("text", [
    "",
    "To be, or not to be: that is the question.",
    "  leading and trailing spaces  \n\n\ttabs\r\nwindows newlines\n",
    "naïve café, Ünïcödé — “quotes” … 日本語のテキスト, Ελληνικά",
    "emoji 🙂👍🏽 and 👨‍👩‍👧‍👦 family, math ∑∫√",
])
def test_offline_gpt2_round_trips_text(text):
    tok = tokenizer.GPT2Tokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_gpt2_tokenizer_encodes_endoftext_as_the_special_token():
    tok = tokenizer.GPT2Tokenizer()
    assert tok.encode("hi<|endoftext|>") == tok.encode("hi") + [50256]
    assert tok.eot_token == 50256 and tok.vocab_size == 50257


def test_gpt2_loader_reads_vocab_files_from_any_directory(tmp_path):
    for name in tokenizer.GPT2_FILE_HASHES:
        shutil.copy(tokenizer.gpt2_files_dir() / name, tmp_path / name)
    assert tokenizer.gpt2_encoding(tmp_path).encode_ordinary("Hello world") == [15496, 995]


@pytest.mark.parametrize("corrupted", ["vocab.bpe", "encoder.json"])
def test_gpt2_loader_refuses_a_file_whose_hash_does_not_match(tmp_path, corrupted):
    for name in tokenizer.GPT2_FILE_HASHES:
        shutil.copy(tokenizer.gpt2_files_dir() / name, tmp_path / name)
    data = bytearray((tmp_path / corrupted).read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit, the size stays the same
    (tmp_path / corrupted).write_bytes(bytes(data))
    with pytest.raises(UserError, match=corrupted):
        tokenizer.gpt2_encoding(tmp_path)


def test_gpt2_loader_names_a_missing_vocab_file(tmp_path):
    shutil.copy(tokenizer.gpt2_files_dir() / "vocab.bpe", tmp_path / "vocab.bpe")
    with pytest.raises(UserError, match="encoder.json"):
        tokenizer.gpt2_encoding(tmp_path)


# -----------------------------------------------------------------------------
# tokenizers from meta.json

def test_load_tokenizer_rejects_unknown_tokenizer_and_unknown_characters(tmp_path):
    textdata.write_meta(tmp_path / "meta.json", {"tokenizer": "sentencepiece", "vocab_size": 10})
    with pytest.raises(UserError, match="sentencepiece"):
        tokenizer.tokenizer_from_meta(files.read_meta(tmp_path))
    char = tokenizer.CharTokenizer.from_text("abc")
    with pytest.raises(UserError, match="'z'"):
        char.encode("abz")


def test_vocab_check_accepts_65536_tokens_and_refuses_more():
    textdata.check_vocab_fits(65536)  # ids 0..65535 are all representable
    with pytest.raises(UserError, match="uint16"):
        textdata.check_vocab_fits(65537)


def test_char_prepare_refuses_a_vocabulary_too_large_for_uint16(char_prep, tmp_path):
    chars = [chr(c) for c in range(0x100, 0x100 + 70_000) if not 0xD800 <= c <= 0xDFFF]  # no lone surrogates
    (tmp_path / "huge.txt").write_text("".join(chars), encoding="utf-8")
    with pytest.raises(UserError, match="uint16"):
        char_prep.prepare(tmp_path / "out", str(tmp_path / "huge.txt"))
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


# -----------------------------------------------------------------------------
# shakespeare_char and shakespeare

def test_play_markdown_becomes_speaker_lines_without_markup(char_prep):
    markdown = (
        "# Hamlet\n\n## ACT I\n\n### SCENE I. Elsinore. A platform\n\nbefore the castle.\n\n"
        "_FRANCISCO at his post. Enter to him\nBERNARDO_\n\n"
        "**BERNARDO**  \nWho's there?\n\n"
        "**FRANCISCO**  \n_\\[Aside]_  \nNay, answer me:  \n\\--stand, and unfold yourself.\n\n"
        "*Exit.*\n\nStill Francisco, after his exit.\n"
    )
    assert textdata.play_to_text(markdown) == (
        "BERNARDO:\nWho's there?\n\n"
        "FRANCISCO:\nNay, answer me:\n--stand, and unfold yourself.\nStill Francisco, after his exit."
    )


def test_packaged_plays_make_a_plain_text_of_speeches(plays_prepared):
    _, text, report = plays_prepared
    assert text.startswith("THESEUS:\nNow, fair Hippolyta, our nuptial hour\n")  # A Midsummer Night's Dream sorts first
    assert not set(text) & set("#*_\\[]")  # no markdown left
    assert report["characters"] == len(text) > 4_000_000


def test_shakespeare_char_train_is_the_head_and_val_the_tail_of_the_text(plays_prepared):
    out_dir, text, report = plays_prepared
    tok = tokenizer.tokenizer_from_meta(files.read_meta(out_dir))
    train, val = read_bin(out_dir / "train.bin"), read_bin(out_dir / "val.bin")
    n = int(len(text) * 0.9)
    assert tok.decode(train[:2000]) == text[:2000]
    assert tok.decode(train) == text[:n]
    assert tok.decode(val) == text[n:]
    assert (report["train_tokens"], report["val_tokens"]) == (len(train), len(val))
    assert (out_dir / "train.bin").stat().st_size == 2 * len(train)  # uint16


def test_shakespeare_char_meta_json_round_trips_the_text(plays_prepared):
    out_dir, text, _ = plays_prepared
    meta = json.loads((out_dir / "meta.json").read_text(encoding="utf-8"))
    assert meta["tokenizer"] == "char" and meta["chars"] == sorted(set(text))
    tok = tokenizer.tokenizer_from_meta(files.read_meta(out_dir))
    assert tok.vocab_size == meta["vocab_size"] == len(set(text))
    assert tok.eot_token is None
    assert tok.decode(tok.encode(text)) == text


def test_shakespeare_gpt2_bins_decode_to_the_text_split_90_10(tmp_path):
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n" * 30 + "Ünïcödé 🙂 tail\n"
    (tmp_path / "input.txt").write_text(text, encoding="utf-8")
    report = load_script("shakespeare").prepare(tmp_path / "out", str(tmp_path / "input.txt"))
    n = int(len(text) * 0.9)
    tok = tokenizer.tokenizer_from_meta(files.read_meta(tmp_path / "out"))
    assert isinstance(tok, tokenizer.GPT2Tokenizer)
    assert json.loads((tmp_path / "out" / "meta.json").read_text()) == {"tokenizer": "gpt2", "vocab_size": 50257,
                                                                        "eot_token": 50256,
                                                                        "text": str(tmp_path / "input.txt"),
                                                                        "max_token_ids": {
        name: max(read_bin(tmp_path / "out" / name)) for name in ("train.bin", "val.bin")}}
    assert tok.decode(read_bin(tmp_path / "out" / "train.bin")) == text[:n]
    assert tok.decode(read_bin(tmp_path / "out" / "val.bin")) == text[n:]
    assert report["train_tokens"] + report["val_tokens"] > 0


@pytest.mark.slow  # BPE-encodes every play (~2.5 s)
def test_the_packaged_plays_as_bpe_are_one_document_per_scene_each_closed_by_end_of_text(tmp_path):
    load_script("shakespeare").prepare(tmp_path)
    scenes, tok = textdata.shakespeare_scenes(), tokenizer.GPT2Tokenizer()
    docs = []
    for split in ("train", "val"):
        ids = list(read_bin(tmp_path / f"{split}.bin"))
        assert ids[-1] == 50256  # every document, the last one included, is closed
        bounds = [-1] + [i for i, t in enumerate(ids) if t == 50256]
        docs.append([tok.decode(ids[a + 1:b]) for a, b in zip(bounds, bounds[1:])])
    assert docs[0] + docs[1] == scenes and len(scenes) > 700  # whole scenes, in order, split between them
    train_chars = sum(map(len, docs[0]))
    assert 0.9 <= train_chars / sum(map(len, scenes)) < 0.9 + max(map(len, scenes)) / sum(map(len, scenes))
    assert "\n\n".join(scenes) + "\n" == textdata.shakespeare_text()  # the character dataset's text, unchanged


# -----------------------------------------------------------------------------
# openwebtext pipeline on local corpora

def expected_token_count(docs: list[str]) -> int:
    enc = tokenizer.gpt2_encoding()
    return sum(len(enc.encode_ordinary(d)) + 1 for d in docs)  # + one end-of-text per document


def check_owt_outputs(out_dir: Path, report: dict, docs: list[str]) -> None:
    train, val = read_bin(out_dir / "train.bin"), read_bin(out_dir / "val.bin")
    assert (out_dir / "train.bin").stat().st_size == 2 * len(train)  # uint16
    assert len(train) + len(val) == expected_token_count(docs)
    assert (report["train_tokens"], report["val_tokens"]) == (len(train), len(val))
    assert report["val_documents"] >= 1 and report["train_documents"] + report["val_documents"] == len(docs)
    assert val.count(50256) == report["val_documents"] and val[-1] == 50256
    # every document comes back whole, between end-of-text tokens
    decoded = tokenizer.gpt2_encoding().decode(train + val).split("<|endoftext|>")[:-1]
    assert sorted(decoded) == sorted(docs)


@pytest.mark.slow  # two worker processes (the text corpus below runs the same pipeline in one)
def test_openwebtext_pipeline_on_a_local_jsonl_corpus(tmp_path):
    docs = [f"Doc {i}: the quick brown fox 🦊 jumps, café {'na' * i}\n\nsecond paragraph." for i in range(40)]
    with open(tmp_path / "corpus.jsonl", "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"id": len(d), "body": d}) + "\n")
    report = load_script("openwebtext").prepare(
        tmp_path / "out", data_files=[str(tmp_path / "corpus.jsonl")], text_column="body", num_proc=2,
        val_fraction=0.1, cache_dir=str(tmp_path / "hf_cache"), block_size=8)
    assert report["val_documents"] == 4
    check_owt_outputs(tmp_path / "out", report, docs)
    ids = {name: int(np.fromfile(tmp_path / "out" / name, dtype=np.uint16).max()) for name in ("train.bin", "val.bin")}
    assert json.loads((tmp_path / "out" / "meta.json").read_text()) == {
        "tokenizer": "gpt2", "vocab_size": 50257, "eot_token": 50256, "text": str((tmp_path / "corpus.jsonl").resolve()),
        "max_token_ids": ids}


@pytest.mark.slow  # multi-second end to end: the whole suite runs it
def test_openwebtext_pipeline_on_a_text_corpus_keeps_one_val_document(tmp_path):
    docs = [f"Paragraph {i} — with  spaces\nand a second line." for i in range(25)]
    (tmp_path / "corpus.txt").write_text("\n\n".join(docs), encoding="utf-8")  # documents are paragraphs
    report = load_script("openwebtext").prepare(
        tmp_path / "out", data_files=[str(tmp_path / "corpus.txt")], num_proc=1, block_size=8,
        cache_dir=str(tmp_path / "hf_cache"))  # default val_fraction 0.0005 of 25 documents rounds up to 1
    assert report["val_documents"] == 1
    check_owt_outputs(tmp_path / "out", report, docs)


@pytest.mark.slow  # the pipeline twice (~2.3 s); the text corpus above runs it once in the fast tier
def test_openwebtext_skips_records_without_text_counts_them_and_refuses_when_too_few_are_left(tmp_path):
    owt = load_script("openwebtext")
    docs = [f"Document {i} of the corpus, with words enough." for i in range(30)]
    with open(tmp_path / "mixed.jsonl", "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"text": d}) + "\n")
            if i % 6 == 0:
                f.write(json.dumps({"title": f"no text here {i}"}) + "\n")  # 5 records without the field
    report = owt.prepare(tmp_path / "out", data_files=[str(tmp_path / "mixed.jsonl")], num_proc=1, val_fraction=0.1,
                         cache_dir=str(tmp_path / "hf_cache"), block_size=8)
    assert report["skipped_records"] == 5
    check_owt_outputs(tmp_path / "out", report, docs)  # every document with text, and nothing else
    with open(tmp_path / "titles.jsonl", "w", encoding="utf-8") as f:
        f.write(json.dumps({"text": "the only text"}) + "\n")
        for i in range(4):
            f.write(json.dumps({"title": f"title {i}"}) + "\n")
    with pytest.raises(UserError, match=r"titles.jsonl has 1 document\(s\) \(4 of 5 records have no 'text'\); a "
                                        r"train and a val split need at least 2 - pass --text_column="):
        owt.prepare(tmp_path / "out2", data_files=[str(tmp_path / "titles.jsonl")], num_proc=1,
                    cache_dir=str(tmp_path / "hf_cache"))
    assert not (tmp_path / "out2").exists()


@pytest.mark.slow  # the whole pipeline through main, datasets and all (~1.5 s)
def test_openwebtext_refuses_a_split_smaller_than_one_training_block_and_writes_nothing(tmp_path, capsys):
    owt = load_script("openwebtext")
    (tmp_path / "c.txt").write_text("\n\n".join(f"paragraph {i} of a short corpus" for i in range(40)))
    assert owt.main([f"--data_files={tmp_path / 'c.txt'}", f"--out_dir={tmp_path / 'out'}", "--num_proc=1",
                     f"--cache_dir={tmp_path / 'hf_cache'}"]) == 2  # default block_size 1024: train.py's
    lines = capsys.readouterr().err.strip().splitlines()  # datasets' progress bars, then the error
    error = [line for line in lines if line.startswith("error:")]
    assert error == lines[-1:] and error[0].startswith("error: the train split would hold ")
    assert "and training reads 1,025 at a time (--block_size=1024)" in error[0] and "Nothing was written." in error[0]
    assert not (tmp_path / "out").exists()


def test_openwebtext_refuses_empty_and_missing_data_files(tmp_path):
    owt = load_script("openwebtext")
    (tmp_path / "empty.jsonl").write_text("")
    for data_files, message in [([str(tmp_path / "empty.jsonl")], "empty"),
                                ([str(tmp_path / "nope.jsonl")], "does not exist")]:
        with pytest.raises(UserError, match=message):
            owt.prepare(tmp_path / "out", data_files=data_files, num_proc=1, cache_dir=str(tmp_path / "hf_cache"))


@pytest.mark.parametrize("option, sentence", [
    ("--num_proc=0", "num_proc must be at least 1, got 0"),
    ("--val_fraction=1.0", "val_fraction must be greater than 0 and less than 1, got 1.0"),
])
def test_openwebtext_numeric_options_out_of_range_are_one_line(tmp_path, capsys, option, sentence):
    owt = load_script("openwebtext")
    (tmp_path / "c.txt").write_text("one\n\ntwo\n")
    assert owt.main([option, f"--data_files={tmp_path / 'c.txt'}", f"--out_dir={tmp_path / 'out'}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {sentence}; pass {option.split('=')[0]}= a "
                                                            f"value in {owt.LIMITS[option[2:].split('=')[0]]}."]
    assert not (tmp_path / "out").exists()


# -----------------------------------------------------------------------------
# failed runs never clobber earlier outputs

def snapshot(out_dir: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(out_dir.iterdir())}


@pytest.mark.parametrize("bad_input", ["missing.txt", "empty.txt"])
def test_failed_script_run_leaves_existing_outputs_untouched_and_prints_one_error_line(char_prep, tmp_path, bad_input):
    (tmp_path / "good.txt").write_text("hello shakespeare\n" * 20, encoding="utf-8")
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    out_dir = tmp_path / "out"
    char_prep.prepare(out_dir, str(tmp_path / "good.txt"))
    before = snapshot(out_dir)
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "data" / "shakespeare_char" / "prepare.py"),
         f"--input={tmp_path / bad_input}", f"--out_dir={out_dir}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)  # run from elsewhere than the repo root
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and bad_input in lines[0]
    assert snapshot(out_dir) == before  # same bytes and mtimes, and no leftover .tmp files


@pytest.mark.slow  # the openwebtext pipeline (~1.5 s); the staged writing it uses is a fast unit below
def test_a_failure_while_writing_removes_temporaries_and_keeps_old_files(tmp_path, monkeypatch):
    owt = load_script("openwebtext")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "train.bin").write_bytes(b"old")
    before = snapshot(out_dir)
    docs = [f"document number {i}" for i in range(10)]
    (tmp_path / "c.txt").write_text("\n\n".join(docs), encoding="utf-8")
    real_write_split = owt.write_split

    def write_then_fail(tokenized, path, name):
        real_write_split(tokenized, path, name)
        if name == "val":
            raise UserError("simulated failure after train.bin.tmp was written")
    monkeypatch.setattr(owt, "write_split", write_then_fail)
    with pytest.raises(UserError, match="simulated"):
        owt.prepare(out_dir, data_files=[str(tmp_path / "c.txt")], num_proc=1, cache_dir=str(tmp_path / "hf_cache"),
                    block_size=2, overwrite=True)  # the old file's origin unknown: replaced only when asked
    assert snapshot(out_dir) == before


def test_staged_writing_that_fails_half_way_removes_its_temporaries_and_keeps_the_old_files(tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "train.bin").write_bytes(b"old")
    before = snapshot(out_dir)
    with pytest.raises(UserError, match="simulated"):
        with writing.staged_outputs(out_dir, ["train.bin", "val.bin"]) as tmp:
            tmp["train.bin"].write_bytes(b"new, half of the job")
            raise UserError("simulated failure after train.bin.tmp was written")
    assert snapshot(out_dir) == before  # the old train.bin, no .tmp left, no val.bin


def test_an_unwritable_out_dir_is_one_clear_error(tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    (tmp_path / "input.txt").write_text("some text to prepare\n" * 5)
    with pytest.raises(UserError, match="could not write"):
        load_script("shakespeare").prepare(tmp_path / "a_file" / "out", str(tmp_path / "input.txt"))


def test_preparing_data_and_reading_settings_do_not_import_torch():
    code = ("import sys; from core import configurator, errors, files, tokenizer; from data import textdata; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, timeout=60).returncode == 0


def test_openwebtext_without_network_is_one_line_at_once_not_the_hubs_retries(tmp_path, monkeypatch):
    owt = load_script("openwebtext")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)

    def unreachable(address, timeout=None):
        raise OSError(101, "Network is unreachable")
    monkeypatch.setattr(owt.socket, "create_connection", unreachable)
    monkeypatch.setattr(owt.datasets, "load_dataset", lambda *a, **k: pytest.fail("the hub was asked anyway"))
    with pytest.raises(UserError, match=r"could not reach the Hugging Face hub to download openwebtext \(no network "
                                        r"here\); pass --data_files="):
        owt.prepare(tmp_path / "out")
    assert not (tmp_path / "out").exists()


# -- texts as a user hands them in --------------------------------------------------------------------------

def test_a_folder_as_input_is_named_a_folder(char_prep, tmp_path):
    with pytest.raises(UserError, match=rf"^input {tmp_path} is a folder; pass --input= one text file"):
        char_prep.prepare(tmp_path / "out", input=str(tmp_path))


def test_text_piped_through_a_fifo_is_prepared_as_a_file_is(char_prep, tmp_path):
    """--input=/dev/stdin with text piped in, stood in for by a FIFO made here."""
    import threading
    text = "To be, or not to be, that is the question.\n" * 50
    fifo = tmp_path / "stdin"
    os.mkfifo(fifo)
    threading.Thread(target=lambda: fifo.write_text(text), daemon=True).start()
    piped = char_prep.prepare(tmp_path / "piped", input=str(fifo))
    (tmp_path / "file.txt").write_text(text)
    char_prep.prepare(tmp_path / "file", input=str(tmp_path / "file.txt"))
    assert piped["characters"] == len(text)
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "piped" / name).read_bytes() == (tmp_path / "file" / name).read_bytes()
    meta = [json.loads((tmp_path / run / "meta.json").read_text()) for run in ("piped", "file")]
    assert [m.pop("text") for m in meta] != [None, None] and meta[0] == meta[1]  # the same but for the text's name


def test_a_byte_order_mark_is_not_a_character_of_the_vocabulary(char_prep, tmp_path):
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + b"hello world\n" * 20)
    char_prep.prepare(tmp_path / "out", input=str(tmp_path / "bom.txt"))
    chars = json.loads((tmp_path / "out" / "meta.json").read_text())["chars"]
    assert "\ufeff" not in chars and chars == sorted(set("hello world\n"))


def test_a_long_text_is_prepared_in_a_few_times_its_size_of_memory(char_prep, tmp_path):
    """A list of ints per character took 21x the text (4.35 GB for 200 MB); the ids go to an array in chunks."""
    import tracemalloc
    text = ("the quick brown fox jumps over the lazy dog\n" * 400_000)  # 17.6 MB
    (tmp_path / "long.txt").write_text(text)
    tracemalloc.start()
    try:
        char_prep.prepare(tmp_path / "out", input=str(tmp_path / "long.txt"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 6 * len(text), f"{peak / len(text):.1f}x the text"
    ids = np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint16)
    assert "".join(json.loads((tmp_path / "out" / "meta.json").read_text())["chars"][i] for i in ids[:44]) == \
        text[:44]


def test_a_dataset_name_that_leaves_data_is_refused_not_prepared(tmp_path):
    from core.dataset import dataset_dir
    with pytest.raises(UserError, match=r"^dataset '../../x' is not the name of a folder in data/; pass --dataset= "
                                        r"such a name, or --data_dir= the folder that holds train.bin and val.bin\.$"):
        dataset_dir("", "../../x")


def test_a_prepare_of_another_text_or_tokenizer_into_a_prepared_folder_is_refused_and_replaces_nothing(
        char_prep, tmp_path, capsys):
    """A character dataset a checkpoint was trained on is not replaced by GPT-2 ids (the BPE script pointed at its
    folder by a slip), nor by the default text (the same command without --input): each is one error line naming
    the fix, and the files stay as they were. The same text again, or --overwrite=True, replaces them."""
    bpe_prep = load_script("shakespeare")
    corpus = tmp_path / "my_corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog.\n" * 200)
    folder = tmp_path / "mytext_char"
    assert char_prep.main([f"--input={corpus}", f"--out_dir={folder}"]) == 0
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert json.loads((folder / "meta.json").read_text())["text"] == str(corpus.resolve())
    capsys.readouterr()
    for script, args in ((bpe_prep, [f"--input={corpus}"]), (char_prep, [])):  # another tokenizer; another text
        assert script.main([*args, f"--out_dir={folder}"]) == 2
        said = capsys.readouterr().err.strip().splitlines()
        assert len(said) == 1 and said[0].startswith(f"error: {folder} holds data prepared from {corpus.resolve()} "
                                                     f"with the char tokenizer, which this prepare (")
        assert said[0].endswith("would replace; pass another --out_dir=, or --overwrite=True to replace it")
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert char_prep.main([f"--input={corpus}", f"--out_dir={folder}"]) == 0  # the same text again
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert bpe_prep.main([f"--input={corpus}", f"--out_dir={folder}", "--overwrite=True"]) == 0
    assert json.loads((folder / "meta.json").read_text())["tokenizer"] == "gpt2"


@pytest.mark.parametrize("folder_kind", ["nanoGPT's (meta.pkl, no meta.json)", "a damaged meta.json",
                                         "a meta.json that names no text", "another text's"])
@pytest.mark.parametrize("script", ["shakespeare_char", "shakespeare", "openwebtext"])
def test_every_prepare_refuses_to_replace_data_it_cannot_tell_is_its_own(tmp_path, capsys, script, folder_kind):
    """Every prepare script replaces a folder's data only where its meta.json shows the same text and tokenizer; a
    nanoGPT data folder, a damaged or older meta.json, or another text's data is one error line naming
    --overwrite=True, and every file stays as it was."""
    folder = tmp_path / "data"
    folder.mkdir()
    for name in ("train.bin", "val.bin"):
        np.arange(300, dtype=np.uint16).tofile(folder / name)
    meta = {"nanoGPT's (meta.pkl, no meta.json)": None, "a damaged meta.json": "{not json",
            "a meta.json that names no text": json.dumps({"tokenizer": "char", "vocab_size": 300}),
            "another text's": json.dumps({"tokenizer": "gpt2", "vocab_size": 50257, "text": "/elsewhere/other.txt"})}
    if meta[folder_kind] is None:
        (folder / "meta.pkl").write_bytes(b"nanoGPT's vocabulary")
    else:
        (folder / "meta.json").write_text(meta[folder_kind])
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog.\n" * 200)
    args = [f"--data_files={corpus}", "--block_size=8"] if script == "openwebtext" else [f"--input={corpus}"]
    capsys.readouterr()
    assert load_script(script).main([*args, f"--out_dir={folder}"]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith(f"error: {folder} holds ") and said[0].endswith(
        "; pass another --out_dir=, or --overwrite=True to replace it"), said
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_a_folder_mixing_two_preparations_is_named_at_start(char_prep, tmp_path):
    """meta.json records each file's largest id when it is written with them: a train.bin from another preparation
    of the same vocabulary (copied in, or left by an interrupted copy) is named before training."""
    import train
    from conftest import TINY
    a, b = tmp_path / "a", tmp_path / "b"
    (tmp_path / "a.txt").write_text("abcdefgh " * 300)
    (tmp_path / "b.txt").write_text("abcd " * 300 + "efgh " * 10)
    for folder, text in ((a, "a.txt"), (b, "b.txt")):
        assert char_prep.main([f"--input={tmp_path / text}", f"--out_dir={folder}"]) == 0
    assert json.loads((a / "meta.json").read_text())["max_token_ids"] == {"train.bin": 8, "val.bin": 8}
    (a / "train.bin").write_bytes((b / "train.bin").read_bytes())  # same vocabulary, other files
    assert json.loads((b / "meta.json").read_text())["max_token_ids"]["train.bin"] == 4  # 'd': b's train split
    with pytest.raises(UserError, match=r"train.bin's largest token id is \d+, but the meta.json written with it "
                                        r"records 8: the folder holds files of two preparations"):
        train.main(TINY + [f"--data_dir={a}", "--block_size=8", f"--out_dir={tmp_path / 'out'}"])
