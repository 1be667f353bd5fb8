"""The two houses, as README's "Where to start" states them. The read: model.py (which imports nothing of the project
at module level), core/ (which imports only core/), engine/ and the scripts. The tools (tools/, benchmarks/): they
import the read, and the read opens them only inside a function, at the setting that asks for one (a door). Every
import counts, module-level or inside a function (a lazy import is still an arrow a reader follows), and none runs
in a cycle."""
import ast
import os
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


def test_model_py_stands_alone_and_core_imports_only_core():
    edges = graph()
    assert edges["model"][0] == set()  # module level: nothing of the project
    assert sorted(f"{m} -> {n}" for m, (eager, lazy) in edges.items() if m.startswith("core")
                  for n in eager | lazy if not n.startswith("core")) == []


def test_the_read_opens_a_tool_only_at_its_door():
    edges = graph()
    read = [m for m in edges if not is_tool(m) and m not in ("bench", "export_hf")]  # bench's sweeps: its own
    assert sorted(f"{m} -> {n}" for m in read for n in edges[m][0] if is_tool(n)) == []
    assert "tools.sharded" in edges["train"][1] and "tools.attn_auto" in edges["train"][1]  # the walk is real


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
          "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tools', 'benchmarks') and '.' in m))")


@pytest.mark.slow  # four training runs of two steps, each in a fresh interpreter: what it loads is the point
@pytest.mark.parametrize("setting, opens", [
    ([], []),
    (["--window=8"], ["tools.kernels", "tools.masks"]),
    (["--checkpoint_format=sharded"], ["tools.kernels", "tools.sharded"]),
    (["--attn=auto", "--attn_auto_budget=1"], ["tools.attn_auto", "tools.kernels"]),
], ids=["default", "window", "sharded", "auto"])
def test_a_setting_opens_its_own_tool_and_nothing_else(char_data, tmp_path, setting, opens):
    """The default run's tools are the check of the implementation (set_attention's) alone; each setting adds its
    own door's tool."""
    from conftest import TINY
    args = [f"--data_dir={char_data}", f"--out_dir={tmp_path / 'out'}", "--max_iters=2", "--eval_interval=2",
            *TINY, *setting]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-c", OPENED, *args], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert ast.literal_eval(run.stdout.strip().splitlines()[-1]) == (opens or ["tools.kernels"])
