"""The layout README's "Where to start" states. The default path: model.py (which imports nothing of the project
at module level), core/ (which imports only core/), attention/, engine/ and the scripts. The opt-in features
(tools/, benchmarks/): they import the default path, which imports them only inside the function that reads the
setting asking for one. Every import counts, module-level or inside a function (a lazy import is still an arrow a reader
follows), and none runs in a cycle."""
import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TOOLS = ("tools", "benchmarks")


def project_modules() -> dict[str, Path]:
    paths = [p for p in REPO.rglob("*.py") if not {"tests", "data", "config"} & set(p.relative_to(REPO).parts)
             and not p.relative_to(REPO).parts[0].startswith(".")]
    return {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p for p in paths}


def imports_of(path: Path, modules: set[str]) -> tuple[set[str], set[str]]:
    """The project modules `path` imports at module level, and those it imports inside a function."""
    tree = ast.parse(path.read_text())
    inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f)}
    eager, lazy = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        (lazy if id(node) in inside else eager).update(n for n in names if n in modules)
    return eager, lazy


def is_tool(module: str) -> bool:
    return module.split(".")[0] in TOOLS


def graph() -> dict[str, tuple[set[str], set[str]]]:
    modules = project_modules()
    return {m: tuple(found - {m} for found in imports_of(p, set(modules))) for m, p in modules.items()}


# Each folder's description (README's house table) as a rule on what its files import: (module level, inside a
# function). The read is model.py, core/, attention/, engine/ and the scripts; the tools are tools/ and benchmarks/.
DEFAULT_PATH = {"core", "attention", "engine", "model"}
FOLDERS = {
    "core": ({"core"}, {"core"}),  # the foundation: only itself
    "attention": ({"core", "attention"}, {"core", "attention"}),  # handed model's records, never importing model.py
    "engine": (DEFAULT_PATH, DEFAULT_PATH | {"tools"}),  # runs a model for the scripts; tools/ where a setting asks
    "tools": (DEFAULT_PATH | {"tools"}, DEFAULT_PATH | {"tools"}),  # opt-in features: never a script or a benchmark
    "benchmarks": (DEFAULT_PATH | {"tools", "benchmarks"},
                   DEFAULT_PATH | {"tools", "benchmarks", "train"}),  # times train.py's runs
    "model": (set(), {"core", "attention"}),  # the single-file GPT: nothing of the project at module level
}


def test_every_file_imports_only_what_its_folders_sentence_allows():
    def home(module: str) -> str:
        return module.split(".")[0]
    broken = [f"{m} -> {n} ({'module level' if n in eager else 'in a function'})"
              for m, (eager, lazy) in graph().items() if home(m) in FOLDERS
              for n in eager | lazy if home(n) not in FOLDERS[home(m)][0 if n in eager else 1] | {home(m)}]
    assert broken == []
    assert set(FOLDERS) - {"model"} == {p.name for p in REPO.iterdir() if (p / "__init__.py").is_file()}


def test_model_py_stands_alone_and_core_imports_only_core():
    edges = graph()
    assert edges["model"][0] == set()  # module level: nothing of the project
    assert sorted(f"{m} -> {n}" for m, (eager, lazy) in edges.items() if m.startswith("core")
                  for n in eager | lazy if not n.startswith("core")) == []


def test_a_script_imports_a_tool_only_where_the_setting_that_needs_it_is_read():
    edges = graph()
    read = [m for m in edges if not is_tool(m) and m not in ("bench", "export_hf")]  # bench's sweeps: its own
    assert sorted(f"{m} -> {n}" for m in read for n in edges[m][0] if is_tool(n)) == []
    assert "tools.sharded" in edges["train"][1] and "attention.attn_auto" in edges["train"][1]  # the walk is real


def test_no_import_runs_in_a_cycle():
    arrows = {m: eager | lazy for m, (eager, lazy) in graph().items()}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m == goal:
                return True
            if m not in seen:
                seen.add(m)
                todo += arrows.get(m, ())
        return False
    assert sorted(f"{m} <-> {n}" for m in arrows for n in arrows[m] if reaches(n, m)) == []
    assert arrows["core.errors"] == set() and "model" in arrows["train"]  # the walk reads the real graph


