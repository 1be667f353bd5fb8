"""Faults in what the newest features read and write, met as a failing disk or a new user would meet them: a damaged
sharded checkpoint (through every reader), a decision cache or a measured-peak cache that is not what the project
wrote, a bad mask setting in bench, a measuring tool's settings, an OS error under an asynchronous save. The promise
is the scripts' own: one error line that names what is wrong and a next step that can work, and nothing on disk lost.
"""

import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import bench
import export_hf
import sample
import train
from model import IMPLEMENTATIONS
from conftest import REPO, SHARDED, TINY
from core import writing
from core.errors import UserError
from core.runtime import Runtime
from attention import attn_auto
from engine.reader import load_checkpoint


def tiny(char_data, out, *args) -> None:
    assert train.main(TINY + [f"--data_dir={char_data}", f"--out_dir={out}", "--eval_interval=2", *args]) == 0


@pytest.fixture(scope="module")
def sharded_run(char_data_session, tmp_path_factory) -> Path:
    """Steps 2 and 4 of a sharded run; each test damages its own copy."""
    out = tmp_path_factory.mktemp("sharded") / "run"
    tiny(char_data_session, out, "--max_iters=4", *SHARDED)
    return out


def damaged(sharded_run, tmp_path, damage) -> Path:
    out = tmp_path / "out"
    shutil.copytree(sharded_run, out)
    damage(out)
    return out


