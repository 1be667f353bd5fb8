"""Bad input and faults: nothing a user types costs them data (checkpoints, prepared datasets), and every mistake
is one error line that says what was wrong and what to do. Run in process through each script's main(argv)."""

import itertools
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from pathlib import Path

import bench
from core import configurator
from core import errors
from core import dataset
import sample
import train
from engine.reader import load_checkpoint
from conftest import REPO, TINY, checkpoint_of, metrics
from model import GPT, GPTConfig
from core.errors import UserError


def train_tiny(*args: str) -> int:
    return train.main(TINY + list(args))


@pytest.fixture(scope="module")
def trained_once(char_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained") / "out"
    train_tiny(f"--data_dir={char_data}", "--max_iters=2", "--eval_interval=2", f"--out_dir={out}")
    return out


@pytest.fixture()
def trained(trained_once, tmp_path):
    """out_dir holding the checkpoint and metrics of two steps of a tiny model (evaluated and saved at step 2): a
    copy of one run per module, this test's own to change."""
    return shutil.copytree(trained_once, tmp_path / "out")


def token_folder(path, train_ids, val_ids=None, vocab_size=None):
    path.mkdir(parents=True)
    np.asarray(train_ids, dtype=np.uint16).tofile(path / "train.bin")
    if val_ids is not None:
        np.asarray(val_ids, dtype=np.uint16).tofile(path / "val.bin")
    if vocab_size is not None:
        chars = [chr(ord("a") + i) for i in range(vocab_size)]
        (path / "meta.json").write_text(json.dumps({"tokenizer": "char", "vocab_size": vocab_size, "chars": chars}))
    return path


# -- data loss -------------------------------------------------------------------------------------------

def test_eval_only_after_resume_evaluates_at_the_resumed_step_and_writes_nothing(trained, char_data, capsys):
    before = {name: (trained / name).read_bytes() for name in ("ckpt.pt", "metrics.jsonl")}
    capsys.readouterr()
    train_tiny(f"--data_dir={char_data}", "--init_from=resume", "--eval_only=True", "--max_iters=100",
               "--eval_interval=2", f"--out_dir={trained}")
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    fields = printed.split()
    assert fields[:2] == ["iter", "2"], printed
    # the same fixed evaluation batches as the training run's evaluation at step 2, so the same loss
    assert float(fields[fields.index("val/loss") + 1]) == pytest.approx(metrics(trained, "val/loss")[2], rel=1e-3)
    assert {name: (trained / name).read_bytes() for name in before} == before
    assert sorted(p.name for p in trained.iterdir()) == [".lock", "ckpt.pt", "metrics.jsonl"]  # .lock: empty


def test_a_new_run_into_another_runs_out_dir_is_refused_and_its_files_survive(trained, char_data):
    before = {name: (trained / name).read_bytes() for name in ("ckpt.pt", "metrics.jsonl")}
    with pytest.raises(UserError) as refused:
        train_tiny(f"--data_dir={char_data}", "--max_iters=2", "--optimizer=muon", f"--out_dir={trained}")
    val = metrics(trained, "val/loss")[2]
    assert str(refused.value) == (f"{trained} already holds another run's checkpoint (iter 2, val loss {val:.3f}); "
                                  f"continue it with --init_from=resume, pass another --out_dir=, or replace it "
                                  f"with --overwrite=True.")
    assert {name: (trained / name).read_bytes() for name in before} == before
    (trained / "ckpt.pt").unlink()  # a run that stopped before its first checkpoint: nothing to resume, reused
    assert (trained / ".lock").exists()
    train_tiny(f"--data_dir={char_data}", "--max_iters=3", "--eval_interval=3", f"--out_dir={trained}")
    assert sorted(metrics(trained, "train/step_loss")) == [1, 2, 3]  # the new run's log, the old one replaced


def test_overwrite_starts_the_out_dir_afresh(trained, char_data):
    train_tiny(f"--data_dir={char_data}", "--max_iters=3", "--eval_interval=3", "--overwrite=True",
               f"--out_dir={trained}")
    assert sorted(metrics(trained, "train/step_loss")) == [1, 2, 3]  # this run's lines only
    assert load_checkpoint(trained / "ckpt.pt").iter_num == 3


def test_a_mistyped_data_dir_is_refused_and_the_custom_corpus_in_the_default_folder_survives(
        char_data, tmp_path, monkeypatch):
    data = tmp_path / "data"
    corpus = data / "shakespeare_char"  # the default folder, holding a corpus prepared with --input=
    corpus.mkdir(parents=True)
    for name in ("train.bin", "val.bin", "meta.json"):
        (corpus / name).write_bytes((char_data / name).read_bytes())
    # a prepare script that would clobber the corpus if it were ever run
    (corpus / "prepare.py").write_text("from pathlib import Path\n"
                                       "for n in ('train.bin', 'val.bin', 'meta.json'):\n"
                                       "    (Path(__file__).parent / n).write_text('overwritten')\n")
    before = {p.name: p.read_bytes() for p in corpus.iterdir()}
    monkeypatch.setattr(dataset, "DATA", data)
    with pytest.raises(UserError, match=f"data_dir {data / 'shakespear_char'} does not exist"):
        train_tiny("--dataset=shakespeare_char", f"--data_dir={data / 'shakespear_char'}",
                   f"--out_dir={tmp_path / 'out'}")
    (corpus / "val.bin").unlink()  # a half-prepared default folder is not prepared over either
    del before["val.bin"]
    with pytest.raises(UserError, match="data/shakespeare_char/val.bin is missing"):
        train_tiny("--dataset=shakespeare_char", f"--out_dir={tmp_path / 'out'}")
    assert {p.name: p.read_bytes() for p in corpus.iterdir()} == before


def test_an_empty_default_folder_of_an_embedded_dataset_is_prepared_there_by_its_prepare_script(tmp_path,
                                                                                                   monkeypatch):
    """train.py runs the folder's own prepare.py with --out_dir= the folder, then trains on what it wrote: here a
    stand-in that writes a small dataset; the packaged script preparing the plays is the slow test below."""
    folder = tmp_path / "data" / "shakespeare_char"
    folder.mkdir(parents=True)
    (folder / "prepare.py").write_text(
        "import json, sys\n"
        "from pathlib import Path\n"
        "import numpy as np\n"
        f"assert sys.argv[1:] == ['--out_dir={folder}'], sys.argv\n"
        "out = Path(sys.argv[1].split('=', 1)[1])\n"
        "(np.arange(3000) % 7).astype(np.uint16).tofile(out / 'train.bin')\n"
        "(np.arange(300) % 7).astype(np.uint16).tofile(out / 'val.bin')\n"
        "(out / 'meta.json').write_text(json.dumps({'tokenizer': 'char', 'vocab_size': 7, 'chars': list('abcdefg')}))\n")
    monkeypatch.setattr(dataset, "DATA", tmp_path / "data")
    train_tiny("--dataset=shakespeare_char", "--max_iters=1", "--eval_interval=1", f"--out_dir={tmp_path / 'out'}")
    assert load_checkpoint(tmp_path / "out" / "ckpt.pt").meta["chars"] == list("abcdefg")


@pytest.mark.slow  # the packaged script, in its own interpreter, reads every play
def test_an_empty_default_folder_of_an_embedded_dataset_is_prepared_there(tmp_path, monkeypatch):
    folder = tmp_path / "data" / "shakespeare_char"
    folder.mkdir(parents=True)
    (folder / "prepare.py").write_text((REPO / "data" / "shakespeare_char" / "prepare.py").read_text()
                                       .replace("REPO_ROOT = HERE.parent.parent", f"REPO_ROOT = {str(REPO)!r}"))
    monkeypatch.setattr(dataset, "DATA", tmp_path / "data")
    train_tiny("--dataset=shakespeare_char", "--max_iters=1", "--eval_interval=1", f"--out_dir={tmp_path / 'out'}")
    assert json.loads((folder / "meta.json").read_text())["vocab_size"] > 60  # the packaged plays' characters
    assert (tmp_path / "out" / "ckpt.pt").is_file()


def test_a_full_disk_while_saving_keeps_the_previous_checkpoint_and_leaves_no_temporary_file(trained, char_data,
                                                                                              monkeypatch):
    before = (trained / "ckpt.pt").read_bytes()
    # every write of the checkpoint fails as on a full disk ("No space left on device")
    def full_disk(contents, f):  # what torch.save's writer raises once the disk takes no more
        f.write(b"PK")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 768 vs 662")
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(UserError, match=r"could not write the checkpoint .*the write was cut short: the disk is full"
                                        r".*previous ckpt.pt is kept"):
        train_tiny(f"--data_dir={char_data}", "--init_from=resume", "--max_iters=4", "--eval_interval=2",
                   f"--out_dir={trained}")
    assert (trained / "ckpt.pt").read_bytes() == before
    assert load_checkpoint(trained / "ckpt.pt", for_training=True).iter_num == 2
    assert not os.path.lexists(trained / f"ckpt.pt.{os.getpid()}.tmp")


def test_an_out_dir_made_read_only_after_a_save_is_one_line_and_keeps_the_checkpoint(trained, char_data,
                                                                                     monkeypatch):
    """A folder made read-only (or a filesystem remounted so) after the first save: the next save is one error line,
    and the checkpoint already there is kept. (Root writes through permissions: the open is refused here as the
    kernel refuses it.)"""
    from engine import checkpoint
    before = (trained / "ckpt.pt").read_bytes()

    def read_only(path, mode="r", *args, **kwargs):
        raise OSError(30, "Read-only file system", str(path))
    monkeypatch.setattr(checkpoint, "open", read_only, raising=False)
    with pytest.raises(UserError, match=r"^could not write the checkpoint to .*ckpt.pt \(Read-only file system\); "
                                        r"the previous ckpt.pt is kept"):
        train_tiny(f"--data_dir={char_data}", "--init_from=resume", "--max_iters=4", "--eval_interval=2",
                   f"--out_dir={trained}")
    assert (trained / "ckpt.pt").read_bytes() == before


@pytest.mark.parametrize("kind", ["read-only filesystem", "a folder", "a link to nothing"])
def test_an_out_dir_whose_lock_cannot_be_taken_is_one_line(char_data, tmp_path, monkeypatch, kind):
    from core import writing
    out = tmp_path / "out"
    out.mkdir()
    if kind == "a folder":
        (out / ".lock").mkdir()
    elif kind == "a link to nothing":
        (out / ".lock").symlink_to(tmp_path / "gone" / "lock")
    else:
        def read_only(path, mode="r", *args, **kwargs):
            raise OSError(30, "Read-only file system", str(path))
        monkeypatch.setattr(writing, "open", read_only, raising=False)
        monkeypatch.setattr(writing, "check_writable_dir", lambda *a, **k: None)  # passes, as on a lying mount
    said = {"a folder": r"\.lock is a folder, not the run's lock file; remove it",
            "a link to nothing": r"\.lock is a link to a path that cannot be made, not the run's lock file",
            "read-only filesystem": r"cannot be written to \(Read-only file system\): a run writes its lock"}[kind]
    with pytest.raises(UserError, match=said):
        train_tiny(f"--data_dir={char_data}", f"--out_dir={out}")


# -- settings out of range --------------------------------------------------------------------------------

@pytest.mark.parametrize("script, override, sentence", [
    (train, "--batch_size=0", "batch_size must be at least 1, got 0"),
    (train, "--batch_size=-4", "batch_size must be at least 1, got -4"),
    (train, "--max_iters=-1", "max_iters must be at least 0, got -1"),
    (train, "--eval_interval=0", "eval_interval must be at least 1"),
    (train, "--eval_iters=-1", "eval_iters must be a whole number at least 0"),
    (train, "--log_interval=0", "log_interval must be at least 1"),
    (train, "--gradient_accumulation_steps=0", "gradient_accumulation_steps must be at least 1"),
    (train, "--learning_rate=-0.001", "learning_rate must be greater than 0, got -0.001"),
    (train, "--dropout=1.0", "dropout must be at least 0 and less than 1, got 1.0"),
    (train, "--beta2=1.5", "beta2 must be at least 0 and less than 1"),
    (sample, "--num_samples=0", "num_samples must be at least 1"),
    (sample, "--temperature=-0.5", "temperature must be at least 0"),
    (sample, "--top_k=0", "top_k must be a whole number at least 1, or None"),
    (bench, "--iters=0", "iters must be a whole number at least 1"),
    (bench, "--n_layer=-2", "n_layer must be a whole number at least 1"),
    (bench, "--mem_budget_gb=0", "mem_budget_gb must be greater than 0"),
])
def test_a_numeric_setting_out_of_range_is_one_sentence_at_configuration_time(script, override, sentence):
    with pytest.raises(UserError, match=sentence):
        script.main([override])  # raised before any device, data or model is touched


@pytest.mark.parametrize("script", [train, sample, bench])
def test_every_numeric_setting_of_every_script_has_a_declared_range(script):
    numeric = {k for k, v in configurator.settings(vars(script)).items() if type(v) in (int, float)}
    assert numeric and numeric <= set(script.LIMITS)
    assert configurator.configure(vars(script), [], script.LIMITS)  # the defaults are within their ranges


def test_a_numeric_setting_without_a_range_is_a_programming_error():
    with pytest.raises(RuntimeError, match="no LIMITS entry for numeric setting.*warmup"):
        configurator.configure({"warmup": 10, "name": "x"}, [], {})


def test_none_is_allowed_where_a_script_sizes_a_setting_itself_and_a_word_is_not_a_number():
    limits = {"n_layer": "[1, inf)"}
    assert configurator.configure({"n_layer": None}, [], limits).n_layer is None
    with pytest.raises(UserError, match="n_layer must be a number, got 'deep'"):
        configurator.configure({"n_layer": None}, ["--n_layer=deep"], limits)


def test_a_choice_is_checked_against_its_declared_words_before_anything_runs():
    defaults = {"parallel": "ddp", "padding": None}
    limits = {"parallel": configurator.one_of("ddp", "fsdp"), "padding": configurator.comma_list_of("off", "on")}
    cfg = configurator.configure(defaults, ["--parallel=fsdp", "--padding=off,on"], limits)
    assert (cfg.parallel, cfg.padding) == ("fsdp", "off,on")
    assert configurator.configure(defaults, [], limits).padding is None  # None: the script picks
    with pytest.raises(UserError, match="^parallel must be one of 'ddp', 'fsdp', got 'zero'.$"):
        configurator.configure(defaults, ["--parallel=zero"], limits)
    with pytest.raises(UserError, match="^padding must be a comma list of 'off', 'on', got 'off,maybe'; 'maybe' is not one of them.$"):
        configurator.configure(defaults, ["--padding=off,maybe"], limits)
    with pytest.raises(UserError, match="parallel must be one of 'ddp', 'fsdp', got 'zero'"):
        train.main(["--parallel=zero"])  # declared beside train.py's LIMITS, refused before any work


@pytest.mark.slow  # a fresh interpreter importing torch: what only the command line shows
def test_the_command_line_prints_an_out_of_range_setting_as_one_line():
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "config/train_shakespeare_char_cpu.py",
                             "--gradient_accumulation_steps=0"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: gradient_accumulation_steps must be at least 1, got 0; pass --gradient_accumulation_steps= a value "
        "in [1, inf)."]



