"""The house's floors, as README's "Where to start" states them: core/ imports nothing of the project; the model's
files (model.py, attention.py, masks.py, decode.py, attn_auto.py) only core/ and each other; engine/ those and itself;
the scripts and benchmarks/ anything below. Every import counts, module-level or inside a function (a lazy import is
still an arrow a reader follows), and none runs in a cycle."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL_FLOOR = {"model", "attention", "masks", "decode", "attn_auto"}
SCRIPTS = {"train", "sample", "bench", "export_hf"}


def floor(module: str) -> int:
    top = module.split(".")[0]
    if top == "core":
        return 0
    if top in MODEL_FLOOR:
        return 1
    if top == "engine":
        return 2
    assert top in SCRIPTS or top == "benchmarks", f"{module} has no floor: add it to README's layout and here"
    return 3


def project_modules() -> dict[str, Path]:
    paths = [p for p in REPO.rglob("*.py") if not {"tests", "data", "config"} & set(p.relative_to(REPO).parts)
             and not p.relative_to(REPO).parts[0].startswith(".")]
    return {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p for p in paths}


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports anywhere in its source."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in modules}
    return found


def test_every_import_points_down_or_along_its_floor_and_none_runs_in_a_cycle():
    modules = project_modules()
    graph = {m: imports_of(p, set(modules)) - {m} for m, p in modules.items()}
    upward = sorted(f"{m} -> {n}" for m, targets in graph.items() for n in targets if floor(n) > floor(m))
    assert upward == []

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m == goal:
                return True
            if m not in seen:
                seen.add(m)
                todo += graph.get(m, ())
        return False
    cycles = sorted(f"{m} <-> {n}" for m in graph for n in graph[m] if reaches(n, m))
    assert cycles == []
    assert graph["core.errors"] == set() and "model" in graph["train"]  # the walk reads the real graph