# every reader of a checkpoint, each through its own entry point
READERS = {
    "resume": lambda out, data: tiny(data, out, "--max_iters=6", "--init_from=resume", *SHARDED),
    "sample": lambda out, data: sample.main([f"--out_dir={out}", "--max_new_tokens=2", "--num_samples=1"]),
    "export_hf": lambda out, data: export_hf.main([f"--out_dir={out}", f"--hf_dir={out.parent / 'hf'}"]),
    "conversion": lambda out, data: load_checkpoint(out / "ckpt.pt").save(out / "single.pt"),  # docs/training.md's
}
FALLBACK = "the newest whole step{} is {}: point {}/latest at it (echo step-000002 > {}/latest) and run again"


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("fault, damage, sentence", [
    ("binary pointer", lambda out: (out / "latest").write_bytes(b"\xff\xfe\x00\x81step"), "{out}/latest holds no text "
     "(binary bytes); the newest whole step is {out}/step-000004"),
    ("empty pointer", lambda out: (out / "latest").write_text(""), "{out}/latest is empty; the newest whole step is "
     "{out}/step-000004"),
    ("a gone step", lambda out: (out / "latest").write_text("step-000009"), "{out}/latest names step-000009, which "
     "is not in {out}; the newest whole step is {out}/step-000004"),
    ("no .metadata", lambda out: (out / "step-000004" / ".metadata").unlink(), "{out}/step-000004 has no .metadata "
     "(its save never finished, or the file was lost); " + FALLBACK.format(" before it", "{out}/step-000002", "{out}",
                                                                           "{out}")),
    ("a cut shard", lambda out: [os.truncate(f, f.stat().st_size // 2) for f in (out / "step-000004").glob("*.distcp")],
     "{out}/step-000004's shards cannot be read ("),
], ids=lambda v: v if isinstance(v, str) and " " in v or v in READERS else "")
def test_a_damaged_sharded_checkpoint_is_one_sentence_naming_the_file_and_a_step_that_can_be_read(
        sharded_run, char_data, tmp_path, reader, fault, damage, sentence):
    out = damaged(sharded_run, tmp_path, damage)
    before = sorted((p.relative_to(out), p.stat().st_size) for p in out.rglob("*") if p.is_file())
    with pytest.raises(UserError) as refused:
        READERS[reader](out, char_data)
    message = str(refused.value)
    assert message.startswith(sentence.format(out=out)) and "\n" not in message
    if fault == "a cut shard":  # the shard's own complaint, then the step before it
        assert message.endswith(FALLBACK.format(" before it", out / "step-000002", out, out))
    after = sorted((p.relative_to(out), p.stat().st_size) for p in out.rglob("*") if p.is_file()
                   if p.name not in ("metrics.jsonl",))
    assert after == [b for b in before if b[0].name != "metrics.jsonl"]  # nothing of the run deleted or rewritten


def test_with_no_whole_step_left_the_sentence_offers_a_fresh_run(sharded_run, tmp_path):
    out = damaged(sharded_run, tmp_path, lambda out: [(s / ".metadata").unlink() for s in out.glob("step-*")])
    with pytest.raises(UserError, match=r"has no \.metadata .*; no whole step is left in .*: start a fresh run there "
                                        r"with --overwrite=True, or pass another --out_dir=$"):
        load_checkpoint(out / "ckpt.pt")


# -- caches a user never wrote: measured again, rewritten, said in one line ---------------------------------

def cached_decision(w, rt, implementations, budget):
    return attn_auto.Decision("manual", [dict(attn="manual", status="ok", ms=1.0, ratio=1.0, reason=None)], w)


@pytest.mark.parametrize("held", [
    "[1, 2, 3]",                                     # valid JSON of another shape
    '{"a workload": "sdpa"}',                         # an object whose entries are not decisions
    "\x00\x01 not json",                              # not JSON at all
], ids=["list", "entries", "garbage"])
def test_a_decision_cache_of_another_shape_is_measured_again_rewritten_and_named_in_one_line(tmp_path, capsys, held,
                                                                                          monkeypatch):
    path = tmp_path / "attn_auto.json"
    path.write_text(held)
    monkeypatch.setattr(attn_auto, "cache_file", lambda: path)
    monkeypatch.setattr(attn_auto, "measure", cached_decision)
    w = attn_auto.Workload.of(train_config(), Runtime("cpu", "float32"), 1, 16, training=False, compiled=False)
    decision = attn_auto.choose(w, Runtime("cpu", "float32"), IMPLEMENTATIONS, 1.0)
    assert decision.pick == "manual" and not decision.cached  # measured, not read
    note = capsys.readouterr().err
    assert note.startswith(f"note: {path} is not what this project wrote (") and note.count("\n") == 1
    assert note.endswith("; measuring again, and the file is rewritten with the result.\n")
    assert json.loads(path.read_text())[w.key()]["pick"] == "manual"  # rewritten, usable by the next run
    assert attn_auto.choose(w, Runtime("cpu", "float32"), IMPLEMENTATIONS, 1.0).cached


def train_config():
    from model import GPTConfig
    return GPTConfig(block_size=16, vocab_size=11, n_layer=1, n_head=2, n_embd=8)


@pytest.mark.slow  # multi-second end to end: the whole suite runs it
def test_a_decision_naming_an_implementation_that_no_longer_exists_is_measured_again_by_train_and_sample(
        char_data, tmp_path, monkeypatch, capsys):
    """The workload's own entry names 'flash9': train.py and sample.py measure again (no 'unknown attn'), rewrite
    the cache, and train.py says nothing of a checkpoint it does not have."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    args = [f"--data_dir={char_data}", "--attn=auto", "--attn_auto_budget=1", "--max_iters=2"]
    tiny(char_data, tmp_path / "first", *args)
    cache = tmp_path / "cache" / "nanogpt-attn" / "attn_auto.json"
    stale = {key: {**entry, "pick": "flash9"} for key, entry in json.loads(cache.read_text()).items()}
    cache.write_text(json.dumps(stale))
    capsys.readouterr()
    tiny(char_data, tmp_path / "second", *args)
    out, err = capsys.readouterr()
    assert err.startswith(f"note: {cache} is not what this project wrote (1 of its 1 entries are not decisions")
    assert out.startswith("attn=auto: ") and "as the checkpoint decided" not in out and "; measured in " in out
    assert all(entry["pick"] != "flash9" for entry in json.loads(cache.read_text()).values())
    cache.write_text("[]")
    assert sample.main([f"--out_dir={tmp_path / 'second'}", "--attn=auto", "--attn_auto_budget=1",
                        "--max_new_tokens=2", "--num_samples=1"]) == 0
    assert capsys.readouterr().err.startswith(f"note: {cache} is not what this project wrote (it holds a JSON list")


# -- tools check every setting before they run --------------------------------------------------------------

def test_a_bad_document_setting_in_bench_is_refused_before_the_first_row(char_data, tmp_path, capsys):
    """char_data has no end-of-text token, so no documents: said before the plan line, bar or any row."""
    with pytest.raises(UserError, match=r"has no end-of-text token, so no documents; pass --doc_data="):
        bench.main(["--device=cpu", "--attn=manual", "--mask=causal,doc", f"--doc_data={char_data}", "--seq_len=64",
                    f"--out_dir={tmp_path}"])
    assert capsys.readouterr().err == "" and not list(tmp_path.glob("train-*"))


# -- an OS error under an asynchronous save ----------------------------------------------------------------

# Resumes under a file size limit (`ulimit -f`; SIGXFSZ ignored, so a write past it fails with EFBIG): the shard's
# write is cut short inside a tensor's record, where PyTorch's writer used to leave only its own text on top.
UNDER_A_FILE_SIZE_LIMIT = textwrap.dedent("""
    import json, resource, signal, sys
    import train
    from core.errors import UserError
    limit, args = int(sys.argv[1]), json.loads(sys.argv[2])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    said = {}
    for async_save, out in args.items():
        try:
            train.main(out + ["--max_iters=4", "--init_from=resume", "--async_save=" + async_save])
        except UserError as e:
            said[async_save] = str(e)
    print(json.dumps(said))
""")


@pytest.mark.slow  # multi-second end to end: the whole suite runs it
def test_a_save_cut_short_by_the_file_size_limit_says_so_and_keeps_the_previous_step(char_data, tmp_path):
    runs = {}
    for async_save in ("False", "True"):
        out = tmp_path / f"async_{async_save}"
        tiny(char_data, out, "--max_iters=2", *SHARDED)
        runs[async_save] = TINY + [f"--data_dir={char_data}", f"--out_dir={out}", "--eval_interval=2", *SHARDED]
    # the limit in the middle of the shard's first tensor record of 16 KB or more (AdamW's moments), where the writer
    # used to say only "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
    import torch.distributed.checkpoint as dcp
    records = dcp.FileSystemReader(tmp_path / "async_False" / "step-000002").read_metadata().storage_data.values()
    first = min((r for r in records if r.length >= 16384), key=lambda r: r.offset)
    limit = first.offset + first.length // 2
    done = subprocess.run([sys.executable, "-c", UNDER_A_FILE_SIZE_LIMIT, str(limit), json.dumps(runs)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    said = json.loads(done.stdout.strip().splitlines()[-1])
    for async_save, message in said.items():
        out = tmp_path / f"async_{async_save}"
        assert "enforce fail" not in message and "unexpected pos" not in message
        assert message.startswith(f"could not write the checkpoint {out / 'step-000004'} (rank 0: File too large); "
                                  f"the previous one ({out / 'latest'}) is kept")
        assert (out / "latest").read_text() == "step-000002" and load_checkpoint(out / "ckpt.pt").iter_num == 2
    assert set(said) == {"False", "True"}


# -- a disk that fills at any byte of a save ----------------------------------------------------------------

SAVE_UNDER_A_FILE_SIZE_LIMIT = textwrap.dedent("""
    import json, resource, signal, sys
    from pathlib import Path
    from core.errors import UserError
    from model import GPT, GPTConfig
    sys.path.insert(0, "tests")
    from conftest import checkpoint_of
    folder, limits = Path(sys.argv[1]), json.loads(sys.argv[2])
    model = GPT(GPTConfig(block_size=8, vocab_size=11, n_layer=1, n_head=1, n_embd=8))
    checkpoint_of(model, iter_num=1).save(folder / "ckpt.pt")
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
    said = []
    for limit in limits:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        try:
            checkpoint_of(model, iter_num=2).save(folder / "ckpt.pt")
            said.append(None)
        except UserError as e:
            said.append(str(e))
    print(json.dumps(said))
""")


def test_a_checkpoint_save_cut_short_at_any_byte_is_one_sentence_and_keeps_the_old_one(tmp_path):
    """torch.save's own writer refuses a write the disk cuts short ('unexpected pos', or its stream's error near the
    end): a file-size limit anywhere in the file, from its first bytes to its last, stops the save with one sentence,
    the previous checkpoint whole and no temporary file."""
    from model import GPT, GPTConfig
    from conftest import checkpoint_of
    model = GPT(GPTConfig(block_size=8, vocab_size=11, n_layer=1, n_head=1, n_embd=8))
    checkpoint_of(model, iter_num=2).save(tmp_path / "probe" / "ckpt.pt")  # the size of the file to cut short (the
    size = (tmp_path / "probe" / "ckpt.pt").stat().st_size                 # archive's records carry the file's name)
    limits = sorted({*range(1, size, max(1, size // 40)), *range(size - 64, size)})  # the tail, byte by byte
    done = subprocess.run([sys.executable, "-c", SAVE_UNDER_A_FILE_SIZE_LIMIT, str(tmp_path), json.dumps(limits)],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    said = json.loads(done.stdout.strip().splitlines()[-1])
    path = tmp_path / "ckpt.pt"
    for limit, message in zip(limits, said):
        assert message == (f"could not write the checkpoint to {path} (the write was cut short: the disk is full, or "
                           f"the file past a size limit); the previous ckpt.pt is kept - free disk space or pass "
                           f"--out_dir= another folder, then resume."), (limit, message)
    assert load_checkpoint(path).iter_num == 1 and not list(tmp_path.glob("*.tmp"))


def test_a_full_disk_at_metrics_jsonl_is_one_sentence(char_data, tmp_path, monkeypatch):
    """metrics.jsonl's append is one error line, not OSError's traceback."""
    import builtins
    real_open = builtins.open

    def full(path, mode="r", *args, **kwargs):
        if str(path).endswith("metrics.jsonl") and "a" in mode:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_open(path, mode, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", full)
    out = tmp_path / "run"
    with pytest.raises(UserError, match=rf"^could not append to {out / 'metrics.jsonl'} \(No space left on device\); "
                                        r"the run stops, its checkpoint \(if one was saved\) kept - free disk space"):
        train.main([f"--data_dir={char_data}", f"--out_dir={out}", "--max_iters=2", *TINY])
    assert not list(out.glob("*.tmp"))


def test_metrics_jsonl_holds_whole_records_after_a_cut_write_and_a_resume_starts_on_a_fresh_line(char_data, tmp_path,
                                                                                                 capsys):
    """A full disk cuts an append mid-record: the cut part is taken back, so the file stays JSON lines. A crash that
    left a cut last record behind: the resume drops it before its own first line."""
    import resource
    from engine.metrics import MetricsLog
    from types import SimpleNamespace
    out = tmp_path / "run"
    assert train.main([f"--data_dir={char_data}", f"--out_dir={out}", "--max_iters=2", *TINY]) == 0
    log_file = out / "metrics.jsonl"
    whole = log_file.read_bytes()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    log = MetricsLog(SimpleNamespace(out_dir=str(out), wandb_log=False, init_from="resume"), {}, enabled=True)
    resource.setrlimit(resource.RLIMIT_FSIZE, (len(whole) + 20, hard))  # room for 20 bytes of the record
    try:
        with pytest.raises(UserError, match=r"could not append to"):
            log.log({"iter": 3, "train/step_loss": 1.0, "lr": 0.001, "ms_per_iter": 12.5, "tokens_per_s": 1000.0})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    assert log_file.read_bytes() == whole  # not a byte of the cut record
    log_file.write_bytes(whole + b'{"iter": 3, "train/st')  # what a crash mid-append leaves
    assert train.main([f"--data_dir={char_data}", f"--out_dir={out}", "--max_iters=4", "--init_from=resume",
                       *TINY]) == 0
    records = [json.loads(line) for line in log_file.read_text().splitlines()]  # every line JSON
    assert log_file.read_bytes().startswith(whole) and {r["iter"] for r in records} >= {3, 4}


@pytest.mark.parametrize("fails", ["safetensors", "tokenizer"])
def test_an_export_that_meets_a_full_disk_is_one_sentence_and_leaves_nothing(char_data, tmp_path, monkeypatch, fails):
    """The weights are written by safetensors (Rust: its own error type, not OSError), the tokenizer by Python."""
    from safetensors import SafetensorError
    import transformers.modeling_utils as modeling
    train.main([f"--data_dir={char_data}", f"--out_dir={tmp_path / 'run'}", "--max_iters=2", *TINY])

    def full(*args, **kwargs):
        if fails == "safetensors":
            raise SafetensorError('Error while serializing: I/O error: No space left on device (os error 28)')
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if fails == "safetensors":
        monkeypatch.setattr(modeling, "safe_save_file", full)
    else:
        monkeypatch.setattr(export_hf, "hf_tokenizer", full)
    hf_dir = tmp_path / "hf"
    with pytest.raises(UserError, match=rf"^could not write {hf_dir} \(.*No space left on device.*\); pass --hf_dir= "
                                        r"a writable folder with free space; nothing was left there\.$"):
        export_hf.main([f"--out_dir={tmp_path / 'run'}", f"--hf_dir={hf_dir}"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


# -- a refused run leaves out_dir as it found it -----------------------------------------------------------------

def test_an_overwrite_refused_after_claiming_out_dir_keeps_the_old_log_and_checkpoint(char_data, tmp_path):
    """--overwrite=True once deleted metrics.jsonl when it claimed out_dir; a later start-up check (here the attention
    implementation) then refused the run, and the old log was gone with nothing in its place."""
    out = tmp_path / "run"
    tiny(char_data, out, "--max_iters=2")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(UserError, match="attn='efficient' cannot run"):
        tiny(char_data, out, "--max_iters=2", "--overwrite=True", "--attn=efficient")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_new_run_on_a_full_disk_leaves_no_empty_log_so_the_same_command_runs_once_there_is_room(
        char_data, tmp_path, monkeypatch):
    out = tmp_path / "run"
    real_write = Path.write_text

    def full(path, *args, **kwargs):
        if "metrics.jsonl" in path.name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(path, *args, **kwargs)
    with monkeypatch.context() as m:
        m.setattr(Path, "write_text", full)
        with pytest.raises(UserError, match=rf"^could not write {out / 'metrics.jsonl'} \(No space left on device\); "
                                            r"nothing was written - free disk space"):
            tiny(char_data, out, "--max_iters=2")
    assert not (out / "metrics.jsonl").exists() and not list(out.glob("*.tmp"))
    tiny(char_data, out, "--max_iters=2")  # room again: the same command, not refused
    assert (out / "ckpt.pt").exists()


# -- the eighth read: tracebacks, silent takes and wrong sentences ------------------------------------------------

@pytest.mark.slow  # a process of its own: a pipe
@pytest.mark.parametrize("script", ["sample", "train", "bench"])
def test_output_piped_into_head_ends_quietly(trained_char_run, char_data, tmp_path, script):
    args = {"sample": ["sample.py", f"--out_dir={trained_char_run}", "--max_new_tokens=200", "--num_samples=3"],
            "train": ["train.py", *TINY, f"--data_dir={char_data}", f"--out_dir={tmp_path / 'run'}", "--max_iters=50"],
            "bench": ["bench.py", "--help"]}[script]
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    proc.stdout.readline()
    proc.stdout.close()  # what `head -1` does once it has its line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_a_name_longer_than_a_filesystem_takes_and_a_seed_past_63_bits_are_one_sentence(char_data, tmp_path,
                                                                                           trained_char_run):
    long = tmp_path / ("x" * 256)
    with pytest.raises(UserError, match=r"^out_dir has a name of 256 bytes \(x{20}\.\.\.\), more than the 255 a file "
                                        r"or folder name may have; pass --out_dir= a shorter one\.$"):
        tiny(char_data, long)
    with pytest.raises(UserError, match=r"^json has a name of 261 bytes"):
        sample.main([f"--out_dir={trained_char_run}", f"--json={long}.json"])
    for main, args in ((train.main, [*TINY, f"--data_dir={char_data}", f"--out_dir={tmp_path / 'run'}"]),
                       (sample.main, [f"--out_dir={trained_char_run}"])):
        with pytest.raises(UserError, match=r"^seed must be a whole number at least 0 and less than 2\*\*63"):
            main(args + [f"--seed={2 ** 64 + 5}"])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("meta, said", [
    ({"eot_token": "x"}, r"has an \"eot_token\" that is not a token id below its vocab_size \d+, nor -1 for none "
                         r"\(it holds 'x'\)"),
    ({"eot_token": 10 ** 6}, r"has an \"eot_token\" that is not a token id below its vocab_size \d+, nor -1 for "
                             r"none \(it holds 1000000\)"),
    ({"chars": ["a", "b"]}, r"is a character vocabulary of vocab_size (\d+) but its \"chars\" are 2 characters, not "
                            r"\1 single characters"),
], ids=["eot-not-a-number", "eot-past-the-vocabulary", "fewer-chars"])
def test_a_meta_json_that_cannot_be_right_is_refused_before_training(char_data, tmp_path, meta, said):
    """A meta.json with fewer characters than its vocab_size once trained a checkpoint sample.py then refused."""
    data = tmp_path / "data"
    shutil.copytree(char_data, data)
    (data / "meta.json").write_text(json.dumps({**json.loads((data / "meta.json").read_text()), **meta}))
    with pytest.raises(UserError, match=rf"^{data / 'meta.json'} {said}; rerun the dataset's prepare.py$"):
        tiny(char_data, tmp_path / "run", f"--data_dir={data}")
    assert not (tmp_path / "run").exists()


def test_a_path_of_the_wrong_kind_is_named_as_such(char_data, tmp_path, trained_char_run):
    with pytest.raises(UserError, match=r"data_dir .*train\.bin is a file, not a folder; pass --data_dir="):
        tiny(char_data, tmp_path / "run", f"--data_dir={char_data / 'train.bin'}")
    data = tmp_path / "data"
    shutil.copytree(char_data, data)
    (data / "train.bin").unlink()
    (data / "train.bin").mkdir()
    with pytest.raises(UserError, match=r"train\.bin is a folder, not a token file; a dataset folder needs"):
        tiny(char_data, tmp_path / "run", f"--data_dir={data}")
    with pytest.raises(UserError, match=rf"^prompt file {tmp_path} is a folder; pass --start=FILE: and an existing"):
        sample.main([f"--out_dir={trained_char_run}", f"--start=FILE:{tmp_path}"])
    (tmp_path / "empty" / "ckpt.pt").mkdir(parents=True)
    with pytest.raises(UserError, match=r"ckpt\.pt is a folder, not a checkpoint file; pass --out_dir= the folder"):
        sample.main([f"--out_dir={tmp_path / 'empty'}"])
    for given in (trained_char_run, trained_char_run / "ckpt.pt"):  # the hub was named for these
        with pytest.raises(UserError, match=rf"^{given} is a checkpoint train.py wrote, .*pass --init_from=resume "
                                            rf"--out_dir={trained_char_run}\.$"):
            sample.main([f"--init_from={given}"])


def test_digits_are_a_prompt_and_a_config_file_that_exits_is_refused(trained_char_run, char_data, tmp_path, capsys):
    assert sample.main([f"--out_dir={trained_char_run}", "--start=2024", "--num_samples=1", "--max_new_tokens=3",
                        "--temperature=0"]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("2024")
    config = tmp_path / "exits.py"
    config.write_text("import sys\nbatch_size = 2\nsys.exit(0)\n")
    with pytest.raises(UserError, match=rf"^config file '{config}' calls sys.exit\(\), and nothing ran"):
        tiny(char_data, tmp_path / "run", str(config))


def test_a_nanogpt_meta_pkl_nested_without_end_is_refused(tmp_path):
    from tools.nanogpt import read_nanogpt_meta
    depth = 100_000
    (tmp_path / "meta.pkl").write_bytes(b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b".")  # lists in lists
    with pytest.raises(UserError, match=r"is refused: it is not a pickle of plain .*nested too deep"):
        read_nanogpt_meta(tmp_path / "meta.pkl")


def test_a_checkpoint_field_this_version_does_not_know_is_said(trained_char_run, tmp_path, capsys):
    saved = torch.load(trained_char_run / "ckpt.pt", weights_only=True)
    saved["model_config"]["rope_theta"] = 10000.0  # a newer version's
    (tmp_path / "run").mkdir()
    torch.save(saved, tmp_path / "run" / "ckpt.pt")
    load_checkpoint(tmp_path / "run" / "ckpt.pt")
    assert capsys.readouterr().err == (f"note: {tmp_path / 'run' / 'ckpt.pt'}'s model_config has field(s) this "
                                       f"version does not know (rope_theta: a newer version's checkpoint?); the "
                                       f"model is built without them.\n")


def test_an_export_to_a_long_legal_name_works_and_one_stopped_leaves_nothing(trained_char_run, tmp_path,
                                                                             monkeypatch):
    """The staging folder's name was made from hf_dir's, so a legal 250-byte name was refused; a SIGTERM during the
    export left the staging folder for ever."""
    from core import errors
    long = tmp_path / ("h" * 250)
    assert export_hf.main([f"--out_dir={trained_char_run}", f"--hf_dir={long}"]) == 0
    assert (long / "config.json").is_file()
    real = export_hf.hf_tokenizer

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)
    monkeypatch.setattr(export_hf, "hf_tokenizer", terminated)
    stopped = tmp_path / "stopped"
    assert errors.exit_code(lambda: export_hf.main([f"--out_dir={trained_char_run}", f"--hf_dir={stopped}"])) == 143
    assert sorted(p.name for p in tmp_path.iterdir()) == [long.name]


def test_a_sample_reading_while_the_run_replaces_its_step_reads_the_new_one(sharded_run, tmp_path, monkeypatch):
    """keep_checkpoints=1: the run points `latest` at a new step and removes the old one while sample reads it."""
    from tools import sharded
    out = tmp_path / "run"
    shutil.copytree(sharded_run, out)
    (out / "latest").write_text("step-000002")
    real = sharded.read_step

    def run_moves_on(folder, parts):
        if folder.name == "step-000002":
            (out / "latest").write_text("step-000004")
            shutil.rmtree(folder)
        return real(folder, parts)
    monkeypatch.setattr(sharded, "read_step", run_moves_on)
    assert load_checkpoint(out / "ckpt.pt").iter_num == 4


@pytest.mark.slow  # three processes at once
def test_three_preparations_into_one_folder_at_once_each_end_whole(tmp_path):
    """They once shared one train.bin.tmp, and one ended in a traceback."""
    runs = [subprocess.Popen([sys.executable, str(REPO / "data" / "shakespeare_char" / "prepare.py"),
                              f"--out_dir={tmp_path}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for _ in range(3)]
    assert [(p.wait(timeout=300), p.stderr.read()) for p in runs] == [(0, "")] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json", "train.bin", "val.bin"]


# -- a path is written as what it is: a symlink through, a device or FIFO as a stream ---------------------------

def test_a_staged_write_goes_through_a_symlink_and_leaves_the_link(tmp_path):
    target = tmp_path / "elsewhere" / "target.json"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    writing.write_json(link, {"a": 1}, "json")
    assert link.is_symlink() and os.readlink(link) == str(target) and json.loads(target.read_text()) == {"a": 1}
    assert [p.name for p in target.parent.iterdir()] == ["target.json"]  # staged beside the target, renamed there
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "link.json"]


def test_a_fifo_is_written_as_a_stream_and_stays_a_fifo(tmp_path):
    """What `--json=/dev/stdout` (piped into jq) meets, made in a temporary folder: written to, never renamed over."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    writing.write_json(fifo, {"a": 1}, "json")
    reader.join(30)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and json.loads(got[0]) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["pipe"]


def test_a_stream_that_cannot_take_the_write_is_one_line_and_stays_what_it_was(tmp_path, monkeypatch):
    """A full device (/dev/full), stood in for by a FIFO whose every write fails: one error line, and the FIFO is still a
    FIFO (as root, the old code replaced /dev/full with a regular file)."""
    fifo = tmp_path / "full"
    os.mkfifo(fifo)
    real = Path.write_text

    def full(self, *args, **kwargs):
        if self == fifo:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, *args, **kwargs)
    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(UserError, match=rf"^could not write {fifo} \(No space left on device\); what reached it may "
                                        rf"be partial - pass --json= a writable path\.$"):
        writing.write_json(fifo, {"a": 1}, "json")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and [p.name for p in tmp_path.iterdir()] == ["full"]


