"""Every setting of every script given a value of each kind a user can type by mistake: the wrong type, a value that
is not plain (a dict), None, empty, negative, zero, NaN (from a config file), infinite, huge, a 300-byte name. Each command
also holds one problem that is surely wrong (so no run starts), and the property is the start-up report's: exit 2,
one `error:` line, no traceback, nothing written (the working folder, the data folders, the cache folder); where the
value is wrong whatever the setting means (the wrong type, not plain, None where a value is needed, not finite, a
name too long for a path), the line names the setting."""

import importlib.util
import math
from pathlib import Path

import pytest

import bench
import export_hf
import sample
import train
from conftest import REPO
from core import configurator, errors
from core.configurator import PATH
from core.files import cache_folder


def prepare_script(name: str):
    spec = importlib.util.spec_from_file_location(f"prepare_{name}_values", REPO / "data" / name / "prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# each script, and a problem that stops it whatever else the command holds (two, for a setting that is the first's)
SCRIPTS = {
    "train": (lambda: train, ["--dataset=no_such_dataset"], ["--batch_size=0"]),
    "sample": (lambda: sample, ["--out_dir={tmp}/no_checkpoint"], ["--num_samples=0"]),
    "bench": (lambda: bench, ["--iters=0"], ["--warmup=-1"]),
    "export_hf": (lambda: export_hf, ["--out_dir={tmp}/no_checkpoint"], ["--top_k=0"]),
    "prepare_char": (lambda: prepare_script("shakespeare_char"), ["--input={tmp}/missing.txt"],
                     ["--out_dir={tmp}/" + "x" * 300]),
    "prepare_bpe": (lambda: prepare_script("shakespeare"), ["--input={tmp}/missing.txt"],
                    ["--out_dir={tmp}/" + "x" * 300]),
    "prepare_owt": (lambda: prepare_script("openwebtext"), ["--data_files={tmp}/missing.jsonl"],
                    ["--val_fraction=0"]),
}
KINDS = {"wrong type": "abc", "not plain": "{}", "None": "None", "empty": "", "negative": "-1", "zero": "0", "NaN": None,
         "infinite": "1e999", "huge": "1" + "0" * 30, "long name": "a" * 300}


def always_wrong(kind: str, default, spec) -> bool:
    """Whether the value is wrong whatever the setting means, so the line must name it."""
    number = type(default) in (int, float)
    return (kind == "not plain" or kind in ("wrong type", "empty", "infinite", "NaN") and (number or type(default)
            is bool) or kind == "long name" and spec == PATH or kind == "None" and default is not None and
            not configurator.none_allowed(spec))


def cases():
    for name, (module, _, _) in SCRIPTS.items():
        script = module()
        limits = getattr(script, "LIMITS", {})
        for key, default in configurator.settings(vars(script)).items():
            for kind in KINDS:
                if kind == "NaN" and type(default) not in (int, float):
                    continue
                yield pytest.param(name, key, kind, always_wrong(kind, default, limits.get(key)),
                                   id=f"{name}-{key}-{kind}")


def snapshot(*folders: Path) -> dict:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for folder in folders if folder.exists()
            for p in [folder, *folder.rglob("*")] if "__pycache__" not in p.parts}


@pytest.mark.slow  # ~1,500 commands, each stopped at start-up
@pytest.mark.parametrize("name, key, kind, named", list(cases()))
def test_every_setting_of_every_script_with_a_value_of_each_kind_is_one_line_and_writes_nothing(
        name, key, kind, named, tmp_path, monkeypatch, capsys):
    module, stop, other = SCRIPTS[name]
    script = module()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # relative defaults (out, bench_results) land here, if anywhere
    stop = [a.replace("{tmp}", str(tmp_path)) for a in (other if stop[0].split("=")[0] == f"--{key}" else stop)]
    if kind == "NaN":
        (tmp_path / "nan.py").write_text(f"{key} = float('nan')\n")
        given = [str(tmp_path / "nan.py")]
    else:
        given = [f"--{key}={KINDS[kind]}"]
    before = snapshot(tmp_path, cache_folder(), REPO / "data")
    code = errors.exit_code(lambda: script.main([*stop, *given]))
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert not named or key in lines[0], (key, lines[0])
    assert snapshot(tmp_path, cache_folder(), REPO / "data") == before  # (nan.py was written before it)


def test_the_kinds_reach_each_check():  # the table above can fail: math.inf is what "1e999" reads as
    assert configurator._parse_value(KINDS["infinite"]) == math.inf and configurator._parse_value("{}") == {}