def test_a_scripts_user_error_is_one_line_on_stderr_and_exit_code_2_and_a_bug_still_raises(capsys):
    """errors.exit_code, which every script's __main__ goes through (runtime.run_main): the in-process half of the
    command-line tests (marked slow), which also show the scripts are wired to it."""
    def refuses():
        raise UserError("batch_size must be at least 1, got 0; pass --batch_size= a value in [1, inf).")
    assert errors.exit_code(refuses) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: batch_size must be at least 1, got 0; pass --batch_size= a value in [1, inf)."]
    assert errors.exit_code(lambda: None) == 0 and errors.exit_code(lambda: 3) == 3
    assert errors.exit_code(lambda: (_ for _ in ()).throw(KeyboardInterrupt)) == 130
    assert capsys.readouterr().err == "interrupted\n"
    with pytest.raises(ZeroDivisionError):  # a programming error keeps its traceback
        errors.exit_code(lambda: 1 / 0)
    assert capsys.readouterr().err == ""


# -- the start-up check: every problem at once, before anything is written ----------------------------------

@pytest.mark.parametrize("args, named", [
    (["--batch_size=0", "--dataset=nope"], ["batch_size must be at least 1, got 0", "unknown dataset 'nope'"]),
    (["--n_embd=130", "--dataset=nope"], ["n_embd=130 is not divisible by n_head=12", "unknown dataset 'nope'"]),
    (["--n_embd=130", "--dataset=plays"], ["n_embd=130 is not divisible by n_head=12"]),
    (["--n_embd=130", "--async_save=True", "--dataset=plays"], ["async_save=True writes sharded checkpoints only",
                                                                "n_embd=130 is not divisible by n_head=12"]),
])
def test_every_start_up_problem_is_named_at_once_and_nothing_is_prepared_or_made(args, named, tmp_path,
                                                                                   monkeypatch):
    """A setting out of range, a rule between settings, the model's shape and a missing dataset are one error line
    together; an embedded dataset is not prepared and out_dir is not made for a command that is refused."""
    from core import dataset
    plays = tmp_path / "data" / "plays"
    plays.mkdir(parents=True)
    (plays / "prepare.py").write_text("open(__file__ + '.ran', 'w')")  # a marker: preparing ran
    monkeypatch.setattr(dataset, "DATA", tmp_path / "data")
    monkeypatch.setattr(dataset, "EMBEDDED_DATASETS", {"plays"})
    with pytest.raises(UserError) as refused:
        train.main(["--device=cpu", "--compile=False", *args, f"--out_dir={tmp_path / 'out'}"])
    said = str(refused.value)
    assert said.startswith(f"{len(named)} problems: (1) " if len(named) > 1 else named[0]), said
    assert all(f"({i}) {text}" in said for i, text in enumerate(named, 1)) or len(named) == 1, said
    assert [p.name for p in plays.iterdir()] == ["prepare.py"] and not (tmp_path / "out").exists()