def test_sample_json_and_a_checkpoint_are_written_through_links_in_out_dir(trained_char_run, char_data, tmp_path):
    """One rule for every link a user makes, whoever writes it: sample's --json, a checkpoint save and the log's
    lines all land in the link's target, and the links stay links."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    report = tmp_path / "report.json"
    report.symlink_to(elsewhere / "report.json")
    assert sample.main([f"--out_dir={trained_char_run}", "--num_samples=1", "--max_new_tokens=2",
                        f"--json={report}"]) == 0
    assert report.is_symlink() and json.loads((elsewhere / "report.json").read_text())["samples"]
    out = tmp_path / "run"
    tiny(char_data, out, "--max_iters=2")
    for name in ("ckpt.pt", "metrics.jsonl"):
        shutil.move(out / name, elsewhere / name)
        (out / name).symlink_to(elsewhere / name)
    lines = len((elsewhere / "metrics.jsonl").read_text().splitlines())
    tiny(char_data, out, f"--max_iters={load_checkpoint(out / 'ckpt.pt').iter_num + 2}", "--init_from=resume")
    assert (out / "ckpt.pt").is_symlink() and (out / "metrics.jsonl").is_symlink()
    assert load_checkpoint(elsewhere / "ckpt.pt").iter_num == load_checkpoint(out / "ckpt.pt").iter_num
    assert len((elsewhere / "metrics.jsonl").read_text().splitlines()) > lines


# -- a sharded checkpoint is read without running code -------------------------------------------------------

class RunsACommand:
    """What a crafted pickle holds: unpickling it runs `touch <marker>`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def pickled_metadata(out: Path, marker: Path) -> None:
    """.metadata replaced by a pickle that runs a command when it is loaded."""
    import pickle
    (out / "step-000004" / ".metadata").write_bytes(pickle.dumps(RunsACommand(marker)))