OPENED = ("import sys, train; train.main(sys.argv[1:]); "
          "print(sorted(m for m in sys.modules if m.split('.')[0] in ('attention', 'tools', 'benchmarks') and '.' in m))")


@pytest.mark.slow  # four training runs of two steps, each in a fresh interpreter: what it loads is the point
@pytest.mark.parametrize("setting, opens", [
    ([], []),
    (["--window=8"], ["attention.kernels", "attention.masks"]),
    (["--checkpoint_format=sharded"], ["attention.kernels", "tools.sharded"]),
    (["--attn=auto", "--attn_auto_budget=1"], ["attention.attn_auto", "attention.kernels"]),
], ids=["default", "window", "sharded", "auto"])
def test_a_setting_imports_the_tool_it_needs_and_nothing_else(char_data, tmp_path, setting, opens):
    """The default run imports one tool, the check of the implementation (set_attention's); each setting adds the
    tool that its code imports where the setting is read."""
    from conftest import TINY
    args = [f"--data_dir={char_data}", f"--out_dir={tmp_path / 'out'}", "--max_iters=2", "--eval_interval=2",
            *TINY, *setting]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-c", OPENED, *args], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert ast.literal_eval(run.stdout.strip().splitlines()[-1]) == (opens or ["attention.kernels"])


# -- one record per attention implementation ---------------------------------------------------------------

WITH_ONE_MORE = """
import runpy, sys
import model
from benchmarks import measure
# a new implementation, as a developer would add it to model.IMPLEMENTATIONS: its function and its record; and for
# bench's kernel audit, what it runs (no SDPA op here)
model.IMPLEMENTATIONS["mine"] = model.Attention(lambda q, k, v, mask, p: model.manual_attention(q, k, v, mask, p),
                                                "the test's own")
measure.AUDIT["mine"] = measure.Audit("none")
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_new_implementation_runs_in_train_sample_and_bench_from_its_record_alone(char_data, tmp_path):
    """What adding an implementation takes: its entry in model.py, and the kernels bench's audit may see it run
    (benchmarks/measure.py's AUDIT), nothing else. Train, sample and bench's attention rows with their kernel audit
    all run it (the audit expects what its AUDIT entry says: no SDPA op)."""
    from conftest import TINY, bench_file
    out = tmp_path / "run"

    def run(*argv) -> str:
        done = subprocess.run([sys.executable, "-c", WITH_ONE_MORE, *argv], cwd=REPO, capture_output=True,
                              text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout
    assert "attn=mine" in run("train.py", *TINY, f"--data_dir={char_data}", f"--out_dir={out}", "--attn=mine",
                              "--max_iters=2", "--eval_interval=2")
    assert "attn=mine:" in run("sample.py", f"--out_dir={out}", "--attn=mine", "--num_samples=1",
                               "--max_new_tokens=4", "--device=cpu", "--dtype=float32")
    run("bench.py", "--mode=attention", "--attn=mine,manual", "--attn_batch=1", "--attn_heads=2",
        "--attn_seq_lens=64", "--attn_head_sizes=16", "--iters=1", "--warmup=1", "--dtype=float32", "--threads=1",
        "--device=cpu", f"--out_dir={tmp_path / 'bench'}")
    rows = json.loads(bench_file(tmp_path / "bench", "attention.json").read_text())["rows"]
    mine = [r for r in rows if r["attn"] == "mine"]
    assert mine and all(r["status"] == "ok" and r["kernel"] == "none" and r["kernel_ok"] for r in mine)


def test_no_file_but_model_py_names_an_implementation_in_a_string_test():
    """Knowledge about an implementation lives in its record (model.Attention): an `attn == "flex"` elsewhere would
    be a second home. Kernel labels (benchmarks/measure.py) and chosen baselines are names, not tests."""
    from model import IMPLEMENTATIONS
    names = "|".join(IMPLEMENTATIONS)
    test = re.compile(rf"""(==|!=|\bin)\s*\(?\s*["']({names})["']|["']({names})["']\s*(==|!=)""")
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for path in project_modules().values()
             if path.name != "model.py" for n, line in enumerate(path.read_text().splitlines(), 1)
             if test.search(line) and "attn" in line]
    assert found == []