def tree(*folders: Path) -> dict:
    """Every path under the folders with its bytes (None for a folder): what a refused command must leave as it was."""
    return {str(p): None if p.is_dir() else p.read_bytes() for folder in folders if folder.exists()
            for p in [folder, *sorted(folder.rglob("*"))]}


MIXED = {  # a mix of bad settings, of each kind beside the others -> what the one report must name
    "range, device, model, data": (["--dtype=float64", "--n_embd=130", "--dataset=nope"],
                                   ["dtype must be one of", "n_embd=130 is not divisible", "unknown dataset 'nope'"]),
    "device, model, data": (["--device=cuda:99", "--n_embd=130", "--dataset=nope"],
                            ["device 'cuda:99'", "n_embd=130 is not divisible", "unknown dataset 'nope'"]),
    "resume, range, runtime, rule": (["--init_from=resume", "--out_dir={tmp}/empty", "--batch_size=0",
                                      "--async_save=True", "--threads=100000", "--dataset=plays"],
                                     ["batch_size must be at least 1", "--threads=100000 is more threads",
                                      "no checkpoint at", "async_save=True writes sharded checkpoints only"]),
    "unknown, range, data": (["--n_layr=3", "--batch_size=0", "--dataset=nope"],
                             ["unknown setting 'n_layr'", "batch_size must be at least 1", "unknown dataset 'nope'"]),
    "type, range, data": (["--batch_size=abc", "--learning_rate=-1", "--dataset=nope"],
                          ["batch_size expects an int", "learning_rate must be greater than 0",
                           "unknown dataset 'nope'"]),
    "no value, config file, rule": (["--compile", "{tmp}/raises.py", "--async_save=True", "--dataset=plays"],
                                    ["'--compile' has no value", "raises.py' failed to run",
                                     "async_save=True writes sharded checkpoints only"]),
    "init_from, block_size": (["--init_from={tmp}/gpt2-local", "--block_size=128", "--dataset=plays"],
                              ["block_size=128 is longer than the 64 positions"]),
    "init_from, vocabulary": (["--init_from={tmp}/gpt2-local", "--block_size=8", "--data_dir={tmp}/chars"],
                              ["has vocab_size 50257 but the data in"]),
    "a batch out of range, the weights past memory": (["--batch_size=0", "--n_embd=1000000000000", "--n_head=1",
                                                        "--dataset=plays"],
                                                       ["batch_size must be at least 1", "this run needs at least"]),
    "a batch out of range, an attention that cannot run": (["--batch_size=0", "--attn=efficient", "--device=cpu",
                                                            "--dataset=plays"],
                                                           ["batch_size must be at least 1",
                                                            "attn='efficient' cannot run"]),
    "both splits": (["--data_dir={tmp}/broken", "--block_size=8", "--n_layer=1", "--n_head=1", "--n_embd=8"],
                    ["train.bin holds token id 9 but the model's vocabulary has 5 ids",
                     "val.bin is 201 bytes, not a whole number"]),
}