def one_more_entry(out: Path, marker: Path) -> None:
    """Step 4 saved again by dcp.save with one more entry, among the settings, whose unpickling runs a command."""
    import torch.distributed.checkpoint as dcp
    from tools.sharded import read_step
    from engine.checkpoint import TRAIN
    step = out / "step-000004"
    contents = read_step(step, {"model", "optimizer"})
    state = {"model": contents.pop("model"), "optimizer": contents.pop("optimizer"), TRAIN: contents}
    state[TRAIN]["settings"]["extra"] = RunsACommand(marker)
    shutil.rmtree(step)
    dcp.save(state, checkpoint_id=step)


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("craft", [pickled_metadata, one_more_entry], ids=["metadata", "an entry"])
def test_a_crafted_sharded_step_runs_no_code_in_any_reader_and_is_one_line(sharded_run, char_data, tmp_path, reader,
                                                                           craft):
    marker = tmp_path / "ran"
    out = damaged(sharded_run, tmp_path, lambda out: craft(out, marker))
    with pytest.raises(UserError, match=rf"^{out}/step-000004's shards cannot be read \(UnpicklingError: .*\); "
                                        rf"the newest whole step before it is {out}/step-000002") as refused:
        READERS[reader](out, char_data)
    assert "\n" not in str(refused.value) and not marker.exists()


