"""--help on every script, and the messages a user reads when a word, a meta.pkl or a corpus is wrong. Help is read
against the scripts' own source, parsed here line by line (not with the configurator's reader)."""

import importlib.util
import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

import bench
import export_hf
import sample
import train
from benchmarks import time_to_loss
from core.configurator import Choice
from core.tokenizer import tokenizer_from_meta
from conftest import REPO
from core.errors import UserError

PLAIN = (bool, int, float, str, tuple, list, type(None))
INTERVALS = {"[1, inf)": "at least 1", "[0, inf)": "at least 0", "(0, inf)": "greater than 0",
             "[0, 1)": "at least 0 and less than 1", "(0, 1]": "greater than 0 and at most 1",
             "(0, 1)": "greater than 0 and less than 1", "[1, inf) int": "a whole number at least 1",
             "[1, inf) int or None": "a whole number at least 1, or None",
             "[0, inf) int": "a whole number at least 0",
             "[0, 9223372036854775808) int": "a whole number at least 0 and less than 2**63",
             "a path": "a path, each name at most 255 bytes"}  # what each declared interval reads as


def prepare_script(name: str):
    """data/<name>/prepare.py as a module (the prepare scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(f"prepare_{name}_help", REPO / "data" / name / "prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# openwebtext's prepare.py reads its corpus with datasets, which a GPU image may lack: its cases skip there, in words
HAS_DATASETS = importlib.util.find_spec("datasets") is not None
NEEDS_DATASETS = pytest.mark.skipif(not HAS_DATASETS, reason="data/openwebtext/prepare.py needs datasets")
PREPARE = {name: prepare_script(name) for name in ("shakespeare_char", "shakespeare", "openwebtext")
           if name != "openwebtext" or HAS_DATASETS}
# each script, with the LIMITS it passes to configure (export_hf.py writes its own in main)
SCRIPTS = {"train": (train, train.LIMITS), "sample": (sample, sample.LIMITS), "bench": (bench, bench.LIMITS),
           "export_hf": (export_hf, export_hf.LIMITS),
           "time_to_loss": (time_to_loss, time_to_loss.LIMITS),
           **{f"prepare_{name}": (module, getattr(module, "LIMITS", {})) for name, module in PREPARE.items()}}


def source_settings(module) -> list[tuple[str, str, str]]:
    """(header, name, comment) of each setting, read from the source line by line: a header is a `# ...` line at
    the margin (consecutive ones join), a comment follows `#` beside the value and on indented `#` lines below."""
    found, header, joined, last = [], "", False, None
    for line in open(module.__file__, encoding="utf-8").read().splitlines():
        if re.match(r"^# (?!-)", line):
            header, joined, last = f"{header} {line[2:].strip()}" if joined else line[2:].strip(), True, None
            continue
        joined = False
        continuation = re.match(r"^\s+# (.*)$", line)
        if continuation and last is not None:
            found[-1] = (*found[-1][:2], f"{found[-1][2]} {continuation.group(1).strip()}")
            continue
        match = re.match(r"^([a-z_][a-z0-9_]*) += +(.+?)(?: +# (.*))?$", line)
        last = None
        if match and isinstance(getattr(module, match.group(1)), PLAIN) and match.group(1) not in [f[1] for f in found]:
            found.append((header, match.group(1), (match.group(3) or "").strip()))
            last = match.group(1)
    return found


def allowed(spec) -> str:
    if isinstance(spec, Choice):
        return f"[{'a comma list of' if spec.many else 'one of'} {', '.join(w or repr(w) for w in spec.words)}]"
    return f"[{INTERVALS[spec]}]"


def help_sections(text: str) -> list[tuple[str, str, str]]:
    """(header, name, rest of its line) for each `  name = default ...` line of a help text, wrapped lines joined,
    runs of spaces as one."""
    lines = []
    for line in text.splitlines():
        if line.startswith("   ") and lines:
            lines[-1] += " " + line.strip()
        else:
            lines.append(line)
    rows, header = [], ""
    for line in lines:
        if line == "":
            header = ""
        elif line.startswith("# "):
            header = line[2:]
        elif match := re.match(r"^  ([a-z_0-9]+) = (.*)$", line):
            rows.append((header, match.group(1), " ".join(match.group(2).split())))
    return rows


def run_help(module, argv, capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        module.main(argv)
    assert stop.value.code == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_help_lists_every_setting_with_its_default_comment_and_limits_in_its_group_and_writes_nothing(
        script, flag, tmp_path, monkeypatch, capsys):
    module, limits = SCRIPTS[script]
    monkeypatch.chdir(tmp_path)  # every relative out_dir would land here
    folder = Path(module.__file__).parent  # a prepare script's default out_dir
    before = sorted(p.name for p in folder.iterdir())
    out = run_help(module, [flag], capsys)
    summary = " ".join(out.split("\n\n")[0].split())
    assert summary.startswith(" ".join(module.__doc__.strip().splitlines()[0].split()))  # the docstring's summary
    expected = source_settings(module)
    assert len(expected) >= 4 or script.startswith("prepare_shakespeare")  # the reader found the settings
    rows = help_sections(out)
    assert [(h, name) for h, name, _ in rows] == [(h, name) for h, name, _ in expected]  # each in its group, in order
    for (header, name, comment), (_, _, shown) in zip(expected, rows):
        default = getattr(module, name)
        words = " ".join(part for part in (comment, allowed(limits[name]) if name in limits else "") if part)
        assert shown == f"{default!r} {words}".strip(), name
    assert list(tmp_path.iterdir()) == []
    if script.startswith("prepare_"):  # (the repository root, the others' folder, is shared with other work)
        assert sorted(p.name for p in folder.iterdir()) == before


def test_train_help_reads_as_its_settings_do(capsys):
    """A few lines written out by hand, so that the check above cannot agree with a wrong reading of the source."""
    out = run_help(train, ["--help"], capsys)
    rows = {name: (header, rest) for header, name, rest in help_sections(out)}
    assert rows["eval_interval"] == ("I/O", "2000 evaluate (and checkpoint) every this many iterations [at least 1]")
    assert rows["dropout"] == ("model", "0.0 0 for pretraining, 0.1+ for finetuning [at least 0 and less than 1]")
    assert rows["n_layer"] == ("model", "12 transformer blocks [at least 1]")
    assert rows["wandb_log"][0].startswith("wandb logging") and rows["wandb_log"][1].startswith("False log every ")
    assert rows["early_decay_to"] == ("learning rate schedule: linear warmup, then cosine decay to min_lr",
                                      "0.3 with early_decay_iters: the fraction of learning_rate reached there "
                                      "[greater than 0 and at most 1]")
    assert "usage: python train.py [CONFIG_FILE ...] [--key=value ...]" in out.splitlines()
    bench_rows = {name: rest for _, name, rest in help_sections(run_help(bench, ["-h"], capsys))}
    assert bench_rows["weights"] == ("None the weights' dtype per row: float32,bfloat16,int8 (int8 weight-only, "
                                     "torchao); None: sized for the device (a CPU gets bf16 rows only where its "
                                     "matmuls run bf16 in hardware: AMX, AVX512-BF16) [a comma list of float32, "
                                     "bfloat16, int8]")
    assert "usage: python -m benchmarks.time_to_loss " in run_help(time_to_loss, ["-h"], capsys)


@NEEDS_DATASETS
def test_openwebtext_help_reads_as_its_settings_do(capsys):
    owt = help_sections(run_help(PREPARE["openwebtext"], ["--help"], capsys))
    assert ("system", "num_proc", "None worker processes; None: min(8, half the CPU cores) [at least 1]") in owt


def test_help_shows_what_the_command_line_sets_and_answers_a_line_with_mistakes_too(tmp_path, monkeypatch, capsys):
    """`python train.py config/X.py --help` shows X's values (it once showed the defaults: no way to see what a
    command line resolves to before running it); a line with a mistake still gets help, with the defaults."""
    monkeypatch.chdir(tmp_path)
    plain = run_help(train, ["--help"], capsys)
    resolved = run_help(train, [str(REPO / "config" / "train_shakespeare_char_cpu.py"), "--n_layer=3", "--help"],
                        capsys)
    rows = {name: rest for _, name, rest in help_sections(resolved)}
    assert rows["out_dir"].startswith("'out-shakespeare-char-cpu' ") and rows["n_layer"].startswith("3 ")
    assert {name: rest for _, name, rest in help_sections(plain)}["n_layer"].startswith("12 ")
    assert run_help(train, ["--no_such_setting=1", "no_such_config.py", "-h"], capsys) == plain
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # a fresh interpreter importing torch: the command line's wiring (help in process is above)
def test_python_train_py_help_prints_help_and_exits_0():
    existed = (REPO / "out").exists()  # train.py's default out_dir, from the repository root
    result = subprocess.run([sys.executable, "train.py", "--help"], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.startswith("Train a GPT on one CPU, one GPU, or many GPUs with DDP or FSDP2.\n")
    assert "\n# I/O\n  out_dir = 'out' " in result.stdout
    assert (REPO / "out").exists() == existed


def test_a_mistyped_choice_is_answered_with_the_word_it_is_close_to(tmp_path):
    with pytest.raises(UserError, match=r"^2 problems: \(1\) attn must be one of 'auto', 'manual', .*, got 'flsh'; "
                                        r"did you mean 'flash'\? \(2\) dataset 'openwebtext' is not prepared"):
        train.main(["--attn=flsh"])  # and the default dataset's problem with it
    with pytest.raises(UserError, match=r"got 'manual,flsh'; did you mean 'manual,flash'\?$"):
        bench.main(["--attn=manual,flsh", f"--out_dir={tmp_path}"])
    with pytest.raises(UserError, match=r"^2 problems: \(1\) parallel must be one of 'ddp', 'fsdp', got 'zero'\. "
                                        r"\(2\)"):  # nothing close
        train.main(["--parallel=zero"])
    assert list(tmp_path.iterdir()) == []


def test_a_meta_pkl_with_a_repeated_character_is_reported_as_that_meta_pkl(tmp_path):
    with open(tmp_path / "meta.pkl", "wb") as f:  # as nanoGPT's prepare.py writes it, with 'a' twice
        pickle.dump({"vocab_size": 3, "itos": {0: "a", 1: "b", 2: "a"}, "stoi": {"a": 2, "b": 1}}, f)
    from tools.nanogpt import read_nanogpt_meta
    with pytest.raises(UserError) as error:
        read_nanogpt_meta(tmp_path / "meta.pkl")
    assert str(tmp_path / "meta.pkl") in str(error.value) and "meta.json" not in str(error.value)
    assert "'a'" in str(error.value)
    with pytest.raises(UserError, match=r"^the chars list in the meta of out/ckpt.pt must hold distinct single"):
        tokenizer_from_meta({"tokenizer": "char", "vocab_size": 2, "chars": ["a", "a"]},
                            source="the meta of out/ckpt.pt")


@pytest.mark.parametrize("records, sentence", [
    ([{"title": f"title {i}"} for i in range(5)], "has no column 'text' (columns: title); pass --text_column=NAME"),
    ([{"text": "the only text"}] + [{"title": f"title {i}"} for i in range(4)],
     "has 1 document(s) (4 of 5 records have no 'text'); a train and a val split need at least 2 - pass "
     "--text_column= the field that holds the text"),
], ids=["no-record-has-text", "one-record-has-text"])
@NEEDS_DATASETS
def test_openwebtext_on_records_without_text_prints_its_error_alone(records, sentence, tmp_path, capfd):
    import datasets
    corpus = tmp_path / "titles.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    code = PREPARE["openwebtext"].main([f"--data_files={corpus}", f"--out_dir={tmp_path / 'out'}", "--num_proc=1",
                                        f"--cache_dir={tmp_path / 'hf_cache'}"])
    out, err = capfd.readouterr()
    assert (code, out, err) == (2, "", f"error: {corpus} {sentence}\n")  # no "Generating train split" bars
    assert datasets.is_progress_bar_enabled()  # and the bars are back on for whatever comes next
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_every_setting_has_a_comment_that_help_shows(name):
    """bench.py --help had ten settings with no words (n_layer, bias, seed, out_dir, ...), time_to_loss one."""
    module, _ = SCRIPTS[name]
    assert [setting for _, setting, comment in source_settings(module) if not comment] == []


# the recipes this project ships: a user's own config in config/ (nanoGPT's habit) is theirs, not the suite's
RECIPES = ["eval_gpt2.py", "eval_gpt2_large.py", "eval_gpt2_medium.py", "eval_gpt2_xl.py", "finetune_shakespeare.py",
           "train_gpt2.py", "train_shakespeare_char.py", "train_shakespeare_char_cpu.py", "train_shakespeare_char_fast.py"]


def test_the_recipes_listed_are_the_ones_in_the_repository():
    import subprocess
    tracked = subprocess.run(["git", "ls-files", "config"], cwd=REPO, capture_output=True, text=True).stdout.split()
    if tracked:  # a checkout (a copy without git: nothing to hold the list against)
        assert set(RECIPES) <= {Path(p).name for p in tracked}


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_recipe_for_another_dataset_logs_to_wandb_under_its_own_names(recipe):
    """train.py's wandb defaults name GPT-2 on openwebtext: a recipe for other data names its own project and run."""
    settings = {}
    exec((REPO / "config" / recipe).read_text(), {}, settings)
    if settings.get("dataset", "openwebtext") != "openwebtext":
        assert settings.get("wandb_project", "owt") != "owt" and settings.get("wandb_run_name", "gpt2") != "gpt2"