@pytest.mark.parametrize("case", MIXED)
def test_a_mix_of_bad_settings_is_one_report_naming_each_with_exit_2_and_nothing_written(case, tmp_path,
                                                                                       monkeypatch, capsys):
    """Parse errors, settings out of range, rules between settings, the device, the model, GPT-2 weights' shape and
    the data's own problems are named together, whatever mix a command holds; exit code 2; the file tree (out_dir,
    the data folders, the cache folder) as it was: nothing prepared, made or locked."""
    from core.files import cache_folder
    plays = tmp_path / "data" / "plays"
    plays.mkdir(parents=True)
    (plays / "prepare.py").write_text("open(__file__ + '.ran', 'w')")  # a marker: preparing ran
    monkeypatch.setattr(dataset, "DATA", tmp_path / "data")
    monkeypatch.setattr(dataset, "EMBEDDED_DATASETS", {"plays"})
    (tmp_path / "empty").mkdir()
    (tmp_path / "raises.py").write_text("batch_size = 1 / 0\n")
    (tmp_path / "gpt2-local").mkdir()
    (tmp_path / "gpt2-local" / "config.json").write_text(json.dumps(dict(
        model_type="gpt2", n_positions=64, vocab_size=50257, n_layer=1, n_head=1, n_embd=8)))
    token_folder(tmp_path / "chars", np.arange(200) % 5, np.arange(100) % 5, vocab_size=5)
    ids = np.arange(200) % 5
    ids[150] = 9  # meta.json says 5 tokens
    token_folder(tmp_path / "broken", ids, np.arange(100) % 5, vocab_size=5)
    with open(tmp_path / "broken" / "val.bin", "ab") as f:
        f.write(b"\x01")  # 201 bytes
    args, named = MIXED[case]
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if not any(a.startswith("--out_dir=") for a in args):
        args.append(f"--out_dir={tmp_path / 'out'}")
    before = tree(tmp_path, cache_folder())
    assert errors.exit_code(lambda: train.main(["--compile=False", *args])) == 2
    err = capsys.readouterr().err
    assert [line.startswith("error: ") for line in err.splitlines()][-1:] == [True] and err.count("error: ") == 1, err
    assert all(text in err for text in named), err
    assert len(named) == 1 or f"{len(named)} problems: (1) " in err, err
    assert tree(tmp_path, cache_folder()) == before