def short_text(text: str) -> bytes:  # pickle's SHORT_BINUNICODE
    return b"\x8c" + bytes([len(text.encode())]) + text.encode()


def bypasses(marker: Path) -> dict[str, bytes]:
    """Hand-made pickles of each kind that has slipped past an allow-list elsewhere; any that ran would make
    `marker`. Protocol 4: module and name by STACK_GLOBAL, REDUCE calls, then STOP."""
    p4, command = b"\x80\x04", f"touch {marker}"
    call = short_text(command) + b"\x85R."  # (command,) called by REDUCE

    def global4(module: str, name: str) -> bytes:
        return p4 + short_text(module) + short_text(name) + b"\x93"
    return {
        "dotted name under an admitted module": global4("torch.distributed.checkpoint.metadata", "os.system") + call,
        "a name an admitted module imports": global4("torch.distributed.checkpoint.metadata", "field") + b")R.",
        "builtins exec by REDUCE": global4("builtins", "exec") + short_text(
            f"import os; os.system({command!r})") + b"\x85R.",
        "operator by REDUCE": global4("operator", "methodcaller") + short_text("system") + b"\x85R.",
        "functools by REDUCE": global4("functools", "partial") + global4("os", "system")[2:] + b"\x85R.",
        "INST": b"(" + f"V{command}\n".encode() + b"ios\nsystem\n.",
        "OBJ": b"(cos\nsystem\n" + f"V{command}\n".encode() + b"o.",
        "NEWOBJ": global4("os", "system") + b")\x81.",
        "BUILD on an admitted class": global4("pathlib", "PosixPath") + short_text("x") + b"\x85R}" + short_text(
            "_raw_paths") + short_text(command) + b"sb.",
        "EXT1": p4 + b"\x82\x01.", "EXT2": p4 + b"\x83\x01\x00.", "EXT4": p4 + b"\x84\x01\x00\x00\x00.",
        "persistent id": p4 + short_text(command) + b"Q.",
    }


@pytest.mark.parametrize("reader", ["sample", "resume"])
def test_no_crafted_metadata_runs_code_and_each_is_one_line(sharded_run, char_data, tmp_path, reader):
    """The .metadata allow-list admits exact (module, name) pairs only: every kind of bypass is one error line, and
    the marker a bypass would make is never made."""
    marker = tmp_path / "ran"
    for kind, crafted in bypasses(marker).items():
        out = damaged(sharded_run, tmp_path / kind.replace(" ", "_"),
                      lambda out: (out / "step-000004" / ".metadata").write_bytes(crafted))
        with pytest.raises(UserError, match=rf"^{out}/step-000004's shards cannot be read \(\w+.*\); the newest "
                                            rf"whole step before it is {out}/step-000002") as refused:
            READERS[reader](out, char_data)
        assert "\n" not in str(refused.value) and not marker.exists(), kind


def test_no_crafted_meta_pkl_runs_code_and_each_is_one_line(tmp_path):
    """nanoGPT's meta.pkl is read with every import refused: the same bypasses are one error line each."""
    from tools.nanogpt import read_nanogpt_meta
    marker = tmp_path / "ran"
    for kind, crafted in bypasses(marker).items():
        (tmp_path / "meta.pkl").write_bytes(crafted)
        with pytest.raises(UserError, match=rf"^{tmp_path / 'meta.pkl'} is refused: it is not a pickle of plain"):
            read_nanogpt_meta(tmp_path / "meta.pkl")
        assert not marker.exists(), kind