# one problem of each kind the start-up report gathers -> (its arguments, what names it)
KINDS = {"unknown": (["--n_layr=3"], "unknown setting 'n_layr'"),
         "type": (["--weight_decay=abc"], "weight_decay expects a float"),
         "range": (["--learning_rate=-1"], "learning_rate must be greater than 0"),
         "rule": (["--async_save=True"], "async_save=True writes sharded checkpoints only"),
         "config file": (["{tmp}/raises.py"], "raises.py' failed to run"),
         "device": (["--device=cuda:99"], "device 'cuda:99'"),
         "model": (["--n_embd=130"], "n_embd=130 is not divisible"),
         "memory": (["--gradient_accumulation_steps=1000000000000"], "this run needs at least"),
         "gpt2 weights": (["--init_from={tmp}/gpt2-local", "--block_size=128"], "block_size=128 is longer than"),
         "data": (["--dataset=nope"], "unknown dataset 'nope'"),
         "out_dir": (["--out_dir={tmp}/a_file"], "is a file, not a folder")}
APART = {("device", "memory"),  # the memory check needs the device it would run on
         ("model", "gpt2 weights")}  # GPT-2's weights decide the shape: n_embd is not read


@pytest.mark.parametrize("first, second", [pair for pair in itertools.combinations(KINDS, 2) if pair not in APART])
def test_each_kind_of_start_up_problem_is_named_beside_each_other_kind(first, second, tmp_path, monkeypatch, capsys):
    from core.files import cache_folder
    monkeypatch.setattr(dataset, "DATA", tmp_path / "data")
    (tmp_path / "data").mkdir()
    (tmp_path / "raises.py").write_text("batch_size = 1 / 0\n")
    (tmp_path / "a_file").write_text("")
    (tmp_path / "gpt2-local").mkdir()
    (tmp_path / "gpt2-local" / "config.json").write_text(json.dumps(dict(
        model_type="gpt2", n_positions=64, vocab_size=50257, n_layer=1, n_head=1, n_embd=8)))
    args = [a.replace("{tmp}", str(tmp_path)) for kind in (first, second) for a in KINDS[kind][0]]
    args += [f"--out_dir={tmp_path / 'out'}"] if "out_dir" not in (first, second) else []
    args += ["--dataset=plays"] if "data" not in (first, second) else []
    (tmp_path / "data" / "plays").mkdir()
    (tmp_path / "data" / "plays" / "prepare.py").write_text("open(__file__ + '.ran', 'w')")
    monkeypatch.setattr(dataset, "EMBEDDED_DATASETS", {"plays"})
    before = tree(tmp_path, cache_folder())
    assert errors.exit_code(lambda: train.main(["--compile=False", *args])) == 2
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(said) == 1 and KINDS[first][1] in said[0] and KINDS[second][1] in said[0], err
    assert tree(tmp_path, cache_folder()) == before