def test_a_step_removed_while_it_is_read_is_passed_over_for_the_newer_one_without_tracebacks(
        sharded_run, char_data, tmp_path, monkeypatch, capfd, caplog):
    """A training run saves step 6 and removes step 4 (keep_checkpoints) while sample reads step 4: sample reads step
    6, and prints none of DCP's logged fallback ("Global metadata is not found") or its tracebacks."""
    from tools import sharded
    out = damaged(sharded_run, tmp_path, lambda out: None)
    real, moved = sharded.SafeReader.read_metadata, []

    def run_moves_on(self, *args, **kwargs):
        metadata = real(self, *args, **kwargs)
        if not moved and Path(self.path).name == "step-000004":  # the run's save of step 6, then its clean-up
            moved.append(1)
            shutil.copytree(out / "step-000004", out / "step-000006")
            (out / "latest").write_text("step-000006")
            shutil.rmtree(out / "step-000004")
        return metadata
    monkeypatch.setattr(sharded.SafeReader, "read_metadata", run_moves_on)
    capfd.readouterr()
    assert sample.main([f"--out_dir={out}", "--max_new_tokens=2", "--num_samples=1"]) == 0
    err = capfd.readouterr().err
    assert moved and "Traceback" not in err and "Global metadata" not in err, err[-2000:]
    assert not [r for r in caplog.records if r.exc_info or "metadata" in r.getMessage()]  # DCP logs to the root