def test_sample_export_and_bench_name_every_problem_of_a_command_at_once(tmp_path, capsys):
    """The other scripts report the same way: sample.py's output file, comparison and missing checkpoint; bench's
    settings, implementations and lengths; export_hf's settings and checkpoint."""
    import export_hf
    (tmp_path / "a_folder").mkdir()
    commands = [
        (sample.main, [f"--json={tmp_path / 'a_folder'}", "--compare=foo", f"--out_dir={tmp_path}", "--top_k=0"],
         ["json", "unknown attn 'foo'", "no checkpoint at", "top_k must be"]),
        (bench.main, ["--attn=flash,foo", "--attn_seq_lens=0", "--iters=0", f"--out_dir={tmp_path / 'b'}"],
         ["iters must be", "'foo' is not one of them", "attn_seq_lens must be positive"]),
        (export_hf.main, [f"--out_dir={tmp_path}", "--temperature=-1", "--tmperature=1"],
         ["unknown setting 'tmperature'", "temperature must be", "no checkpoint at"]),
    ]
    for main, args, named in commands:
        assert errors.exit_code(lambda: main(args)) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {len(named)} problems: (1) ") and all(text in err for text in named), err


# -- data files -------------------------------------------------------------------------------------------

def test_train_bin_without_val_bin_is_named(tmp_path):
    folder = token_folder(tmp_path / "d", np.arange(200) % 5, vocab_size=5)
    with pytest.raises(UserError, match=r"val.bin is missing; a dataset folder needs train.bin and val.bin"):
        train_tiny(f"--data_dir={folder}", f"--out_dir={tmp_path / 'out'}")


def test_a_bin_that_is_not_whole_uint16_tokens_is_named(tmp_path):
    folder = token_folder(tmp_path / "d", np.arange(200) % 5, np.arange(100) % 5, vocab_size=5)
    with open(folder / "val.bin", "ab") as f:
        f.write(b"\x01")  # a truncated or foreign file: 201 bytes
    with pytest.raises(UserError, match=r"val.bin is 201 bytes, not a whole number of uint16 tokens"):
        train_tiny(f"--data_dir={folder}", f"--out_dir={tmp_path / 'out'}")


def test_token_ids_beyond_the_vocabulary_are_refused_before_training(tmp_path):
    ids = np.arange(200) % 5
    ids[150] = 9  # meta.json says 5 tokens
    folder = token_folder(tmp_path / "d", ids, np.arange(100) % 5, vocab_size=5)
    with pytest.raises(UserError, match=r"train.bin holds token id 9 but the model's vocabulary has 5 ids"):
        train_tiny(f"--data_dir={folder}", f"--out_dir={tmp_path / 'out'}")
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_the_largest_token_id_is_found_across_read_chunks(tmp_path):
    ids = np.zeros(1000, dtype=np.uint16)
    ids[999] = 40000
    ids.tofile(tmp_path / "t.bin")
    assert dataset.scan_max_token_id(tmp_path / "t.bin", chunk=64) == 40000


def test_a_token_file_is_read_through_once_and_again_only_when_it_changes(tmp_path, monkeypatch):
    """OpenWebText's train.bin is 17 GB: the id check at each start and resume reads what it remembered, and a file
    rewritten since is read again, even with its old size and modification time, so an id past the vocabulary is
    still refused."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    scans = []
    real_scan = dataset.scan_max_token_id
    monkeypatch.setattr(dataset, "scan_max_token_id", lambda path: scans.append(path.name) or real_scan(path))
    folder = token_folder(tmp_path / "d", np.arange(100) % 5, np.arange(100) % 5, vocab_size=5)
    for _ in range(3):
        dataset.check_token_files(folder, vocab_size=5, block_size=8)
    assert scans == ["train.bin", "val.bin"]
    bad = np.arange(100, dtype=np.uint16) % 5
    bad[50] = 9
    kept = os.stat(folder / "train.bin")
    bad.tofile(folder / "train.bin")
    os.utime(folder / "train.bin", ns=(kept.st_atime_ns, kept.st_mtime_ns))  # its size and time kept, as cp -p does
    with pytest.raises(UserError, match=r"train.bin holds token id 9 but the model's vocabulary has 5 ids"):
        dataset.check_token_files(folder, vocab_size=5, block_size=8)
    assert scans == ["train.bin", "val.bin", "train.bin"]


def test_an_unknown_dataset_lists_the_datasets_that_exist_and_names_a_close_one(tmp_path, monkeypatch):
    """The candidates are data/'s folders with a prepare.py or a train.bin (a dataset a user prepared there)."""
    from core import dataset
    with pytest.raises(UserError, match=r"unknown dataset 'shakespear' \(no data/shakespear/\); did you mean "
                                        r"--dataset=shakespeare\? The datasets are openwebtext, shakespeare, "
                                        r"shakespeare_char"):
        train_tiny("--dataset=shakespear", f"--out_dir={tmp_path / 'out'}")
    (tmp_path / "data" / "pystdlib_char").mkdir(parents=True)
    (tmp_path / "data" / "pystdlib_char" / "train.bin").write_bytes(b"")
    monkeypatch.setattr(dataset, "DATA", tmp_path / "data")
    with pytest.raises(UserError, match=r"did you mean --dataset=pystdlib_char\? The datasets are pystdlib_char"):
        train_tiny("--dataset=pystdlib_chr", f"--out_dir={tmp_path / 'out'}")
    with pytest.raises(UserError, match=r"\(1\) unknown setting 'lr'; did you mean learning_rate\? \(2\)"):
        train_tiny("--lr=1e-3")


def test_a_known_dataset_not_yet_prepared_names_its_prepare_command(tmp_path, monkeypatch):
    (tmp_path / "data" / "openwebtext").mkdir(parents=True)
    (tmp_path / "data" / "openwebtext" / "prepare.py").write_text("raise SystemExit('must not run')\n")
    monkeypatch.setattr(dataset, "DATA", tmp_path / "data")
    with pytest.raises(UserError, match=r"run: python data/openwebtext/prepare.py"):
        train_tiny("--dataset=openwebtext", f"--out_dir={tmp_path / 'out'}")


# -- out_dir ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["a file", "under a file", "unwritable"])
def test_an_out_dir_that_cannot_be_written_is_refused_before_training(char_data, tmp_path, kind):
    (tmp_path / "file").write_text("keep me")
    out = {"a file": tmp_path / "file", "under a file": tmp_path / "file" / "run",
           "unwritable": "/proc/nanogpt-run"}[kind]  # /proc takes no new folders, not even from root
    expected = "is a file, not a folder" if kind == "a file" else r"cannot be written to \(.+\)"
    with pytest.raises(UserError, match=f"out_dir {out} {expected}; pass --out_dir= a writable folder"):
        train_tiny(f"--data_dir={char_data}", f"--out_dir={out}")
    assert (tmp_path / "file").read_text() == "keep me"


# -- checkpoints that are not this project's ----------------------------------------------------------------

@pytest.fixture()
def tiny_model() -> GPT:
    return GPT(GPTConfig(block_size=16, vocab_size=11, n_layer=1, n_head=2, n_embd=8))


def test_a_bare_state_dict_is_named_as_such(tiny_model, char_data, tmp_path):
    torch.save(tiny_model.state_dict(), tmp_path / "ckpt.pt")
    before = (tmp_path / "ckpt.pt").read_bytes()
    with pytest.raises(UserError, match="is a bare state dict"):
        train_tiny("--init_from=resume", f"--data_dir={char_data}", f"--out_dir={tmp_path}")
    assert (tmp_path / "ckpt.pt").read_bytes() == before


def test_a_weights_only_checkpoint_samples_but_does_not_resume(tiny_model, char_data, tmp_path):
    checkpoint_of(tiny_model).save(tmp_path / "ckpt.pt")
    assert load_checkpoint(tmp_path / "ckpt.pt").model_config["n_layer"] == 1
    with pytest.raises(UserError, match="has no optimizer, rng; it is not a resumable"):
        train_tiny(f"--data_dir={char_data}", "--init_from=resume", f"--out_dir={tmp_path}")


def test_checkpoints_written_with_and_without_the_retired_version_field_load_alike(tiny_model, tmp_path):
    checkpoint_of(tiny_model, iter_num=5).save(tmp_path / "ckpt.pt")
    contents = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert "version" not in contents
    for name, version in (("v1.pt", None), ("v2.pt", 2)):  # earlier releases wrote no field, then version 2
        torch.save(contents if version is None else {**contents, "version": version}, tmp_path / name)
        old = load_checkpoint(tmp_path / name)
        assert old.iter_num == 5
        assert all(torch.equal(old.model[k], v) for k, v in tiny_model.state_dict().items())