# -- weights that are not finite --------------------------------------------------------------------------------

NAN_READERS = {**{k: v for k, v in READERS.items() if k != "conversion"},
               "eval_only": lambda out, data: train.main(TINY + [f"--data_dir={data}", f"--out_dir={out}",
                                                                 "--init_from=resume", "--eval_only=True"])}


@pytest.mark.parametrize("reader", list(NAN_READERS))
@pytest.mark.parametrize("sharded", [False, True], ids=["ckpt.pt", "sharded"])
def test_a_checkpoint_with_a_nan_weight_is_named_as_such_by_every_reader(char_data, tmp_path, reader, sharded):
    out = tmp_path / "run"
    tiny(char_data, out, "--max_iters=2", *(SHARDED if sharded else []))
    if sharded:  # step 2 saved again with one NaN weight
        import torch.distributed.checkpoint as dcp
        from engine.checkpoint import TRAIN
        from tools.sharded import read_step
        step = out / "step-000002"
        contents = read_step(step, {"model", "optimizer"})
        contents["model"]["transformer.h.0.mlp.c_fc.weight"][0, 0] = float("nan")
        state = {"model": contents.pop("model"), "optimizer": contents.pop("optimizer"), TRAIN: contents}
        shutil.rmtree(step)
        dcp.save(state, checkpoint_id=step)
    else:
        saved = torch.load(out / "ckpt.pt", weights_only=True)
        saved["model"]["transformer.h.0.mlp.c_fc.weight"][0, 0] = float("nan")
        torch.save(saved, out / "ckpt.pt")
    with pytest.raises(UserError, match=r"holds weights that are not finite \(NaN or inf: transformer\.h\.0\.mlp\."
                                        r"c_fc\.weight\), so it can be neither trained on nor sampled from; use an "
                                        r"earlier checkpoint\.$"):
        NAN_READERS[reader](out, char_data)
    assert not (tmp_path / "hf").exists()