def test_bench_and_sample_check_where_they_write_before_any_work(tmp_path):
    (tmp_path / "file").write_text("keep me")
    with pytest.raises(UserError, match="out_dir .*file is a file, not a folder; pass --out_dir= a writable folder"):
        bench.main([f"--out_dir={tmp_path / 'file'}", "--attn=manual"])
    with pytest.raises(UserError, match="json .*file is a file, not a folder; pass --json= a path in a writable"):
        sample.main([f"--json={tmp_path / 'file' / 'report.json'}", f"--out_dir={tmp_path / 'no_checkpoint'}"])
    assert (tmp_path / "file").read_text() == "keep me"


@pytest.mark.parametrize("vocab_size", ["missing", "65", 0, True, 2.5])
def test_a_meta_json_without_a_whole_vocab_size_is_one_sentence(tmp_path, vocab_size):
    from core import files
    (tmp_path / "meta.json").write_text(json.dumps(
        {"tokenizer": "char", "chars": list("ab"), **({} if vocab_size == "missing" else {"vocab_size": vocab_size})}))
    with pytest.raises(UserError, match=r"meta.json has no positive whole \"vocab_size\" .*rerun the dataset's"):
        files.read_meta(tmp_path)


def test_a_vocabulary_too_large_for_uint16_token_files_is_refused_before_training(char_data, tmp_path):
    """cl100k's 100,277 ids cannot be stored in the uint16 train.bin: the data folder is refused, not trained on."""
    data = tmp_path / "data"
    shutil.copytree(char_data, data)
    (data / "meta.json").write_text(json.dumps({"tokenizer": "cl100k_base", "vocab_size": 100277}))
    with pytest.raises(UserError, match=rf"^{data / 'meta.json'} says vocab_size 100,277, but train.bin and val.bin "
                                        rf"hold uint16 ids, at most 65,536 of them; use a tokenizer"):
        train.main(TINY + [f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}", "--max_iters=1"])
    assert not (tmp_path / "out").exists()
    (data / "meta.json").write_text(json.dumps({"tokenizer": "some_bpe", "vocab_size": 65536}))
    from core import files
    assert files.read_meta(data)["vocab_size"] == 65536  # every uint16 id: still fits


# -- what a newcomer types ----------------------------------------------------------------------------------

@pytest.mark.parametrize("script, arg, said", [
    (train, "batch_size=8", "'batch_size=8' is not a config file; a setting takes two dashes: pass --batch_size=8."),
    (train, "bacth_size=8", "'bacth_size=8' is not a config file; a setting takes two dashes: pass --batch_size=8."),
    (sample, "num_samples=2", "'num_samples=2' is not a config file; a setting takes two dashes: pass "
                              "--num_samples=2."),
    (bench, "iters=3", "'iters=3' is not a config file; a setting takes two dashes: pass --iters=3."),
])
def test_a_setting_typed_without_its_dashes_is_named_with_them(script, arg, said):
    with pytest.raises(UserError) as refused:
        script.main([arg])
    assert str(refused.value).split(" (2) ")[0] in (said, f"2 problems: (1) {said}")  # train names its data too


@pytest.mark.parametrize("script", [train, sample])
def test_a_typo_in_init_from_gets_a_did_you_mean_not_the_hub(script, tmp_path, char_data, monkeypatch):
    import huggingface_hub
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("went to the hub"))
    args = [f"--data_dir={char_data}", *TINY[:4]] if script is train else []
    with pytest.raises(UserError, match=r"^init_from='resum' is not scratch, resume, a GPT-2 name or a local folder; "
                                        r"did you mean --init_from=resume\?$"):
        script.main([*args, "--init_from=resum", f"--out_dir={tmp_path / 'out'}"])
    assert not (tmp_path / "out").exists()


def test_help_prints_the_seeds_range_as_a_whole_number(capsys):
    with pytest.raises(SystemExit):
        train.main(["--help"])
    text = capsys.readouterr().out
    assert "less than 2**63]" in text.replace("\xa0", " ") and "e+18" not in text


@pytest.mark.parametrize("setting, named", [("--n_layer=1000000000000", "lower batch_size, block_size, n_layer"),
                                            ("--batch_size=1000000000000", "lower batch_size, block_size"),
                                            ("--eval_iters=1000000000000", "lower gradient_accumulation_steps, "
                                                                          "eval_iters or batch_size")])
def test_a_run_that_cannot_fit_in_memory_is_one_line_naming_what_drives_it_before_anything_is_built(
        char_data, tmp_path, setting, named):
    """A value in range that no machine holds is named against the machine's memory at start, not an allocator's
    traceback minutes in (and no layer is built, no probe run)."""
    with pytest.raises(UserError, match=rf"^this run needs at least [\d,.]+ GiB \(.*\) and this machine's memory is "
                                        rf"[\d,.]+ GiB; {named}"):
        train_tiny(f"--data_dir={char_data}", setting, f"--out_dir={tmp_path / 'out'}")
    assert not (tmp_path / "out").exists()


def test_sample_names_a_kv_cache_no_machine_holds(trained, capsys):
    assert errors.exit_code(lambda: sample.main([f"--out_dir={trained}", "--num_samples=1000000000000"])) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: this run needs at least ") and "(the KV cache " in err and "lower num_samples." in err
